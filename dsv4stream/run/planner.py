"""How a `--budget` is split: pinned trunk layers, a layer ring, the head, expert slots.

Owns: pure arithmetic from the model's byte sizes and a budget to a `Plan`, its printed
summary, the refusal of a budget that cannot work (naming the minimum), and the warning
when the expert cache is smaller than one forward pass's working set (an LRU then never
hits). It reads no files; `needs_from_config` estimates sizes from config.json alone (for
`inspect --config-only` and `doctor`), the runtime passes sizes measured from the catalog.

Why trunk layers are pinned before expert slots are added: a pinned layer saves its whole
size in reads on every token, while a cached expert saves its size only when it hits.
Layers are pinned in order (0, 1, ...); the rest stream through a ring of two layer slots
(read layer i+1 while computing layer i). The embedding is read by rows on demand.

The prefill segment S (tokens that go through each layer together, see `engine`) costs
`segment_token_bytes` per token: the residual streams, the MoE's input, its per-expert
outputs kept for the fixed-order sum, the shared expert's and the router's. The segment and
the expert slots are never needed at the same moment, so they share one pool, the bytes left
after the trunk: while decoding, all of it is expert slots (beside one token's activations);
while a prefill segment of s tokens runs, the segment's activations take the bytes of the
slots they need (`Plan.prefill_slots`: the store lends them and gets them back at the next
decode step). S is as long as the pool allows beside PREFILL_SLOTS slots, up to
SEGMENT_CAP, so a prompt whose activations fit goes through as one segment and reads each
expert it touches once. The attention sub-chunk's temporaries are `staging`.

Budgets are in decimal GB (10^9 bytes), the unit drives and `free` report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..checkpoint.config import V4, V41, ModelConfig
from ..checkpoint.spec import block_specs, drafter_nbytes, unused_summary
from ..checkpoint.spec_v41 import engram_nbytes, vision_nbytes
from ..checkpoint.tensors import released_nbytes
from ..errors import BudgetError
from ..store.directio import ALIGN
from ..trunkpack import headcopy
from . import planner_dspark, planner_head, planner_v4, planner_v41

GB = 1_000_000_000
# Interpreter, numpy/numba/tokenizers code and heaps, thread stacks, allocator slack:
# peak RSS of a run whose weights are negligible, less those weights (2026-12-04, python 3.11,
# 2 cpus: `python bench/overhead.py` 220 MB with the numba kernels, 119 MB with the numpy
# reference; the CLI's own peak report on the tiny real-vocabulary checkpoint with --think,
# 0.247 GB peak with 21.6 MB of weights: 225 MB), the larger plus 15%, rounded up to 5 MB.
DEFAULT_OVERHEAD = 260 * 1000 * 1000
DEFAULT_CHUNK = 64  # attention sub-chunk of a prefill segment (RunOptions.chunk); also the shortest segment
SUB_CHUNK = DEFAULT_CHUNK
SEGMENT_CAP = 4096  # longest prefill segment the planner gives
# Slots a prefill segment keeps at least: one expert computing while the next one's read lands
# (get_many pins at most the free slots; each (layer, expert) is still read once per segment).
PREFILL_SLOTS = 2
BLOCK_FLOATS = 4 << 20  # the numpy reference's attention gather / indexer score blocks (kernels.reference)
# The Engram row cache's share of the budget (V4.1): 1% is 160 MB, ~570k rows, at --budget 16.
ENGRAM_SHARE = 0.01


# The run layer's one family switch: each family's planner module answers the same questions
# (state, the attention scores' and extra staging bytes, per segment token, the head beyond its
# matrix and norm, the Engram row cache's unit and rows per token).
FAMILY_PLANNERS = {V4: planner_v4, V41: planner_v41}


def family_planner(cfg: ModelConfig):
    """The planner module of `cfg`'s family (`planner_v4` or `planner_v41`)."""
    return FAMILY_PLANNERS[cfg.family]


