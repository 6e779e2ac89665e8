"""Run DeepSeek's own DeepSeek-V4.1 reference on CPU, from a local copy, on a generated checkpoint.

No released library runs DeepSeek-V4.1, so the independent check is DeepSeek's
`inference/model.py` and `engram.py` (revision dba1be0a of deepseek-ai/DeepSeek-V4.1-Flash)
with torch CPU ports of its kernels (`kernel_cpu.py`), loaded from a LOCAL copy (never
committed, nothing of it copied here: docs/development.md says where to get it). Used by
`make_v41_fixtures.py` and by tests/test_v41_oracle_live.py.

Runs: prefill = one forward over all T tokens at start_pos 0, logits at every position;
step = token 0 as a one-token prefill, then one decode step per token.

Numerics and index keys, and what is changed at run time (the reference files stay as they
are; the changes are applied to the freshly loaded modules of one model):
  official    as shipped: bf16 activations, FP8 QDQ of every FP8/FP4 matmul input per 32,
              FP8 window KV, FP4 compressed KV (16, E4M3 scales), FP4 indexer q/k (32, E8M0).
  fp32        float32 default dtype; every FP8/FP4 weight dequantised exactly into float32
              (bf16 ones upcast); the activation, window-KV, compressed-KV and indexer QDQ
              made identities; the Engram rows dequantised to float32 (not rounded to bf16);
              sparse attention in float32 (the kernel rounds probabilities and its output to
              bf16).
  as-shipped  decode reads `shared_attn.index_k` as published: a ratio-2 kv source whose
              group is still incomplete publishes nothing, so on every other step its
              indexer scores the previous publisher's keys (the last kv source of the previous
              token), cut to (p+1)//2 rows. Prefill never does this.
  owner       each kv source's indexer first publishes its own index-key cache, so decode
              scores the same keys prefill does.
  f32act      a diagnostic, not a fixture: the official quantisation at the same points with
              float32 activations instead of bf16 (what an engine keeping float32
              activations computes); its distance from `official` is recorded.
The head is asked for every position's logits (the reference returns only the last one
unless asked); that changes no number.

Ties: the reference leaves the order of exactly equal values in a top-k (router, indexer,
candidate blocks) to torch, whose CPU top-k keeps an arbitrary subset of them; dsv4stream keeps
the lowest indices. A run with ties="lowest" (`lowest_index_ties`) takes the same rule, so a
checkpoint whose top-k boundaries tie exactly (few index heads: rows whose every head's ReLU
is zero score exactly 0) can still be compared; the fixtures instead use seeds without
near-ties and leave the reference as shipped.

Needs torch >= 2.9 (float4_e2m1fn_x2, float8_e8m0fnu), sympy, pillow and tokenizers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np

REFERENCE_FILES = ("model.py", "engram.py", "kernel_cpu.py", "vision.py", "image_processor.py")


class ReferenceError(Exception):
    """The local reference copy or a checkpoint does not fit what the reference needs."""


# ---- the reference, loaded from a local copy ----------------------------------------------------
_loaded = itertools.count()


def load_reference(path: str | Path):
    """A fresh copy of the reference's `model` module (its module globals hold one model's
    state, so every model gets its own import). Accepts the tt-metal layout (package-relative
    imports of kernel_cpu) and upstream's flat imports with kernel_cpu.py beside them."""
    path = Path(path).resolve()
    missing = [f for f in REFERENCE_FILES if not (path / f).is_file()]
    if missing:
        raise ReferenceError(f"{path}: missing {', '.join(missing)}; see docs/development.md (V4.1 oracle)")
    name = f"dsv41_reference_{next(_loaded)}"
    flat = "from .kernel_cpu import" not in (path / "model.py").read_text()
    if flat:  # upstream layout: `from kernel import ...`, `from engram import ...`
        for mod in ("kernel_cpu", "engram", "vision", "image_processor"):
            spec = importlib.util.spec_from_file_location(mod if mod != "kernel_cpu" else "kernel", path / f"{mod}.py")
            m = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = m
            spec.loader.exec_module(m)
        spec = importlib.util.spec_from_file_location(name, path / "model.py")
        model = importlib.util.module_from_spec(spec)
        sys.modules[name] = model
        spec.loader.exec_module(model)
        return model
    pkg_spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    pkg = importlib.util.module_from_spec(pkg_spec)
    pkg.__path__ = [str(path)]
    sys.modules[name] = pkg
    spec = importlib.util.spec_from_file_location(f"{name}.model", path / "model.py")
    model = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model
    spec.loader.exec_module(model)
    return model


