"""Images into a DeepSeek-V4.1 prompt: marker expansion, the vision tower, the span rows.

Owns: turning token ids with `image_token_id` markers and decoded images (`text.image`) into
the expanded ids, their token types and the `SpanRows` a session's first prefill takes
(`Session.prefill(spans=...)`), running the tower and aligner (`model.v41.vision`) on the
checkpoint's `vision.*` / `aligner.*` / `image_*` weights under the engine's numerics
("official": bf16 as DeepSeek's reference; "fp32": float32, the pixels still bf16).
"""

from __future__ import annotations

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


def check_vision(engine) -> None:
    """Refuse images on a checkpoint that cannot take them (one line)."""
    cfg = engine.cfg
    if cfg.family != V41:
        raise UsageError("images need a DeepSeek-V4.1 checkpoint; this one is DeepSeek-V4 (text only)")
    if cfg.vision is None or cfg.image_token_id is None or engine.catalog is None:
        raise UsageError("this checkpoint has no vision tower (no vision_config in config.json); it takes no images")


def decode_images(engine, files: list[tuple[str, bytes]]) -> list[ImageInput]:
    """(name, bytes) per image -> the tower's inputs, planned by the checkpoint's vision_config."""
    check_vision(engine)
    return [image_input(data, name, engine.cfg.vision) for name, data in files]


def image_prompt(engine, ids: np.ndarray, images: list[ImageInput]) -> ImagePrompt:
    """The k-th image marker in ids expanded to the k-th image's span, and the span rows."""
    check_vision(engine)
    cfg = engine.cfg
    prompt = expand_prompt(ids, cfg.image_token_id, [im.plan for im in images])
    numerics = getattr(getattr(engine.stack, "options", None), "numerics", "official")
    params = VisionParams(
        cfg.vision.num_attention_heads, cfg.vision.rope_theta, cfg.vision.downsample_ratio, numerics == "official"
    )
    w = load_vision(engine.catalog, cfg)
    rows = []
    for im, start in zip(images, prompt.starts, strict=True):
        feats = encode_image(im.patches, im.plan.vit_h, im.plan.vit_w, w, params)
        types = prompt.types[start : start + im.plan.span_len]
        rows.append(span_rows(types, feats, w))
    d = cfg.hidden_size
    spans = SpanRows(prompt.types, np.concatenate(rows) if rows else np.zeros((0, d), dtype=np.float32))
    return ImagePrompt(prompt, spans)
