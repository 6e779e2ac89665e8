"""The Engram compressed vocabulary: every tokenizer id mapped to a class of tokens that read alike.

Owns: the normalisation that decides which token ids share a class, the class map itself
(computed once per tokenizer, then cached as bytes by whoever packs the tokenizer) and its
serialised form. It does not own hashing (`hashing.py`) or where the tokenizer comes from.

The rule, as DeepSeek-V4.1's `inference/engram.py` applies it: decode each id alone (special
tokens kept), normalise the text by NFKC, then NFD, strip combining accents, lowercase, collapse
every run of space/tab/CR/LF into one space, then strip leading and trailing spaces, except that
a text which is exactly one space stays one space. A decode that contains U+FFFD (a token holding
part of a UTF-8 character) is keyed by its raw token string instead; a text that normalises to
nothing is keyed by its decoded form. Classes are numbered in order of first appearance over the
ids 0, 1, 2, ... On the real tokenizer this yields 99,092 classes for its 129,280 ids (V4's
tokenizer and V4.1's differ only in nine added tokens, each its own class in both: same map).

Every hash multiplier derives from the class count, so a wrong count rehashes everything: the
count is part of the map and callers compare it with `engram_compressed_vocab_size`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import tokenizers
from tokenizers import Regex, normalizers

from ..errors import ConfigError, TokenizerError

# A private-use character stands in for a lone space while the ends are stripped.
_LONE_SPACE = "\ue000"
MAGIC = b"DSV4ENGV"  # serialised map: magic, u32 version, u32 n_ids, u32 n_classes, 32-byte sha256, i32[n_ids]
VERSION = 1


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE, " "),
        ]
    )


@dataclass(frozen=True)
class TokenClasses:
    """`classes[token_id]` is the token's class (int32, (n_ids,)); `n_classes` = max + 1."""

    classes: np.ndarray
    n_classes: int

    def __post_init__(self) -> None:
        c = self.classes
        if c.ndim != 1 or c.dtype != np.int32 or c.size == 0:
            raise ConfigError("engram token classes: expected a non-empty int32 vector")
        if int(c.min()) < 0 or int(c.max()) + 1 != self.n_classes:
            raise ConfigError(f"engram token classes: values must cover 0..{self.n_classes - 1}")
        c.setflags(write=False)

    @property
    def n_ids(self) -> int:
        return int(self.classes.size)

    def of(self, token_ids: np.ndarray) -> np.ndarray:
        """Class of each token id (any shape) as int64; ids outside the tokenizer are refused."""
        ids = np.asarray(token_ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_ids):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise TokenizerError(f"token id {bad} is outside the tokenizer's {self.n_ids} ids; use ids it can decode")
        return self.classes[ids].astype(np.int64)

    def to_bytes(self) -> bytes:
        body = self.classes.astype("<i4").tobytes()
        head = MAGIC + np.array([VERSION, self.n_ids, self.n_classes], dtype="<u4").tobytes()
        return head + hashlib.sha256(body).digest() + body

    @classmethod
    def from_bytes(cls, blob: bytes, where: str = "engram token classes") -> TokenClasses:
        if len(blob) < 52 or blob[:8] != MAGIC:
            raise TokenizerError(f"{where}: not an Engram token-class map; recompute it from the tokenizer")
        version, n_ids, n_classes = (int(v) for v in np.frombuffer(blob, dtype="<u4", count=3, offset=8))
        if version != VERSION:
            raise TokenizerError(f"{where}: map version {version}, this dsv4 reads {VERSION}; recompute it")
        body = blob[52:]
        if len(body) != 4 * n_ids or hashlib.sha256(body).digest() != blob[20:52]:
            raise TokenizerError(f"{where}: the map is truncated or corrupt (checksum differs); recompute it")
        return cls(np.frombuffer(body, dtype="<i4").astype(np.int32), n_classes)


def token_classes(tok: tokenizers.Tokenizer) -> TokenClasses:
    """The class map of every id the tokenizer knows (added tokens included)."""
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    norm = _normalizer()
    index: dict[str, int] = {}
    classes = np.empty(n, dtype=np.int32)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        classes[i] = index.setdefault(key, len(index))
    return TokenClasses(classes, len(index))


def check_class_count(tc: TokenClasses, expected: int, where: str = "tokenizer") -> None:
    """Refuse a tokenizer whose class count is not the config's: every hash would differ."""
    if tc.n_classes != expected:
        raise TokenizerError(
            f"{where}: its Engram compressed vocabulary has {tc.n_classes} classes, the config's "
            f"engram_compressed_vocab_size is {expected}; use the checkpoint's own tokenizer.json"
        )
