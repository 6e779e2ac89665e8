"""The answer's grammar when tools constrain it: `tool_choice` that forces a call, and `strict` tools.

Owns: one llguidance Lark grammar for the whole answer (after any reasoning), built from the
DSML tags `dsml` itself writes and reads (`Markup`: `dsml`'s own strings, the description
`dsml.parse_block` reads, not a copy) and the declared tools:

- `tool_choice` "required" or a named function: the answer is exactly one call block (of that
  function when named); "auto" with a strict tool: free text, or text then a block (the
  block is constrained once its opening tag is written; nothing follows it).
- A strict tool's invoke writes its declared parameters in the schema's order (required ones
  always, optional ones optionally), each value either raw text (`string="true"`, offered
  only where the schema says no more than "a string", or as the literal members of a string
  enum) or JSON checked against the parameter's own schema (`string="false"`, the schema's
  `$defs` carried along), so the arguments `parse_block` returns validate against the
  tool's schema. A non-strict tool's invoke takes any parameters (raw text or any JSON).
- `parallel_tool_calls: false`: one invoke per block.
- A `response_format` with tools: the answer is that JSON value or (tools allowing) a block.

Refused (`GrammarError`, a 400 naming the tool): a strict tool whose `parameters` is not an
object schema of named `properties` (top-level `anyOf`, `patternProperties`, ... cannot be
written as DSML parameters), or a required name that is not a property.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..text import dsml
from . import subset
from .grammar import JSON_OPTIONS as JSON_STYLE
from .grammar import GrammarError, Grammars, Shape, answer_schema
from .schemas import ChatRequest

# schema keys that only annotate a value: a string schema with no others is "any text"
_ANNOTATIONS = frozenset({"type", "description", "title", "examples", "default", "$comment", "deprecated"})
# top-level keys of a strict tool's parameters that the DSML parameters can carry
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                          "description", "title", "$schema", "$id", "$comment", "strict"})  # fmt: skip


@dataclass(frozen=True)
class Markup:
    """The DSML tags a call block is written with: `dsml`'s own strings, which `parse_block` reads."""

    block_start: str
    block_end: str
    invoke_head: str
    invoke_close: str
    param_head: str
    param_close: str

    @classmethod
    def of(cls, release: dsml.Grammar) -> Markup:
        """The tags of one release's DSML (V4's `tool_calls`..., V4.1's ` calls`...)."""
        g = release
        return cls(g.block_start, g.block_end, g.invoke_head, g.invoke_close, g.param_head, g.param_close)


V4 = Markup.of(dsml.V4)
V41 = Markup.of(dsml.V41)


@dataclass(frozen=True)
class ToolSpec:
    """One declared function: its name, parameters schema, and whether it is strict."""

    name: str
    parameters: Mapping[str, Any] | None
    strict: bool


def lark_string(s: str) -> str:
    """A Lark string literal of `s` (JSON escapes, non-ASCII kept)."""
    return json.dumps(s, ensure_ascii=False)


_TRUE, _FALSE = lark_string('true">'), lark_string('false">')  # the rest of a parameter tag: raw text, or JSON


def answer_grammar(
    g: Markup,
    tools: Sequence[ToolSpec],
    choice: str | None,
    parallel: bool,
    answer_schema: Mapping[str, Any] | None,
) -> str | None:
    """The answer's Lark grammar, or None when nothing constrains it (tools called freely and
    none strict, no response format). `choice`: "auto", "required", or a function's name;
    `answer_schema`: the response format's JSON schema (None: free text)."""
    forced = choice not in (None, "auto")
    if not forced and not any(t.strict for t in tools):
        return None
    allowed = [t for t in tools if choice in (None, "auto", "required") or t.name == choice]
    if forced and not allowed:
        raise GrammarError(f"tool_choice names {choice!r}, which is not one of the tools")
    rules = [
        "%llguidance {}",
        f"block: {lark_string(chr(10))} {'invoke+' if parallel else 'invoke'} {lark_string(g.block_end)}",
        f"invoke: {' | '.join(f'invoke_{i}' for i in range(len(allowed)))}",
        f"raw[lazy]: /(?s:.*)/ {lark_string(g.param_close)}",
        'ANY_KEY: /[^"\\n]+/',
    ]
    for i, t in enumerate(allowed):
        rules += _invoke(g, i, t)
    if not all(t.strict for t in allowed):
        rules.append(any_param(g))
    opening = lark_string(g.block_start)
    if answer_schema is not None:
        rules.append(f"answer: %json {json.dumps({**answer_schema, 'x-guidance': JSON_STYLE})}")
    else:
        escaped = _regex_literal(g.block_start)
        rules.append(f"answer: FREE\nFREE: /(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/")
        rules.append(f"head[lazy]: /(?s:.*)/ {opening}")
    if forced:
        start = f"start: {opening} block"
    elif answer_schema is not None:
        start = f"start: answer | {opening} block"
    else:
        start = "start: answer | head block"
    return "\n".join([start, *rules])


