"""DeepSeek-V4-Flash-0731's DSpark drafter: B tokens drafted at once from the main model's taps.

Owns: the 0731 drafter's math over frozen weights (`DSpark0731Weights`), filling its state (one
window of main-model keys per stage: `model.dspark.DSparkState`, with `Draft` and the Markov
head, shared with V4.1's design). Where its weights, experts and taps come from is the
caller's (`weights.loading_dspark_0731`, the session's expert source, the V4 stack's "input"
trace); nothing here changes the main model's state.

No DeepSeek code for the 0731 drafter is in a release dsv4 can read; this follows the checkpoint's
tensors and public ports of DeepSeek's `DeepSeek-V4-Flash-DSpark` inference code (whose structure
the 0731 release says it shares), which agree with V4.1's `forward_spec` except for the blocks:
- taps: the mean over the hc copies of the streams entering each of `dspark_target_layer_ids`,
  concatenated -> main_x = main_norm(main_proj(taps)) (as V4.1).
- every stage is a V4 block (`model.v4.block`: each sublayer its own hyper-connection pre, the
  MoE of the main model's expert count and top-k, score routing with its bias) whose attention is
  V4's (q RMS-normalised per head without weight, RoPE on the trailing qk_rope_head_dim channels,
  the window KV on V4's E4M3 grid under official numerics) over a window only: per stage, that
  stage's kv_norm(wkv(main_x)) of the main model's last `sliding_window` positions (<= p), and
  the block's B rows at positions p+1..p+B, every block query seeing all of them (no causal mask
  inside the block), with the sink.
- the block: [the token after p] + (B - 1) x dspark_noise_token_id, main embedding, hc copies.
- head: the last stage's own `hc_head` collapses the streams (V4's head collapse, not V4.1's
  FFN pre), then its `norm` and the main head. Markov head: `markov_w1` is the embedding (rank
  R) of the token slot j stands after, `markov_w2` the (vocab, R) projection added to slot j's
  logits (V4.1's `markov_head.embed` / `.head` under other names); confidence = proj .
  [collapsed streams (not normed), markov_w1[t_j]], raw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...checkpoint.config import ModelConfig
from ...kernels import QWeight, attend, get_numerics, matmul, matmul_grouped
from ...kernels.actquant import kv_grid_v4
from ...kernels.head import head_logits
from ..cache import WindowCache
from ..dspark import Draft, DSparkState
from ..dspark import new_state as new_window_state
from ..mhc import HcHeadWeights, hc_head, hc_post, hc_pre
from ..moe import ExpertSource
from ..ops import rms_norm
from ..rope import Rope, apply_rope
from .attention import AttnWeights
from .block import ffn_half
from .layer import LayerWeights

F32 = np.float32


@dataclass(frozen=True)
class DSpark0731Weights:
    stages: tuple[LayerWeights, ...]  # mtp.0 .. mtp.{n-1}, window-only V4 blocks
    main_proj: QWeight  # (D, D * len(targets))
    main_norm: np.ndarray  # (D,)
    norm: np.ndarray  # (D,) the last stage's
    hc_head: HcHeadWeights  # the last stage's collapse of the streams
    markov_embed: np.ndarray  # markov_w1 (vocab, R) float32
    markov_head: QWeight  # markov_w2 (vocab, R)
    confidence: np.ndarray  # (D + R,) float32


@dataclass(frozen=True)
class DSpark0731Params:
    block_size: int
    noise_token_id: int
    targets: tuple[int, ...]  # main layers whose inputs are tapped
    first_layer: int  # index of mtp.0 in the expert source's numbering (= n_layers)
    window: int
    cfg: ModelConfig  # heads, dims, eps, hc and MoE settings (the main model's)


def new_state(p: DSpark0731Params, stages: int) -> DSparkState:
    return new_window_state(p.window, p.cfg.head_dim, stages)


def _kv(x: np.ndarray, a: AttnWeights, positions: np.ndarray, rope: Rope, cfg: ModelConfig) -> np.ndarray:
    cos, sin = rope.cos_sin(positions)
    kv = apply_rope(rms_norm(matmul(a.wkv, x), a.kv_norm, cfg.rms_norm_eps), cos, sin, in_place=True)
    # official: V4 keeps its window KV on E4M3 with the RoPE channels as computed (kernels/actquant.py)
    return kv_grid_v4(kv, cfg.qk_rope_head_dim) if get_numerics() == "official" else kv


def main_x(taps: np.ndarray, w: DSpark0731Weights, p: DSpark0731Params) -> np.ndarray:
    """Concatenated taps (T, D * len(targets)) -> the stages' window input (T, D)."""
    return rms_norm(matmul(w.main_proj, taps), w.main_norm, p.cfg.rms_norm_eps)


