#!/usr/bin/env python3
"""Issue 44's acceptance check rehearsed on reference checkpoints that are NOT the test fixtures.

The acceptance run uses checkpoints generated elsewhere; this tool makes new ones (other seeds,
odd dimensions, other expert counts and compress ratios, prompts several windows long), runs the
independent references on them with the fixture builders (`make_oracle_fixtures.build`: HF
transformers' DeepseekV4 in float32; `make_v41_fixtures.build` / `build_dspark`: DeepSeek's own
V4.1 reference, fp32 and official), then feeds the same ids through `dsv4 logits` in a child
process per run (prefill and `--mode step`; `--numerics exact | official | fast`, and `fast` again
with `NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=`, the AVX2 variants) and prints a table:

  exact:     max over positions of max|d| / max|ref| (the oracle tests allow 1e-4) and the
             argmax agreement on clear positions;
  official, fast, fast-haswell: the median over positions of max|d| / max|ref| and the argmax
             agreement on clear positions (`tests/numerics_deviation.figures`); fast must be
             at least as close as official on both.
  V4.1 official against the reference's official run: median <= 0.05, argmax >= 85 %
             (tests/test_v41_oracle.py's limits).
  DSpark (V4.1): `dsv4 logits --draft-out` against the reference drafter with issue 41's
             tolerances (exact: 1e-4 of max|ref|, argmax on clear rows; official: median row
             max|d| <= 0.08, argmax >= 80 %, confidence median <= 0.05).

Three steps (the references need torch; V4.1's needs torch >= 2.9 and DeepSeek's local copy):
  /work/main/.venv/bin/python tools/rehearse_acceptance.py make-v4 --out DIR
  /work/refenv/bin/python tools/rehearse_acceptance.py make-v41 --reference /work/ref/deepseek_v41 --out DIR
  /work/main/.venv/bin/python tools/rehearse_acceptance.py check --out DIR [--json FILE]
Nothing it writes belongs in the repository (the checkpoints are regenerated from the specs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

HASWELL = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
EXACT_TOL = 1e-4  # tests/test_forward_oracle.py and test_v41_oracle.py: exact vs the float32 reference
CLEAR = 0.01  # numerics_deviation.CLEAR: top-2 gap / max|ref| below which argmax is a coin toss


def v4_specs():
    """New V4 checkpoints: transformers needs every FP8 dim <= 128 or a multiple of 128."""
    from make_oracle_fixtures import _BASE, FixtureSpec

    return (
        FixtureSpec(
            "r-odd96",
            seed=101,
            n_tokens=320,
            overrides={
                **_BASE,
                "hidden_size": 96,
                "num_attention_heads": 6,
                "head_dim": 32,
                "o_groups": 3,
                "o_lora_rank": 24,
                "q_lora_rank": 48,
                "n_routed_experts": 10,
                "num_experts_per_tok": 3,
                "moe_intermediate_size": 96,
                "num_hidden_layers": 4,
                "num_nextn_predict_layers": 1,
                "compress_ratios": [4, 128, 0, 4, 0],
                "sliding_window": 24,
                "index_topk": 5,
                "num_hash_layers": 1,
                "swiglu_limit": 2.5,
                "expert_gain": 2.5,
            },
            what="hidden 96, 6 heads in 3 groups, 10 experts top-3; ratio-4 / ratio-128 / window / ratio-4, 320 tokens",
        ),
        FixtureSpec(
            "r-ratio8",
            seed=202,
            n_tokens=240,
            overrides={
                **_BASE,
                "n_routed_experts": 16,
                "num_experts_per_tok": 4,
                "num_hidden_layers": 4,
                "num_nextn_predict_layers": 1,
                "compress_ratios": [8, 0, 8, 4, 0],
                "sliding_window": 12,
                "index_topk": 7,
                "num_hash_layers": 2,
                "swiglu_limit": 3.0,
                "expert_gain": 3.0,
                "scale_fmt": "float",
            },
            what="16 experts top-4, hash layers 0-1; ratio-8 / window / ratio-8 / ratio-4 (transformers takes one compressed ratio besides 4), F32 scales, 240 tokens",
        ),
        FixtureSpec(
            "r-wide256",
            seed=303,
            n_tokens=160,
            overrides={
                **_BASE,
                "hidden_size": 256,
                "num_attention_heads": 4,
                "head_dim": 64,
                "q_lora_rank": 128,
                "o_lora_rank": 64,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 256,
                "num_hidden_layers": 3,
                "num_nextn_predict_layers": 1,
                "compress_ratios": [0, 4, 128, 0],
                "sliding_window": 16,
                "index_topk": 6,
                "num_hash_layers": 1,
                "swiglu_limit": 3.0,
                "expert_gain": 3.0,
            },
            what="hidden 256 and experts 256 wide: every FP4 / FP8 / BF16 product takes the fast kernels"
            " (int8 needs columns in multiples of 256, BF16 of 64); window / ratio-4 / ratio-128, 160 tokens",
        ),
    )


def v41_specs():
    from make_v41_fixtures import _BASE, FixtureSpec, _plan

    from dsv4stream.synth.v41 import layer_plan

    main = (
        FixtureSpec(
            "r41-wide96",
            seed=301,
            n_tokens=224,
            vocab=80,
            overrides={
                **_BASE,
                **_plan(6, window=1, encoder=2, kv_group=1, index_every=3),
                "hidden_size": 96,
                "num_attention_heads": 3,
                "head_dim": 64,
                "o_groups": 1,
                "moe_intermediate_size": 96,
                "n_routed_experts": 6,
                "num_experts_per_tok": 2,
                "sliding_window": 10,
                "index_topk": 7,
                "candidate_topk_blocks": 3,
                "candidate_block_size": 4,
            },
            what="hidden 96, 3 heads in 1 group, 6 experts top-2; window 10, 224 tokens; ratio-2 sources 1-2",
        ),
        FixtureSpec(
            "r41-deep",
            seed=402,
            n_tokens=256,
            vocab=120,
            overrides={
                **_BASE,
                **_plan(8, window=2, encoder=3, kv_group=2, index_every=2),
                "n_routed_experts": 12,
                "num_experts_per_tok": 3,
                "engram_max_ngram_size": 3,
                "sliding_window": 6,
                "index_topk": 10,
                "candidate_topk_blocks": 5,
                "candidate_block_size": 4,
            },
            what="8 layers, 12 experts top-3, 2-3-grams; window 6 (256 tokens = 42 windows), index_topk 10",
        ),
        FixtureSpec(
            "r41-wide256",
            seed=505,
            n_tokens=160,
            vocab=100,
            overrides={
                **_BASE,
                **_plan(5, window=1, encoder=2, kv_group=2, index_every=2),
                "hidden_size": 256,
                "q_lora_rank": 64,
                "moe_intermediate_size": 256,
                "engram_head_dim": 64,
                "sliding_window": 12,
                "index_topk": 8,
                "candidate_topk_blocks": 4,
                "candidate_block_size": 4,
            },
            what="hidden 256 and experts 256 wide: the FP4 experts take the int8 kernels, FP8 / BF16 the BF16 ones;"
            " window 12, 160 tokens",
        ),
    )
    dspark = FixtureSpec(
        "r41-dspark",
        seed=500,
        n_tokens=44,
        vocab=72,
        overrides={
            **_BASE,
            **layer_plan(6, window=2, encoder=2, kv_group=2, index_every=2, mtp=3, targets=3),
            "sliding_window": 6,
            "index_topk": 6,
            "candidate_topk_blocks": 4,
            "candidate_block_size": 4,
            "dspark_n_routed_experts": 6,
            "dspark_num_experts_per_tok": 2,
        },
        what="DSpark: 3 stages over layers 3-5, 6 experts top-2, window 6",
    )
    return main, dspark


@click.group()
def cli() -> None:
    pass


@cli.command("make-v4")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--only", multiple=True, help="only these checkpoints (by name)")
def make_v4(out: Path, only: tuple[str, ...]) -> None:
    """V4 checkpoints and transformers' float32 logits (oracle.npz), under OUT/v4."""
    from make_oracle_fixtures import build

    for spec in v4_specs():
        if only and spec.name not in only:
            continue
        meta = build(spec, out / "v4")
        print(f"v4/{spec.name}: seed {meta['seed']}, checks {meta['checks']}", flush=True)


