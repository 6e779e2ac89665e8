"""Images in: decoding, DeepSeek-V4.1's size plan, ViT patches, and the span an image takes in a prompt.

Owns: image bytes -> pixels (Pillow; the one place that reads image files), the resize plan of
`vision_config`, the normalised bf16-rounded patches the vision tower reads, and the expansion
of each `image_token_id` marker into its span of token ids and types. Not here: the tower
(`model.v41.vision`), the span rows in the embeddings and the image routing (`engine`).

Facts this follows (DeepSeek's V4.1 `inference/image_processor.py`, same Pillow calls):
- decoding: `Image.open(...).convert("RGB")`: the first frame of an animation, the palette
  expanded, alpha DROPPED (not composited: an RGBA pixel keeps its RGB), no EXIF rotation
  (`exif_transpose=True` applies it; the reference does not).
- plan (width w, height h, patch p, cell = p * downsample): if max_wh_ratio and w > h * ratio,
  w = h * ratio; if w * h < min_pixels both scale by sqrt(min_pixels / (w h)) and truncate;
  best = ceil(w / p) p by ceil(h / p) p; the token grid is ceil((best / p) / downsample) per
  side; if the span (n_h (n_w + 1) + 2 tokens) exceeds max_image_tokens, the largest
  aspect-preserving size that fits (`_shrink`).
- pixels: `ImageOps.pad` to the planned size (fit inside, centred, grey 127 bars), or a plain
  `resize` when the image is at least max_wh_ratio times wider than tall; then x / 255,
  (x - 0.5) / 0.5 in float32, rounded to bf16; patches in reading order, each (3, p, p) flat.
- span: [start] + ([image] * n_w + [newline]) * n_h + [end]; every position carries
  image_token_id, the types tell them apart (-1 text, 0 start, 1 image, 2 newline, 3 end).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..checkpoint.config import VisionConfig
from ..errors import UsageError

TEXT, START, IMAGE, NEWLINE, END = -1, 0, 1, 2, 3
MAX_FILE_BYTES = 64 << 20  # an image file above this is refused before decoding
MAX_PIXELS = 40_000_000  # decoded size limit (Pillow's bomb check fires at 89.5M / 179M)
F32 = np.float32


@dataclass(frozen=True)
class ImagePlan:
    """Where an image of size (width, height) goes: the pixel size it is brought to, the ViT
    patch grid and the aligner's token grid."""

    best_width: int
    best_height: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int

    @property
    def span_len(self) -> int:
        return span_len(self.llm_h, self.llm_w)


@dataclass(frozen=True)
class ImageInput:
    """One decoded image: patches (vit_h * vit_w, 3 * p * p) float32 holding bf16 values."""

    name: str
    plan: ImagePlan
    patches: np.ndarray


def span_len(llm_h: int, llm_w: int) -> int:
    return llm_h * (llm_w + 1) + 2


