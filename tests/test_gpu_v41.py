"""`--gpu` on DeepSeek-V4.1, driven by the numpy stand-in device (no GPU here).

The device boundary with V4.1's formats (FP8 E4M3 with one E8M0 scale per 32x32 block), the
trunk of a generated V4.1 checkpoint placed on the stand-in against the CPU path (same ids under
both numerics: the activation grid is applied by the model code before the boundary, so the
device multiplies exactly the activations the CPU would), the budgeted runtime with --gpu, and
the VRAM planner's V4.1 sizes (`dsv4 inspect --gpu` on the shipped config), checked against
numbers worked out here from the config by hand.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gpu_fakes import FakeCudaOps

from dsv4stream import gpu, kernels
from dsv4stream.checkpoint import formats
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.cli import main
from dsv4stream.cli.inspect import inspect as inspect_cmd
from dsv4stream.engine.session import Engine
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.gpu import context, cuda, device, plan
from dsv4stream.gpu.device import DeviceQWeight, HostOps
from dsv4stream.kernels import QWeight

V41_CONFIG = Path(__file__).resolve().parents[1] / "dsv4stream" / "v41_flash_config.json"


@pytest.fixture(scope="module")
def dev():
    d = gpu.host_device()
    yield d
    d.close()


def _fp8_32(rng: np.random.Generator, rows: int, cols: int, fmt: str = "ue8m0") -> QWeight:
    """A V4.1-style FP8 weight: E4M3 bytes, one scale per 32x32 block (E8M0 bytes or float32)."""
    data = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    data[(data & 0x7F) == 0x7F] = 0x38  # no NaN encodings
    shape = formats.fp8_scale_shape(rows, cols, (32, 32))
    if fmt == "ue8m0":
        scale = rng.integers(118, 130, size=shape, dtype=np.uint8)
    else:
        scale = rng.uniform(0.01, 0.1, size=shape).astype(np.float32)
    return QWeight("fp8", data, scale, rows, cols, role="trunk", block=(32, 32))


@pytest.mark.parametrize("rows,cols,fmt", [(96, 64, "ue8m0"), (77, 96, "ue8m0"), (300, 160, "float")])
def test_32x32_blocks_dequantise_exactly_and_multiply_like_the_cpu(dev, rows, cols, fmt) -> None:
    rng = np.random.default_rng(rows)
    w = _fp8_32(rng, rows, cols, fmt)
    dw = dev.upload(w)
    assert isinstance(dw, DeviceQWeight) and dw.block == (32, 32) and dw.role == "trunk"
    np.testing.assert_array_equal(dw.dense(), kernels.dense(w))  # exact: E4M3 x 2^k in float32
    # a 128x128 reading of the same scales would be wrong: the test can fail
    wrong = replace(dw, block=(128, 128), scale=dw.scale[::4, ::4])
    assert not np.array_equal(wrong.dense(), kernels.dense(w))
    for t in (1, 5, 11):
        x = rng.standard_normal((t, cols), dtype=np.float32)
        assert cuda.relative_error(dw.matmul(x), kernels.reference.matmul(w, x)) <= 1e-5
        assert cuda.relative_error(dw.matmul(x), kernels.matmul(w, x)) <= 1e-5


def test_row_blocks_follow_the_scale_block(dev) -> None:
    """dequant_gemm in many small row blocks (each a multiple of 128 and of the scale block)
    gives the single-block result; a row block that starts inside a scale block is refused."""
    rng = np.random.default_rng(3)
    qw = _fp8_32(rng, 416, 64)
    w = dev.upload(qw)
    x = rng.standard_normal((4, 64), dtype=np.float32)
    lut = device.E4M3_TABLE
    whole = device.dequant_gemm(np, w, x, lut, block_bytes=1 << 30)
    pieces = device.dequant_gemm(np, w, x, lut, block_bytes=1)  # one 128-row block at a time
    # Both against a float64 product of the exact dequantisation, to float32 rounding of the
    # sums: BLAS may sum a 128-row block in another order than the whole matrix (it did on a
    # Zen 4 OpenBLAS), while a block read with the wrong scales is off by powers of two.
    dense = kernels.dense(qw).astype(np.float64)
    ref = x.astype(np.float64) @ dense.T
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(dense).T)
    assert np.all(np.abs(whole - ref) <= bound) and np.all(np.abs(pieces - ref) <= bound)
    shifted = device.dequant_gemm(np, replace(w, scale=np.roll(w.scale, 1, axis=0)), x, lut, block_bytes=1)
    assert not np.all(np.abs(shifted - ref) <= bound)  # the check can fail
    assert device.row_unit(w) == 128 and device.row_unit(replace(w, block=(96, 32))) == 384
    with pytest.raises(Exception, match="multiple of 32"):
        device.dequant_rows(np, w, 16, 64, lut)


def test_the_cuda_selftest_covers_32x32_blocks_on_the_stand_in() -> None:
    """CudaOps.selftest's matrices (V4.1's 32x32 blocks among them) through the stand-in's
    upload and dequantise-then-GEMM: the same check a GPU runs at start-up."""
    assert any(s[3] == (32, 32) for s in cuda.SELFTEST_SHAPES)
    assert cuda.CudaOps.selftest(HostOps(), (1, 3, cuda.MAXT)) <= cuda.TOLERANCE
    assert cuda.fused_block((32, 32)) and cuda.fused_block((128, 128))
    assert not cuda.fused_block((32, 8)) and not cuda.fused_block((48, 32))
    src = cuda.kernel_source(False)
    assert "int BRS, int BCS" in src and "(r >> BRS)" in src and "((v << 4) >> BCS)" in src


def test_device_bytes_use_the_block() -> None:
    assert plan.device_bytes_of("fp8", 4096, 4096, (32, 32)) == 4096 * 4096 + 4 * 128 * 128
    assert plan.device_bytes_of("fp8", 4096, 4096) == 4096 * 4096 + 4 * 32 * 32
    w = QWeight("fp8", np.zeros((64, 96), np.uint8), np.zeros((2, 3), np.uint8), 64, 96, block=(32, 32))
    assert plan.matrix_of((0, "x"), w).device_bytes == 64 * 96 + 4 * 6


# ---- the trunk of a generated V4.1 checkpoint on the stand-in ------------------------------


class StandIn:
    """A DevicePlacement for Engine.open: every candidate matrix on the stand-in device."""

    enabled = True

    def __init__(self, dev, budget: int = 10**12) -> None:
        self.dev, self.budget, self.placed = dev, budget, None

    def place(self, cat):
        self.placed = gpu.place(cat, self.dev, self.budget, min_bytes=0)
        return self.placed

    def source(self, cat):
        return self.placed.source(cat)


def test_candidates_from_the_config_match_the_checkpoint(tiny_v41) -> None:
    cat = Catalog.open(tiny_v41)
    got = sorted(gpu.candidates(cat), key=lambda m: str(m.key))
    want = sorted(gpu.candidates_from_config(cat.config), key=lambda m: str(m.key))
    assert got == want
    keys = {m.key[1] for m in got}
    assert "layers.1.engram.wkv" in keys and "layers.2.attn.indexer.wk" in keys and "head" in keys
    fp8 = [m for m in got if m.kind == "fp8"]
    assert fp8 and all(m.device_bytes == m.rows * m.cols + 4 * -(-m.rows // 32) * -(-m.cols // 32) for m in fp8)


@pytest.mark.parametrize("numerics", ["official", "fp32"])
def test_v41_trunk_on_the_stand_in_gives_the_cpu_ids(dev, tiny_v41, numerics) -> None:
    opts = V41Options(numerics)
    cpu = Engine.open(tiny_v41, v41=opts)
    on = StandIn(dev)
    placed = Engine.open(tiny_v41, v41=opts, gpu=on)
    p = on.placed.placement
    assert p.count == p.total and not on.placed.kept_on_cpu
    assert any(w.block == (32, 32) and w.kind == "fp8" for w in on.placed.weights.values())
    x = np.random.default_rng(5).integers(0, cpu.cfg.vocab_size, 16)
    calls = dev.stats.calls
    a = cpu.session(chunk_size=5).prefill(x)
    b = placed.session(chunk_size=5).prefill(x)
    assert dev.stats.calls > calls  # the placed trunk really multiplied on the device
    served = placed.trunk.cat.served
    assert served == set(on.placed.weights)  # every placed matrix came from the device
    rel = cuda.relative_error(b, a)
    # fp32: float rounding only. official: the FP8 activation grid turns a last-bit change of a
    # sum into a step of the grid now and then, as DeepSeek's own prefill and decode differ
    assert rel <= (1e-5 if numerics == "fp32" else 2e-2), rel
    assert np.array_equal(a.argmax(-1), b.argmax(-1))
    assert list(cpu.session().generate(x[:6], 5)) == list(placed.session().generate(x[:6], 5))


@pytest.mark.parametrize("vram_mb", [1000, 0.05])
def test_v41_runtime_with_gpu_gives_the_same_ids(monkeypatch, tiny_v41, vram_mb) -> None:
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    monkeypatch.setattr(context, "available", lambda: (True, "1 CUDA device"))
    monkeypatch.setattr(cuda, "CudaOps", FakeCudaOps)
    cpu_opts = RunOptions(budget=10**9, io="buffered", trunk="")
    with Runtime.open(tiny_v41, cpu_opts) as rt:
        ids = [int(i) for i in np.random.default_rng(11).integers(0, rt.cfg.vocab_size, 9)]
        want = list(rt.generate(rt.session(), ids, 6))
        full = sum(rt.plan.needs.layer_bytes)
    ctx = gpu.setup(True, None, None, min_bytes=0)
    try:
        ctx.vram_budget = int(vram_mb * 10**6)  # 50 kB: only some matrices fit
        with Runtime.open(tiny_v41, replace(cpu_opts, gpu=ctx)) as rt:
            got = list(rt.generate(rt.session(), ids, 6))
            placed = ctx.placed
            assert placed is not None and placed.weights
            assert (placed.placement.count == placed.placement.total) == (vram_mb == 1000)
            assert sum(rt.plan.needs.layer_bytes) < full  # what went to VRAM left the trunk's budget
    finally:
        ctx.close()
    assert got == want


# ---- the VRAM planner on the released V4.1 config ------------------------------------------


def release_sizes(c: dict) -> dict[str, int]:
    """Device and host bytes of V4.1-Flash's trunk matrices, worked out from config.json here
    (FP8 data + float32 scales per 32x32 block in VRAM; FP8 + E8M0 bytes in RAM; BF16 twice)."""
    t = c["text_config"]
    d, h, hd = t["hidden_size"], t["num_attention_heads"], t["head_dim"]
    q, og, ol = t["q_lora_rank"], t["o_groups"], t["o_lora_rank"]
    m, e, v, n = t["moe_intermediate_size"], t["n_routed_experts"], t["vocab_size"], t["num_hidden_layers"]
    ih, ihd = t["index_n_heads"], t["index_head_dim"]
    cols = t["engram_n_heads"] * (t["engram_max_ngram_size"] - 1) * t["engram_head_dim"]
    kv, ix = set(t["kv_source_layer_ids"]), set(t["index_source_layer_ids"])
    ratios = t["compress_ratios"]

    def fp8(r: int, c_: int) -> tuple[int, int]:
        blocks = -(-r // 32) * -(-c_ // 32)
        return r * c_ + 4 * blocks, r * c_ + blocks

    per_layer = [fp8(q, d), fp8(h * hd, q), fp8(hd, d), fp8(og * ol, h * hd // og), fp8(d, og * ol)]
    per_layer += [fp8(m, d), fp8(d, m), fp8(m, d)]
    dev = host = 0
    for i in range(n):
        mats = list(per_layer)
        if i in t["engram_layer_ids"]:
            mats.append(fp8((t["hc_mult"] + 1) * d, cols))
        if i in ix:
            mats.append(fp8(ih * ihd, q))
        dev += sum(a for a, _ in mats)
        host += sum(b for _, b in mats)
        bf16 = e * d  # the router
        if i in kv:
            bf16 += hd * d * (2 if ratios[i] > 1 else 1)  # compressor wkv (+ wgate at ratio 2)
            bf16 += ihd * hd if i in ix else 0  # the indexer's wk
        if i in ix:
            bf16 += ih * d  # weights_proj
        dev += 2 * bf16
        host += 2 * bf16
    head = 2 * v * d
    return {"device": dev + head, "host": host + head, "head": head}


def test_inspect_gpu_plans_the_real_v41_sizes(capsys) -> None:
    c = json.loads(V41_CONFIG.read_text())
    want = release_sizes(c)
    cfg = ModelConfig.from_json(V41_CONFIG)
    mats = gpu.candidates_from_config(cfg)
    assert sum(m.device_bytes for m in mats) == want["device"]
    assert sum(m.host_bytes for m in mats) == want["host"]
    everything = gpu.plan_placement(mats, 10**13, min_bytes=0)
    assert everything.device_bytes == want["device"] and everything.host_bytes_left == 0
    r = CliRunner().invoke(inspect_cmd, [str(V41_CONFIG), "--gpu", "--vram", "8", "--budget", "16"])
    assert r.exit_code == 0, r.output
    lines = [s for s in r.output.splitlines() if s.startswith("gpu:")]
    p = gpu.plan_placement(mats, 8 * 10**9)
    assert f"{want['device'] / 1e9:.2f} GB" in lines[0]
    assert p.summary() in r.output and p.device_bytes <= 8 * 10**9
    assert "head on the CPU" in p.summary()  # FP8 first: 8 GB does not reach the BF16 head
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(V41_CONFIG), "--vram", "8"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "dsv4: --vram applies to --gpu; add --gpu or drop --vram"
