#!/usr/bin/env python3
"""Golden numbers for DeepSeek-V4.1 from DeepSeek's own reference, run on CPU (see v41_reference.py).

For each fixture: generate a V4.1 checkpoint (`dsv4stream.synth`, preset tiny-v41
with the fixture's shapes and layer plan, and its small generated tokenizer), damp what each
sublayer adds to the residual streams (`damp_outputs`), run random
prompts through the reference six ways, and write under tests/fixtures/v41/<name>/ the
checkpoint plus:

  oracle.npz   token_ids (T,); per run, logits (T, vocab) float32 and gap_<run> (T,), the
               relative gap between the two largest logits; engram_rows (T, layers, cols),
               the Engram row ids the reference hashed
  oracle.json  seed, overrides, torch version, reference file digests, the smallest fp32
               top-k boundary gaps, the reference's differences from itself, and how much the
               indexer and the candidate blocks select

Runs: prefill_fp32, step_fp32_owner, step_fp32_asshipped, prefill_official,
step_official_asshipped, step_official_owner (what the modes change: v41_reference.py).
Prompts are random ids, long enough that each query sees more compressed rows than
index_topk and the candidate source more blocks than candidate_topk_blocks. A seed is kept
only if, in the fp32 runs, no router, indexer or candidate-block top-k boundary is within
TIE_GAP (relative to the row's largest magnitude) of a tie, so the choices cannot flip on
rounding.

`--engram` writes tests/fixtures/v41/engram instead: the reference's hash layouts and row ids
on random sequences, for the released layout and generated ones. `--quant` writes
tests/fixtures/v41/quant: the reference kernels' activation quantisation (FP8 per 32 with
power-of-two scales; FP4 per 32 with E8M0 scales; FP4 per 16 with E4M3 scales) on inputs
that reach every rounding case, for a bit-exact test of ours.

Needs torch >= 2.9, sympy, pillow beside this package's dependencies (docs/development.md).

Usage:
  tools/make_v41_fixtures.py --reference DIR [--out tests/fixtures/v41] [--only NAME ...]
  tools/make_v41_fixtures.py --reference DIR --engram [--out tests/fixtures/v41]
  tools/make_v41_fixtures.py --reference DIR --quant [--out tests/fixtures/v41]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from v41_reference import (
    HFTokenizer,
    ReferenceError,
    compare,
    engram_hashes,
    kernel_module,
    load_reference,
    reference_digests,
    reference_run,
    top2_gap,
)

from dsv4stream.synth import make_checkpoint
from dsv4stream.synth.v41 import layer_plan, small_tokenizer_json

TIE_GAP = 1e-5
# fp32 first: their top-k boundaries decide whether a seed is kept
RUNS = (
    ("prefill", "fp32", "owner"),
    ("step", "fp32", "owner"),
    ("step", "fp32", "as-shipped"),
    ("prefill", "official", "as-shipped"),
    ("step", "official", "as-shipped"),
    ("step", "official", "owner"),
)


def run_key(mode: str, numerics: str, index_keys: str) -> str:
    """Array name of one run: prefill runs do not depend on the index keys."""
    keys = "" if mode == "prefill" else "_" + index_keys.replace("-", "")
    return f"{mode}_{numerics}{keys}"


# ---- fixtures ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FixtureSpec:
    name: str
    seed: int
    n_tokens: int
    overrides: dict = field(default_factory=dict)
    what: str = ""
    vocab: int = 64
    out_gain_log2: int = -4
    need_clamp: bool = False


# Small shapes shared by the fixtures: FP8 dims multiples of 32, 16 indexer heads (with 8, rows
# where every head's ReLU is zero, exact ties at 0, sit at the top-k boundary too often), the drafter cut to one stage and no vision tower (neither
# runs in a text forward; both are validated elsewhere).
_BASE = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "engram_vocab_size": 40,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "dspark_markov_rank": 8,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "vision_config": None,
}


def _plan(n_layers: int, **kw) -> dict:
    return layer_plan(n_layers, mtp=1, targets=1, **kw)


def specs() -> tuple[FixtureSpec, ...]:
    return (
        FixtureSpec(
            "plan",
            seed=4,
            n_tokens=256,
            overrides={
                **_BASE,
                **_plan(7, window=1, encoder=3, kv_group=2, index_every=2),
                "sliding_window": 8,
                "index_topk": 8,
                "candidate_topk_blocks": 4,
                "candidate_block_size": 4,
            },
            what="every block type: window-only 0; ratio-2 kv+index sources 1 and 3 (Engram on both), a ratio-2"
            " reader 2; ratio-1 kv+index+candidate source 4, reader 5, index-only source 6 inside 4 candidate blocks"
            " of 4; window 8, index_topk 8 of up to 128 (ratio 2) / 256 (ratio 1) rows",
        ),
        FixtureSpec(
            "wide",
            seed=21,
            n_tokens=160,
            vocab=96,
            overrides={
                **_BASE,
                **_plan(6, window=2, encoder=2, kv_group=2, index_every=1),
                "hidden_size": 64,
                "num_attention_heads": 8,
                "head_dim": 32,
                "o_groups": 4,
                "index_head_dim": 64,
                "moe_intermediate_size": 64,
                "engram_max_ngram_size": 3,
                "engram_n_heads": 4,
                "engram_head_dim": 64,
                "engram_vocab_size": 97,
                "sliding_window": 16,
                "index_topk": 6,
                "candidate_topk_blocks": 3,
                "candidate_block_size": 8,
                "routed_scaling_factor": 2.5,
            },
            what="other shapes: hidden 64, 8 heads of 32, 4 output groups, 2- and 3-grams x 4 Engram heads of 64"
            " on layers 1 and 2; window-only 0-1, ratio-2 source 2, ratio-1 sources 4 (candidates: 3 blocks of 8)"
            " and 5",
        ),
        FixtureSpec(
            "clamp",
            seed=40,
            n_tokens=200,
            out_gain_log2=-6,
            need_clamp=True,
            overrides={
                **_BASE,
                **_plan(8, window=2, encoder=3, kv_group=3, index_every=2),
                "sliding_window": 12,
                "index_topk": 5,
                "candidate_topk_blocks": 5,
                "candidate_block_size": 2,
                "swiglu_limit": 1.5,
                "expert_gain": 3.0,
                "num_experts_per_tok": 3,
            },
            what="SwiGLU clamp biting (limit 1.5, experts x3, outputs damped x1/64), top-3 of 8; window-only 0-1, ratio-2 source 2 and"
            " readers 3-4, ratio-1 source 5 (candidates: 5 blocks of 2), reader 6, index-only source 7",
        ),
        FixtureSpec(
            "odd",
            seed=60,
            n_tokens=192,
            overrides={
                **_BASE,
                **_plan(7, window=1, encoder=3, kv_group=2, index_every=2),
                "num_attention_heads": 2,
                "head_dim": 96,
                "o_groups": 1,
                "sliding_window": 4,
                "index_topk": 3,
                "candidate_topk_blocks": 2,
                "candidate_block_size": 4,
            },
            what="unusual small dimensions (issue 40, item 15): 2 heads of 96 (not a power of two) in 1 output group,"
            " window 4, index_topk 3 of up to 96 (ratio 2) / 192 (ratio 1) rows inside 2 candidate blocks of 4;"
            " plan as in `plan`",
        ),
    )


def make_v41_checkpoint(dst: Path, spec: FixtureSpec, seed: int) -> Path:
    """A generated V4.1 checkpoint; synth writes its small tokenizer.json and sets
    engram_compressed_vocab_size to that tokenizer's class count."""
    overrides = {**spec.overrides, "vocab_size": spec.vocab}
    overrides.setdefault("dspark_noise_token_id", spec.vocab - 1)
    overrides.setdefault("image_token_id", spec.vocab - 2)
    ckpt = make_checkpoint(dst, preset="tiny-v41", seed=seed, **overrides)
    if not (ckpt / "tokenizer.json").is_file():
        raise click.ClickException(f"{ckpt}: the generator wrote no tokenizer.json (the Engram class map needs one)")
    return ckpt