def observe(
    state: DSparkState,
    taps: np.ndarray,
    positions: np.ndarray,
    w: DSpark0731Weights,
    p: DSpark0731Params,
    rope: Rope,
) -> None:
    """The main model's taps (T, D * len(targets)) at positions (T,), the next ones after
    `state.last`: each stage's window keys of them go into its window."""
    if positions.size == 0:
        return
    mx = main_x(taps, w, p)
    for win, stage in zip(state.windows, w.stages, strict=True):
        win.push(_kv(mx, stage.attn, positions, rope, p.cfg), positions)
    state.last = int(positions[-1])


def block_attention(x: np.ndarray, a: AttnWeights, win: WindowCache, pos: int, rope: Rope, cfg: ModelConfig):
    """The block's attention: x (B, D) normed input at positions pos+1..pos+B -> (B, D); every
    query sees the window and every block row."""
    b, eps = x.shape[0], cfg.rms_norm_eps
    positions = np.arange(pos + 1, pos + 1 + b, dtype=np.int64)
    cos, sin = rope.cos_sin(positions)
    q_res = rms_norm(matmul(a.wq_a, x), a.q_norm, eps)
    q = rms_norm(matmul(a.wq_b, q_res).reshape(b, cfg.num_attention_heads, cfg.head_dim), None, eps)
    q = apply_rope(q, cos, sin, in_place=True)
    keys, _ = win.with_new(_kv(x, a, positions, rope, cfg), positions)
    o = attend(q, keys, np.ones((b, keys.shape[0]), dtype=bool), None, None, None, a.sink)
    o = apply_rope(o, cos, sin, inverse=True, in_place=True)
    mid = matmul_grouped(a.wo_a, o.reshape(b, len(a.wo_a), -1))
    return matmul(a.wo_b, mid)


def draft(
    state: DSparkState,
    token: int,
    w: DSpark0731Weights,
    p: DSpark0731Params,
    embed: Callable[[np.ndarray], np.ndarray],
    head: QWeight | None,
    experts_of: Callable[[int], ExpertSource],
    rope: Rope,
    slots: int | None = None,
    q8: object | None = None,
) -> Draft:
    """The drafter right after the main model consumed position `state.last`, whose next token
    is `token`: the block's head logits and collapsed streams. `experts_of(layer)`: the expert
    source of block `layer` (p.first_layer + stage). `slots`: head logits of the first `slots`
    slots only (the vocabulary-wide head is the drafter's largest product). `q8`: the main
    head's int8 copy, which `fast` proposes with where the main model reads it (`kernels.head`).
    `head` None: the head's input rows instead of its logits (`Draft.rows`)."""
    cfg = p.cfg
    it, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    pos = state.last
    ids = np.full(p.block_size, p.noise_token_id, dtype=np.int64)
    ids[0] = token
    x = np.repeat(embed(ids)[:, None, :], cfg.hc_mult, axis=1)
    for k, (stage, win) in enumerate(zip(w.stages, state.windows, strict=True)):
        h, post, comb = hc_pre(x, stage.hc_attn, it, hc_eps, eps)
        x = hc_post(x, block_attention(rms_norm(h, stage.attn_norm, eps), stage.attn, win, pos, rope, cfg), post, comb)
        x = ffn_half(x, ids, stage, cfg, experts_of(p.first_layer + k))
    hidden = hc_head(x, w.hc_head, hc_eps, eps)
    n = p.block_size if slots is None else slots
    rows = rms_norm(hidden[:n], w.norm, eps)
    if head is None:  # the caller runs the head on these rows (with other rows, in one call)
        return Draft(None, hidden, rows)
    return Draft(head_logits(head, q8, rows), hidden)
