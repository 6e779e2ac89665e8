"""The DSpark drafter's weights (`mtp.0..n-1` of a DeepSeek-V4.1 checkpoint), built once.

Owns: filling `model.v41.dspark.DSparkWeights` and `DSparkParams` from a `TensorSource` by the
names in `checkpoint.spec_v41` (`MTP_EXTRAS_V41`); each stage's block through
`loading_v41.load_layer` (a stage is a window-only V4.1 block under `mtp.K`). The stages' routed
experts are not here: they come through the session's expert provider as blocks n_layers + K,
so they stream and cache in the main model's budget.

V4-Flash-0731's drafter (layout `dspark`) is not the same design: its stages are V4 blocks
(every sublayer uses its own hyper-connection pre, a separate `hc_head` collapses the streams,
V4 attention with a per-head q rescale) and its Markov head is stored as `markov_w1`/`markov_w2`;
`weights.loading_dspark_0731` loads it. `drafter_reason` answers for both.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..checkpoint.config import DSPARK, DSPARK_V41, LAYOUTS, ModelConfig
from ..checkpoint.tensors import layer_prefix
from ..errors import UsageError
from ..model.v41.block import HcParams
from ..model.v41.dspark import DSparkParams, DSparkWeights
from ..model.v41.moe import V41MoeParams
from .loading_v41 import load_layer


def drafter_reason(cfg: ModelConfig) -> str | None:
    """Why this checkpoint has no drafter `--speculate` runs (None: it has one)."""
    if cfg.layout in (DSPARK_V41, DSPARK) and cfg.dspark is not None:
        return None  # V4.1's (here) or V4-Flash-0731's (weights.loading_dspark_0731)
    return f"it has {LAYOUTS.get(cfg.layout, 'no mtp.* blocks')}, not a DSpark drafter"


def check_drafter(cfg: ModelConfig) -> None:
    """UsageError where the checkpoint holds no V4.1 drafter (what `load_dspark` reads; `--draft-out`
    asks it only where `drafter_reason` finds no drafter at all)."""
    if cfg.layout != DSPARK_V41 or cfg.dspark is None:
        what = LAYOUTS.get(cfg.layout, cfg.layout)
        raise UsageError(
            "--draft-out needs a checkpoint with a DSpark drafter (mtp.* of DeepSeek-V4.1 or V4-Flash-0731);"
            f" this one has {what}"
        )


def dspark_params(cfg: ModelConfig, quantise: bool) -> DSparkParams:
    ds = cfg.dspark
    n_experts, k = cfg.experts_of(cfg.n_layers)
    del n_experts
    return DSparkParams(
        block_size=ds.block_size,
        noise_token_id=ds.noise_token_id,
        targets=tuple(ds.target_layer_ids),
        first_layer=cfg.n_layers,
        window=cfg.sliding_window,
        n_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        eps=cfg.rms_norm_eps,
        quantise=quantise,
        hc=HcParams(cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps),
        hc_mult=cfg.hc_mult,
        moe=V41MoeParams(k, cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.norm_topk_prob, quantise),
    )


def load_dspark(src) -> DSparkWeights:
    """Every dense weight of the drafter (routed experts excluded)."""
    cfg = src.config
    check_drafter(cfg)
    n, stages = cfg.n_layers, cfg.n_mtp
    first, last = layer_prefix(cfg, n), layer_prefix(cfg, n + stages - 1)
    conf = src.f32(last + "confidence_head.proj.weight").reshape(-1)
    return DSparkWeights(
        stages=tuple(load_layer(src, n + k) for k in range(stages)),
        main_proj=src.qweight(first + "main_proj"),
        main_norm=src.f32(first + "main_norm.weight"),
        norm=src.f32(last + "norm.weight"),
        markov_embed=np.ascontiguousarray(src.f32(last + "markov_head.embed.weight"), dtype=np.float32),
        markov_head=replace(src.qweight(last + "markov_head.head"), role="head"),
        confidence=np.ascontiguousarray(conf, dtype=np.float32),
    )
