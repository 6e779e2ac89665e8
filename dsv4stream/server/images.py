"""Images in requests (V4.1): an image part's `data:` URI, base64 data or URL -> checked bytes.

Owns: the server's image policy (`ImagePolicy`: the checkpoint's vision config, whether
remote URLs may be fetched, the byte and time limits), `data:` URIs (`;base64` only;
image/png, image/jpeg, image/webp, image/gif), the declared media type checked against the
bytes' own format, remote http(s) URLs (refused unless `dsv4 serve --allow-image-urls`; then
fetched with httpx, the byte cap and the deadline enforced while the body streams in,
redirects followed by hand, at most MAX_REDIRECTS, only to http or https), and decoding
each image once here (`text.image.image_input`: Pillow, the size plan, the patches) so a bad
one is a 400 naming its field before anything is queued. Not here: where an image goes in
the prompt (`text.chat_v41`), its span and the cache keys (`server.imagekeys`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import numpy as np

from ..engine.images import check_image_config, image_prompt
from ..engine.stack_v41 import SpanRows
from ..errors import InternalError, UsageError
from ..text.image import MAX_FILE_BYTES, ImageInput, expand_prompt, image_input
from .cache import KEY_BASE, image_keys

# what a data: URI or Anthropic's media_type may declare, and Pillow's name for each format
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
MAX_REDIRECTS = 3
FETCH_SECONDS = 10.0  # a remote image: the whole fetch, redirects included


class ImageError(UsageError):
    """A bad image part: the 400 names `param`, the request's field."""

    code = "invalid_image"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ImagePolicy:
    """What a server does with image parts. `vision`: the checkpoint's `vision_config` (None:
    it takes no images, `refusal` says why)."""

    vision: object | None
    refusal: str = ""
    image_token_id: int | None = None
    allow_urls: bool = False
    max_bytes: int = MAX_FILE_BYTES  # an image's bytes, decoded from base64 or fetched
    fetch_seconds: float = FETCH_SECONDS


def policy_for(cfg, allow_urls: bool = False, max_bytes: int = MAX_FILE_BYTES) -> ImagePolicy:
    """The policy of a checkpoint: its vision config, or why it takes no images."""
    try:
        check_image_config(cfg)
    except UsageError as e:
        return ImagePolicy(None, str(e), None, allow_urls, max_bytes)
    return ImagePolicy(cfg.vision, "", cfg.image_token_id, allow_urls, max_bytes)


def no_images(policy: ImagePolicy | None) -> str:
    """Why a server takes no images, in one line."""
    why = policy.refusal if policy is not None and policy.refusal else "this server takes no images"
    why = why if "takes no images" in why else f"this model takes no images: {why}"
    return f"{why}; send text only"


def load(policy: ImagePolicy | None, url: str, param: str, media_type: str | None = None) -> tuple[bytes, ImageInput]:
    """An image part's bytes and the tower's input: `url` a data: URI or (if allowed) an http(s)
    URL; `media_type` what the part declares besides (Anthropic's). ImageError naming `param`."""
    if policy is None or policy.vision is None:
        raise ImageError(param, no_images(policy))
    if not isinstance(url, str) or not url:
        raise ImageError(param, "an image needs a data: URI (or an http(s) URL with --allow-image-urls)")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        declared, data = data_uri(url, param, policy.max_bytes)
    elif scheme in ("http", "https"):
        if not policy.allow_urls:
            raise ImageError(
                param,
                "remote image URLs are not fetched by this server (start it with --allow-image-urls);"
                " send the image inline as a data: URI (data:image/png;base64,...)",
            )
        declared, data = None, fetch(url, param, policy.max_bytes, policy.fetch_seconds)  # its bytes say what it is
    else:
        raise ImageError(param, f"an image URL of scheme {scheme or '(none)'!r}: send a data: URI or an http(s) URL")
    return data, checked(data, param, media_type or declared, policy)


def checked(data: bytes, param: str, declared: str | None, policy: ImagePolicy) -> ImageInput:
    """The bytes decoded (format, declared media type, Pillow's checks, the size plan)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise ImageError(param, "not a readable image: send a PNG, JPEG, WebP or GIF") from None
    if fmt not in MEDIA_TYPES.values():
        raise ImageError(param, f"a {fmt} image: send a PNG, JPEG, WebP or GIF")
    if declared is not None and declared.lower() != "application/octet-stream":
        want = MEDIA_TYPES.get(declared.lower())
        if want is None:
            raise ImageError(param, f"media type {declared!r} is not one of {', '.join(MEDIA_TYPES)}")
        if want != fmt:
            raise ImageError(param, f"declared {declared} but the bytes are a {fmt} image")
    try:
        return image_input(data, param, policy.vision)
    except ImageError:
        raise
    except UsageError as e:  # text.image's one line starts with the name it was given: the field
        raise ImageError(param, str(e).removeprefix(f"{param}: ")) from None


def data_uri(url: str, param: str, max_bytes: int) -> tuple[str | None, bytes]:
    """(declared media type, bytes) of `data:[<type>][;params];base64,<data>`."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError(param, "a data: URI needs a comma before its data (data:image/png;base64,...)")
    fields = head[5:].split(";")
    if "base64" not in (f.strip().lower() for f in fields[1:]):
        raise ImageError(param, "a data: URI of an image must be base64 (data:image/png;base64,...)")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(param, f"the image is over {max_bytes:,} bytes")
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(param, "the data: URI's base64 is not valid") from None
    return fields[0].strip() or None, data