def kernel_module(ref):
    """The kernel_cpu module the loaded `model` module calls."""
    return sys.modules[ref.act_quant.__module__]


def reference_digests(path: str | Path) -> dict[str, str]:
    path = Path(path)
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in REFERENCE_FILES}


def reference_config(config: dict) -> dict:
    """A release config.json (HF names, text model under text_config) in the reference's
    inference/config.json names, for the keys a text forward reads."""
    t = config["text_config"]
    rs = t.get("rope_scaling") or {}
    q = config.get("quantization_config") or {}
    return {
        "vocab_size": t["vocab_size"],
        "dim": t["hidden_size"],
        "moe_inter_dim": t["moe_intermediate_size"],
        "n_layers": t["num_hidden_layers"],
        "n_mtp_layers": t.get("num_nextn_predict_layers", 0),
        "n_heads": t["num_attention_heads"],
        "n_routed_experts": t["n_routed_experts"],
        "n_shared_experts": t.get("n_shared_experts", 1),
        "n_activated_experts": t["num_experts_per_tok"],
        "score_func": t.get("scoring_func", "sqrtsoftplus"),
        "route_scale": t["routed_scaling_factor"],
        "swiglu_limit": t["swiglu_limit"],
        "q_lora_rank": t["q_lora_rank"],
        "head_dim": t["head_dim"],
        "rope_head_dim": t["qk_rope_head_dim"],
        "norm_eps": t["rms_norm_eps"],
        "o_groups": t["o_groups"],
        "o_lora_rank": t["o_lora_rank"],
        "window_size": t["sliding_window"],
        "compress_ratios": list(t["compress_ratios"]),
        "kv_source_layers": list(t["kv_source_layer_ids"]),
        "index_source_layers": list(t["index_source_layer_ids"]),
        "compress_rope_theta": t["compress_rope_theta"],
        "original_seq_len": rs.get("original_max_position_embeddings", 0),
        "rope_theta": t["rope_theta"],
        "rope_factor": rs.get("factor", 1),
        "beta_fast": rs.get("beta_fast", 32),
        "beta_slow": rs.get("beta_slow", 1),
        "index_n_heads": t["index_n_heads"],
        "index_head_dim": t["index_head_dim"],
        "index_topk": t["index_topk"],
        "candidate_source_layer": t.get("candidate_source_layer_id", -1),
        "candidate_topk_blocks": t.get("candidate_topk_blocks", 0),
        "candidate_block_size": t.get("candidate_block_size", 0),
        "hc_mult": t["hc_mult"],
        "hc_sinkhorn_iters": t["hc_sinkhorn_iters"],
        "hc_eps": t["hc_eps"],
        "engram_layer_ids": list(t.get("engram_layer_ids", ())),
        "engram_num_embeddings": list(t.get("engram_num_embeddings", ())),
        "engram_max_ngram_size": t.get("engram_max_ngram_size", 1),
        "engram_vocab_size": t.get("engram_vocab_size", 0),
        "engram_n_heads": t.get("engram_n_heads", 0),
        "engram_head_dim": t.get("engram_head_dim", 0),
        "engram_pad_id": t.get("engram_pad_token_id", 2),
        "engram_compressed_vocab_size": t.get("engram_compressed_vocab_size", 0),
        "dtype": "fp8",
        "expert_dtype": q.get("expert_dtype", "fp4"),
        "image_token_id": config.get("image_token_id", 129264),
    }


def reference_vision(config: dict) -> dict:
    """The reference's vision_* ModelArgs for a release config.json's vision_config."""
    v = config["vision_config"]
    return {
        "vision_n_layers": v["num_hidden_layers"],
        "vision_dim": v["hidden_size"],
        "vision_n_heads": v["num_attention_heads"],
        "vision_inter_dim": v["intermediate_size"],
        "vision_patch_size": v["patch_size"],
        "vision_rope_theta": float(v["rope_theta"]),
        "vision_downsample_ratio": v["downsample_ratio"],
        "vision_max_n_token": v["max_image_tokens"],
        "vision_min_pixels": v["min_pixels"],
        "vision_max_wh_ratio": v.get("max_wh_ratio"),
    }


