"""DSML, V4's tool-call markup: the tool-schema prompt, and parsing the model's calls.

Owns: the "## Tools" text DeepSeek's official `encoding_dsv4.py` appends to the system (or
developer) message when tools are declared (`tools_prompt`), and the inverse of the call
block `chat.py` renders: `parse_reply` splits a reply into reasoning, content and calls;
`parse_block` reads one `<｜DSML｜tool_calls>` block. A block that does not follow the
grammar is a `DsmlError`; callers then return the text unchanged, never a partial call.

The block, as the encoder writes it (and the model is trained to answer):
  "\\n\\n<｜DSML｜tool_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜tool_calls>"
  invoke: '<｜DSML｜invoke name="N">\\n' + params joined by "\\n" + '\\n</｜DSML｜invoke>'
  param:  '<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>'
with V raw text when string="true", else a JSON value. Arguments come back as one JSON
object text (OpenAI style), keys in the order written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .chat import ToolCall
from .tokenizer import DSML, THINK, THINK_END

BLOCK_START = f"\n\n<{DSML}tool_calls>"
BLOCK_END = f"</{DSML}tool_calls>"
_INVOKE = f'<{DSML}invoke name="'
_INVOKE_END = f"</{DSML}invoke>"
_PARAM = f'<{DSML}parameter name="'
_PARAM_END = f"</{DSML}parameter>"

# The official encoder's tool prompt, byte for byte (the model was trained on this text);
# {d} is the DSML marker, {schemas} one JSON object per line.
_TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a"
    ' "<{d}tool_calls>" block like the following:\n\n'
    "<{d}tool_calls>\n"
    '<{d}invoke name="$TOOL_NAME">\n'
    '<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n'
    "...\n"
    "</{d}invoke>\n"
    '<{d}invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</{d}invoke>\n"
    "</{d}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers,'
    ' booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside"
    " {think}...{think_end} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {think_end} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


class DsmlError(ValueError):
    """Text that claims to be a DSML block but does not follow the grammar."""


@dataclass(frozen=True)
class ParsedReply:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]


def tools_prompt(functions: Sequence[Mapping[str, Any]]) -> str:
    """The tools section for these function definitions ({"name", "description", "parameters"})."""
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return _TOOLS_TEMPLATE.format(d=DSML, think=THINK, think_end=THINK_END, schemas=schemas)


def with_tools(system: str, functions: Sequence[Mapping[str, Any]]) -> str:
    """A system message's text once tools are declared on it."""
    return system + "\n\n" + tools_prompt(functions)


def parse_reply(text: str, thinking: bool, tools: bool = True) -> ParsedReply:
    """Reasoning (thinking: up to the first </think>, all of it when there is none), content,
    and the calls of a well-formed block; a malformed block stays in the content as text."""
    reasoning = ""
    if thinking:
        reasoning, sep, text = text.partition(THINK_END)
        if not sep:
            return ParsedReply(reasoning, "", ())
    at = text.find(BLOCK_START) if tools else -1
    if at < 0:
        return ParsedReply(reasoning, text, ())
    try:
        calls = parse_block(text[at + len(BLOCK_START) :])
    except DsmlError:
        return ParsedReply(reasoning, text, ())
    return ParsedReply(reasoning, text[:at], calls)


def parse_block(rest: str) -> tuple[ToolCall, ...]:
    """The calls of a block given the text after "\\n\\n<｜DSML｜tool_calls>"; nothing may follow its end."""
    p = _Cursor(rest)
    p.expect("\n")
    calls = []
    while not p.take(BLOCK_END):
        p.expect(_INVOKE)
        name = p.until('">')
        p.expect("\n")
        args: dict[str, Any] = {}
        if p.peek("\n" + _INVOKE_END):
            p.expect("\n")
        while not p.take(_INVOKE_END):
            p.expect(_PARAM)
            key = p.until('" string="')
            flag = p.until('">')
            value = p.until(_PARAM_END)
            p.expect("\n")
            if key in args:
                raise DsmlError(f"parameter {key!r} given twice")
            args[key] = _value(key, flag, value)
        p.expect("\n")
        if not name:
            raise DsmlError("an invoke without a name")
        calls.append(ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))
    if p.rest():
        raise DsmlError(f"text after the block: {p.rest()[:40]!r}")
    if not calls:
        raise DsmlError("a block without calls")
    return tuple(calls)


def _value(key: str, flag: str, value: str) -> Any:
    if flag == "true":
        return value
    if flag != "false":
        raise DsmlError(f"parameter {key!r}: string={flag!r}, expected true or false")
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise DsmlError(f"parameter {key!r}: not a JSON value: {value[:40]!r}") from None


class _Cursor:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def peek(self, s: str) -> bool:
        return self.text.startswith(s, self.i)

    def take(self, s: str) -> bool:
        if self.peek(s):
            self.i += len(s)
            return True
        return False

    def expect(self, s: str) -> None:
        if not self.take(s):
            raise DsmlError(f"expected {s!r} at {self.text[self.i : self.i + 40]!r}")

    def until(self, s: str) -> str:
        j = self.text.find(s, self.i)
        if j < 0:
            raise DsmlError(f"missing {s!r}")
        out, self.i = self.text[self.i : j], j + len(s)
        return out

    def rest(self) -> str:
        return self.text[self.i :]