def _invoke(g: Markup, i: int, t: ToolSpec) -> list[str]:
    """The invoke rule of tool `i` and its parameters' rules."""
    if '"' in t.name or "\n" in t.name or not t.name:
        raise GrammarError(f"tools: the name {t.name!r} cannot be written in a call (no quotes or line breaks)")
    head = lark_string(f'{g.invoke_head}{t.name}">\n')
    close = lark_string(f"{g.invoke_close}\n")
    if not t.strict:
        return [f"invoke_{i}: {head} any_param* {close}"]
    body, rules = [], []
    for j, (key, schema, required) in enumerate(_strict_params(g, t)):
        rule = f"p_{i}_{j}"
        body.append(rule if required else f"{rule}?")
        tag = lark_string(f'{g.param_head}{key}" string="')
        rules.append(f"{rule}: {tag} ({_value(g, schema)}) {lark_string(chr(10))}")
    # no parameters: an empty line, as the official encoder writes it
    return [f"invoke_{i}: {head} {' '.join(body) or lark_string(chr(10))} {close}", *rules]


def any_param(g: Markup) -> str:
    """A parameter of a non-strict tool: any name, raw text or any JSON value."""
    tag, mid = lark_string(g.param_head), lark_string('" string="')
    json_any = json.dumps({"x-guidance": JSON_STYLE})
    raw, as_json = lark_string('true">'), lark_string('false">')
    close, nl = lark_string(g.param_close), lark_string("\n")
    return f"any_param: {tag} ANY_KEY {mid} ({raw} raw | {as_json} %json {json_any} {close}) {nl}"


def _value(g: Markup, schema: Mapping[str, Any]) -> str:
    """The alternatives after `string="` for one parameter: raw text where the schema allows
    any string (or is a string enum), JSON checked against the schema always. A string enum's
    members are written as their JSON text, a member holding the parameter's closing tag with
    `<` as `\\u003c` (raw text has no escape, so that member is JSON only): what `parse_block`
    reads back is the member itself."""
    close = lark_string(g.param_close)
    values = _string_members(schema)
    if values is not None:
        as_json = " | ".join(lark_string(_json_text(v, g.param_close)) for v in values)
        raws = [v for v in values if g.param_close not in v]
        choices = f"{_TRUE} ({' | '.join(lark_string(v) for v in raws)}) {close} | " if raws else ""
        return f"{choices}{_FALSE} ({as_json}) {close}"
    as_json = f"{_FALSE} %json {json.dumps({**schema, 'x-guidance': JSON_STYLE})} {close}"
    if schema.get("type") != "string":
        return as_json
    rest = set(schema) - _ANNOTATIONS - {"$defs", "definitions"}
    if not rest:
        return f"{_TRUE} raw | {as_json}"
    return as_json


def _string_members(schema: Mapping[str, Any]) -> list[str] | None:
    """The members of a string enum (or a string const) with nothing else to check, else None."""
    rest = set(schema) - _ANNOTATIONS - {"$defs", "definitions"}
    values = [schema["const"]] if rest == {"const"} else schema.get("enum") if rest == {"enum"} else None
    if not values or not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        return None
    return values


def _json_text(value: str, close: str) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text.replace("<", "\\u003c") if close in value else text