def reference_args(ref, config: dict, max_seq_len: int, vision: bool = False, drafter: bool = False):
    """The reference's ModelArgs for a release config.json, for one sequence of up to max_seq_len.

    Vision and the DSpark drafter are left out unless asked for (`tools/v41_reference_vision.py`,
    `tools/v41_reference_dspark.py`, which calls its `forward_spec`): neither runs in a text
    forward. norm_topk_prob
    is the reference's default (True): the release states it in config.json, inference/config.json
    does not."""
    d = reference_config(config)
    tuples = ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids", "engram_num_embeddings")
    d.update({k: tuple(d[k]) for k in tuples})
    if not config["text_config"].get("norm_topk_prob", True):
        d["norm_topk_prob"] = False
    d.update(reference_vision(config) if vision else {"vision_n_layers": 0})
    t = config["text_config"]
    ds = {"dspark_block_size": 0}
    if drafter:
        ds = {
            "dspark_block_size": t["dspark_block_size"],
            "dspark_noise_token_id": t["dspark_noise_token_id"],
            "dspark_target_layer_ids": tuple(t["dspark_target_layer_ids"]),
            "dspark_markov_rank": t["dspark_markov_rank"],
            "dspark_n_routed_experts": t.get("dspark_n_routed_experts", 0),
            "dspark_n_activated_experts": t.get("dspark_num_experts_per_tok", 0),
        }
    return ref.ModelArgs(max_batch_size=1, max_seq_len=max_seq_len, temperature=0.0, **ds, **d)


class HFTokenizer:
    """What the reference's engram.py reads from a transformers tokenizer: the Rust backend and
    len() (transformers' len() counts the added tokens, as get_vocab_size(True) does)."""

    def __init__(self, tokenizer_json: Path):
        import tokenizers

        self.backend_tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


# ---- run-time changes: owner index keys, fp32 numerics ------------------------------------------
def use_owner_index_keys(ref) -> None:
    """Each kv source's indexer publishes its own key cache before scoring (see the docstring)."""
    orig = ref.Indexer.forward

    def forward(self, x, qr, latent, start_pos, offset):
        if self.owns_k:
            ref.shared_attn.index_k = self.k_cache
        return orig(self, x, qr, latent, start_pos, offset)

    ref.Indexer.forward = forward


def use_fp32_numerics(ref) -> None:
    """No activation/KV quantisation and float32 attention (weights are converted by `to_fp32`)."""
    import torch

    def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
        if not inplace:
            raise RuntimeError("fp32 numerics: a quantised matmul was reached; weights were not dequantised")
        return x

    def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=None):
        if not inplace:
            raise RuntimeError("fp32 numerics: an FP4 quantisation outside QDQ was reached")
        return x

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
        # q (b, m, h, d), kv (b, n, d), topk_idxs (b, m, k): softmax over the valid indices with
        # the sink in the denominator only; a row without a valid index gives zeros
        b = q.size(0)
        idx = topk_idxs.long()
        valid = idx >= 0
        keys = kv.float()[torch.arange(b).view(b, 1, 1), idx.clamp_min(0)]  # (b, m, k, d)
        logits = torch.einsum("bmhd,bmkd->bmhk", q.float(), keys) * softmax_scale
        logits = logits.masked_fill(~valid[:, :, None, :], -torch.inf)
        sink = attn_sink.float().view(1, 1, -1)
        top = torch.maximum(logits.amax(dim=-1), sink)
        p = torch.exp(logits - top[..., None])
        denom = p.sum(dim=-1) + torch.exp(sink - top)
        out = torch.einsum("bmhk,bmkd->bmhd", p, keys) / denom[..., None]
        return out.to(q.dtype)

    def engram_rows(self, indices):
        local = (indices - self.vocab_start_idx).clamp(0, self.part_num_embeddings - 1)
        values = self.weight.float()[local].unflatten(-1, (-1, self.block_size))
        return (values * self.scale.float()[local].unsqueeze(-1)).flatten(-2)

    ref.act_quant = act_quant
    ref.fp4_act_quant = fp4_act_quant
    ref.sparse_attn = sparse_attn
    ref.ParallelEngramEmbedding.forward = engram_rows


def _pow2_ceil(x):
    """2**ceil(log2(x)) for positive float32 x, exactly."""
    import torch

    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def _e2m1(v):
    """float32 in [-6, 6] -> the nearest E2M1 value, ties to the even code."""
    import torch

    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    tie_up = torch.arange(7) % 2 == 1  # the upper neighbour of midpoint i has code i + 1
    mag = v.abs().unsqueeze(-1)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return torch.copysign(grid[code], v)