@dataclass(frozen=True)
class MemoryNeeds:
    """Resident byte sizes the plan has to place (all in bytes)."""

    layer_bytes: tuple[int, ...]  # dense weights of each main layer
    head_bytes: int  # head + final norm + hc_head
    slot_bytes: int  # one expert cache slot (aligned windows included)
    state_bytes: int  # KV window, compressed rows, compressor state for --ctx
    staging_bytes: int  # activations and per-chunk scratch
    overhead_bytes: int = DEFAULT_OVERHEAD
    working_set: int = 0  # experts one pass touches
    experts_per_token: int = 1
    total_experts: int = 0
    segment_token_bytes: int = 0  # activations per prefill segment token (0: not counted)
    segment_min: int = SUB_CHUNK
    segment: int | None = None  # --prefill-segment: fixed S instead of the planner's choice
    unused: str | None = None  # what the checkpoint holds that is not run (mtp.*, V4.1's vision), for the plan
    # V4.1's Engram tables stay on disk; their rows are read into a row cache (0: no Engram).
    engram_slot_bytes: int = 0  # one cached row: its FP8 values and E8M0 scales, plus its index entry
    engram_rows_per_token: int = 0  # rows one token reads over all Engram layers (48 in the release)
    engram_table_bytes: int = 0  # the tables on disk (for the plan's line)
    engram_rows: int | None = None  # a fixed row-cache size instead of the planner's share
    # V4.1 runs that take images: the tower's weights (BF16, read for each prompt with images)
    # and its activations for the largest image, held while it is encoded (0: no images)
    vision_weight_bytes: int = 0
    vision_activation_bytes: int = 0
    # --speculate: the DSpark drafter's dense weights (its routed experts share the expert slots)
    drafter_bytes: int = 0
    # The int8 head copy (`trunkpack.headcopy`) where this run can read it for fast's logits (0:
    # not offered), the BF16 matrix inside head_bytes, and the mode `planner_head` took for the
    # plan (the BF16 head resident, or the copy with the BF16 matrix on disk)
    head_q8_bytes: int = 0
    head_matrix_bytes: int = 0
    head_mode: str = planner_head.BF16

    @property
    def fixed_bytes(self) -> int:
        """What every plan holds whatever the budget: overhead, state, staging, the head."""
        return (
            self.overhead_bytes
            + self.state_bytes
            + self.staging_bytes
            + self.head_resident_bytes
            + self.vision_weight_bytes
            + self.vision_activation_bytes
            + self.drafter_bytes
        )

    @property
    def head_resident_bytes(self) -> int:
        """The head's bytes in RAM in `head_mode` (`planner_head.resident_bytes`)."""
        return planner_head.resident_bytes(self)

    @property
    def trunk_resident_bytes(self) -> int:
        """The fixed part plus every trunk layer pinned: the smallest plan without a ring."""
        return self.fixed_bytes + sum(self.layer_bytes)


