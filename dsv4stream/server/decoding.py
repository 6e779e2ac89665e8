"""A request's control over each pick: logit_bias, frequency/presence penalties, the grammar
of structured output, and the log-probabilities reported back.

Owns: `Controls` (the per-request settings, checked), `Picker` (one per generated choice:
adjusts the logits, then picks with `text.sampler.make_pick`, the same sampler as
`dsv4 run`, so banned ids and the sampling ladder are shared), and token bytes for the
`logprobs` answer.

Order of the adjustments (OpenAI's): logits + logit_bias[id]; minus count[id] x
frequency_penalty and presence_penalty once if count[id] > 0, counting the ids this choice
has generated; then the grammar mask; then the sampler (temperature, top-k/p, min-p).
Reported log-probabilities are those of the adjusted distribution at temperature 1 over
the ids the sampler may pick (banned ids and grammar-refused ids have none): what the
model, as the request shaped it, thinks of each token, before the sampler's truncation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..text.sampler import SamplingParams, make_pick, top_ids
from ..text.tokenizer import Tokenizer
from .grammar import Constraint, Shape


@dataclass(frozen=True)
class Controls:
    bias: dict[int, float] = field(default_factory=dict)
    frequency: float = 0.0
    presence: float = 0.0
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives per token (0..20)
    grammar: Shape | None = None  # what the answer must follow (structured output, tool calls)
    think_budget: int | None = None  # reasoning tokens at most: then </think> is forced


@dataclass
class TokenLogprob:
    id: int
    logprob: float
    top: list[tuple[int, float]]


class Picker:
    """The pick function of one choice; `logprobs` collects one entry per pick when asked."""

    def __init__(
        self,
        controls: Controls,
        params: SamplingParams,
        n_ids: int,
        rng: np.random.Generator,
        banned: list[int],
        budget: int,
        constraint: Constraint | None = None,
        thinking: bool = False,
        think_end: int | None = None,
    ) -> None:
        self.c = controls
        self.reasoning = thinking and think_end is not None  # still in the reasoning the prompt opened
        self.reasoned = 0
        self.think_end = think_end
        self.n_ids = n_ids
        self.rng = rng  # what the sampler draws from (the worker moves position-keyed draws along)
        self._pick = make_pick(params, n_ids, rng, banned)
        self._ban = np.asarray([i for i in banned if i < n_ids], dtype=np.int64)
        self.counts: Counter[int] = Counter()
        self.left = budget
        self.constraint = constraint
        self.logprobs: list[TokenLogprob] = []
        self.first_logits: np.ndarray | None = None  # the prompt's own logits, for more choices

    def __call__(self, logits: np.ndarray) -> int:
        if self.first_logits is None:
            self.first_logits = np.array(logits, copy=True)
        x = adjust(logits, self.c, self.counts)
        if self.constraint is not None:
            x = self.constraint.restrict(x, self.left)
        if self.reasoning and self.c.think_budget is not None and self.reasoned >= self.c.think_budget:
            forced = np.full_like(x, -np.inf)
            forced[self.think_end] = 0.0
            x = forced
        tok = self._pick(x)
        if self.constraint is not None:
            tok = self.constraint.fit(tok, self.left)  # near the budget's end: keep room to close the value
        if self.c.top_logprobs is not None:
            self.logprobs.append(logprob_entry(x[: self.n_ids], self._ban, tok, self.c.top_logprobs))
        self.counts[tok] += 1
        self.left -= 1
        if self.reasoning:
            self.reasoning = tok != self.think_end
            self.reasoned += 1
        if self.constraint is not None:
            self.constraint.advance(tok)
        return tok

    @property
    def complete(self) -> bool:
        """Whether the answer is whole as the request shaped it: "stop" only then, else "length"."""
        return self.constraint is None or self.constraint.complete


def adjust(logits: np.ndarray, c: Controls, counts: Counter[int]) -> np.ndarray:
    """Logits after logit_bias and the penalties (a float64 copy when anything applies)."""
    if not (c.bias or (counts and (c.frequency or c.presence))):
        return logits
    x = np.array(logits, dtype=np.float64)
    for i, b in c.bias.items():
        if i < x.size:
            x[i] += b
    if counts and (c.frequency or c.presence):
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        x[ids] -= n * c.frequency + c.presence
    return x


def logprob_entry(x: np.ndarray, banned: np.ndarray, tok: int, top: int) -> TokenLogprob:
    """log-softmax of `x` (ids past the sampler's range already cut) less `banned`."""
    z = np.array(x, dtype=np.float64)
    if banned.size:
        z[banned] = -np.inf
    m = np.max(z)
    lse = m + np.log(np.sum(np.exp(z - m)))
    lp = z - lse
    alts = [(int(i), float(lp[i])) for i in top_ids(z, top)] if top else []
    return TokenLogprob(int(tok), float(lp[tok]), alts)


@lru_cache(maxsize=1)
def _byte_of_symbol() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes as
    themselves, the other 68 bytes as U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    text = tok.token_text(token_id)
    table = _byte_of_symbol()
    if all(ch in table for ch in text):
        return bytes(table[ch] for ch in text)
    return text.encode()  # an added token (e.g. "<think>") is stored as its text


def logprob_json(tok: Tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """OpenAI's `logprobs.content` items."""

    def one(i: int, lp: float) -> dict:
        b = token_bytes(tok, i)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _finite(lp), "bytes": list(b)}

    return [{**one(e.id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]


def _finite(lp: float) -> float:
    return lp if np.isfinite(lp) else -9999.0  # JSON has no -inf; OpenAI uses -9999.0 too