@cli.command("make-v41")
@click.option("--reference", type=click.Path(path_type=Path, exists=True), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--only", multiple=True, help="only these checkpoints (by name)")
def make_v41(reference: Path, out: Path, only: tuple[str, ...]) -> None:
    """V4.1 checkpoints and DeepSeek's reference logits / drafts, under OUT/v41."""
    from make_v41_fixtures import build, build_dspark

    main, dspark = v41_specs()
    for spec in main:
        if only and spec.name not in only:
            continue
        meta = build(reference, spec, out / "v41")
        print(f"v41/{spec.name}: seed {meta['seed']}, gaps {meta['fp32_min_boundary_gaps']}", flush=True)
    if not only or dspark.name in only:
        meta = build_dspark(reference, out / "v41", dspark)
        print(f"v41/{dspark.name}: seed {meta['seed']}", flush=True)


def dsv4_logits(ckpt: Path, ids: np.ndarray, mode: str, numerics: str, env: dict, draft: bool = False):
    """`dsv4 logits` in a child process: (logits, draft npz arrays or None)."""
    with tempfile.TemporaryDirectory() as d:
        tok, out, dr = Path(d) / "ids.npy", Path(d) / "out.npy", Path(d) / "draft.npz"
        np.save(tok, ids)
        cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", "logits", str(ckpt)]
        cmd += ["--tokens-file", str(tok), "--out", str(out), "--mode", mode, "--numerics", numerics]
        if draft:
            cmd += ["--draft-out", str(dr)]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, check=False)
        if p.returncode:
            raise SystemExit(
                f"dsv4 logits {ckpt.name} {mode} {numerics} {env}: exit {p.returncode}\n{p.stderr[-3000:]}"
            )
        drafts = None
        if draft:
            with np.load(dr) as z:
                drafts = {k: z[k] for k in z.files}
        return np.load(out), drafts


