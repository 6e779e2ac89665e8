"""Structured output: grammar-constrained decoding with llguidance on the checkpoint's tokenizer.

Owns: compiling a request's `response_format` (`json_object`, `json_schema`) into an
llguidance grammar (`Grammars.compile`, checked at request time: a schema it cannot use is
a 400), and `Constraint`, one per generated choice: the token mask before each pick, the
tokens consumed after it, and the budget rule that makes the answer parse *whatever the
weights*:

- Each pick is restricted to the tokens the grammar allows (EOS only once the value is
  complete; JSON is written compactly, `", "` and `": "` between items, no free whitespace,
  so a complete value ends the answer).
- A model that never closes its string (a random one picks `"` about once in 10^5 tokens)
  would run out of `max_tokens` mid-value. So near the end of the budget the constraint
  computes a short completion from where the output stands (fast-forced tokens, then
  closing characters `"`, `}`, `]` and the shortest values `0`, `""`, `[]`, `{}`, `true`,
  `null`, then the shortest allowed token; where that greedy closing finds nothing, as for a
  string with a `format` or `pattern`, a bounded breadth-first search over printable bytes)
  and, once that completion plus EOS just fits in what is left, forces it token by token; a
  pick that would leave no room for a completion (`fit`) is replaced by the completion's
  first token. The answer is then a complete value, ending with EOS, within `max_tokens`,
  unless the grammar's shortest value is itself longer than that. `complete` says whether
  it is: the worker reports "stop" only then, else "length" (never a cut value as "stop").
- Schemas are checked first (`subset.normalize`): outside the enforced JSON-Schema subset,
  or with no finite value, a 400.
- With thinking on, the grammar starts after `</think>`; the reasoning is forced to end
  when only the completion's reserve is left.

The llguidance tokenizer is built once per server from the checkpoint's own tokenizer.json
(about 5 s for V4's 129k entries), on the first request that needs it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..text.tokenizer import THINK_END, Tokenizer
from .subset import GrammarError, normalize

# tokens tried first when completing a value: closers, then the shortest values
_CLOSERS = ('"', "}", "]", ",", "0", "[]", "{}", '""', "true", "null", ":")
_MAX_CLOSING = 512  # a completion longer than this is not searched for
_SEARCH_DEPTH, _SEARCH_WIDTH = 64, 6  # the breadth-first completion search: bytes, states kept per length
_SEARCH_TRIES = 50_000  # tokens tried in one search at most (about 0.6 s): past it, no completion is found
_PROBES = '"@.:-/_+ 0aAzZTPDHMSWY,}]'  # the bytes whose acceptance tells two search states apart
_SLACK = 8  # a pick is checked for room once this close to the last completion's length
# JSON as OpenAI's models write it in structured output: ", " and ": ", no free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Shape:
    """What a request's answer must follow: a compiled llguidance grammar, the multi-token
    closers tried first when completing it (a tool call's closing tags), and the ids that open
    a tool-call block when free text may come first."""

    grammar: str
    phrases: tuple[tuple[int, ...], ...] = ()
    opening: tuple[int, ...] = ()


class Grammars:
    """The llguidance tokenizer of one checkpoint (built lazily) and grammar compilation."""

    def __init__(self, tok: Tokenizer, n_vocab: int) -> None:
        self.tok = tok
        self.n_vocab = n_vocab
        self._lock = threading.Lock()
        self._ll = None
        self._closers: list[int] = []
        self._short: list[int] = []  # ids of one-byte tokens, ascending: the last resort of a completion
        self._ascii: list[int] = []  # ids of the printable ASCII one-byte tokens: the completion search's steps
        self._probes: list[int] = []  # ids of the _PROBES bytes
        self.think_end = tok.token_id(THINK_END)

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(
                    self.tok.to_json(), n_vocab=self.n_vocab, eos_token=self.tok.special.eos
                )
                for text in _CLOSERS:
                    ids = self.tok.encode(text)
                    if len(ids) == 1:
                        self._closers.append(ids[0])
                ll = self._ll
                self._short = [
                    i for i in range(self.tok.n_tokens) if len(ll.decode_bytes([i])) == 1 and not ll.is_special_token(i)
                ]
                self._ascii = [i for i in self._short if 32 <= ll.decode_bytes([i])[0] < 127]
                self._probes = [i for i in self._ascii if chr(ll.decode_bytes([i])[0]) in _PROBES]
            return self._ll

    def compile(self, response_format: dict[str, Any] | None) -> Shape | None:
        """The shape of a request's response_format (None: free text)."""
        schema = answer_schema(response_format)
        return None if schema is None else Shape(self.compile_schema(schema, "response_format.json_schema.schema"))

    def compile_schema(self, schema: dict[str, Any], where: str) -> str:
        """A JSON schema in the enforced subset (`subset.normalize`), checked against this tokenizer."""
        import llguidance

        schema = normalize(schema, where)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{where}: not a usable JSON schema ({_first_line(e)})") from None
        return self._checked(grammar, f"{where}: not a usable JSON schema")

    def compile_lark(self, lark: str, where: str) -> str:
        """A Lark grammar (`toolgrammar`'s), checked against this tokenizer."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{where}: cannot be enforced ({_first_line(e)})") from None
        return self._checked(grammar, f"{where}: cannot be enforced")

    def _checked(self, grammar: str, what: str) -> str:
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if failed:
            raise GrammarError(f"{what} ({_first_line(messages[0]) if messages else 'refused'})")
        return grammar

    def constraint(self, shape: Shape, thinking: bool) -> Constraint:
        return Constraint(self, shape.grammar, thinking, shape.phrases, shape.opening)


def _first_line(message: object) -> str:
    """The compiler's reason without its position or the grammar it quotes (our internals)."""
    line = str(message).strip().splitlines()[0] if str(message).strip() else "refused"
    line = re.sub(r"^at \d+\(\d+\): ", "", line)
    return line if len(line) <= 200 else line[:200] + "..."


def answer_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a response_format asks for (None: free text)."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    schema = response_format["json_schema"].get("schema") or {}
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema must be a JSON object")
    return schema


class Constraint:
    """One choice's grammar state; `allowed` before each pick, `advance` after it."""

    def __init__(
        self,
        grammars: Grammars,
        grammar: str,
        thinking: bool,
        phrases: Sequence[Sequence[int]] = (),
        opening: Sequence[int] = (),
    ) -> None:
        """`phrases`: multi-token closers (a tool call's closing tags); `opening`: the ids that
        open a tool-call block where free text may come first (its shortest completion then
        sizes the window in which the answer is completed)."""
        import llguidance

        self.g = grammars
        self.matcher = llguidance.LLMatcher(grammars.ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar was refused: {_first_line(self.matcher.get_error())}")
        self.thinking = thinking  # the reply is still in its reasoning: not constrained yet
        self.eos = grammars.tok.special.eos
        self._bits = np.full((grammars.n_vocab + 31) // 32, -1, dtype=np.int32)
        self._phrases = [list(p) for p in phrases if p]
        self._reserve = len(self._closing(self.matcher) or ()) + 1  # the shortest whole answer, EOS included
        longest = self._reserve
        if opening:
            m = self.matcher.deep_copy()
            if m.try_consume_tokens(list(opening)) == len(opening):
                longest = max(longest, len(opening) + len(self._closing(m) or ()) + 1)
        self._window = 2 * longest + 64  # tokens before the budget's end from which a completion is looked for
        self._need = self._reserve  # the last completion's length (EOS included): picks are checked near it
        self._forced: list[int] = []

    @property
    def complete(self) -> bool:
        """Whether the answer so far is a whole value (what a "stop" finish promises)."""
        return not self.thinking and not self.matcher.is_error() and self.matcher.is_accepting()

    def fit(self, token: int, left: int) -> int:
        """`token` if the answer can still be completed within the budget after it, else the
        first token of the completion from here (then forced to its end). `left`: tokens this
        choice may still generate, `token` included. This keeps room for the closing: a pick
        that opens more than the rest of the budget can close (a key, a string with a format)
        is replaced, so the value ends whole rather than cut by `max_tokens`."""
        if self._forced or self.thinking or token == self.eos or left > self._window or left > self._need + _SLACK:
            return token
        m = self.matcher.deep_copy()
        if m.try_consume_tokens([token]) != 1:
            return token
        after = self._closing(m)
        if after is not None and len(after) + 2 <= left:  # the completion, then EOS, after this token
            self._need = len(after) + 1
            return token
        here = self._closing(self.matcher)
        if here is None or len(here) + 1 > left:
            return token  # no shorter way out: the budget ends the answer ("length")
        self._forced = [*here, self.eos]
        return here[0]

    def restrict(self, logits: np.ndarray, left: int) -> np.ndarray:
        """`logits` (vocab,) with what the grammar refuses at -inf; `left`: tokens this choice may
        still generate, this one included."""
        force = self._force(left)
        out = np.full_like(logits, -np.inf)
        if force is not None:
            out[force] = 0.0 if not np.isfinite(logits[force]) else logits[force]
            return out
        if self.thinking:
            return logits
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self.matcher, self._bits.reshape(1, -1))
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: logits.size].astype(bool)
        out[allowed] = logits[allowed]
        return out

    def advance(self, token: int) -> None:
        if self._forced and self._forced[0] == token:
            self._forced.pop(0)
        else:
            self._forced.clear()
        if self.thinking:
            if token == self.g.think_end:
                self.thinking = False
            return
        if token != self.eos or not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    def _force(self, left: int) -> int | None:
        if self._forced:
            return self._forced[0]
        if self.thinking:
            # the reasoning ends while the answer still fits: </think>, then the completion
            return self.g.think_end if left <= self._reserve + 1 else None
        if left > self._window or self.matcher.is_error():
            return None
        if left > self._need + _SLACK and left % 8:
            return None  # far from the last completion's length: looked at every 8th token only
        path = self._closing(self.matcher)
        if path is not None:
            self._need = len(path) + 1
        if path is None or len(path) + 1 < left:  # + 1: EOS after the value
            return None
        self._forced = [*path, self.eos]
        return self._forced[0]

    def _closing(self, matcher) -> list[int] | None:
        """A short token path from `matcher`'s state to a complete value (None: none found): the
        greedy closing first, else a breadth-first search over printable bytes."""
        path = self._greedy(matcher)
        return path if path is not None else self._search(matcher)

    def _search(self, matcher) -> list[int] | None:
        """The shortest path of one-byte tokens to a complete value, breadth first: what a
        string with a `format` or a `pattern` needs (`@x"` for an email), where the greedy
        closing loops on the lowest byte. States reached by paths of one length that accept
        the same next bytes are taken as one (at most `_SEARCH_WIDTH` kept per length)."""
        steps, probes = self.g._ascii, self.g._probes
        if matcher.is_error():
            return None
        layer = [(matcher.deep_copy(), [])]
        tries = 0
        for _ in range(_SEARCH_DEPTH):
            nxt: dict[tuple[int, ...], tuple] = {}
            for m, path in layer:
                acc = _accepted(m, steps)
                tries += len(steps) + len(acc) * len(probes)
                if tries > _SEARCH_TRIES:
                    return None
                for t in acc:
                    c = m.deep_copy()
                    c.consume_token(t)
                    if c.is_accepting():
                        return [*path, t]
                    sig = tuple(_accepted(c, probes))
                    if sig not in nxt:
                        nxt[sig] = (c, [*path, t])
            layer = list(nxt.values())[:_SEARCH_WIDTH]
            if not layer:
                return None
        return None

    def _greedy(self, matcher) -> list[int] | None:
        """Closers and shortest values first, then the lowest byte that fits (None: none found)."""
        m = matcher.deep_copy()
        path: list[int] = []
        while not m.is_accepting():
            if len(path) > _MAX_CLOSING or m.is_error():
                return None
            ff = m.compute_ff_tokens()
            if ff and m.consume_tokens(ff):
                path += ff
                continue
            # a closing tag that ends the span it closes: free text (a raw value, a JSON string)
            # takes the tag as more text, and then could take it again right after
            for phrase in self._phrases:
                c, n = m.deep_copy(), len(phrase)
                if c.try_consume_tokens(phrase) == n and c.deep_copy().try_consume_tokens(phrase) < n:
                    m = c
                    path += phrase
                    break
            else:
                phrase = None
            if phrase is not None:
                continue
            for t in (*self.g._closers, *self.g._short):
                if m.try_consume_tokens([t]) == 1:
                    path.append(t)
                    break
            else:
                return None
        return path


def _accepted(m, ids: Sequence[int]) -> list[int]:
    """Those of `ids` that `m` takes as its next token (`m` is left as it was)."""
    out = []
    for t in ids:
        if m.try_consume_tokens([t]) == 1:
            out.append(t)
            m.rollback(1)
    return out