DAMPED = ("attn.wo_b.scale", ".w2.scale", "engram.wkv.scale")


def damp_outputs(ckpt: Path, log2_gain: int) -> int:
    """Multiply what each sublayer adds to the residual streams by 2**log2_gain, exactly: the E8M0
    scales of attn.wo_b, every w2 (routed and shared experts) and engram.wkv move by log2_gain.

    Random weights make every sublayer as large as the stream it adds to, so the logits carry
    all the quantisation noise of every layer (official numerics land 30-45% of max |logit| away
    from fp32 ones, and any change of where activations are rounded moves them as far). Trained
    models add small updates to a large residual; damped fixtures do too, and keep every path
    (selection, routing, Engram) live. Returns the number of tensors changed."""
    n = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        hlen = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + hlen])
        for name, v in header.items():
            if name == "__metadata__" or not name.endswith(DAMPED):
                continue
            if v["dtype"] != "F8_E8M0":
                raise click.ClickException(f"{name}: expected F8_E8M0 scales, found {v['dtype']}")
            a, b = (8 + hlen + o for o in v["data_offsets"])
            e = np.frombuffer(bytes(raw[a:b]), dtype=np.uint8).astype(np.int32) + log2_gain
            if e.min() < 1 or e.max() > 254:
                raise click.ClickException(f"{name}: a scale leaves the E8M0 range when moved by {log2_gain}")
            raw[a:b] = e.astype(np.uint8).tobytes()
            n += 1
        f.write_bytes(bytes(raw))
    return n


