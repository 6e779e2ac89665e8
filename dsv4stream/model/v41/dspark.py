"""DeepSeek-V4.1's DSpark drafter: B tokens drafted at once from the main model's taps.

Owns: the drafter's math over frozen weights (`DSparkWeights`), filling its state (one window of
main-model keys per stage: `model.dspark.DSparkState`, with `Draft` and the Markov head, shared
with V4-Flash-0731's design). Where the stage weights, the experts and the main model's taps come
from is the caller's (`weights.loading_dspark`, the session's expert source, the stack's
"input" trace); nothing here changes the main model's state.

Facts this follows (DeepSeek's V4.1 `DSparkBlock`, `DSparkAttention`, `forward_spec`):
- taps: the mean over the hc copies of the streams entering each of `dspark_target_layer_ids`
  (after that layer's Engram), concatenated -> main_x = main_norm(main_proj(taps)) (main_proj
  an FP8 linear: its input meets the activation grid under the official numerics).
- every stage is a V4.1 block (`model.v41.block`: hyper-connections one sublayer ahead) whose
  attention is window-only (ratio 0, plain RoPE): the window holds, per stage, that stage's
  kv_norm(wkv(main_x)) of the main model's positions (RoPE at the main position, FP8 grid),
  the last `window` of them; the block's B queries (positions p+1..p+B) each see every window
  row of positions <= p and all B block rows (no causal mask inside the block), with the sink.
- the block: tokens = [the token after p] + (B - 1) x dspark_noise_token_id, embedded with the
  main embedding, repeated to hc copies, pre one-hot on stream 0 before stage 0; one MoE of
  `dspark_n_routed_experts`, top-`dspark_num_experts_per_tok`, with the shared expert.
- head: the last stage's FFN pre collapses the streams; logits = main head(rms_norm(., norm))
  (the last stage's norm); Markov head (rank R): slot j adds markov.head @ markov.embed[t_j]
  where t_0 is the block's first token and t_j (j >= 1) the token slot j - 1 stands for
  (sampled in generation; teacher-forced here); confidence[j] = proj . [collapsed streams_j
  (not normed), markov.embed[t_j]] (raw, no sigmoid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...kernels import QWeight, attend, matmul, matmul_grouped
from ...kernels.head import head_logits
from ..cache import WindowCache
from ..dspark import Draft, DSparkState
from ..dspark import new_state as new_window_state
from ..mhc import collapse
from ..moe import ExpertSource
from ..ops import rms_norm
from ..rope import Rope, apply_rope
from .attention import V41AttnWeights
from .block import HcParams, V41LayerWeights, hc_mixes, hc_post, identity_pre
from .moe import V41MoeParams, moe
from .quant import act_qdq

F32 = np.float32


@dataclass(frozen=True)
class DSparkWeights:
    stages: tuple[V41LayerWeights, ...]  # mtp.0 .. mtp.{n-1}, window-only blocks
    main_proj: QWeight  # (D, D * len(targets))
    main_norm: np.ndarray  # (D,)
    norm: np.ndarray  # (D,) the last stage's
    markov_embed: np.ndarray  # (vocab, R) float32
    markov_head: QWeight  # (vocab, R)
    confidence: np.ndarray  # (D + R,) float32


@dataclass(frozen=True)
class DSparkParams:
    block_size: int
    noise_token_id: int
    targets: tuple[int, ...]  # main layers whose inputs are tapped
    first_layer: int  # index of mtp.0 in the expert source's numbering (= n_layers)
    window: int
    n_heads: int
    head_dim: int
    eps: float
    quantise: bool  # official numerics
    hc: HcParams
    hc_mult: int
    moe: V41MoeParams  # the drafter's own top-k


def _aq(x: np.ndarray, p: DSparkParams) -> np.ndarray:
    return act_qdq(x) if p.quantise else x


def new_state(p: DSparkParams, stages: int) -> DSparkState:
    return new_window_state(p.window, p.head_dim, stages)


def main_x(taps: np.ndarray, w: DSparkWeights, p: DSparkParams) -> np.ndarray:
    """Concatenated taps (T, D * len(targets)) -> the stages' window input (T, D)."""
    return rms_norm(matmul(w.main_proj, _aq(taps, p)), w.main_norm, p.eps)


