#!/usr/bin/env python3
"""Golden numbers for the forward pass from an independent implementation.

Builds small checkpoints in the release format with `dsv4stream.synth`, runs HF
transformers' `DeepseekV4ForCausalLM` on them (CPU torch, float32), and stores under
tests/fixtures/<name>/ the checkpoint, the token ids, the float32 logits and a few
intermediates (per-layer streams / attention / FFN outputs at probe positions, router and
indexer choices). Needs the `oracle` extra (torch, transformers>=5.23, accelerate); CI never
runs it, the tests only read what it stored.

Each fixture is checked before it is kept: no near-tie at any indexer or router top-k
boundary or between the two largest logits (a tie would make the choice depend on
rounding), and the SwiGLU clamp must actually bite. A seed that fails a check is skipped
for the next one; the seed used is recorded.

Usage: tools/make_oracle_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4stream import jsonio
from dsv4stream.synth import make_checkpoint

RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention"}
HCA = "heavily_compressed_attention"
# relative gap (to the row's largest magnitude) below which two candidates count as tied
TIE_GAP = 1e-4
N_PROBES = 12


@dataclass(frozen=True)
class FixtureSpec:
    name: str
    seed: int
    n_tokens: int
    overrides: dict = field(default_factory=dict)
    what: str = ""
    preset: str = "tiny"


# Small shapes: every FP8 dim is <= 128 or a multiple of 128 (transformers derives the block
# size from the scale grid), 8 indexer heads (fewer make exact zero-score ties likely).
_BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "tokenizer": False,
}

SPECS = (
    FixtureSpec(
        "mixed",
        seed=1,
        n_tokens=100,
        overrides={
            **_BASE,
            "num_hidden_layers": 4,
            "num_nextn_predict_layers": 1,
            "compress_ratios": [0, 4, 16, 4, 0],
            "sliding_window": 16,
            "index_topk": 3,
            "num_hash_layers": 2,
            "swiglu_limit": 3.0,
            "expert_gain": 3.0,
        },
        what="window / ratio-4 / ratio-16 / ratio-4; hash layers 0-1, scored 2-3; E8M0 scales",
    ),
    FixtureSpec(
        "ratio128",
        seed=15,
        n_tokens=300,
        overrides={
            **_BASE,
            "num_hidden_layers": 3,
            "num_nextn_predict_layers": 1,
            "compress_ratios": [128, 4, 0, 0],
            "sliding_window": 32,
            "index_topk": 8,
            "num_hash_layers": 1,
            "swiglu_limit": 2.0,
            "expert_gain": 2.0,
        },
        what="ratio-128 / ratio-4 / window over 300 tokens (2 rows at ratio 128, 75 at ratio 4)",
    ),
    FixtureSpec(
        "f32scales",
        seed=22,
        n_tokens=80,
        overrides={
            **_BASE,
            "num_hidden_layers": 3,
            "num_nextn_predict_layers": 1,
            "compress_ratios": [4, 8, 0, 0],
            "sliding_window": 8,
            "index_topk": 4,
            "num_hash_layers": 1,
            "swiglu_limit": 2.0,
            "expert_gain": 2.0,
            "scale_fmt": "float",
            "compressor_dtype": "fp8",
        },
        what="F32 scales everywhere, FP8 compressor projections; ratio-4 / ratio-8 / window",
    ),
    FixtureSpec(
        "dspark0731",
        seed=40,
        n_tokens=90,
        preset="tiny-0731",
        overrides={
            **_BASE,
            "num_hidden_layers": 3,
            "compress_ratios": [0, 4, 16, 0, 0, 0],
            "dspark_target_layer_ids": [0, 1, 2],
            "dspark_noise_token_id": 255,
            "sliding_window": 16,
            "index_topk": 4,
            "num_hash_layers": 1,
            "swiglu_limit": 3.0,
            "expert_gain": 3.0,
        },
        what="the 0731 layout: three DSpark stages under mtp.0-2 (transformers ignores mtp.*)",
    ),
    FixtureSpec(
        "proshape",
        seed=60,
        n_tokens=120,
        overrides={
            **_BASE,
            "num_attention_heads": 8,
            "o_groups": 4,
            "o_lora_rank": 32,
            "n_routed_experts": 12,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 2.5,
            "num_hidden_layers": 3,
            "num_nextn_predict_layers": 1,
            "compress_ratios": [16, 16, 4, 0],
            "sliding_window": 16,
            "index_topk": 6,
            "num_hash_layers": 1,
            "swiglu_limit": 3.0,
            "expert_gain": 3.0,
        },
        what="V4-Pro proportions: wo_a [o_groups*o_lora = 128, heads*head_dim/o_groups = 64] taller than hidden 64,"
        " 1.5x the experts, ratio-16 first layers as Pro's ratio-128 ones, routed_scaling_factor 2.5",
    ),
)


# ---- running the reference -------------------------------------------------------------
def load_reference(ckpt: Path):
    """transformers' model for a release-format directory, in float32."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils.quantization_config import FineGrainedFP8Config

    d = jsonio.read_json(ckpt / "config.json", "config.json")
    n = d["num_hidden_layers"]
    ratios = d["compress_ratios"][:n]
    hca = sorted({r for r in ratios if r not in RATIO_TO_TYPE})
    if len(hca) > 1:
        raise SystemExit(f"transformers supports one heavily-compressed ratio per model, found {hca}")
    # its config maps compress_ratios 0/4/128 only: give the layer types and rates explicitly
    d = {k: v for k, v in d.items() if k != "compress_ratios"}
    d["layer_types"] = [RATIO_TO_TYPE.get(r, HCA) for r in ratios]
    d["compress_rates"] = {"compressed_sparse_attention": 4, HCA: hca[0] if hca else 128}
    cfg = DeepseekV4Config.from_dict(d)
    q = d["quantization_config"]
    qc = FineGrainedFP8Config(
        dequantize=True,  # CPU: dequantise FP8/FP4 at load time
        scale_fmt=q.get("scale_fmt") or "float",
        expert_dtype=d.get("expert_dtype", "fp8"),
        weight_block_size=tuple(q["weight_block_size"]),
    )
    try:  # float32 parameters keep dequantised values exact (F32 scales would round in bf16)
        m = DeepseekV4ForCausalLM.from_pretrained(ckpt, config=cfg, quantization_config=qc, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        print(f"  float32 load failed ({type(e).__name__}: {e}); loading in bf16, then .float()")
        m = DeepseekV4ForCausalLM.from_pretrained(ckpt, config=cfg, quantization_config=qc)
    return m.float().eval()


def run_reference(model, token_ids: np.ndarray, limit: float) -> dict:
    """Logits and intermediates for one teacher-forced pass over token_ids."""
    import torch
    import torch.nn.functional as F

    cap: dict = {"hidden": {}, "attn": {}, "ffn": {}, "route": {}, "route_scores": {}, "index": {}, "index_scores": {}}
    clamp = {"gate_over": 0, "up_over": 0, "values": 0}
    hooks = []

    def keep(kind, i):
        def hook(mod, inp, out):
            cap[kind][i] = (out[0] if isinstance(out, tuple) else out)[0].detach().numpy().copy()

        return hook

    def count(gate, up):
        clamp["gate_over"] += int((gate > limit).sum())
        clamp["up_over"] += int((up.abs() > limit).sum())
        clamp["values"] += gate.numel()

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(keep("hidden", i)))
        hooks.append(layer.self_attn.register_forward_hook(keep("attn", i)))
        hooks.append(layer.mlp.register_forward_hook(keep("ffn", i)))

        def route_hook(mod, inp, out, i=i):
            logits, _, idx = out
            cap["route"][i] = np.sort(idx.numpy(), axis=-1)
            s = F.softplus(logits).sqrt()
            if hasattr(mod, "e_score_correction_bias"):
                s = s + mod.e_score_correction_bias
                cap["route_scores"][i] = s.detach().numpy().copy()

        hooks.append(layer.mlp.gate.register_forward_hook(route_hook))
        experts = layer.mlp.experts
        orig = experts._apply_gate

        def apply_gate(gate_up, orig=orig):
            g, u = gate_up.chunk(2, dim=-1)
            count(g, u)
            return orig(gate_up)

        experts._apply_gate = apply_gate
        sh = layer.mlp.shared_experts
        hooks.append(sh.gate_proj.register_forward_hook(lambda m, i_, o: count(o, o.new_zeros(0))))
        hooks.append(sh.up_proj.register_forward_hook(lambda m, i_, o: count(o.new_zeros(0), o)))
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            hooks.append(comp.indexer.register_forward_hook(keep("index", i)))
            hooks.append(comp.indexer.scorer.register_forward_hook(keep("index_scores", i)))
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(token_ids[None, :].astype(np.int64)), use_cache=True)
    for h in hooks:
        h.remove()
    cap["logits"] = out.logits[0].detach().numpy().astype(np.float32)
    cap["clamp"] = clamp
    return cap


