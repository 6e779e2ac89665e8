"""V4.1's vision tower under `fast` numerics, and stopping it between blocks.

On a generated tower whose widths the fast BF16 kernels take (multiples of 64): `fast`'s span
rows are at least as close to the float32 tower's as `official`'s (the rule the rest of fast
keeps, docs/numerics.md) and not identical to them (the kernels ran); `exact` stays the float32
tower. An `on_block` that raises stops the tower after that block (a server's cancellation).
"""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

TOWER = {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 2,
    "intermediate_size": 192, "patch_size": 4, "rope_theta": 10000, "downsample_ratio": 2, "max_image_tokens": 64,
    "min_pixels": 400, "max_wh_ratio": None,
}  # fmt: skip


@cache
def checkpoint(root: Path) -> Path:
    from dsv4stream.synth import make_checkpoint

    return make_checkpoint(root / "ck", "tiny-v41", seed=3, vision_config=TOWER)


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("vision-fast"))


def png(w: int, h: int) -> bytes:
    rng = np.random.default_rng(5)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def rows(ck: Path, numerics: str, on_block=None) -> np.ndarray:
    from dsv4stream.engine.images import decode_images, image_prompt
    from dsv4stream.engine.session import Engine
    from dsv4stream.engine.stack_v41 import V41Options

    eng = Engine.open(ck, v41=V41Options(numerics=numerics))
    ims = decode_images(eng, [("a.png", png(40, 28))])
    ip = image_prompt(eng, np.array([eng.cfg.bos_token_id, eng.cfg.image_token_id]), ims, on_block)
    return ip.spans.rows


def test_fast_tower_within_official_of_float32(ck):
    ref = rows(ck, "fp32")
    fast = rows(ck, "fast")
    official = rows(ck, "official")
    rms = np.sqrt(np.mean(np.square(ref, dtype=np.float64)))
    d_fast = np.abs(fast - ref).max() / rms
    d_official = np.abs(official - ref).max() / rms
    assert 0 < d_fast <= d_official, (d_fast, d_official)
    assert d_fast < 0.05


def test_exact_is_the_float32_tower(ck):
    from dsv4stream.model.v41 import vision

    # exact and fp32 name one mode; fast=False is the float32 products whatever the process runs
    assert vision.VisionParams(2, 1e4, 2, False).fast is False
    np.testing.assert_array_equal(rows(ck, "exact"), rows(ck, "fp32"))


@pytest.mark.parametrize("numerics", ["fp32", "fast"])
def test_on_block_stops_the_tower(ck, numerics):
    seen = []

    class Gone(Exception):
        pass

    def on_block(i: int) -> None:
        seen.append(i)
        if i == 0:
            raise Gone

    with pytest.raises(Gone):
        rows(ck, numerics, on_block)
    assert seen == [0]  # blocks 1 and 2 never ran
    done = []
    rows(ck, numerics, done.append)
    assert done == [0, 1, 2]


def test_fast_keeps_sgemm_beyond_fast_tokens(ck, monkeypatch):
    from dsv4stream.model.v41 import vision

    # the ViT's 1500+ patches: the BF16 kernels lose to sgemm there, so fast is the float32 tower
    monkeypatch.setattr(vision, "FAST_TOKENS", 0)
    np.testing.assert_array_equal(rows(ck, "fast"), rows(ck, "fp32"))


def test_server_spans_stop_between_blocks(ck):
    # the worker hands its layer_done to PromptImages.spans: a request whose client went away
    # raises Cancelled after the block it is in, the rest of the tower never runs
    from dsv4stream.engine.images import decode_images
    from dsv4stream.engine.session import Engine
    from dsv4stream.engine.stack_v41 import V41Options
    from dsv4stream.server.images import PromptImages, keyed_prompt
    from dsv4stream.server.worker import Cancelled

    eng = Engine.open(ck, v41=V41Options(numerics="fast"))
    ims = decode_images(eng, [("a.png", png(40, 28))])
    ids = keyed_prompt([eng.cfg.bos_token_id, eng.cfg.image_token_id], ims, eng.cfg.image_token_id)
    seen = []

    def layer_done(i: int) -> None:
        seen.append(i)
        if len(seen) == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        PromptImages(tuple(ims), eng.cfg.image_token_id).spans(eng, ids, layer_done)
    assert seen == [0, 1]