def _kv(x: np.ndarray, a: V41AttnWeights, positions: np.ndarray, rope: Rope, p: DSparkParams) -> np.ndarray:
    cos, sin = rope.cos_sin(positions)
    kv = apply_rope(rms_norm(matmul(a.wkv, _aq(x, p)), a.kv_norm, p.eps), cos, sin, in_place=True)
    return _aq(kv, p)


def observe(
    state: DSparkState, taps: np.ndarray, positions: np.ndarray, w: DSparkWeights, p: DSparkParams, rope: Rope
) -> None:
    """The main model's taps (T, D * len(targets)) at positions (T,), the next ones after
    `state.last`: each stage's window keys of them go into its window."""
    if positions.size == 0:
        return
    mx = main_x(taps, w, p)
    for win, stage in zip(state.windows, w.stages, strict=True):
        win.push(_kv(mx, stage.attn, positions, rope, p), positions)
    state.last = int(positions[-1])


def _attention(x: np.ndarray, a: V41AttnWeights, win: WindowCache, pos: int, rope: Rope, p: DSparkParams):
    """The block's attention: x (B, D) normed input at positions pos+1..pos+B -> (B, D)."""
    b = x.shape[0]
    positions = np.arange(pos + 1, pos + 1 + b, dtype=np.int64)
    cos, sin = rope.cos_sin(positions)
    xq = _aq(x, p)
    qr = rms_norm(matmul(a.wq_a, xq), a.q_norm, p.eps)
    q = apply_rope(matmul(a.wq_b, _aq(qr, p)).reshape(b, p.n_heads, p.head_dim), cos, sin, in_place=True)
    kv = apply_rope(rms_norm(matmul(a.wkv, xq), a.kv_norm, p.eps), cos, sin, in_place=True)
    keys, _ = win.with_new(_aq(kv, p), positions)
    o = attend(q, keys, np.ones((b, keys.shape[0]), dtype=bool), None, None, None, a.sink)
    o = apply_rope(o, cos, sin, inverse=True, in_place=True)
    mid = matmul_grouped(a.wo_a, o.reshape(b, len(a.wo_a), -1))
    return matmul(a.wo_b, _aq(mid, p))


def draft(
    state: DSparkState,
    token: int,
    w: DSparkWeights,
    p: DSparkParams,
    embed: Callable[[np.ndarray], np.ndarray],
    head: QWeight | None,
    experts_of: Callable[[int], ExpertSource],
    rope: Rope,
    slots: int | None = None,
    q8: object | None = None,
) -> Draft:
    """The drafter right after the main model consumed position `state.last`, whose next token
    is `token`: the block's head logits and collapsed streams. `experts_of(layer)` is the
    expert source of block `layer` (p.first_layer + stage). `slots`: head logits of the first
    `slots` slots only (speculation drafting fewer than B tokens: the vocabulary-wide head is
    the drafter's largest product; the stages still run the whole block). `q8`: the main
    head's int8 copy, which `fast` proposes with where the main model reads it (`kernels.head`).
    `head` None: the head's input rows instead of its logits (`Draft.rows`)."""
    pos = state.last
    ids = np.full(p.block_size, p.noise_token_id, dtype=np.int64)
    ids[0] = token
    x = np.repeat(embed(ids)[:, None, :], p.hc_mult, axis=1)
    pre = identity_pre(p.block_size, p.hc_mult)
    for k, (stage, win) in enumerate(zip(w.stages, state.windows, strict=True)):
        a_pre, post, comb = hc_mixes(x, stage.hc_attn, p.hc)
        h = rms_norm(collapse(x, pre), stage.attn_norm, p.eps)
        x = hc_post(x, _attention(h, stage.attn, win, pos, rope, p), post, comb)
        pre, post, comb = hc_mixes(x, stage.hc_ffn, p.hc)
        h = rms_norm(collapse(x, a_pre), stage.ffn_norm, p.eps)
        x = hc_post(x, moe(h, stage.moe, experts_of(p.first_layer + k), p.moe), post, comb)
    hidden = collapse(x, pre)
    n = p.block_size if slots is None else slots
    rows = rms_norm(hidden[:n], w.norm, p.eps)
    if head is None:  # the caller runs the head on these rows (with other rows, in one call)
        return Draft(None, hidden, rows)
    return Draft(head_logits(head, q8, rows), hidden)
