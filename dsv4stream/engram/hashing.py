"""Engram n-gram hashing for DeepSeek-V4.1: token classes -> table row ids, pure integer arithmetic.

Owns: the hash layout of each Engram layer (prime bucket sizes, their offsets, the multipliers)
and the row ids of every position, both for a whole sequence at once and one token at a time.
It does not own the class map (`vocab.py`), reading rows, or the gate that adds them in.

The hash, as DeepSeek-V4.1's `inference/engram.py` defines it, for an Engram layer with
multipliers m[0..N-1] (N = engram_max_ngram_size) at position p:
  t[s] = class of the token at p - s, for s = 0..N-1; once a look-back reaches before the start
         (p - s < 0) or a dead position (an image-span token), that slot and every older one take
         the class of `engram_pad_id`;
  r = t[0]*m[0]; for n = 1..N-1: r ^= t[n]*m[n]; row[n-1][h] = r % prime[n-1][h] + offset[n-1][h]
so a position yields (N-1) n-gram sizes x n_heads row ids per layer (24 for 2-,3-,4-grams x 8
heads), each inside its own prime-sized range of the layer's table.

Primes (`engram.layout`, which config validation shares): successive primes >=
engram_vocab_size, never reused, taken n_heads at a time for each n-gram size of each layer in
turn; a layer's table has exactly the sum of its primes as rows, and `offset` is the running sum
within the layer (flattened n-gram-major, head-minor).

Multipliers: per layer, `numpy.random.default_rng(10007 * layer_id).integers(0, B, size=N,
dtype=int64) * 2 + 1` with B = (2**63 - 1) // n_classes // 2, so a product stays below 2**63.
They are integers from a seeded generator: for the released config they are pinned below as
integers and the generator is checked against them by the tests, so a change in numpy's stream
cannot rehash every row unnoticed. They are never handled as floats (a float32 rounds every
one of them; they are exact in a float64 only because n_classes keeps them below 2**53).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import CheckpointError, ConfigError, InternalError
from .layout import column_primes

INT64_MAX = (1 << 63) - 1
SEED_STRIDE = 10007

# DeepSeek-V4.1-Flash (engram_layer_ids [1, 14], max n-gram 4, 99,092 classes): the generator's
# values, pinned as integers. Key: (layer_id, max_ngram_size, n_classes).
PINNED_MULTIPLIERS: dict[tuple[int, int, int], tuple[int, ...]] = {
    (1, 4, 99092): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (14, 4, 99092): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}


@lru_cache(maxsize=64)
def hash_multipliers(layer_id: int, max_ngram_size: int, n_classes: int) -> tuple[int, ...]:
    """The layer's N odd multipliers (pinned for the released config, else from the generator)."""
    pinned = PINNED_MULTIPLIERS.get((layer_id, max_ngram_size, n_classes))
    if pinned is not None:
        return pinned
    return generated_multipliers(layer_id, max_ngram_size, n_classes)


