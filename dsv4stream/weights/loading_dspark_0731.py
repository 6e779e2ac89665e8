"""V4-Flash-0731's DSpark drafter weights (`mtp.0..n-1`, layout `dspark`), built once.

Owns: filling `model.v4.dspark.DSpark0731Weights` / `DSpark0731Params` from a `TensorSource` by
the names in `checkpoint.spec_v4` (`MTP_EXTRAS["dspark"]`); each stage's block through
`loading_v4.load_layer` (a stage is a window-only V4 block under `mtp.K`). The stages' routed
experts come through the session's expert provider as blocks n_layers + K, in the main model's
budget. What each extra tensor is read as (e.g. `markov_w1` the Markov embedding) is
`model.v4.dspark`'s docstring.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..checkpoint.config import DSPARK, ModelConfig
from ..checkpoint.tensors import MODEL, layer_prefix
from ..errors import UsageError
from ..model.mhc import HcHeadWeights
from ..model.v4.dspark import DSpark0731Params, DSpark0731Weights
from .loading import hc_weights
from .loading_v4 import load_layer


def is_0731(cfg: ModelConfig) -> bool:
    return cfg.layout == DSPARK and cfg.dspark is not None


def dspark_0731_params(cfg: ModelConfig) -> DSpark0731Params:
    ds = cfg.dspark
    return DSpark0731Params(
        block_size=ds.block_size,
        noise_token_id=ds.noise_token_id,
        targets=tuple(ds.target_layer_ids),
        first_layer=cfg.n_layers,
        window=cfg.sliding_window,
        cfg=cfg,
    )


def load_dspark_0731(src) -> DSpark0731Weights:
    """Every dense weight of the 0731 drafter (routed experts excluded), shapes checked against
    the config: a checkpoint whose tensors do not fit the design is refused, not guessed at."""
    cfg = src.config
    if not is_0731(cfg):
        raise UsageError("this checkpoint has no V4-Flash-0731 DSpark drafter (mtp.* of the 0731 layout)")
    n, stages = cfg.n_layers, cfg.n_mtp
    first, last = layer_prefix(cfg, n), layer_prefix(cfg, n + stages - 1)
    d, v, r, t = cfg.hidden_size, cfg.vocab_size, cfg.dspark.markov_rank, len(cfg.dspark.target_layer_ids)
    w1 = np.ascontiguousarray(src.f32(last + "markov_head.markov_w1.weight"), dtype=np.float32)
    w2 = replace(src.qweight(last + "markov_head.markov_w2"), role="head")
    conf = np.ascontiguousarray(src.f32(last + "confidence_head.proj.weight").reshape(-1), dtype=np.float32)
    main_proj = src.qweight(first + "main_proj")
    got = {
        "markov_w1": (w1.shape, (v, r)),
        "markov_w2": ((w2.rows, w2.cols), (v, r)),
        "confidence_head.proj": (conf.shape, (d + r,)),
        "main_proj": ((main_proj.rows, main_proj.cols), (d, d * t)),
    }
    for name, (shape, want) in got.items():
        if tuple(shape) != want:
            raise UsageError(
                f"mtp.* {name} is {tuple(shape)}, the 0731 drafter needs {want}: not a DSpark drafter dsv4 runs"
            )
    return DSpark0731Weights(
        stages=tuple(load_layer(src, n + k) for k in range(stages)),
        main_proj=main_proj,
        main_norm=src.f32(first + "main_norm.weight"),
        norm=src.f32(last + "norm.weight"),
        hc_head=hc_weights(src, last + MODEL["hc_head"], HcHeadWeights),
        markov_embed=w1,
        markov_head=w2,
        confidence=conf,
    )
