"""V4's `official` KV grids (kernels/actquant.py) against an independent torch implementation of
DeepSeek's V4 reference (`act_quant(kv[..., :-rd], 64, "ue8m0")` on the window KV and the main
compressor's rows; `rotate_activation` then `fp4_act_quant(., 32)` on the indexer's queries and
keys, written here from the reference's formulas in torch, with torch's own E4M3 cast), and their
wiring: `official` rounds what V4's attention keeps, `exact` and `fast` do not.

The torch half runs in a child process with a torch interpreter (DSV4_TORCH_PYTHON, default
/work/refenv/bin/python); it is skipped where there is none."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.engine.session import Engine
from dsv4stream.kernels import actquant
from dsv4stream.model.v4 import attention as v4_attention

TORCH = os.environ.get("DSV4_TORCH_PYTHON", "/work/refenv/bin/python")
MIXED = Path(__file__).parent / "fixtures" / "mixed"

_TORCH_GRIDS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch

    def pow2_ceil(v):  # 2^ceil(log2 v) on the float32 bits, as the reference's ue8m0 scales
        b = v.contiguous().view(torch.int32)
        e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(torch.int32)
        return (e << 23).view(torch.float32)

    def act_quant(x, block):
        z = x.unflatten(-1, (-1, block))
        amax = z.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        s = pow2_ceil(amax * torch.tensor(1 / 448.0, dtype=torch.float32))
        return ((z / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2)

    GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

    def fp4_round(a):  # |a| <= 6 to the nearest E2M1 magnitude, ties to the even code
        idx = (torch.searchsorted(GRID, a.abs().contiguous(), right=True) - 1).clamp(0, 7)
        lo, hi = GRID[idx], GRID[(idx + 1).clamp(max=7)]
        mid = (lo + hi) / 2
        up = (a.abs() > mid) | ((a.abs() == mid) & (idx % 2 == 1))
        return torch.copysign(torch.where(up, hi, lo), a)

    def fp4_act_quant(x, block=32):
        z = x.unflatten(-1, (-1, block))
        amax = z.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126)
        s = pow2_ceil(amax * torch.tensor(1 / 6.0, dtype=torch.float32))
        return (fp4_round((z / s).clamp(-6, 6)) * s).flatten(-2)

    def rotate(x):  # Sylvester Hadamard matrix times n^-0.5, as fast_hadamard_transform
        n = x.shape[-1]
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (x.double() @ h * n**-0.5).float()

    z = np.load(sys.argv[1])
    kv, idx = torch.from_numpy(z["kv"]), torch.from_numpy(z["idx"])
    rd = int(z["rd"])
    kv_out = kv.clone()
    kv_out[..., :-rd] = act_quant(kv[..., :-rd], 64)
    rot = rotate(idx)
    np.savez(sys.argv[2], kv=kv_out.numpy(), rot=rot.numpy(), fp4=fp4_act_quant(rot).numpy())
    """
)


def test_v4_kv_grids_match_an_independent_torch_version_of_the_reference(tmp_path):
    if not os.access(TORCH, os.X_OK):
        pytest.skip(f"no torch interpreter at {TORCH} (set DSV4_TORCH_PYTHON)")
    rng = np.random.default_rng(4)
    kv = (rng.standard_normal((9, 512)) * np.exp2(rng.integers(-12, 6, (9, 1)))).astype(np.float32)
    kv[3, :448] = 0.0  # an all-zero row: the 1e-4 floor
    idx = (rng.standard_normal((5, 4, 128)) * np.exp2(rng.integers(-8, 4, (5, 4, 1)))).astype(np.float32)
    idx[1, 2] = 0.0
    np.savez(tmp_path / "in.npz", kv=kv, idx=idx, rd=64)
    r = subprocess.run(
        [TORCH, "-c", _TORCH_GRIDS, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    with np.load(tmp_path / "out.npz") as ref:
        np.testing.assert_array_equal(actquant.kv_grid_v4(kv, 64), ref["kv"])  # RoPE channels untouched
        np.testing.assert_allclose(actquant.hadamard(idx), ref["rot"], rtol=0, atol=1e-6 * np.abs(idx).max())
        np.testing.assert_array_equal(actquant.fp4_qdq_v4(ref["rot"]), ref["fp4"])
        got = actquant.index_grid_v4(idx)
        assert np.mean(got == ref["fp4"]) > 0.999  # float64 butterflies vs a float64 matmul
    assert not np.array_equal(actquant.kv_grid_v4(kv, 64), kv)


def test_the_grids_are_the_formats_they_claim():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    g = actquant.kv_grid_v4(x, 32)
    np.testing.assert_array_equal(g[:, 64:], x[:, 64:])
    s = actquant.pow2_ceil(np.abs(x[:, :64]).max(axis=1, keepdims=True) / np.float32(448))
    e4 = (g[:, :64] / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(e4 * s, g[:, :64])  # every value an E4M3 value times its scale
    y = actquant.fp4_qdq_v4(x[:, :48])  # 48 = a group of 32 and a short one of 16
    for part in (y[:, :32], y[:, 32:]):
        s4 = actquant.pow2_ceil(np.abs(part).max(axis=1, keepdims=True) / np.float32(6))
        assert set(np.unique(np.abs(part / s4))) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    h = actquant.hadamard(np.eye(8, dtype=np.float32))
    np.testing.assert_allclose(h @ h.T, np.eye(8), atol=1e-6)  # orthogonal: q . k is kept


@pytest.mark.parametrize("mode", ["exact", "official", "fast"])
def test_only_official_rounds_what_v4_attention_keeps(mode, monkeypatch):
    calls = {"kv": 0, "index": 0}

    def kv_grid(kv, rd):
        calls["kv"] += 1
        return actquant.kv_grid_v4(kv, rd)

    def index_grid(x):
        calls["index"] += 1
        return actquant.index_grid_v4(x)

    monkeypatch.setattr(v4_attention, "kv_grid_v4", kv_grid)
    monkeypatch.setattr(v4_attention, "index_grid_v4", index_grid)
    with np.load(MIXED / "oracle.npz") as z:
        ids = z["token_ids"][:20]
    try:
        s = Engine.open(MIXED, numerics=mode).session(chunk_size=1 << 30)
        s.prefill(ids)
    finally:
        kernels.set_numerics("exact")
    if mode == "official":
        assert calls["kv"] > 0 and calls["index"] > 0
    else:
        assert calls == {"kv": 0, "index": 0}
