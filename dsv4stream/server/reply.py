"""One reply as it is generated: token ids in, reasoning / content / tool-call deltas out.

Owns: decoding ids to text (`Tokenizer.stream`, so a character split over tokens comes out
whole), the `stop` strings (the text is cut before the first one and generation ends),
splitting reasoning from content at `</think>` when the prompt opened `<think>`, and DSML
tool-call blocks: text that may start a block is held back until it is known; a complete
block becomes `tool_calls`, a malformed one is released as content (`dsml.parse_block`).
The end result equals `dsml.parse_reply` of the whole text (tested). Not here: HTTP shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..text import dsml
from ..text.chat import ToolCall
from ..text.dsml import DsmlError, parse_block
from ..text.tokenizer import THINK_END, Tokenizer


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    index: int = 0  # the choice it belongs to (n > 1)
    logprobs: list = field(default_factory=list)  # decoding.TokenLogprob of the tokens whose text this is

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls or self.logprobs)


@dataclass
class Outcome:
    finish_reason: str  # stop, length, tool_calls
    text: str  # the whole decoded reply up to a stop string
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)
    index: int = 0
    logprobs: list = field(default_factory=list)  # every token's decoding.TokenLogprob, EOS excepted


def _held_prefix(text: str, marks: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `marks`."""
    best = 0
    for m in marks:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ReplyStream:
    """Feed ids with `push`; each returns the delta to send now; `finish` the rest."""

    def __init__(
        self,
        tok: Tokenizer,
        *,
        thinking: bool,
        tools: bool,
        stops: Sequence[str] = (),
        eos: int | None = None,
        grammar: dsml.Grammar = dsml.V4,
        parallel: bool = True,
    ) -> None:
        self.tok = tok
        self.grammar = grammar  # the release's DSML tags (V4.1: `<｜DSML｜ calls>`)
        self.block_start = grammar.block_start
        self.decoder = tok.stream()
        self.eos = tok.special.eos if eos is None else eos
        self.stops = [s for s in stops if s]
        self.tools = tools
        self.parallel = parallel  # False: one tool call at most (parallel_tool_calls: false); later ones dropped
        self.in_reasoning = thinking
        self.text = ""  # decoded so far, before stop handling
        self.passed = 0  # end of the text past the stop check
        self.stopped = False  # a stop string was met
        self.stop_hit: str | None = None  # which one
        self._pending = ""  # passed the stop check, not yet split
        self._block: str | None = None  # text of a DSML block being collected
        self.reasoning, self.content = "", ""
        self.calls: tuple[ToolCall, ...] = ()

    def push(self, token_id: int) -> Delta:
        if self.stopped or token_id == self.eos:
            return Delta()
        self.text += self.decoder.push(token_id)
        return self._advance(final=False)

    def finish(self, finish_reason: str) -> tuple[Delta, Outcome]:
        """The last delta and the outcome; `finish_reason` is length or stop as generation ended."""
        if not self.stopped:
            self.text += self.decoder.flush()
        delta = self._advance(final=True)
        if self._block is not None:
            block, self._block = self._block, None
            try:
                self.calls = parse_block(block[len(self.block_start) :], self.grammar)
                if not self.parallel:
                    self.calls = self.calls[:1]
                delta.tool_calls = self.calls
            except DsmlError:
                delta.content += block
                self.content += block
        reason = "tool_calls" if self.calls else ("stop" if self.stopped else finish_reason)
        cut = self.text if not self.stopped else self.text[: self.passed]
        return delta, Outcome(reason, cut, self.reasoning, self.content, self.calls)

    # ---- internals --------------------------------------------------------------------------
    def _advance(self, final: bool) -> Delta:
        new = self.text[self.passed :]
        if self.stopped:
            new = ""
        for s in self.stops:
            at = new.find(s)
            if at >= 0:  # the earliest stop string wins: each cut leaves only text before it
                new, self.stopped, self.stop_hit = new[:at], True, s
        if self.stopped or final:
            take = len(new)
        else:
            take = len(new) - _held_prefix(new, self.stops)
        self.passed += take
        self._pending += new[:take]
        return self._split(final or self.stopped)

    def _split(self, final: bool) -> Delta:
        d = Delta()
        while self._pending:
            if self._block is not None:
                self._block += self._pending
                self._pending = ""
                break
            if self.in_reasoning:
                head, sep, tail = self._pending.partition(THINK_END)
                if sep:
                    d.reasoning += head
                    self._pending, self.in_reasoning = tail, False
                    continue
                keep = 0 if final else _held_prefix(head, [THINK_END])
                d.reasoning += head[: len(head) - keep]
                self._pending = head[len(head) - keep :]
                break
            at = self._pending.find(self.block_start) if self.tools else -1
            if at >= 0:
                d.content += self._pending[:at]
                self._block, self._pending = self._pending[at:], ""
                break
            keep = 0 if final or not self.tools else _held_prefix(self._pending, [self.block_start])
            d.content += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            break
        if final and self._pending:
            if self.in_reasoning:
                d.reasoning += self._pending
            else:
                d.content += self._pending
            self._pending = ""
        self.reasoning += d.reasoning
        self.content += d.content
        return d