def base64_data(data: str, param: str, max_bytes: int) -> bytes:
    """Anthropic's `source.data`: plain base64."""
    if len(data) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(param, f"the image is over {max_bytes:,} bytes")
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(param, "not valid base64") from None


def fetch(url: str, param: str, max_bytes: int, seconds: float) -> bytes:
    """The body of a remote image: at most `max_bytes`, within `seconds` for the
    whole fetch (each read also times out), redirects only to http(s), at most MAX_REDIRECTS."""
    import httpx

    deadline = time.monotonic() + seconds
    with httpx.Client(follow_redirects=False, timeout=httpx.Timeout(seconds), trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                with client.stream("GET", url, headers={"Accept": ", ".join(MEDIA_TYPES)}) as r:
                    if r.is_redirect:
                        nxt = urljoin(url, r.headers.get("location", ""))
                        if urlsplit(nxt).scheme not in ("http", "https"):
                            raise ImageError(param, f"the image URL redirects to {nxt[:80]!r}, not an http(s) URL")
                        url = nxt
                        continue
                    if r.status_code != 200:
                        raise ImageError(param, f"fetching the image got HTTP {r.status_code}")
                    size = r.headers.get("content-length", "")
                    if size.isdigit() and int(size) > max_bytes:
                        raise ImageError(param, f"the image is {int(size):,} bytes, over the limit of {max_bytes:,}")
                    got, n = [], 0
                    for chunk in r.iter_bytes():  # as it arrives: the deadline is looked at each time
                        n += len(chunk)
                        if n > max_bytes:
                            raise ImageError(param, f"the image is over the limit of {max_bytes:,} bytes")
                        if time.monotonic() > deadline:
                            raise ImageError(param, f"fetching the image took over {seconds:g} s")
                        got.append(chunk)
                    return b"".join(got)
            except httpx.TimeoutException:
                raise ImageError(param, f"fetching the image took over {seconds:g} s") from None
            except httpx.HTTPError as e:
                raise ImageError(param, f"cannot fetch the image ({type(e).__name__}: {e})") from None
    raise ImageError(param, f"the image URL redirects more than {MAX_REDIRECTS} times")


def inline(
    policy: ImagePolicy | None, param: str, url: str | None = None, data: str | None = None,
    media_type: str | None = None,
) -> str:  # fmt: skip
    """An image of another API (Anthropic's base64 `data` and `media_type`, or a `url`; a
    Responses `image_url`) checked under that API's field name -> the data: URI of the chat
    request it is translated into (decoded again there: a remote image is fetched once)."""
    if data is not None:
        if policy is None or policy.vision is None:
            raise ImageError(param, no_images(policy))
        raw = base64_data(data, param, policy.max_bytes)
        checked(raw, param, media_type, policy)
    else:
        raw, _ = load(policy, url or "", param)
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as probe:
        kind = {v: k for k, v in MEDIA_TYPES.items()}[probe.format]
    return f"data:{kind};base64,{base64.b64encode(raw).decode('ascii')}"


@dataclass(frozen=True)
class PromptImages:
    """A prompt's decoded images for the worker, in order. The job's ids are the expanded
    prompt with each span keyed by its image (`cache.image_keys`): a run of ids >= KEY_BASE is
    one span (the chat format puts text between any two image parts), which is how the ids,
    even after `StateCache.splice` moved them, tell where each image goes."""

    inputs: tuple[ImageInput, ...]
    image_token_id: int

    def real(self, ids: Sequence[int]) -> list[int]:
        """Keyed ids -> the ids the model reads (each span position carries image_token_id)."""
        return [self.image_token_id if i >= KEY_BASE else int(i) for i in ids]

    @staticmethod
    def end(ids: Sequence[int]) -> int:
        """Tokens up to and including the last span."""
        return max((k + 1 for k, i in enumerate(ids) if i >= KEY_BASE), default=0)

    def spans(self, engine, ids: Sequence[int], on_block: Callable[[int], None] | None = None) -> SpanRows:
        """The span rows of the whole prompt `ids` (keyed), read from position 0: the tower
        runs here, in the engine thread; on_block after each tower block (cancellation)."""
        marked = [i for k, i in enumerate(ids) if i < KEY_BASE or k == 0 or ids[k - 1] < KEY_BASE]
        ip = image_prompt(engine, np.asarray(self.real(marked), dtype=np.int64), list(self.inputs), on_block)
        if ip.ids.size != len(ids):
            raise InternalError(f"{len(ids)} keyed ids expand to {ip.ids.size}")
        return ip.spans


def digest(im: ImageInput) -> bytes:
    """What keys an image in the prefix cache: its patches as the tower reads them."""
    h = hashlib.sha256(f"{im.plan.vit_h}x{im.plan.vit_w}|".encode())
    h.update(np.ascontiguousarray(im.patches).tobytes())
    return h.digest()


def keyed_prompt(ids: Sequence[int], inputs: Sequence[ImageInput], image_token_id: int) -> list[int]:
    """Ids holding one marker per image -> the expanded prompt, each span keyed by its image."""
    ep = expand_prompt(np.asarray(ids, dtype=np.int64), image_token_id, [im.plan for im in inputs])
    return image_keys(ep.ids.tolist(), ep.starts, [im.plan.span_len for im in inputs], [digest(im) for im in inputs])
