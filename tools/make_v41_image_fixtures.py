#!/usr/bin/env python3
"""Golden numbers for DeepSeek-V4.1 with images, from DeepSeek's own reference run on CPU.

Writes tests/fixtures/v41/vision/ (named images.* so the text-fixture tests pass it by): a generated V4.1 checkpoint with a small vision tower
(2 blocks, hidden 48, 4 heads, patch 4, the release's downsample 3), its outputs damped as in
`make_v41_fixtures.py`, PNG images of other sizes, aspect ratios and Pillow modes (square at
min_pixels, wide, tall below min_pixels, one too large for max_image_tokens, RGBA, L, P),
and a prompt holding one marker per image. The reference (`v41_reference_vision.py`) runs it
four ways: prefill and step, fp32 and official. A seed is kept only if no router, indexer or
candidate-block top-k boundary of the fp32 runs is within TIE_GAP of a tie.

  images.npz   token_ids (the prompt before expansion); tokens, types (T'); per run
               logits_<run> (T', vocab) float32 and gap_<run> (T'); embeds_<numerics> (T', D)
  images.json  seed, images (file, size, mode), torch version, reference digests, gaps

Usage: tools/make_v41_image_fixtures.py --reference DIR [--out tests/fixtures/v41]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_v41_fixtures import _BASE, TIE_GAP, FixtureSpec, _plan, damp_outputs, make_v41_checkpoint
from v41_reference import reference_digests, top2_gap
from v41_reference_vision import reference_image_run

VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 2,
    "hidden_size": 48,
    "num_attention_heads": 4,
    "intermediate_size": 40,
    "patch_size": 4,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 30,
    "min_pixels": 400,
    "max_wh_ratio": None,
}
SPEC = FixtureSpec(
    "vision",
    seed=80,
    n_tokens=40,
    overrides={
        **_BASE,
        **_plan(5, window=1, encoder=2, kv_group=2, index_every=2),
        "sliding_window": 8,
        "index_topk": 8,
        "candidate_topk_blocks": 4,
        "candidate_block_size": 4,
        "vision_config": VISION,
    },
    what="a 2-block vision tower (hidden 48, 4 heads of 12, patch 4, downsample 3, max_image_tokens 30,"
    " min_pixels 400) before a 5-layer text model; seven images in one prompt",
)
# (file, width, height, Pillow mode): what each one exercises
IMAGES = (
    ("square.png", 20, 20, "RGB"),  # exactly min_pixels; 5x5 patches padded to 6x6 by the aligner
    ("wide.png", 50, 12, "RGB"),  # padded to 52 wide, one token row
    ("tall.png", 9, 31, "RGB"),  # below min_pixels: scaled up, then padded
    ("big.png", 120, 90, "RGB"),  # too many tokens: shrunk to fit max_image_tokens
    ("alpha.png", 23, 17, "RGBA"),  # alpha dropped as the reference's convert("RGB")
    ("gray.png", 16, 40, "L"),
    ("palette.png", 33, 25, "P"),
)
RUNS = (("prefill", "fp32"), ("step", "fp32"), ("prefill", "official"), ("step", "official"))


def write_images(dst: Path, seed: int) -> list[Path]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for name, w, h, mode in IMAGES:
        a = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        img = Image.fromarray(a, "RGBA")
        img = img if mode == "RGBA" else img.convert("RGB").convert(mode)
        img.save(dst / name)
        out.append(dst / name)
    return out


def prompt(vocab: int, image_token_id: int, n_text: int, n_images: int, seed: int) -> np.ndarray:
    """Random text ids (never the marker) with the markers spread through them."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, image_token_id, n_text).astype(np.int64)
    at = np.sort(rng.choice(np.arange(1, n_text), n_images, replace=False))
    return np.insert(ids, at, image_token_id)


@click.command()
@click.option("--reference", required=True, type=click.Path(path_type=Path, file_okay=False))
@click.option("--out", default=Path("tests/fixtures/v41"), type=click.Path(path_type=Path))
@click.option("--tries", default=8, show_default=True)
def main(reference: Path, out: Path, tries: int) -> None:
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="v41vision."))
    try:
        for attempt in range(tries):
            seed = SPEC.seed + attempt
            ckpt = make_v41_checkpoint(tmp / f"vision-{seed}", SPEC, seed)
            damp_outputs(ckpt, SPEC.out_gain_log2)
            images = write_images(ckpt, seed)
            ids = prompt(SPEC.vocab, SPEC.vocab - 2, SPEC.n_tokens, len(images), 1000 + seed)
            arrays, gaps, bad = {"token_ids": ids}, {}, []
            for mode, numerics in RUNS:
                g = {}
                lg, tok, ty, emb = reference_image_run(reference, ckpt, ids, images, mode, numerics, g)
                key = f"{mode}_{numerics}"
                arrays[f"logits_{key}"] = lg
                arrays[f"gap_{key}"] = top2_gap(lg).astype(np.float32)
                arrays.setdefault("tokens", tok)
                arrays.setdefault("types", ty)
                arrays[f"embeds_{numerics}"] = emb
                print(f"  vision seed {seed}: {key} done ({tok.size} tokens)", flush=True)
                if numerics == "fp32":
                    gaps[key] = g
                    bad += [f"{key}:{k}" for k, v in g.items() if v < TIE_GAP]
                    if bad:
                        break
            if not bad:
                break
            print(f"  vision: seed {seed} rejected (near-tie at {bad})")
        else:
            raise SystemExit(f"vision: no seed without near-ties in {tries} tries")
        dst = out / SPEC.name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(ckpt, dst)
        np.savez_compressed(dst / "images.npz", **arrays)
        meta = {
            "name": SPEC.name,
            "what": SPEC.what,
            "seed": seed,
            "token_seed": 1000 + seed,
            "images": [{"file": n, "width": w, "height": h, "mode": m} for n, w, h, m in IMAGES],
            "runs": [f"{m}_{n}" for m, n in RUNS],
            "torch": torch.__version__,
            "reference": reference_digests(reference),
            "fp32_topk_gaps": gaps,
        }
        (dst / "images.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"wrote {dst}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
