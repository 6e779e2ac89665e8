"""Where each Engram hash column's rows sit in its layer's table (DeepSeek-V4.1).

Owns: the prime bucket sizes and the flat offsets of every (n-gram size, head) column, the
fact that a layer's table has exactly the sum of its primes as rows (what config.json's
`engram_num_embeddings` must say), and the bytes of one row. Pure arithmetic: the hashing
of token ids into these buckets is `hashing`'s. `checkpoint.config` imports this module to
check `engram_num_embeddings`, so it imports nothing of the project.

The rule (DeepSeek's inference/engram.py, EngramLayout): for each Engram layer in order, for
each n-gram size 2..max_ngram_size, for each head, the bucket size is the smallest prime
above the search start that no earlier column took; the search restarts from
`engram_vocab_size - 1` at every n-gram size, and taken primes are never reused, across
layers too. So the columns' primes are successive primes above engram_vocab_size, and the
released layers' 24 primes each sum to 384,006,168 and 384,016,682 rows.
"""

from __future__ import annotations

from functools import lru_cache

# Deterministic Miller-Rabin witnesses: exact for every n < 3.3e24 (the tables' primes are < 2^32).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=16)
def column_primes(vocab_size: int, layers: int, max_ngram_size: int, n_heads: int) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer, its (max_ngram_size - 1) * n_heads bucket primes, n-gram size major."""
    taken: set[int] = set()
    out = []
    for _ in range(layers):
        cols: list[int] = []
        for _ in range(max_ngram_size - 1):
            current = vocab_size - 1
            for _ in range(n_heads):
                current += 1
                while not is_prime(current) or current in taken:
                    current += 1
                taken.add(current)
                cols.append(current)
        out.append(tuple(cols))
    return tuple(out)


def column_offsets(primes: tuple[int, ...]) -> tuple[int, ...]:
    """First table row of each column: the running sum of the primes before it."""
    out, pos = [], 0
    for p in primes:
        out.append(pos)
        pos += p
    return tuple(out)


def table_rows(vocab_size: int, layers: int, max_ngram_size: int, n_heads: int) -> tuple[int, ...]:
    """Rows each Engram layer's table must have: the sum of its columns' primes."""
    return tuple(sum(c) for c in column_primes(vocab_size, layers, max_ngram_size, n_heads))