# ---- checks ------------------------------------------------------------------------------
def _gap(sorted_desc: np.ndarray, k: int) -> float:
    """Relative gap between the k-th and (k+1)-th of a descending row."""
    scale = max(float(np.abs(sorted_desc).max()), 1e-30)
    return float(sorted_desc[k - 1] - sorted_desc[k]) / scale


def check(cap: dict, cfg: dict, need_clamp: bool = True, tie_gap: float = TIE_GAP) -> dict:
    """Smallest top-k gaps (indexer, router, logits) and clamp counts; raises on a near-tie."""
    res = {"index_gap": np.inf, "route_gap": np.inf, "logit_gap": np.inf}
    k = cfg["num_experts_per_tok"]
    for s in cap["route_scores"].values():
        for row in s:
            res["route_gap"] = min(res["route_gap"], _gap(np.sort(row)[::-1], k))
    for s in cap["index_scores"].values():
        n = s.shape[1]
        for t, row in enumerate(s):
            valid = row[: min(n, (t + 1) // 4)]
            if valid.size > cfg["index_topk"]:
                res["index_gap"] = min(res["index_gap"], _gap(np.sort(valid)[::-1], cfg["index_topk"]))
    for row in cap["logits"]:
        res["logit_gap"] = min(res["logit_gap"], _gap(np.sort(row)[::-1], 1))
    res.update(cap["clamp"])
    cap["gaps"] = {k: f"{v:.2e}" for k, v in res.items() if k.endswith("gap")}
    bad = [key for key in ("index_gap", "route_gap", "logit_gap") if res[key] < tie_gap]
    if need_clamp and (res["gate_over"] == 0 or res["up_over"] == 0):
        bad.append("clamp does not bite")
    if bad:
        raise ValueError(", ".join(bad))
    return res


# ---- building one fixture -------------------------------------------------------------
def probe_positions(n: int, window: int) -> np.ndarray:
    p = {0, 1, 2, 3, window - 1, window, n // 2, n - 2, n - 1}
    p |= set(np.linspace(0, n - 1, N_PROBES).astype(int).tolist())
    return np.array(sorted(x for x in p if 0 <= x < n), dtype=np.int64)


def pack_indices(d: dict, n_tokens: int) -> dict:
    """Per-layer (T, K) choices, each row sorted ascending with invalid (-1) last."""
    out = {}
    for i, a in d.items():
        a = np.where(a < 0, np.iinfo(np.int32).max, a)
        a = np.sort(a, axis=-1)
        out[i] = np.where(a == np.iinfo(np.int32).max, -1, a).astype(np.int32)
    return out


def build(spec: FixtureSpec, out_root: Path, max_tries: int = 20) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="oracle."))
    try:
        for attempt in range(max_tries):
            seed = spec.seed + attempt
            ckpt = make_checkpoint(tmp / f"{spec.name}-{seed}", preset=spec.preset, seed=seed, **spec.overrides)
            cfg = jsonio.read_json(ckpt / "config.json", "config.json")
            ids = np.random.default_rng(1000 + seed).integers(0, cfg["vocab_size"], spec.n_tokens).astype(np.int64)
            cap = run_reference(load_reference(ckpt), ids, cfg["swiglu_limit"])
            try:
                checks = check(cap, cfg)
            except ValueError as e:
                print(f"  {spec.name}: seed {seed} rejected ({e}; {cap['gaps']})")
                continue
            break
        else:
            raise SystemExit(f"{spec.name}: no acceptable seed in {max_tries} tries")
        dst = out_root / spec.name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(ckpt, dst)
        dst.chmod(0o755)
        for f in dst.iterdir():
            f.chmod(0o644)
        probes = probe_positions(spec.n_tokens, cfg["sliding_window"])
        layers = sorted(cap["hidden"])
        arrays = {
            "token_ids": ids,
            "logits": cap["logits"],
            "probes": probes,
            "hidden": np.stack([cap["hidden"][i][probes] for i in layers]).astype(np.float32),
            "attn": np.stack([cap["attn"][i][probes] for i in layers]).astype(np.float32),
            "ffn": np.stack([cap["ffn"][i][probes] for i in layers]).astype(np.float32),
        }
        for i, a in cap["route"].items():
            arrays[f"route_{i}"] = a.astype(np.int16)
        for i, a in pack_indices(cap["index"], spec.n_tokens).items():
            arrays[f"index_{i}"] = a
        meta = {
            "name": spec.name,
            "what": spec.what,
            "seed": seed,
            "token_seed": 1000 + seed,
            "preset": spec.preset,
            "overrides": spec.overrides,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "checks": {k: (float(v) if isinstance(v, float) else v) for k, v in checks.items()},
        }
        np.savez_compressed(dst / "oracle.npz", **arrays)
        (dst / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@click.command()
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path(__file__).resolve().parents[1] / "tests" / "fixtures"
)
@click.option("--only", multiple=True, help="Build only these fixtures (by name).")
def main(out: Path, only: tuple[str, ...]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for spec in SPECS:
        if only and spec.name not in only:
            continue
        meta = build(spec, out)
        size = sum(p.stat().st_size for p in (out / spec.name).iterdir())
        print(f"{spec.name}: seed {meta['seed']}, {size / 1e6:.2f} MB, checks {meta['checks']}")


if __name__ == "__main__":
    main()