def build(reference: Path, spec: FixtureSpec, out_root: Path, max_tries: int = 12) -> dict:
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="v41oracle."))
    try:
        for attempt in range(max_tries):
            seed = spec.seed + attempt
            ckpt = make_v41_checkpoint(tmp / f"{spec.name}-{seed}", spec, seed)
            if spec.out_gain_log2:
                damp_outputs(ckpt, spec.out_gain_log2)
            ids = np.random.default_rng(1000 + seed).integers(0, spec.vocab, spec.n_tokens).astype(np.int64)
            logits, gaps, bad, clamp = {}, {"route": np.inf, "index": np.inf, "candidates": np.inf}, [], {}
            for mode, numerics, keys in RUNS:
                out, g = reference_run(reference, ckpt, ids, mode, numerics, keys, clamp if not clamp else None)
                logits[run_key(mode, numerics, keys)] = out
                print(f"  {spec.name} seed {seed}: {run_key(mode, numerics, keys)} done", flush=True)
                if numerics == "fp32":
                    gaps = {k: min(gaps[k], g[k]) for k in gaps}
                    bad = [k for k, v in gaps.items() if v < TIE_GAP]
                    if spec.need_clamp and not (clamp["gate_over"] and clamp["up_over"]):
                        bad.append("the SwiGLU clamp does not bite")
                    if bad:
                        break
            if bad:
                print(f"  {spec.name}: seed {seed} rejected (near-tie at {bad}: {gaps})")
                continue
            break
        else:
            raise SystemExit(f"{spec.name}: no seed without near-ties in {max_tries} tries")
        hashes = engram_hashes(reference, ckpt, ids)
        f32act, _ = reference_run(reference, ckpt, ids, "prefill", "f32act", "owner")
        dst = out_root / spec.name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(ckpt, dst)
        dst.chmod(0o755)
        for f in dst.iterdir():
            f.chmod(0o644)
        po = logits["prefill_official"]
        diffs = {
            "official: step (as shipped) vs prefill": compare(logits["step_official_asshipped"], po),
            "official: step (owner keys) vs prefill": compare(logits["step_official_owner"], po),
            "official: step as shipped vs owner": compare(
                logits["step_official_asshipped"], logits["step_official_owner"]
            ),
            "fp32: step (owner keys) vs prefill": compare(logits["step_fp32_owner"], logits["prefill_fp32"]),
            "fp32: step as shipped vs owner": compare(logits["step_fp32_asshipped"], logits["step_fp32_owner"]),
            "fp32 prefill vs official prefill": compare(logits["prefill_fp32"], po),
            "official with float32 activations vs official (prefill)": compare(f32act, po),
        }
        arrays = {"token_ids": ids, "engram_rows": hashes, **logits}
        for k, v in logits.items():
            arrays[f"gap_{k}"] = top2_gap(v).astype(np.float32)
        cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
        meta = {
            "name": spec.name,
            "what": spec.what,
            "seed": seed,
            "token_seed": 1000 + seed,
            "n_tokens": spec.n_tokens,
            "vocab": spec.vocab,
            "overrides": {k: v for k, v in spec.overrides.items() if k != "vision_config"},
            "out_gain_log2": spec.out_gain_log2,
            "engram_compressed_vocab_size": cfg["engram_compressed_vocab_size"],
            "torch": torch.__version__,
            "reference": reference_digests(reference),
            "fp32_min_boundary_gaps": {k: float(v) for k, v in gaps.items()},
            "swiglu_clamp_fp32_prefill": clamp,
            "reference_self_differences": diffs,
            "selection": selection_facts(cfg, spec.n_tokens),
        }
        np.savez_compressed(dst / "oracle.npz", **arrays)
        (dst / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def selection_facts(cfg: dict, n: int) -> dict:
    """At the last position: compressed rows visible per ratio vs index_topk, blocks vs the pool."""
    ratios = {r for r in cfg["compress_ratios"][: cfg["num_hidden_layers"]] if r}
    rows = {f"ratio {r}": n // r for r in sorted(ratios)}
    cand = cfg["candidate_source_layer_id"]
    blocks = -(-(n // cfg["compress_ratios"][cand]) // cfg["candidate_block_size"]) if cand >= 0 else 0
    return {
        "visible_rows": rows,
        "index_topk": cfg["index_topk"],
        "candidate_blocks": blocks,
        "candidate_topk_blocks": cfg["candidate_topk_blocks"],
    }


# ---- Engram hashing fixtures -------------------------------------------------------------------
ENGRAM_CONFIGS = (
    # (name, layer ids, max n-gram, heads, engram_vocab_size); the first is the release's
    ("release", (1, 14), 4, 8, 16_000_000),
    ("three-layers-5gram", (0, 3, 9), 5, 3, 1000),
    ("one-layer-bigram", (2,), 2, 1, 97),
    ("late-layers", (27, 30), 4, 4, 50_000),
)


def reference_engram(reference: Path, layer_ids, max_ngram, heads, vocab, n_classes, tokenizer, seq_len: int):
    """The reference's NgramHashState for one layout (no model built)."""
    import types

    ref = load_reference(reference)
    args = types.SimpleNamespace(
        engram_layer_ids=layer_ids,
        engram_max_ngram_size=max_ngram,
        engram_n_heads=heads,
        engram_vocab_size=vocab,
        engram_head_dim=256,
        engram_num_embeddings=(),
        engram_pad_id=2,
        engram_compressed_vocab_size=n_classes,
        max_batch_size=1,
        max_seq_len=seq_len,
    )
    layout = ref.EngramLayout.from_args(args)
    return ref, layout, ref.NgramHashState(args, layout, tokenizer)


def build_engram(reference: Path, out_root: Path, real_tokenizer: Path) -> dict:
    """tests/fixtures/v41/engram: the reference's hash layouts and row ids for random sequences,
    on the real tokenizer (release layout and others) and on a small generated one."""
    import torch

    dst = out_root / "engram"
    dst.mkdir(parents=True, exist_ok=True)
    tiny_json = small_tokenizer_json(300, seed=7)
    tiny_path = dst / "tokenizer.json"
    tiny_path.write_text(tiny_json)
    toks = {"real": HFTokenizer(real_tokenizer), "tiny": HFTokenizer(tiny_path)}
    ref0 = load_reference(reference)
    engram_mod = sys.modules[ref0.EngramLayout.__module__]
    maps = {}
    for k, tok in toks.items():
        lookup, n = engram_mod.build_compressed_token_map(tok)
        maps[k] = (np.asarray(lookup, dtype=np.int32), n)
    arrays, meta = {}, {"torch": torch.__version__, "reference": reference_digests(reference), "layouts": {}}
    for k, (m, n) in maps.items():
        meta[f"{k}_tokenizer"] = {
            "n_ids": int(m.size),
            "n_classes": int(n),
            "classes_sha256": hashlib.sha256(m.astype("<i4").tobytes()).hexdigest(),
        }
    arrays["tiny_classes"] = maps["tiny"][0]
    sample = np.random.default_rng(3).choice(maps["real"][0].size, 2000, replace=False)
    arrays["real_class_sample_ids"] = np.sort(sample)
    arrays["real_class_sample"] = maps["real"][0][np.sort(sample)]
    seq_len = 320
    for tok_name in ("real", "tiny"):
        m, n = maps[tok_name]
        for name, layer_ids, max_ngram, heads, vocab in ENGRAM_CONFIGS:
            if tok_name == "tiny" and name == "release":
                continue
            key = f"{tok_name}/{name}"
            _, layout, state = reference_engram(
                reference, layer_ids, max_ngram, heads, vocab, n, toks[tok_name], seq_len
            )
            rng = np.random.default_rng(zlib.crc32(key.encode()))
            ids = rng.integers(0, m.size, seq_len).astype(np.int64)
            ids[rng.random(seq_len) < 0.1] = 2  # the pad token inside the text, too
            live = rng.random(seq_len) >= 0.05  # a few dead (image-span) positions
            with torch.inference_mode():
                whole = state(torch.from_numpy(ids)[None], 0)[0].numpy().copy()
                # the same state continued in decode: a chunk, then one token at a time, with dead spans
                state2 = reference_engram(reference, layer_ids, max_ngram, heads, vocab, n, toks[tok_name], seq_len)[2]
                mask = torch.from_numpy(live)[None]
                first = state2(torch.from_numpy(ids[:100])[None], 0, mask[:, :100])[0].numpy()
                rest = [
                    state2(torch.from_numpy(ids[p : p + 1])[None], p, mask[:, p : p + 1])[0].numpy()
                    for p in range(100, seq_len)
                ]
            tag = key.replace("/", "_").replace("-", "_")
            arrays[f"{tag}_ids"] = ids
            arrays[f"{tag}_live"] = live
            arrays[f"{tag}_rows"] = whole
            arrays[f"{tag}_rows_masked"] = np.concatenate([first, *rest])
            meta["layouts"][key] = {
                "layer_ids": list(layer_ids),
                "max_ngram_size": max_ngram,
                "n_heads": heads,
                "engram_vocab_size": vocab,
                "n_classes": int(n),
                "pad_class": int(state.pad_id),
                "primes": [[int(p) for g in layer for p in g] for layer in layout.primes],
                "offsets": [[int(o) for o in row] for row in state.offsets.tolist()],
                # integers as decimal strings: a JSON double would round them
                "multipliers": [[str(int(v)) for v in row] for row in state.multipliers.tolist()],
                "arrays": tag,
            }
    np.savez_compressed(dst / "hashes.npz", **arrays)
    (dst / "hashes.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def quant_inputs(seed: int = 5) -> np.ndarray:
    """(rows, 256) bf16-exact float32 activations: blocks of every magnitude, all-zero and
    sub-floor blocks, signed zeros, values on FP8 and E2M1 rounding ties, the bf16 extremes."""
    import torch

    rng = np.random.default_rng(seed)
    rows = []
    for mag in (1e-30, 1e-8, 1e-5, 1e-3, 0.1, 1.0, 7.0, 300.0, 1e4, 3e38):
        rows.append(rng.standard_normal(256) * mag)
        rows.append(rng.standard_t(2, 256) * mag)
    rows.append(np.zeros(256))
    rows.append(np.where(np.arange(256) % 2, -0.0, 0.0))
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0])  # E2M1 midpoints after a scale of 1
    rows.append(np.resize(np.concatenate([ties, -ties]), 256))
    rows.append(np.resize(np.concatenate([ties * 64, [448.0, -448.0, 464.0, 480.0]]), 256))
    rows.append(np.resize([1.0625, 1.1875, 17.0, 19.0, 0.0009765625, 1e-4, 9.9e-5], 256))  # FP8 RNE ties, the floor
    big = float(torch.finfo(torch.bfloat16).max)
    x = torch.tensor(np.clip(np.stack(rows), -big, big), dtype=torch.float32).to(torch.bfloat16)
    return x.float().numpy()


# The DSpark drafter fixture: three stages reading the last three layers, 8 drafter experts
# top-3, window 8 (the drafter's windows wrap), block 5; the `plan` shapes otherwise.
DSPARK_SPEC = FixtureSpec(
    "dspark",
    seed=80,
    n_tokens=40,
    overrides={
        **_BASE,
        **layer_plan(7, window=1, encoder=3, kv_group=2, index_every=2, mtp=3, targets=3),
        "sliding_window": 8,
        "index_topk": 8,
        "candidate_topk_blocks": 4,
        "candidate_block_size": 4,
        "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 3,
    },
    what="the DSpark drafter: 3 stages over the inputs of layers 4-6, 8 experts top-3, block 5, window 8;"
    " layer plan as in `plan`",
)


def build_dspark(reference: Path, out_root: Path, spec: FixtureSpec = DSPARK_SPEC, max_tries: int = 12) -> dict:
    """tests/fixtures/v41/dspark: the reference drafter's outputs at every position (draft.npz)."""
    import torch
    from v41_reference_dspark import reference_drafts

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="v41dspark."))
    try:
        for attempt in range(max_tries):
            seed = spec.seed + attempt
            ckpt = make_v41_checkpoint(tmp / f"{spec.name}-{seed}", spec, seed)
            damp_outputs(ckpt, spec.out_gain_log2)
            ids = np.random.default_rng(1000 + seed).integers(0, spec.vocab, spec.n_tokens).astype(np.int64)
            block = json.loads((ckpt / "config.json").read_text())["text_config"]["dspark_block_size"]
            positions = np.arange(1, spec.n_tokens - block, dtype=np.int64)
            runs, gaps = {}, {}
            for numerics in ("fp32", "official"):
                runs[numerics] = reference_drafts(reference, ckpt, ids, positions, numerics)
                if numerics == "fp32":
                    gaps = runs[numerics][2]
                    if min(gaps.values()) < TIE_GAP:
                        break
            if min(gaps.values()) < TIE_GAP:
                print(f"  {spec.name}: seed {seed} rejected (near-tie: {gaps})")
                continue
            break
        else:
            raise SystemExit(f"{spec.name}: no seed without near-ties in {max_tries} tries")
        dst = out_root / spec.name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(ckpt, dst)
        dst.chmod(0o755)
        for f in dst.iterdir():
            f.chmod(0o644)
        arrays = {"token_ids": ids, "positions": positions}
        for numerics, (logits, conf, _) in runs.items():
            arrays[f"logits_{numerics}"] = logits
            arrays[f"confidence_{numerics}"] = conf
        lf, lo = runs["fp32"][0], runs["official"][0]
        meta = {
            "name": spec.name,
            "what": spec.what,
            "seed": seed,
            "token_seed": 1000 + seed,
            "n_tokens": spec.n_tokens,
            "vocab": spec.vocab,
            "overrides": {k: v for k, v in spec.overrides.items() if k != "vision_config"},
            "out_gain_log2": spec.out_gain_log2,
            "torch": torch.__version__,
            "reference": reference_digests(reference),
            "fp32_min_boundary_gaps": {k: float(v) for k, v in gaps.items()},
            "official vs fp32 (draft logits, max |d| / max |fp32|)": float(np.abs(lo - lf).max() / np.abs(lf).max()),
            "official vs fp32 (argmax agreement)": float((lo.argmax(-1) == lf.argmax(-1)).mean()),
        }
        np.savez_compressed(dst / "draft.npz", **arrays)
        (dst / "draft.json").write_text(json.dumps(meta, indent=1) + "\n")
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_quant(reference: Path, out_root: Path) -> dict:
    """tests/fixtures/v41/quant: the reference kernels' activation QDQ on quant_inputs(), bit for bit."""
    import torch

    kc = kernel_module(load_reference(reference))
    x = torch.from_numpy(quant_inputs()).to(torch.bfloat16)
    q, s = kc.act_quant(x.clone(), 32, "ue8m0", torch.float8_e8m0fnu)
    arrays = {
        "x": x.float().numpy(),
        "fp8_codes": q.view(torch.uint8).numpy(),  # E4M3 bytes
        "fp8_scales": s.float().numpy(),
        "fp8_qdq": kc.act_quant(x.clone(), 32, "ue8m0", torch.float8_e8m0fnu, True).float().numpy(),
        "fp4_e8m0_qdq": kc.fp4_act_quant(x.clone(), 32, True).float().numpy(),
        "fp4_e4m3_qdq": kc.fp4_act_quant(x.clone(), 16, True, scale_dtype=torch.float8_e4m3fn).float().numpy(),
    }
    dst = out_root / "quant"
    dst.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(dst / "qdq.npz", **arrays)
    meta = {"torch": torch.__version__, "reference": reference_digests(reference), "rows": int(x.shape[0])}
    (dst / "qdq.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


@click.command()
@click.option(
    "--reference",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Local copy of DeepSeek's V4.1 inference code with kernel_cpu.py (see docs/development.md).",
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "v41"
)
@click.option("--only", multiple=True, help="Build only these fixtures (by name).")
@click.option("--engram", is_flag=True, help="Build the Engram hashing fixtures (tests/fixtures/v41/engram) instead.")
@click.option("--quant", is_flag=True, help="Build the activation QDQ fixtures (tests/fixtures/v41/quant) instead.")
@click.option("--dspark", is_flag=True, help="Build the DSpark drafter fixture (tests/fixtures/v41/dspark) instead.")
def main(reference: Path, out: Path, only: tuple[str, ...], engram: bool, quant: bool, dspark: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        if dspark:
            meta = build_dspark(reference, out)
            print(json.dumps(meta, indent=1))
            return
        if quant:
            meta = build_quant(reference, out)
            print(f"quant: {meta['rows']} rows of 256")
            return
        if engram:
            from dsv4stream.text.tokenizer import real_tokenizer_files

            meta = build_engram(reference, out, real_tokenizer_files()[0])
            print(f"engram: {len(meta['layouts'])} layouts, real tokenizer {meta['real_tokenizer']}")
            return
        for spec in specs():
            if only and spec.name not in only:
                continue
            meta = build(reference, spec, out)
            size = sum(p.stat().st_size for p in (out / spec.name).iterdir())
            print(f"{spec.name}: seed {meta['seed']}, {size / 1e6:.2f} MB")
            print(json.dumps(meta["reference_self_differences"], indent=1))
    except ReferenceError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
