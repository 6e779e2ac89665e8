"""DSML, the tool-call markup of V4 and V4.1: the tool-schema prompt, and parsing the model's calls.

Owns: the tag names of each release (`V4`, `V41`: V4.1 gave every tag name a leading space
and renamed the block `tool_calls` -> ` calls`), the "## Tools" text the official encoders
append to a system message that declares tools (`tools_prompt`), and the inverse of the call
block the renderers write: `parse_reply` splits a reply into reasoning, content and calls;
`parse_block` reads one block. A block that does not follow the grammar is a `DsmlError`;
callers then return the text unchanged, never a partial call.

The block, as the encoders write it (and the model is trained to answer), with V4's names
(V4.1: `<｜DSML｜ calls>`, `<｜DSML｜ invoke name=...>`, `<｜DSML｜ parameter name=...>`):
  "\\n\\n<｜DSML｜tool_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜tool_calls>"
  invoke: '<｜DSML｜invoke name="N">\\n' + params joined by "\\n" + '\\n</｜DSML｜invoke>'
  param:  '<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>'
with V raw text when string="true", else a JSON value. Arguments come back as one JSON
object text (OpenAI style), keys in the order written.

Any value round-trips (`param_text` writes, `parse_block` reads): raw text cannot hold the
parameter's closing tag, so a string that contains it is written as a JSON string instead, and
JSON text that would contain it (a string inside) has its '<' written as the JSON escape
\u003c. The reader takes a JSON value up to the first closing tag after which it parses, so a
model's unescaped JSON string holding the tag's text reads back too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .messages import ToolCall
from .vocab import DSML, THINK, THINK_END


@dataclass(frozen=True)
class Grammar:
    """The tag names of one release's tool-call markup (what follows `<｜DSML｜`)."""

    calls: str
    invoke: str
    parameter: str

    @property
    def block_start(self) -> str:
        """What a reply's call block starts with (a blank line, then the opening tag)."""
        return f"\n\n<{DSML}{self.calls}>"

    @property
    def block_end(self) -> str:
        return f"</{DSML}{self.calls}>"

    @property
    def invoke_head(self) -> str:
        """An invoke tag up to its name: the tag is this, the name, then '">'."""
        return f'<{DSML}{self.invoke} name="'

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def param_head(self) -> str:
        """A parameter tag up to its key: then the key, '" string="true|false">', the value."""
        return f'<{DSML}{self.parameter} name="'

    @property
    def param_close(self) -> str:
        return f"</{DSML}{self.parameter}>"


V4 = Grammar("tool_calls", "invoke", "parameter")
V41 = Grammar(" calls", " invoke", " parameter")
BLOCK_START = V4.block_start
BLOCK_END = V4.block_end

# The official encoders' tool prompt, byte for byte (the model was trained on this text);
# {calls}/{invoke}/{param} are the release's tags after <｜DSML｜, {schemas} one JSON object per line.
_TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a"
    ' "<{d}{calls}>" block like the following:\n\n'
    "<{d}{calls}>\n"
    '<{d}{invoke} name="$TOOL_NAME">\n'
    '<{d}{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}{param}>\n'
    "...\n"
    "</{d}{invoke}>\n"
    '<{d}{invoke} name="$TOOL_NAME2">\n'
    "...\n"
    "</{d}{invoke}>\n"
    "</{d}{calls}>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers,'
    ' booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside"
    " {think}...{think_end} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {think_end} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_END = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


class DsmlError(ValueError):
    """Text that claims to be a DSML block but does not follow the grammar."""


@dataclass(frozen=True)
class ParsedReply:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]


def tools_prompt_parts(functions: Sequence[Mapping[str, Any]], grammar: Grammar = V4) -> tuple[str, str, str]:
    """The tools section for these function definitions ({"name", "description", "parameters"})
    as (template head, the schemas, template tail): the schemas are the client's text."""
    head = _TOOLS_TEMPLATE.format(
        d=DSML, calls=grammar.calls, invoke=grammar.invoke, param=grammar.parameter, think=THINK, think_end=THINK_END
    )
    return head, "\n".join(to_json(f) for f in functions), _TOOLS_END


