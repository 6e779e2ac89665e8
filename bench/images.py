"""Seconds, tokens and memory per image, by size, through DeepSeek-V4.1's image path.

Usage: python bench/images.py [CK] [--sizes 224x224,800x600,...] [--numerics fast|exact|official] [--blocks N]
       python bench/images.py [CK] --compare [--sizes ...] [--blocks N]

The run's numerics (`serve` and `run` default to fast); the tower computes in bf16 as the
reference under `official`, in float32 under `exact`, and under `fast` in float32 but for its
BF16 linears of up to 256 rows (the aligner), which take the fast kernels (BF16
activations, `model.v41.vision`).

`--compare`: the tower alone (`model.v41.vision.encode_image`, weights read once beforehand)
under the float32 products (`exact`, what `fast` ran before issue 43's speed-up) and under the
fast kernels, in the same process, each twice per size in the order float32, fast, fast, float32: the best
seconds per block of each, their
ratio (the aligner included: under fast its rows of an image of up to 256 tokens take the
kernels, the ViT's 1500+ patches stay on sgemm, `model.v41.vision.FAST_TOKENS`), and
max |fast - float32| over the float32 rows' RMS.

CK: a V4.1 checkpoint with a vision tower; without one, a generated `tiny-v41` with a tower of
the release's width (hidden 1024, 16 heads, intermediate 2816, patch 14, downsample 3,
max_image_tokens 1024, min_pixels 295,936) and `--blocks` blocks (default 2; the release has 32:
the tower's time grows with the blocks, the decode's does not) is written to a temp folder.

One line per size: the image's ViT patches and the tokens of its span; `decode`: seconds of
`text.image.image_input` on the PNG's bytes (Pillow decode, the size plan, resize/pad,
normalise, bf16-round, patches), what the server does for each image part before queueing;
`tower`: seconds of `engine.images.image_prompt` on one marker (reading the tower's weights
from the shards, the ViT blocks, the aligner, the span rows), what the engine thread does
before the prefill; `per block` is tower / blocks (the weights' read included); `peak`: the
largest Python/numpy allocation traced (tracemalloc) during the tower, the image's working
memory beyond the weights. Images are random noise PNGs of the size (the content does not
change the time). There is no machine limit to report a ratio against: the tower is numpy
matmuls, whose rate bench/matmul_bw.py measures.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4stream import synth
from dsv4stream.engine.images import image_prompt
from dsv4stream.model.v41.vision import VisionParams, encode_image
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.text.image import image_input
from dsv4stream.weights.loading_v41 import load_vision

RELEASE_TOWER = {
    "model_type": "deepseek_v41_vision", "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
    "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936,
    "max_wh_ratio": None,
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ck", nargs="?", type=Path)
    ap.add_argument("--sizes", default="224x224,544x544,800x600,400x900,1024x1024,2048x1536")
    ap.add_argument("--numerics", default="fast", choices=["official", "exact", "fast"])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--compare", action="store_true", help="the tower alone: float32 products against fast kernels")
    a = ap.parse_args()
    if a.compare:
        a.numerics = "fast"  # the process's kernels: VisionParams(fast=False) keeps numpy float32
    ck = a.ck
    if ck is None:
        tmp = tempfile.mkdtemp(prefix="bench-images-")
        ck = synth.make_checkpoint(
            Path(tmp) / "ck", "tiny-v41", seed=1, vision_config={**RELEASE_TOWER, "num_hidden_layers": a.blocks}
        )
    with Runtime.open(ck, RunOptions(budget=8 * 10**9, io="buffered", numerics=a.numerics)) as rt:
        cfg = rt.cfg
        blocks = cfg.vision.num_hidden_layers
        print(f"# {ck.name}: tower of {blocks} blocks, hidden {cfg.vision.hidden_size}, numerics {a.numerics},"
              f" cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
        rng = np.random.default_rng(0)
        if a.compare:
            compare(rt, a.sizes.split(","), rng)
            return
        for size in a.sizes.split(","):
            data = _png(size, rng)
            t0 = time.perf_counter()
            im = image_input(data, size, cfg.vision)
            t1 = time.perf_counter()
            tracemalloc.start()
            image_prompt(rt.engine, np.array([cfg.image_token_id]), [im])
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            t2 = time.perf_counter()
            print(
                f"{size}: {im.plan.vit_h * im.plan.vit_w} patches, {im.plan.span_len} tokens"
                f" ({im.plan.llm_h} rows of {im.plan.llm_w}), png {len(data) / 1e6:.2f} MB; decode {t1 - t0:.3f} s,"
                f" tower {t2 - t1:.2f} s ({(t2 - t1) / blocks:.2f} s per block), peak {peak / 1e9:.3f} GB"
            )


def _png(size: str, rng) -> bytes:
    w, h = (int(x) for x in size.split("x"))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def compare(rt, sizes: list[str], rng) -> None:
    """Per size: the tower's seconds per block with float32 products, then with the fast kernels."""
    cfg = rt.cfg
    v = cfg.vision
    w = load_vision(rt.engine.catalog, cfg)
    blocks = v.num_hidden_layers
    modes = {"float32": False, "fast": True}
    params = {
        k: VisionParams(v.num_attention_heads, v.rope_theta, v.downsample_ratio, False, fast=f)
        for k, f in modes.items()
    }
    warm = image_input(_png("224x224", rng), "warm", v)
    encode_image(warm.patches, warm.plan.vit_h, warm.plan.vit_w, w, params["fast"])  # the kernels' first call
    for size in sizes:
        im = image_input(_png(size, rng), size, v)
        secs, rows = {k: float("inf") for k in modes}, {}
        for k in ("float32", "fast", "fast", "float32"):  # the best of two, in both orders: the load varies
            t0 = time.perf_counter()
            rows[k] = encode_image(im.patches, im.plan.vit_h, im.plan.vit_w, w, params[k])
            secs[k] = min(secs[k], (time.perf_counter() - t0) / blocks)
        ref = rows["float32"]
        rel = np.abs(rows["fast"] - ref).max() / np.sqrt(np.mean(np.square(ref, dtype=np.float64)))
        print(
            f"{size}: {im.plan.vit_h * im.plan.vit_w} patches, {im.plan.span_len} tokens; tower float32"
            f" {secs['float32'] * blocks:.2f} s, fast {secs['fast'] * blocks:.2f} s; per block float32 {secs['float32']:.2f} s,"
            f" fast {secs['fast']:.2f} s, ratio {secs['float32'] / secs['fast']:.2f}x;"
            f" max|d|/rms {rel:.2e}; load {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