@dataclass(frozen=True)
class Plan:
    budget: int
    needs: MemoryNeeds
    pinned_layers: int
    ring_slots: int
    ring_slot_bytes: int
    expert_slots: int
    warnings: tuple[str, ...] = field(default=())
    prefill_segment: int = SEGMENT_CAP
    engram_rows: int = 0  # Engram row-cache rows (beyond the rows of the segment being read)

    @property
    def engram_bytes(self) -> int:
        return self.engram_rows * self.needs.engram_slot_bytes

    @property
    def segment_bytes(self) -> int:
        return self.prefill_segment * self.needs.segment_token_bytes

    @property
    def pool_bytes(self) -> int:
        """The bytes expert slots and prefill activations share (the budget after the rest)."""
        return (
            self.budget
            - self.needs.fixed_bytes
            - self.pinned_bytes
            - self.ring_slots * self.ring_slot_bytes
            - (self.engram_bytes)
        )

    def prefill_slots(self, tokens: int) -> int:
        """Expert slots kept while a pass of `tokens` tokens runs: the pool less the pass's
        activations (a decode step's one token is counted beside every slot)."""
        if not self.needs.slot_bytes:
            return self.expert_slots
        left = (self.pool_bytes - tokens * self.needs.segment_token_bytes) // self.needs.slot_bytes
        return max(0, min(self.expert_slots, left))

    @property
    def streamed_layers(self) -> int:
        return len(self.needs.layer_bytes) - self.pinned_layers

    @property
    def pinned_bytes(self) -> int:
        return sum(self.needs.layer_bytes[: self.pinned_layers])

    @property
    def expert_bytes(self) -> int:
        return self.expert_slots * self.needs.slot_bytes

    @property
    def planned_bytes(self) -> int:
        """The larger of the two phases: decode (every slot, one token's activations) and a
        full prefill segment (its activations and the slots it keeps)."""
        stb, slot = self.needs.segment_token_bytes, self.needs.slot_bytes
        decode = self.expert_bytes + stb
        prefill = self.segment_bytes + self.prefill_slots(self.prefill_segment) * slot
        return (
            self.needs.fixed_bytes
            + self.pinned_bytes
            + self.ring_slots * self.ring_slot_bytes
            + max(decode, prefill)
            + self.engram_bytes
        )

    def lines(self) -> list[str]:
        n = self.needs
        ws = n.working_set
        lent = self.expert_slots - self.prefill_slots(self.prefill_segment)
        lent = f" in the bytes of {lent} expert slots until decode" if lent else ""
        out = [
            (
                f"budget {_gb(self.budget)}: overhead {_gb(n.overhead_bytes)}, state {_gb(n.state_bytes)},"
                f" staging {_gb(n.staging_bytes)}, {planner_head.line(n, _gb)}"
            ),
            f"  trunk: {self.pinned_layers}/{len(n.layer_bytes)} layers pinned ({_gb(self.pinned_bytes)})"
            + (
                f", {self.streamed_layers} streamed through {self.ring_slots} x {_gb(self.ring_slot_bytes)} ring"
                if self.streamed_layers
                else ""
            ),
            (
                f"  experts: {self.expert_slots} slots x {_gb(n.slot_bytes)} = {_gb(self.expert_bytes)}"
                f" (working set per pass: {ws} experts{', all experts fit' if self.expert_slots >= n.total_experts else ''})"
            ),
            (
                f"  prefill: segments of {self.prefill_segment} tokens ({_gb(self.segment_bytes)} of activations{lent}),"
                f" attention in sub-chunks of {min(n.segment_min, self.prefill_segment)}"
            ),
        ]
        if n.engram_slot_bytes:
            out.append(
                f"  engram: row cache {self.engram_rows:,} rows x {n.engram_slot_bytes} B = {_gb(self.engram_bytes)}"
                f" ({n.engram_rows_per_token} rows per token; the tables' {_gb(n.engram_table_bytes)} stay on disk)"
            )
        if n.vision_weight_bytes:
            out.append(
                f"  vision: tower {_gb(n.vision_weight_bytes)} (BF16, read for each prompt with images)"
                f" + {_gb(n.vision_activation_bytes)} of activations for the largest image"
            )
        if n.drafter_bytes:
            out.append(
                f"  drafter: DSpark dense weights {_gb(n.drafter_bytes)} (--speculate; its experts share the expert slots)"
            )
        out.append(f"  planned total {_gb(self.planned_bytes)} of {_gb(self.budget)}")
        if n.unused:
            out.append(f"  {n.unused}")
        return out + [f"warning: {w}" for w in self.warnings]


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB // 10 else f"{n / 1e6:.1f} MB"


def gb_up(n: int) -> str:
    """Bytes as GB rounded up to 0.01: a minimum must never print below itself."""
    return f"{math.ceil(n / GB * 100) / 100:.2f} GB"


def _segment_floor(needs: MemoryNeeds) -> int:
    return needs.segment if needs.segment is not None else min(needs.segment_min, SEGMENT_CAP)


def _pool_floor(needs: MemoryNeeds) -> int:
    """The smallest pool: two tokens' worth of expert slots and one token's activations while
    decoding, or PREFILL_SLOTS slots beside the shortest segment while prefilling."""
    stb, slot = needs.segment_token_bytes, needs.slot_bytes
    decode = 2 * needs.experts_per_token * slot + stb
    return max(decode, PREFILL_SLOTS * slot + _segment_floor(needs) * stb)


def minimum_budget(needs: MemoryNeeds) -> int:
    """Smallest budget that runs: nothing pinned, a two-slot ring, two layers' worth of experts
    while decoding, whose bytes also hold the shortest prefill segment (or the one
    --prefill-segment fixes) beside PREFILL_SLOTS slots; the head as `planner_head` holds it."""
    needs = planner_head.chosen(needs)
    ring = 2 * max(needs.layer_bytes, default=0)
    return needs.fixed_bytes + ring + _pool_floor(needs)