def use_float32_activations(ref) -> None:
    """Diagnostic numerics: the official quantisation at the same points, in float32 instead of
    the reference's bf16 activations (what an engine keeping float32 activations computes).
    Weights stay FP8/FP4; bf16 parameters are upcast after loading (`upcast_bf16`)."""
    import torch

    def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
        xg = x.float().unflatten(-1, (-1, block_size))
        s = _pow2_ceil(xg.abs().amax(dim=-1).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32))
        q = (xg / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        if inplace:
            x.copy_((q.float() * s.unsqueeze(-1)).flatten(-2))
            return x
        return q.flatten(-2), s.to(scale_dtype)

    def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
        if not inplace:
            raise RuntimeError("float32 activations: an FP4 quantisation outside QDQ was reached")
        xg = x.float().unflatten(-1, (-1, block_size))
        amax = xg.abs().amax(dim=-1)
        if scale_dtype == torch.float8_e4m3fn:
            s = (amax.clamp_min(6 * 2**-9) / 6).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        else:
            s = _pow2_ceil(amax.clamp_min(6 * 2**-126) * torch.tensor(1 / 6, dtype=torch.float32))
        x.copy_((_e2m1((xg / s.unsqueeze(-1)).clamp(-6, 6)) * s.unsqueeze(-1)).flatten(-2))
        return x

    use_fp32_numerics(ref)  # float32 attention and Engram rows
    ref.act_quant = act_quant
    ref.fp4_act_quant = fp4_act_quant


def upcast_bf16(model) -> None:
    import torch

    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()


# ---- loading a checkpoint into the reference ---------------------------------------------------
def _dequant_fp8(w, s, block: int = 32):
    """FP8 [out, in] with E8M0 [ceil(out/32), ceil(in/32)] scales -> float32."""
    rows, cols = w.shape
    sc = s.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return w.float() * sc


def _dequant_fp4(w, s, block: int = 32):
    """FP4 E2M1 packed [out, in/2] (low nibble = even element) with E8M0 [out, in/32] -> float32."""
    import torch

    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
    b = w.view(torch.uint8).long()
    vals = torch.stack([table[b & 15], table[b >> 4]], dim=-1).flatten(-2)
    return vals * s.float().repeat_interleave(block, 1)


def load_tensors(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


UNUSED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")


def load_weights(model, tensors: dict) -> None:
    """Checkpoint tensors into the reference's parameters, converted as DeepSeek's convert.py
    leaves them: FP8/E8M0 as stored, FP4 bytes reinterpreted as float4_e2m1fn_x2, attn.wo_a
    dequantised to bf16 (exact: 3 mantissa bits times a power of two), BF16 upcast where the
    reference keeps float32. Every checkpoint tensor must be used or be one the text forward
    leaves out (drafter, vision, `ffn.gate.bias_vl`)."""
    import torch

    used: set[str] = set()
    for name, p in model.state_dict(keep_vars=True).items():
        if re.match(r"mtp\.\d+\.(embed|head)\.", name):
            continue  # the drafter's stages share the model's embed and head (aliases, loaded as such)
        if name not in tensors:
            raise ReferenceError(f"checkpoint has no {name} (the reference needs it)")
        t = tensors[name]
        used.add(name)
        if p.dtype == torch.float4_e2m1fn_x2:
            v = t.contiguous().view(torch.float4_e2m1fn_x2)
        elif t.dtype == torch.float8_e4m3fn and p.dtype != torch.float8_e4m3fn:
            scale = name.removesuffix(".weight") + ".scale"
            used.add(scale)
            v = _dequant_fp8(t, tensors[scale]).to(p.dtype)
        else:
            v = t.to(p.dtype)
        if tuple(v.shape) != tuple(p.shape):
            raise ReferenceError(f"{name}: checkpoint shape {tuple(v.shape)}, the reference builds {tuple(p.shape)}")
        p.data = v.clone()
    left = sorted(k for k in tensors if k not in used and not k.startswith(UNUSED_PREFIXES))
    left = [k for k in left if not k.endswith("ffn.gate.bias_vl")]
    if left:
        raise ReferenceError(
            f"checkpoint tensors the reference does not read: {left[:8]}{'...' if len(left) > 8 else ''}"
        )


def to_fp32(model) -> None:
    """Every weight as float32: FP8/FP4 dequantised exactly, bf16 upcast (both exact)."""
    import torch
    from torch import nn

    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dtype == torch.float32:
            continue
        if type(mod).__name__ == "ParallelEngramEmbedding":
            continue  # dequantised per row on lookup (see use_fp32_numerics)
        if w.dtype == torch.float4_e2m1fn_x2:
            v = _dequant_fp4(w.data, mod.scale.data)
        elif w.dtype == torch.float8_e4m3fn:
            v = _dequant_fp8(w.data, mod.scale.data)
        else:
            v = w.data.float()
        mod.weight = nn.Parameter(v, requires_grad=False)
        if getattr(mod, "scale", None) is not None:
            mod.scale = None
    for name, p in model.named_parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()


def build_model(
    reference: Path,
    ckpt: Path,
    numerics: str,
    index_keys: str,
    max_seq_len: int,
    vision: bool = False,
    drafter: bool = False,
):
    """(model, reference module) loaded from the checkpoint, with the run-time changes applied
    (with its vision tower where `vision`, its DSpark drafter where `drafter`)."""
    import torch

    ref = load_reference(reference)
    config = json.loads((ckpt / "config.json").read_text())
    args = reference_args(ref, config, max_seq_len, vision, drafter)
    tok = HFTokenizer(ckpt / "tokenizer.json") if args.engram_layer_ids else None
    if index_keys == "owner":
        use_owner_index_keys(ref)
    if numerics == "fp32":
        use_fp32_numerics(ref)
    elif numerics == "f32act":
        use_float32_activations(ref)
    elif numerics != "official":
        raise ReferenceError(f"numerics {numerics!r}: official, fp32 or f32act")
    dtype = torch.bfloat16 if numerics == "official" else torch.float32
    torch.set_default_dtype(dtype)  # as generate.py: the reference builds and runs under it
    model = ref.Transformer(args, tok)
    load_weights(model, load_tensors(ckpt))
    if numerics == "fp32":
        to_fp32(model)
    elif numerics == "f32act":
        upcast_bf16(model)
    model.eval()
    orig_head = model.head.forward
    model.head.forward = lambda x, full_logits=False: orig_head(x, full_logits=True)
    return model, ref


# ---- what the reference computes ---------------------------------------------------------------
class Boundaries:
    """Records every top-k the reference takes (router, indexer, candidate blocks) and keeps the
    smallest relative gap at each k boundary."""

    def __init__(self, ref):
        import torch

        self.gaps = {"route": np.inf, "index": np.inf, "candidates": np.inf}
        self._site: str | None = None
        self._torch_topk = torch.Tensor.topk
        self._ref = ref

    def _record(self, x, k: int) -> None:
        a = x.detach().float().reshape(-1, x.shape[-1]).numpy()
        for row in a:
            if k >= row.size:
                continue
            d = np.sort(row)[::-1]
            if not np.isfinite(d[k]):  # nothing competes with the k-th pick
                continue
            fin = np.abs(d[np.isfinite(d)])
            scale = max(float(fin.max()), 1e-30)
            gap = np.inf if not np.isfinite(d[k - 1]) else (float(d[k - 1]) - float(d[k])) / scale
            self.gaps[self._site] = min(self.gaps[self._site], gap)

    @contextlib.contextmanager
    def watching(self):
        import torch

        ref, outer = self._ref, self
        orig = {"Gate": ref.Gate.forward, "Indexer": ref.Indexer.forward, "cand": ref.select_candidate_blocks}

        def topk(t, k, *a, **kw):
            if outer._site is not None:
                outer._record(t, int(k))
            return outer._torch_topk(t, k, *a, **kw)

        def site(name, fn):
            def wrapped(*a, **kw):
                prev, outer._site = outer._site, name
                try:
                    return fn(*a, **kw)
                finally:
                    outer._site = prev

            return wrapped

        ref.Gate.forward = site("route", orig["Gate"])
        ref.Indexer.forward = site("index", orig["Indexer"])
        ref.select_candidate_blocks = site("candidates", orig["cand"])
        torch.Tensor.topk = topk
        try:
            yield self
        finally:
            torch.Tensor.topk = self._torch_topk
            ref.Gate.forward, ref.Indexer.forward = orig["Gate"], orig["Indexer"]
            ref.select_candidate_blocks = orig["cand"]


class ClampCount:
    """Counts SwiGLU inputs past the clamp in every expert (routed and shared): gate values above
    swiglu_limit and up values beyond +-swiglu_limit, out of all gate values."""

    def __init__(self, ref):
        self.counts = {"gate_over": 0, "up_over": 0, "values": 0}
        self._ref = ref

    @contextlib.contextmanager
    def watching(self):
        ref, counts = self._ref, self.counts
        orig = ref.Expert.forward

        def forward(mod, x, weights=None):
            if mod.swiglu_limit > 0:
                gate, up = mod.w1(x).float(), mod.w3(x).float()
                counts["gate_over"] += int((gate > mod.swiglu_limit).sum())
                counts["up_over"] += int((up.abs() > mod.swiglu_limit).sum())
                counts["values"] += gate.numel()
            return orig(mod, x, weights)

        ref.Expert.forward = forward
        try:
            yield self
        finally:
            ref.Expert.forward = orig


def run(model, ids: np.ndarray, mode: str) -> np.ndarray:
    """Logits (T, vocab) float32 at every position of a prefill, or of token-by-token decode."""
    import torch

    x = torch.from_numpy(ids.astype(np.int64))[None]
    if mode == "prefill":
        _, logits, _ = model(x, 0)
        return logits[0].float().numpy().copy()
    rows = []
    for p in range(len(ids)):
        _, logits, _ = model(x[:, p : p + 1], p)
        rows.append(logits.reshape(-1, logits.shape[-1])[-1].float().numpy().copy())
    return np.stack(rows)


@contextlib.contextmanager
def lowest_index_ties():
    """Every top-k inside: among exactly equal values the lowest index wins (dsv4stream's rule,
    `model.ops.topk_lowest_index`, and torch's CUDA top-k's: its gatherTopK takes the values equal
    to the k-th in index order) instead of the CPU top-k's choice.

    The reference leaves tie order to torch: on CPU, `topk` selects with nth_element or a
    partial sort depending on k and the row length, so which of several equal scores it keeps
    is arbitrary (of 30 equal values it keeps 17 and 19-22). Exact ties are common in small
    checkpoints: an index row whose every head's ReLU is zero scores exactly 0, which with 2
    index heads (the tiny-v41 preset) is one row in four. Nothing else changes."""
    import torch

    orig = torch.Tensor.topk

    def topk(t, k, dim=-1, largest=True, sorted=True):
        if not largest:
            return orig(t, k, dim, largest, sorted)
        v, i = torch.sort(t, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = orig


def reference_run(
    reference: Path,
    ckpt: Path,
    ids: np.ndarray,
    mode: str,
    numerics: str,
    index_keys: str,
    clamp: dict | None = None,
    ties: str = "torch",
):
    """(logits, boundary gaps) of one run on a freshly loaded reference; `clamp`, if given, receives
    the SwiGLU clamp counts (ClampCount). ties: "torch" (as shipped: the CPU top-k's choice among
    equal values) or "lowest" (`lowest_index_ties`)."""
    if ties not in ("torch", "lowest"):
        raise ReferenceError(f"ties {ties!r}: torch or lowest")
    model, ref = build_model(reference, ckpt, numerics, index_keys, max_seq_len=_seq_room(len(ids)))
    tie_rule = lowest_index_ties() if ties == "lowest" else contextlib.nullcontext()
    with tie_rule, Boundaries(ref).watching() as b, ClampCount(ref).watching() as c:
        logits = run(model, ids, mode)
    if clamp is not None:
        clamp.update(c.counts)
    return logits, b.gaps


def _seq_room(n: int) -> int:
    return -(-n // 64) * 64 + 64


def engram_hashes(reference: Path, ckpt: Path, ids: np.ndarray) -> np.ndarray:
    """The reference's Engram row ids (T, n_engram_layers, 24) for a prefill of `ids`."""
    import torch

    model, _ = build_model(reference, ckpt, "fp32", "owner", max_seq_len=_seq_room(len(ids)))
    with torch.inference_mode():
        return model.engram_hash(torch.from_numpy(ids.astype(np.int64))[None], 0)[0].numpy().copy()


def rel_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per position: max |a - b| / max |b|."""
    return np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """Per position: (largest - second largest) / max |logit|."""
    s = np.sort(logits, axis=1)
    return (s[:, -1] - s[:, -2]) / np.abs(logits).max(axis=1)


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """How far run a is from run b, as the tests measure it."""
    e = rel_err(a, b)
    agree = a.argmax(1) == b.argmax(1)
    return {
        "median_rel_err": float(np.median(e)),
        "max_rel_err": float(e.max()),
        "argmax_agree": float(agree.mean()),
    }