def _llm_grid(best_h: int, best_w: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((best_h // p) / r), math.ceil((best_w // p) / r)


def _shrink(h: float, w: float, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving pixel size (height, width) whose span fits max_tokens."""
    ratio = h / w
    max_w = math.sqrt((max_tokens - 2) / ratio + 0.25) - 0.5  # n_w from n_h (n_w + 1) + 2 = max
    max_h = max_w * ratio
    cell = p * r
    if max_w < 1.0:  # very tall: one column
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: one row
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / w, math.floor(max_h) * cell / h)
    return math.floor(h * beta / p) * p, math.floor(w * beta / p) * p


def plan_image(width: int, height: int, v: VisionConfig) -> ImagePlan:
    """The size plan for an image of width x height pixels (a pure function, see the docstring)."""
    p, r = v.patch_size, v.downsample_ratio
    w, h = width, height
    if v.max_wh_ratio is not None and w > h * v.max_wh_ratio:
        w = h * v.max_wh_ratio
    if 0 < w * h < v.min_pixels:
        s = (v.min_pixels / (w * h)) ** 0.5
        w, h = int(w * s), int(h * s)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    llm_h, llm_w = _llm_grid(best_h, best_w, p, r)
    if span_len(llm_h, llm_w) > v.max_image_tokens:
        best_h, best_w = _shrink(h, w, p, r, v.max_image_tokens)
        llm_h, llm_w = _llm_grid(best_h, best_w, p, r)
    if best_h < p or best_w < p or span_len(llm_h, llm_w) > v.max_image_tokens:
        raise UsageError(
            f"an image of {width}x{height} pixels fits no patch grid of max_image_tokens"
            f" {v.max_image_tokens}; crop it to a less extreme aspect ratio"
        )
    return ImagePlan(best_w, best_h, best_h // p, best_w // p, llm_h, llm_w)


def read_image_file(path: str | Path) -> bytes:
    """An image file's bytes, refused with one line when unreadable or over MAX_FILE_BYTES."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise UsageError(f"{path}: {size} bytes, images are limited to {MAX_FILE_BYTES >> 20} MiB")
        return path.read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read the image ({e.strerror or e})") from None


def decode_image(data: bytes, name: str, exif_transpose: bool = False):
    """Image bytes -> an RGB Pillow image, as the reference decodes; a truncated, corrupt, too
    large or decompression-bomb image is one UsageError line."""
    from PIL import Image, ImageOps

    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{name}: {len(data)} bytes, images are limited to {MAX_FILE_BYTES >> 20} MiB")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as src:
                w, h = src.size
                if w * h > MAX_PIXELS:
                    raise UsageError(
                        f"{name}: {w}x{h} pixels, images are limited to {MAX_PIXELS // 1_000_000} megapixels;"
                        " scale it down"
                    )
                img = src.convert("RGB")  # decodes (first frame), drops alpha as the reference
        if exif_transpose:
            img = ImageOps.exif_transpose(img)
    except UsageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UsageError(f"{name}: the image is too large to decode (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # Pillow's errors for bad data
        raise UsageError(
            f"{name}: not a readable image ({type(e).__name__}: {e}); send a PNG, JPEG, WebP or GIF"
        ) from None
    if img.width < 1 or img.height < 1:
        raise UsageError(f"{name}: the image has no pixels")
    return img


def image_input(data: bytes, name: str, v: VisionConfig, exif_transpose: bool = False) -> ImageInput:
    """Image bytes -> the tower's input: the plan and the normalised bf16-rounded patches."""
    from PIL import ImageOps

    img = decode_image(data, name, exif_transpose)
    plan = plan_image(img.width, img.height, v)
    size = (plan.best_width, plan.best_height)
    if v.max_wh_ratio is not None and img.width >= v.max_wh_ratio * img.height:
        img = img.resize(size)
    else:
        img = ImageOps.pad(img, size, color=(127, 127, 127))
    x = np.asarray(img, dtype=F32).transpose(2, 0, 1) / F32(255)  # (3, H, W)
    x = ((x - F32(0.5)) / F32(0.5)).astype(ml_dtypes.bfloat16).astype(F32)
    p = v.patch_size
    patches = x.reshape(3, plan.vit_h, p, plan.vit_w, p).transpose(1, 3, 0, 2, 4)
    return ImageInput(name, plan, np.ascontiguousarray(patches.reshape(plan.vit_h * plan.vit_w, 3 * p * p)))


def span_types(plan: ImagePlan) -> np.ndarray:
    """The span's token types in order: start, per row its images and a newline, end."""
    row = [IMAGE] * plan.llm_w + [NEWLINE]
    return np.array([START, *(row * plan.llm_h), END], dtype=np.int64)


@dataclass(frozen=True)
class ExpandedPrompt:
    """A prompt with every image marker expanded: ids (T',), types (T',), per image its span start."""

    ids: np.ndarray
    types: np.ndarray
    starts: tuple[int, ...]

    @property
    def image_mask(self) -> np.ndarray:
        return self.types >= 0

    @property
    def end_of_spans(self) -> int:
        """Tokens up to and including the last span (0 without images)."""
        live = np.flatnonzero(self.types >= 0)
        return int(live[-1]) + 1 if live.size else 0


def expand_prompt(ids: np.ndarray, image_token_id: int, plans: list[ImagePlan]) -> ExpandedPrompt:
    """The k-th image_token_id in ids becomes the k-th image's span (counts must agree)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    where = np.flatnonzero(ids == image_token_id)
    if where.size != len(plans):
        raise UsageError(
            f"the prompt holds {where.size} image marker(s) (id {image_token_id}) but {len(plans)} image(s)"
            " were given; give one image per marker"
        )
    out_ids, out_types, starts, a = [], [], [], 0
    for pos, plan in zip(where, plans, strict=True):
        out_ids.append(ids[a:pos])
        out_types.append(np.full(pos - a, TEXT, dtype=np.int64))
        starts.append(sum(x.size for x in out_ids))
        types = span_types(plan)
        out_ids.append(np.full(types.size, image_token_id, dtype=np.int64))
        out_types.append(types)
        a = pos + 1
    out_ids.append(ids[a:])
    out_types.append(np.full(ids.size - a, TEXT, dtype=np.int64))
    return ExpandedPrompt(np.concatenate(out_ids), np.concatenate(out_types), tuple(starts))
