"""What both releases' chat renderers write the same way, given each release's way with tools.

Owns: `Turn` (a message after tool results are folded into user turns), ordering tool results
like the calls that asked for them, and the layout of the turns the V4 and V4.1 encoders
write alike: a system message with its declarations (tools prompt, response format), a user
turn's blocks, a latest_reminder, an assistant turn (reasoning, content, the DSML tool calls,
EOS). Each renderer passes its `Tools`: the DSML grammar, how the tools prompt lists a tool
definition, how a call's name and parameters are written.
Not here: which turns a conversation has, what opens each one and where reasoning is dropped
(`chat_v4.py`, `chat_v41.py`: the two encoders differ in many small places).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InternalError
from . import dsml
from .messages import ImagePart, Message, Pieces, ToolCall, joined
from .vocab import EOS, IMAGE, LATEST_REMINDER, THINK_END, USER

RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


@dataclass
class Turn:
    """A message after tool results have been folded into user turns."""

    msg: Message
    # user turns only: (is_tool_result, text or a V4.1 image, tool_call_id) in arrival order
    blocks: list[tuple[bool, str | ImagePart, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Tools:
    """A release's way with tools: its DSML `grammar`; `function(tool)`, the definition its
    tools prompt lists for an OpenAI tool; `name(call name)` as a call writes it; `params(call)`,
    the call's (key, value, value is a string) parameters."""

    grammar: dsml.Grammar
    function: Callable[[Any], Any]
    name: Callable[[str], str]
    params: Callable[[ToolCall], list[tuple[str, str, bool]]]


def sort_tool_results(turns: list[Turn]) -> list[Turn]:
    # Results go in the order of the calls of the latest assistant turn that made calls;
    # unknown ids rank as 0 and the sort is stable, as in the official encoders.
    order: dict[str, int] = {}
    for t in turns:
        if t.msg.role == "assistant" and t.msg.tool_calls:
            order = {c.id: k for k, c in enumerate(t.msg.tool_calls) if c.id}
        elif t.msg.role == "user" and order:
            results = [b for b in t.blocks if b[0]]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
                t.blocks = [next(ranked) if b[0] else b for b in t.blocks]
    return turns


def render_turn(out: Pieces, turn: Turn, with_reasoning: bool, tools: Tools) -> None:
    """A system, user, latest_reminder or assistant turn (what opens it is the caller's)."""
    m = turn.msg
    if m.role == "system":
        out.txt(joined(m.content))
        declarations(out, m, tools)
    elif m.role == "user":
        out.ctl(USER)
        for k, (is_tool, text, _) in enumerate(turn.blocks):
            out.ctl("\n\n" if k else "")
            if is_tool:
                out.ctl("<tool_result>")
                out.txt(text)
                out.ctl("</tool_result>")
            elif isinstance(text, ImagePart):
                out.ctl(IMAGE)  # V4.1: the placeholder of a structured image part, never typed text
            else:
                out.txt(text)
    elif m.role == "latest_reminder":
        out.ctl(LATEST_REMINDER)
        out.txt(joined(m.content))
    elif m.role == "assistant":
        if with_reasoning:
            out.txt(m.reasoning)
            out.ctl(THINK_END)
        out.txt(joined(m.content))
        if m.tool_calls:
            _tool_calls(out, m.tool_calls, tools)
        if not m.unfinished:
            out.ctl(EOS)
    else:
        raise InternalError(f"a {m.role!r} turn reached the shared renderer")


def declarations(out: Pieces, m: Message, tools: Tools) -> None:
    """Tools and response format of a system (or V4's developer) message, as the encoders append them."""
    if m.tools:
        head, schemas, tail = dsml.tools_prompt_parts([tools.function(t) for t in m.tools], tools.grammar)
        out.ctl("\n\n" + head)
        out.txt(schemas)
        out.ctl(tail)
    if m.response_format:
        out.ctl("\n\n" + RESPONSE_FORMAT)
        out.txt(dsml.to_json(m.response_format))


def _tool_calls(out: Pieces, calls: tuple[ToolCall, ...], tools: Tools) -> None:
    """The DSML block holding one invoke per call, each with its parameters."""
    g = tools.grammar
    out.ctl(g.block_start + "\n")
    for n, c in enumerate(calls):
        out.ctl(("\n" if n else "") + g.invoke_head)
        out.txt(tools.name(c.name))
        out.ctl('">\n')
        for k, (key, value, is_str) in enumerate(tools.params(c)):
            out.ctl(("\n" if k else "") + g.param_head)
            out.txt(key)
            out.ctl(f'" string="{"true" if is_str else "false"}">')
            out.txt(value)
            out.ctl(g.param_close)
        out.ctl("\n" + g.invoke_close)
    out.ctl("\n" + g.block_end)