def smallest_budget(
    needs: MemoryNeeds, ok: Callable[[Plan], bool], limit: int = 1 << 50, step: int = GB // 100
) -> int | None:
    """Smallest budget, a multiple of `step` bytes (default 0.01 GB, as printed), whose plan
    satisfies `ok`; None below `limit`. Bisection: more budget never pins fewer layers or
    gives fewer slots."""
    lo, hi = minimum_budget(needs), minimum_budget(needs)
    while not ok(plan(needs, hi)):
        if hi > limit:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > min(step, GB // 1000):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(plan(needs, mid)) else (mid, hi)
    b = -(-hi // step) * step
    while not ok(plan(needs, b)):  # the ring's release at "all layers pinned" is the one kink
        b += step
    return b


def plan(needs: MemoryNeeds, budget: int, max_expert_slots: int | None = None) -> Plan:
    """Split `budget` bytes; raise BudgetError (naming the minimum) if it cannot work. The head's
    mode (the int8 copy, the BF16 head on disk) is `planner_head`'s rule, for every caller."""
    needs = planner_head.chosen(needs)
    floor = minimum_budget(needs)
    if budget < floor:
        seg = (
            f" (their bytes also hold a prefill segment of {_segment_floor(needs)} tokens)"
            if needs.segment_token_bytes
            else ""
        )
        raise BudgetError(
            f"--budget {budget / GB:.2f} GB is below the minimum of {gb_up(floor)}"
            f" for this model (head {_gb(needs.head_resident_bytes)}, overhead {_gb(needs.overhead_bytes)},"
            f" state for --ctx {_gb(needs.state_bytes)},"
            + (
                f" the vision tower and an image's activations {_gb(needs.vision_weight_bytes + needs.vision_activation_bytes)},"
                if needs.vision_weight_bytes
                else ""
            )
            + f" two streamed layers, {2 * needs.experts_per_token}"
            f" expert slots{seg}); raise --budget (or lower --ctx"
            + (" or --prefill-segment)" if needs.segment is not None else ")")
        )
    cap = needs.total_experts if max_expert_slots is None else max_expert_slots
    seg_floor, stb, slot = _segment_floor(needs), needs.segment_token_bytes, needs.slot_bytes
    free = budget - needs.fixed_bytes - _pool_floor(needs)
    layers = needs.layer_bytes
    ring_slot = max(layers, default=0)
    pinned = 0
    if sum(layers) <= free:
        pinned, free = len(layers), free - sum(layers)
        ring_slots = 0
    else:
        free -= 2 * ring_slot  # the ring is needed as soon as one layer streams
        acc = 0
        while pinned < len(layers) and acc + layers[pinned] <= free:
            acc += layers[pinned]
            pinned += 1
        free -= acc
        ring_slots = 2
    free = max(0, free)
    # Engram rows before expert slots: a cached row saves two 4 KiB reads for ~280 bytes, and slots
    # short of the working set hardly ever hit.
    engram_rows = 0
    if needs.engram_slot_bytes:
        want = needs.engram_rows
        if want is None:
            want = int(budget * ENGRAM_SHARE) // needs.engram_slot_bytes
        engram_rows = max(0, min(want, free // needs.engram_slot_bytes))
        free -= engram_rows * needs.engram_slot_bytes
    pool = free + _pool_floor(needs)
    # decode: every slot the pool holds beside one token's activations
    slots = cap if not slot else max(0, min(cap, (pool - stb) // slot))
    segment = seg_floor
    if needs.segment is None:
        # prefill: the longest segment beside PREFILL_SLOTS slots (or every slot, when all
        # experts fit in fewer bytes than the pool), in whole sub-chunks
        keep = min(slots, PREFILL_SLOTS) * slot
        grow = SEGMENT_CAP if not stb else min(SEGMENT_CAP, (pool - keep) // stb)
        segment = max(seg_floor, grow)
        if segment > seg_floor >= 1:
            segment = max(seg_floor, segment // seg_floor * seg_floor)  # whole sub-chunks
    warnings = []
    if slots < needs.working_set and slots < cap:
        short = (needs.working_set - slots) * needs.slot_bytes
        warnings.append(
            f"the expert cache holds {slots} experts, fewer than the working set of {needs.working_set}"
            f" one forward pass uses, so LRU evicts nearly every expert before its layer comes round again"
            f" (hit rate near 0); add {_gb(short)} to --budget for the cache to start hitting"
        )
    if needs.engram_rows is not None and engram_rows < needs.engram_rows:
        warnings.append(
            f"the Engram row cache holds {engram_rows:,} of the {needs.engram_rows:,} rows asked for;"
            f" add {_gb((needs.engram_rows - engram_rows) * needs.engram_slot_bytes)} to --budget"
        )
    return Plan(
        budget, needs, pinned, ring_slots, ring_slot if ring_slots else 0, slots, tuple(warnings), segment, engram_rows
    )


def budget_for(needs: MemoryNeeds, slots: int, pinned: int | None = None) -> int:
    """The smallest budget, to the byte, whose plan has at least `slots` expert slots with
    `pinned` trunk layers (None: all)."""
    want = len(needs.layer_bytes) if pinned is None else pinned

    def enough(p: Plan) -> bool:
        return p.pinned_layers > want or (p.pinned_layers == want and p.expert_slots >= slots)

    return smallest_budget(needs, enough, step=1)


def slot_bytes_for(expert_bytes: int, runs: int = 2) -> int:
    """Slot size for an expert in `runs` byte runs read with O_DIRECT aligned windows."""
    return (expert_bytes + runs * 2 * ALIGN + ALIGN - 1) // ALIGN * ALIGN


def state_bytes_for(cfg: ModelConfig, ctx: int) -> int:
    """float32 bytes of per-sequence state at `ctx` tokens, as the family keeps it
    (`planner_v4.state_bytes`, `planner_v41.state_bytes`)."""
    return family_planner(cfg).state_bytes(cfg, ctx)


def staging_bytes_for(cfg: ModelConfig, chunk: int, ctx: int = 4096) -> int:
    """Scratch for one attention sub-chunk of `chunk` tokens at up to `ctx` positions: hc
    streams, q/attention buffers, the scores over the window and the compressed rows a query
    sees (a few live copies: scores, mask, softmax), the indexer's scores over every
    compressed row, the bounded gather / score blocks, the head's logits."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    fam = family_planner(cfg)
    per_tok = 4 * (3 * cfg.hc_mult * d + 3 * h * hd + 4 * cfg.moe_intermediate_size + cfg.vocab_size)
    per_tok += fam.score_token_bytes(cfg, chunk, ctx)
    blocks = 4 * 2 * BLOCK_FLOATS if any(cfg.ratio(i) for i in range(cfg.n_layers)) else 0
    return chunk * per_tok + 4 * cfg.vocab_size * 2 + blocks + fam.staging_extra_bytes(cfg, chunk, ctx)


def segment_token_bytes(cfg: ModelConfig) -> int:
    """float32 bytes per prefill segment token alive at the MoE's peak: the hc streams, the
    normed input, the k weighted expert outputs kept for the fixed-order sum, the shared
    and routed sums and the result, the router's scores, mHC mixing weights, ids."""
    d, hc, k, e = cfg.hidden_size, cfg.hc_mult, cfg.num_experts_per_tok, cfg.n_routed_experts
    extra = family_planner(cfg).segment_extra_bytes(cfg)
    return 4 * (hc * d + (k + 5) * d + 3 * e + hc + hc * hc) + 3 * 8 + extra


def needs_from_config(
    cfg: ModelConfig,
    ctx: int = 4096,
    chunk: int = SUB_CHUNK,
    segment: int | None = None,
    speculate: str | int = "auto",
    head_copy: bool = False,
) -> MemoryNeeds:
    """Estimate from config.json alone, with the release dtypes; the drafter counted as a run
    with this --speculate setting holds it (`planner_dspark`, as `run.memory` measures it);
    `head_copy`: the run reads a pack's int8 head copy (`run.memory.copy_read`), as a packed
    checkpoint's fast run does."""
    drafts = planner_dspark.drafts(cfg, speculate)
    layer_bytes = tuple(
        sum(released_nbytes(cfg, s) for s in block_specs(cfg, i, with_experts=False)) for i in range(cfg.n_layers)
    )
    d, v, fam = cfg.hidden_size, cfg.vocab_size, family_planner(cfg)
    head = v * d * 2 + d * 2 + fam.head_extra_bytes(cfg)
    head += cfg.tid2eid_bytes  # the hash layers' tables stay resident
    needs = MemoryNeeds(
        layer_bytes=layer_bytes,
        head_bytes=head,
        slot_bytes=slot_bytes_for(cfg.expert_bytes),
        state_bytes=state_bytes_for(cfg, ctx),
        staging_bytes=staging_bytes_for(cfg, chunk, ctx),
        working_set=cfg.working_set_experts,
        experts_per_token=cfg.num_experts_per_tok,
        total_experts=cfg.n_layers * cfg.n_routed_experts + (planner_dspark.drafter_experts(cfg) if drafts else 0),
        segment_token_bytes=segment_token_bytes(cfg),
        segment_min=chunk,
        segment=segment,
        unused=unused_summary(cfg, None if drafts else drafter_nbytes(cfg), vision_nbytes(cfg)),
        drafter_bytes=planner_dspark.dense_bytes_from_config(cfg) if drafts else 0,
        engram_slot_bytes=fam.engram_slot_bytes(cfg),
        engram_rows_per_token=fam.engram_rows_per_token(cfg),
        engram_table_bytes=engram_nbytes(cfg),
        head_q8_bytes=headcopy.copy_bytes_of(v, d) if head_copy else 0,
        head_matrix_bytes=v * d * 2,
    )
    return planner_head.chosen(needs)  # its fixed bytes are the plan's
