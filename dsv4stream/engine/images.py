"""Images into a DeepSeek-V4.1 prompt: marker expansion, the vision tower, the span rows.

Owns: turning token ids with `image_token_id` markers and decoded images (`text.image`) into
the expanded ids, their token types and the `SpanRows` a session's first prefill takes
(`Session.prefill(spans=...)`), running the tower and aligner (`model.v41.vision`) on the
checkpoint's `vision.*` / `aligner.*` / `image_*` weights under the engine's numerics
("official": bf16 as DeepSeek's reference; "fp32": float32, the pixels still bf16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..checkpoint.config import V41
from ..errors import UsageError
from ..model.v41.vision import VisionParams, encode_image, span_rows
from ..text.image import ExpandedPrompt, ImageInput, expand_prompt, image_input
from ..weights.loading_v41 import load_vision
from .stack_v41 import SpanRows


@dataclass(frozen=True)
class ImagePrompt:
    """An expanded prompt and its span rows: ids (T',), types (T',), spans for `prefill`."""

    prompt: ExpandedPrompt
    spans: SpanRows

    @property
    def ids(self) -> np.ndarray:
        return self.prompt.ids

    @property
    def types(self) -> np.ndarray:
        return self.prompt.types


def check_image_config(cfg) -> None:
    """Refuse images on a model whose config.json cannot take them (one line)."""
    if cfg.family != V41:
        raise UsageError("images need a DeepSeek-V4.1 checkpoint; this one is DeepSeek-V4 (text only)")
    if cfg.vision is None or cfg.image_token_id is None:
        raise UsageError("this checkpoint has no vision tower (no vision_config in config.json); it takes no images")


def check_vision(engine) -> None:
    """Refuse images on a checkpoint that cannot take them (one line)."""
    check_image_config(engine.cfg)
    if engine.catalog is None:
        raise UsageError("this checkpoint has no vision tower (no vision_config in config.json); it takes no images")


def with_markers(ids: Sequence[int], cfg, count: int) -> list[int]:
    """`ids` as given when they hold an image marker; else `count` markers put before the text
    (after a leading BOS): where `dsv4 run --image` places images the prompt does not place."""
    ids = [int(i) for i in ids]
    if count == 0 or cfg.image_token_id in ids:
        return ids
    at = 1 if ids and ids[0] == cfg.bos_token_id else 0
    return [*ids[:at], *[cfg.image_token_id] * count, *ids[at:]]


def expanded_length(ids: Sequence[int], cfg, images: list[ImageInput]) -> int:
    """The prompt's length once its markers take their images' spans (UsageError on a count
    mismatch): known before the tower runs, for the --ctx check."""
    return expand_prompt(np.asarray(ids, dtype=np.int64), cfg.image_token_id, [im.plan for im in images]).ids.size


def decode_images(engine, files: list[tuple[str, bytes]]) -> list[ImageInput]:
    """(name, bytes) per image -> the tower's inputs, planned by the checkpoint's vision_config."""
    check_vision(engine)
    return inputs_for(engine.cfg, files)


def inputs_for(cfg, files: list[tuple[str, bytes]]) -> list[ImageInput]:
    """As `decode_images`, from config.json alone (before the checkpoint is opened)."""
    check_image_config(cfg)
    return [image_input(data, name, cfg.vision) for name, data in files]


def image_prompt(
    engine, ids: np.ndarray, images: list[ImageInput], on_block: Callable[[int], None] | None = None
) -> ImagePrompt:
    """The k-th image marker in ids expanded to the k-th image's span, and the span rows.
    on_block(i) after each tower block of each image (a server's cancellation raises there)."""
    check_vision(engine)
    cfg = engine.cfg
    prompt = expand_prompt(ids, cfg.image_token_id, [im.plan for im in images])
    numerics = getattr(getattr(engine.stack, "options", None), "numerics", "official")
    params = VisionParams(
        cfg.vision.num_attention_heads, cfg.vision.rope_theta, cfg.vision.downsample_ratio, numerics == "official",
        fast=numerics == "fast",
    )  # fmt: skip
    w = load_vision(engine.catalog, cfg)
    rows = []
    for im, start in zip(images, prompt.starts, strict=True):
        feats = encode_image(im.patches, im.plan.vit_h, im.plan.vit_w, w, params, on_block)
        types = prompt.types[start : start + im.plan.span_len]
        rows.append(span_rows(types, feats, w))
    d = cfg.hidden_size
    spans = SpanRows(prompt.types, np.concatenate(rows) if rows else np.zeros((0, d), dtype=np.float32))
    return ImagePrompt(prompt, spans)
