"""Run DeepSeek's own V4.1 reference with images on CPU (a local copy, never committed).

Builds on `v41_reference.py` (same loading, numerics and index-key changes) with the vision
tower on: the reference's `image_processor.load_image` plans, pads and normalises each image
file, each `image_token_id` in the ids expands to `image_token_types`, and `Transformer.forward`
gets the images and token types on its first call, as DeepSeek's generate does.

Runs: prefill = one forward over the expanded sequence; step = one forward through the last
image span, then one decode step per token. Returns the logits at every position, the expanded
ids and types, and the input rows after the spans are filled (recorded from
`merge_image_embeddings`).

One change for `fp32`: the patches are handed over as float32 (their bf16 values, exactly),
since a bf16 input cannot meet the float32 linears.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from v41_reference import Boundaries, _seq_room, build_model


def _sibling(ref, name: str):
    """A module the loaded reference `model` imported beside it (tt-metal or flat layout)."""
    base = ref.__name__.rsplit(".", 1)[0]
    return sys.modules[f"{base}.{name}"] if f"{base}.{name}" in sys.modules else sys.modules[name]


def reference_image_run(
    reference: Path, ckpt: Path, ids: np.ndarray, images: list[Path], mode: str, numerics: str, gaps: dict | None = None
):
    """(logits (T', vocab), tokens (T',), types (T',), embeds (T', D)) of one run; `gaps`, if
    given, receives the smallest top-k boundary gaps (`Boundaries`)."""
    import torch

    config = json.loads((ckpt / "config.json").read_text())
    image_token_id = config["image_token_id"]
    from v41_reference import load_reference, reference_args

    probe = load_reference(reference)
    ip = _sibling(probe, "image_processor")
    args = reference_args(probe, config, 64, vision=True)
    tokens, types, inputs = [], [], []
    it = iter(images)
    for tok in ids.tolist():
        if tok != image_token_id:
            tokens.append(tok)
            types.append(ip.TEXT)
            continue
        patches, vh, vw, lh, lw = ip.load_image({"url": str(next(it))}, args)
        if numerics != "official":
            patches = patches.float()
        t = ip.image_token_types(lh, lw)
        inputs.append(ip.ImageInput(len(tokens), patches, vh, vw, t))
        tokens += [image_token_id] * t.numel()
        types += t.tolist()
    model, ref = build_model(reference, ckpt, numerics, "owner", max_seq_len=_seq_room(len(tokens)), vision=True)
    seen = {}
    merge = model.merge_image_embeddings

    def recording(imgs, h):
        merge(imgs, h)
        seen["h"] = h[0].float().clone()

    model.merge_image_embeddings = recording
    x = torch.tensor(tokens, dtype=torch.int64)[None]
    tt = torch.tensor(types, dtype=torch.int64)[None]
    end = max(i for i, t in enumerate(types) if t >= 0) + 1 if inputs else 1
    first = len(tokens) if mode == "prefill" else end
    with Boundaries(ref).watching() as b:
        _, logits, _ = model(x[:, :first], 0, images=[inputs] if inputs else None, token_types=tt[:, :first])
        rows = [logits[0].float().numpy().copy()]
        for p in range(first, len(tokens)):
            _, lg, _ = model(x[:, p : p + 1], p)
            rows.append(lg.reshape(-1, lg.shape[-1])[-1:].float().numpy().copy())
    if gaps is not None:
        gaps.update(b.gaps)
    with torch.inference_mode():
        emb = model.embed(x)[0].float().numpy().copy()
    if "h" in seen:
        emb[:first] = seen["h"].numpy()
    return np.concatenate(rows), np.array(tokens, dtype=np.int64), np.array(types, dtype=np.int64), emb