def _markup_in_values(node: Any, close: str, top: bool = True) -> str | None:
    """A string inside an `enum` or `const` of `node` (a normalized schema) that holds `close`,
    except the members of a top-level string enum (written escaped): None if there is none."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key in ("enum", "const"):
                if top and _string_members(node) is not None:
                    continue
                for s in _strings(value):
                    if close in s:
                        return s
            else:
                found = _markup_in_values(value, close, False)
                if found is not None:
                    return found
    elif isinstance(node, list):
        for v in node:
            found = _markup_in_values(v, close, False)
            if found is not None:
                return found
    return None


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _strict_params(g: Markup, t: ToolSpec) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema with every `$ref` target it needs, required) per declared property, in order."""
    where = f"tools: {t.name}: parameters"
    p = t.parameters
    if p is None:
        return []
    if not isinstance(p, Mapping) or p.get("type", "object") != "object":
        raise GrammarError(f"{where}: a strict tool's parameters must be a JSON schema of type object")
    extra = sorted(set(p) - _OBJECT_KEYS - subset.ANNOTATIONS)
    if extra:
        raise GrammarError(f"{where}: {extra[0]!r} at the top level cannot be enforced on a call's named"
                           " parameters; drop it or make the tool non-strict")  # fmt: skip
    props = p.get("properties") or {}
    required = p.get("required") or []
    if not isinstance(props, Mapping) or not isinstance(required, list):
        raise GrammarError(f"{where}: properties must be an object and required a list")
    missing = [r for r in required if r not in props]
    if missing:
        raise GrammarError(f"{where}: required names {missing[0]!r}, which is not a property")
    for key in props:
        if not isinstance(key, str) or '"' in key or "\n" in key or not key:
            raise GrammarError(f"{where}: the property name {key!r} cannot be written in a call")
    # the whole object at once: a `$ref` may point anywhere in it (`#/properties/a`, `#/$defs/x`)
    norm = subset.normalize({k: v for k, v in p.items() if k != "strict"}, where)
    defs = {"$defs": norm["$defs"]} if "$defs" in norm else {}
    out = []
    for key, schema in (norm.get("properties") or {}).items():
        if not isinstance(schema, Mapping):
            raise GrammarError(f"{where}.properties.{key}: a strict tool's parameter needs an object schema")
        schema = {**schema, **defs}
        bad = _markup_in_values(schema, g.param_close)
        if bad is not None:
            raise GrammarError(f"{where}.properties.{key}: the value {bad[:60]!r} holds the call markup"
                               f" {g.param_close!r}, which a nested value cannot escape; move it to a top-level"
                               " string enum or drop it")  # fmt: skip
        out.append((key, schema, key in required))
    return out


def _regex_literal(s: str) -> str:
    """`s` as a literal inside a Lark /regex/ (Rust regex syntax, `/` delimited)."""
    out = []
    for ch in s:
        if ch == "\n":
            out.append("\\n")
        elif ch in "\\.+*?()|[]{}^$#&-~/":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def request_shape(grammars: Grammars, req: ChatRequest, body: Mapping[str, Any], tools_on: bool,
                  markup: Markup | dsml.Grammar = V4) -> Shape | None:  # fmt: skip
    """What a chat request's answer must follow: the tool grammar when tools constrain it (a
    forcing `tool_choice`, or a strict tool), else its response_format (None: nothing)."""
    schema = answer_schema(body.get("response_format"))
    if isinstance(markup, dsml.Grammar):
        markup = Markup.of(markup)
    if tools_on and req.tools:
        specs = [
            ToolSpec(t.function.name, raw["function"].get("parameters"), bool(t.function.strict))
            for t, raw in zip(req.tools, body["tools"], strict=True)
        ]
        choice = (
            req.tool_choice
            if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.function.name
        )
        lark = answer_grammar(markup, specs, choice, req.parallel_tool_calls is not False, schema)
        if lark is not None:
            closers = (markup.param_close, markup.invoke_close + "\n", markup.block_end)
            phrases = tuple(tuple(grammars.tok.encode(c)) for c in closers)
            free_first = choice in (None, "auto") and schema is None
            opening = tuple(grammars.tok.encode(markup.block_start)) if free_first else ()
            return Shape(grammars.compile_lark(lark, "tools"), phrases, opening)
    return grammars.compile(body.get("response_format"))