def generated_multipliers(layer_id: int, max_ngram_size: int, n_classes: int) -> tuple[int, ...]:
    """What the seeded generator gives (the definition; `hash_multipliers` prefers the pins)."""
    bound = max(1, INT64_MAX // n_classes // 2)
    rng = np.random.default_rng(SEED_STRIDE * layer_id)
    draws = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(2 * int(v) + 1 for v in draws)


@dataclass(frozen=True)
class HashLayout:
    """Everything the hash needs, per Engram layer (index i of `layer_ids`):
    primes[i] ((N-1)*H,), offsets[i] ((N-1)*H,), multipliers[i] (N,), all int64."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    n_classes: int
    pad_class: int
    primes: np.ndarray  # (L, (N-1)*H) int64, n-gram-major
    offsets: np.ndarray  # (L, (N-1)*H) int64
    multipliers: np.ndarray  # (L, N) int64

    @property
    def n_rows_per_token(self) -> int:
        """Row ids per layer per position: (N-1) n-gram sizes x heads (24 on V4.1-Flash)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows each layer's table must have: the sum of its primes."""
        return tuple(int(r) for r in self.primes.sum(axis=1))

    @classmethod
    def build(
        cls,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        engram_vocab_size: int,
        n_classes: int,
        pad_class: int,
    ) -> HashLayout:
        layer_ids = tuple(int(i) for i in layer_ids)
        if not layer_ids:
            raise ConfigError("engram_layer_ids is empty: no Engram layer to lay out")
        if max_ngram_size < 2 or n_heads < 1 or engram_vocab_size < 2:
            raise ConfigError(
                f"engram hash: engram_max_ngram_size {max_ngram_size} (>= 2), engram_n_heads {n_heads} (>= 1) "
                f"and engram_vocab_size {engram_vocab_size} (>= 2) are out of range; fix config.json"
            )
        if not 0 <= pad_class < n_classes:
            raise ConfigError(f"engram hash: pad class {pad_class} is outside the {n_classes} classes")
        primes = np.array(column_primes(engram_vocab_size, len(layer_ids), max_ngram_size, n_heads), dtype=np.int64)
        offsets = np.zeros_like(primes)
        offsets[:, 1:] = np.cumsum(primes[:, :-1], axis=1)
        mult = np.array([hash_multipliers(i, max_ngram_size, n_classes) for i in layer_ids], dtype=np.int64)
        for a in (primes, offsets, mult):
            a.setflags(write=False)
        return cls(layer_ids, max_ngram_size, n_heads, n_classes, pad_class, primes, offsets, mult)

    def check_table_rows(self, rows: Sequence[int], where: str = "engram_num_embeddings") -> None:
        """Refuse tables whose row counts are not what the hash addresses (a different layout)."""
        want = self.table_rows
        if tuple(int(r) for r in rows) != want:
            raise CheckpointError(
                f"{where}: Engram tables have {list(rows)} rows, the hash layout addresses {list(want)} "
                "(sum of each layer's primes); the config's engram_* keys do not belong to these tables"
            )


# One position's look-back: the classes of the up to N-1 previous tokens, newest last, cut at the
# sequence start and at the last dead position. `()` is the state before the first token.
History = tuple[int, ...]


def row_ids(
    layout: HashLayout, classes: np.ndarray, history: History = (), live: np.ndarray | None = None
) -> tuple[np.ndarray, History]:
    """classes (T,) int -> (row ids (T, L, (N-1)*H) int64, history after the last token).

    `history` carries the look-back from an earlier chunk (empty at the start of a sequence);
    `live` (T,) bool marks the tokens that take part in n-grams (False: an image-span position,
    which cuts every n-gram across it). The same ids as `next_row_ids` one token at a time.
    """
    c = np.asarray(classes, dtype=np.int64)
    if c.ndim != 1:
        raise InternalError(f"row_ids: classes must be (T,), got shape {c.shape}")
    if c.size and (int(c.min()) < 0 or int(c.max()) >= layout.n_classes):
        raise InternalError(f"row_ids: classes must lie in 0..{layout.n_classes - 1}")
    n = layout.max_ngram_size
    if len(history) > n - 1:
        raise InternalError(f"row_ids: a history holds at most {n - 1} classes, got {len(history)}")
    t = c.size
    alive = np.ones(t, dtype=bool) if live is None else np.asarray(live, dtype=bool)
    # the look-back window over [history, this chunk]; dead/unknown slots are marked -1
    h = len(history)
    ext = np.full(n - 1 + t, -1, dtype=np.int64)
    ext[n - 1 - h : n - 1] = history
    ext[n - 1 :] = np.where(alive, c, -1)
    cols = np.stack([ext[n - 1 - s : n - 1 - s + t] for s in range(n)], axis=1)  # (T, N): shift s
    blocked = np.logical_or.accumulate(cols < 0, axis=1)
    tokens = np.where(blocked, layout.pad_class, cols)
    rows = _hash(layout, tokens)
    return rows, _advance(history, c, alive, n)


def next_row_ids(layout: HashLayout, history: History, cls: int, live: bool = True) -> tuple[np.ndarray, History]:
    """One decode step: the new token's class and the last N-1 -> (row ids (L, (N-1)*H), new history)."""
    n = layout.max_ngram_size
    if not 0 <= cls < layout.n_classes:
        raise InternalError(f"next_row_ids: class {cls} outside 0..{layout.n_classes - 1}")
    window = [cls if live else -1, *reversed(history)]  # shift 0, 1, 2, ...
    tokens, cut = [], False
    for s in range(n):
        v = window[s] if s < len(window) else -1
        cut = cut or v < 0
        tokens.append(layout.pad_class if cut else v)
    rows = _hash(layout, np.array([tokens], dtype=np.int64))[0]
    return rows, _advance(history, np.array([cls], dtype=np.int64), np.array([live]), n)


def _hash(layout: HashLayout, tokens: np.ndarray) -> np.ndarray:
    """tokens (T, N) classes by shift -> (T, L, (N-1)*H) row ids."""
    n, heads = layout.max_ngram_size, layout.n_heads
    products = tokens[:, None, :] * layout.multipliers[None, :, :]  # (T, L, N); < 2**63 by the bound
    rolling = products[..., 0]
    out = np.empty((tokens.shape[0], len(layout.layer_ids), (n - 1) * heads), dtype=np.int64)
    for g in range(1, n):
        rolling = rolling ^ products[..., g]
        sl = slice((g - 1) * heads, g * heads)
        out[..., sl] = rolling[..., None] % layout.primes[None, :, sl]
    out += layout.offsets[None]
    return out


def _advance(history: History, classes: np.ndarray, alive: np.ndarray, n: int) -> History:
    """The look-back after `classes`: the last N-1 live tokens since the last dead one."""
    dead = np.flatnonzero(~alive)
    if dead.size:
        tail = [int(v) for v in classes[dead[-1] + 1 :]]
    else:
        tail = [*history, *(int(v) for v in classes)]
    return tuple(tail[-(n - 1) :]) if n > 1 else ()