def tools_prompt(functions: Sequence[Mapping[str, Any]], grammar: Grammar = V4) -> str:
    return "".join(tools_prompt_parts(functions, grammar))


def with_tools(system: str, functions: Sequence[Mapping[str, Any]], grammar: Grammar = V4) -> str:
    """A system message's text once tools are declared on it."""
    return system + "\n\n" + tools_prompt(functions, grammar)


def to_json(value: Any) -> str:
    """JSON as the official encoders write it: non-ASCII kept, `, ` and `: ` separators."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def param_text(value: Any, grammar: Grammar = V4) -> tuple[str, bool]:
    """(the text a parameter's value is written as, whether as raw text: string="true").

    Strings go in raw, as the official encoders write them, unless they hold the closing tag;
    anything else (and such a string) as JSON, its '<' escaped where the text would hold the tag."""
    if isinstance(value, str) and grammar.param_close not in value:
        return value, True
    text = to_json(value)
    return (text.replace("<", "\\u003c") if grammar.param_close in text else text), False


def parse_reply(text: str, thinking: bool, tools: bool = True, grammar: Grammar = V4) -> ParsedReply:
    """Reasoning (thinking: up to the first </think>, all of it when there is none), content,
    and the calls of a well-formed block; a malformed block stays in the content as text."""
    reasoning = ""
    if thinking:
        reasoning, sep, text = text.partition(THINK_END)
        if not sep:
            return ParsedReply(reasoning, "", ())
    at = text.find(grammar.block_start) if tools else -1
    if at < 0:
        return ParsedReply(reasoning, text, ())
    try:
        calls = parse_block(text[at + len(grammar.block_start) :], grammar)
    except DsmlError:
        return ParsedReply(reasoning, text, ())
    return ParsedReply(reasoning, text[:at], calls)


def parse_block(rest: str, grammar: Grammar = V4) -> tuple[ToolCall, ...]:
    """The calls of a block given the text after its `block_start`; nothing may follow its end."""
    g = grammar
    p = _Cursor(rest)
    p.expect("\n")
    calls = []
    while not p.take(g.block_end):
        p.expect(g.invoke_head)
        name = p.until('">')
        p.expect("\n")
        args: dict[str, Any] = {}
        if p.peek("\n" + g.invoke_close):
            p.expect("\n")
        while not p.take(g.invoke_close):
            p.expect(g.param_head)
            key = p.until('" string="')
            flag = p.until('">')
            if flag == "false":
                value = _json_value(p, g.param_close, key)
            elif flag == "true":
                value = p.until(g.param_close)
            else:
                raise DsmlError(f"parameter {key!r}: string={flag!r}, expected true or false")
            p.expect("\n")
            if key in args:
                raise DsmlError(f"parameter {key!r} given twice")
            args[key] = value
        p.expect("\n")
        if not name:
            raise DsmlError("an invoke without a name")
        calls.append(ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))
    if p.rest():
        raise DsmlError(f"text after the block: {p.rest()[:40]!r}")
    if not calls:
        raise DsmlError("a block without calls")
    return tuple(calls)


def _json_value(p: _Cursor, close: str, key: str) -> Any:
    """A JSON value up to its closing tag: the first `close` before which the text parses (a
    JSON string may hold the tag's text unescaped)."""
    start = p.i
    while True:
        end = p.text.find(close, p.i)
        if end < 0:
            raise DsmlError(f"parameter {key!r}: not a JSON value: {p.text[start : start + 40]!r}")
        p.i = end + len(close)
        try:
            return json.loads(p.text[start:end])
        except (json.JSONDecodeError, RecursionError):
            continue


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