def exact_figures(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """Worst position's max|d| / max|ref|, and argmax agreement where the top-2 gap exceeds
    2x the tolerance (the oracle tests' rule)."""
    scale = np.abs(ref).max(axis=1)
    err = np.abs(got - ref).max(axis=1) / scale
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / scale > 2 * EXACT_TOL
    return float(err.max()), float((got.argmax(1) == ref.argmax(1))[clear].mean())


def draft_check(d: dict, ref: dict, numerics: str) -> dict:
    """Issue 41's tolerances for the drafter against the reference's `numerics` run."""
    pos = ref["positions"].tolist()
    rows = [d["positions"].tolist().index(p) for p in pos]
    lg, cf = d["logits"][rows], d["confidence"][rows]
    rl, rc = ref[f"logits_{numerics}"], ref[f"confidence_{numerics}"]
    m = np.abs(rl).max(axis=-1)
    row = np.abs(lg - rl).max(axis=-1) / m
    top2 = np.sort(rl, axis=-1)[..., -2:]
    if numerics == "fp32":
        clear = (top2[..., 1] - top2[..., 0]) > 1e-3 * m
        agree = float((lg.argmax(-1) == rl.argmax(-1))[clear].mean())
        cerr = float(np.abs(cf - rc).max() / max(1.0, np.abs(rc).max()))
        ok = np.abs(lg - rl).max() <= 1e-4 * np.abs(rl).max() and agree == 1.0 and cerr <= 1e-4
        worst = float(np.abs(lg - rl).max() / np.abs(rl).max())
        return {"max": worst, "median": float(np.median(row)), "agree": agree, "conf": cerr, "ok": bool(ok)}
    clear = (top2[..., 1] - top2[..., 0]) > 1e-3 * m
    agree = float((lg.argmax(-1) == rl.argmax(-1))[clear].mean())
    cmed = float(np.median(np.abs(cf - rc)) / max(1.0, np.abs(rc).max()))
    med = float(np.median(row))
    return {"median": med, "agree": agree, "conf": cmed, "ok": bool(med <= 0.08 and agree >= 0.8 and cmed <= 0.05)}


@cli.command("check")
@click.option("--out", type=click.Path(path_type=Path, exists=True), required=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="also write the figures here")
@click.option("--only", multiple=True, help="only these checkpoints (by name)")
def check(out: Path, json_out: Path | None, only: tuple[str, ...]) -> None:
    """`dsv4 logits` on every checkpoint under OUT against its reference; exit 1 on a failure."""
    from numerics_deviation import figures

    results, failed = {}, []
    for label, env in (("native", {}), ("haswell", HASWELL)):  # the variants `fast` runs on in the children
        cmd = [sys.executable, "-c", "from dsv4stream.kernels import cpu; print(cpu.describe())"]
        p = subprocess.run(
            cmd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True, check=True
        )
        results[f"variant/{label}"] = p.stdout.strip()
        print(f"variant/{label}: {p.stdout.strip()}", flush=True)
    if "fp4=avx2 fp8=avx2 bf16=avx2" not in results["variant/haswell"]:
        failed.append("the haswell children do not run the AVX2 variants")
    for ckpt in sorted(p.parent for p in out.glob("*/*/oracle.npz")):
        if only and ckpt.name not in only:
            continue
        fam = ckpt.parent.name
        with np.load(ckpt / "oracle.npz") as z:
            o = {k: z[k] for k in z.files}
        ids = o["token_ids"]
        for mode in ("prefill", "step"):
            ref = o["logits"] if fam == "v4" else o["prefill_fp32" if mode == "prefill" else "step_fp32_owner"]
            row: dict = {"tokens": int(ids.size)}
            got, _ = dsv4_logits(ckpt, ids, mode, "exact", {})
            row["exact"] = exact_figures(got, ref)
            for name, numerics, env in (
                ("official", "official", {}),
                ("fast", "fast", {}),
                ("fast-haswell", "fast", HASWELL),
            ):
                got, _ = dsv4_logits(ckpt, ids, mode, numerics, env)
                row[name] = figures(got, ref)
            if fam == "v41":  # ours official against the reference's official run
                oref = o["prefill_official" if mode == "prefill" else "step_official_owner"]
                got, _ = dsv4_logits(ckpt, ids, mode, "official", {})
                row["official-vs-ref-official"] = figures(got, oref)
            bad = []
            if row["exact"][0] > EXACT_TOL or row["exact"][1] < 1.0:
                bad.append("exact")
            ours_official = row.get("official-vs-ref-official")  # test_v41_oracle's official limits
            if ours_official and (ours_official[0] > 0.05 or ours_official[1] < 0.85):
                bad.append("official-vs-ref-official")
            for name in ("fast", "fast-haswell"):
                if row[name][0] > row["official"][0] or row[name][1] < row["official"][1]:
                    bad.append(name)
            key = f"{fam}/{ckpt.name}/{mode}"
            results[key] = row
            failed += [f"{key}: {b}" for b in bad]
            print(f"{key}: {json.dumps(row)}{'  FAIL ' + ','.join(bad) if bad else ''}", flush=True)
    for ckpt in sorted(p.parent for p in out.glob("v41/*/draft.npz")):
        if only and ckpt.name not in only:
            continue
        with np.load(ckpt / "draft.npz") as z:
            ref = {k: z[k] for k in z.files}
        got = {}
        for numerics in ("exact", "official", "fast"):
            _, d = dsv4_logits(ckpt, ref["token_ids"], "prefill", numerics, {}, draft=True)
            for against in ("fp32", "official") if numerics != "exact" else ("fp32",):
                r = got[numerics, against] = draft_check(d, ref, against)
                key = f"dspark/{ckpt.name}/{numerics}-vs-{against}"
                results[key] = r
                print(f"{key}: {json.dumps(r)}", flush=True)
        # issue 41: exact within 1e-4 of the fp32 drafts, official within its spread of the
        # official ones; fast at least as close to the fp32 drafts as official is
        failed += [
            f"dspark/{ckpt.name}/{k[0]}-vs-{k[1]}"
            for k in (("exact", "fp32"), ("official", "official"))
            if not got[k]["ok"]
        ]
        f, o = got["fast", "fp32"], got["official", "fp32"]
        if f["median"] > o["median"] or f["agree"] < o["agree"]:
            failed.append(f"dspark/{ckpt.name}/fast-vs-fp32 (not as close as official)")
    if json_out:
        json_out.write_text(json.dumps(results, indent=1) + "\n")
    if failed:
        raise SystemExit("failed: " + "; ".join(failed))
    print("all checks passed")


if __name__ == "__main__":
    cli()
