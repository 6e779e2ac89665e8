"""Conversations rendered to prompt text exactly as DeepSeek's official V4 encoder does.

Owns: the message types and the layout rules of `encoding/encoding_dsv4.py` (shipped in the
checkpoint), for the roles system, user, assistant, tool, developer and latest_reminder.
Not here: tokenization (`Tokenizer.encode` of the whole rendered string, as the official
code does, so special-token text inside messages becomes those tokens); tool-schema prompts
and the internal "task" tokens (callers put a rendered tool description in the system text).

Layout (modes "chat" and "think"; the official names are "chat" and "thinking"):
  BOS, [in think mode, the reasoning-effort prefix], then each message with no separator:
  system            its text as is
  user              <｜User｜> + text blocks joined by "\\n\\n"; a tool result is the block
                    <tool_result>TEXT</tool_result>; consecutive user/tool messages merge
                    into one user turn
  developer         <｜User｜> + text (dropped before the last user turn when thinking)
  latest_reminder   <｜latest_reminder｜> + text
  assistant         [reasoning + </think>] + content + [DSML tool calls] + EOS
  After a user/developer turn that is last, or that an assistant/latest_reminder follows:
  <｜Assistant｜> then <think> (think mode, at or after the last user turn) or </think>.
  In think mode the reasoning of assistant turns before the last user turn is dropped.

Reasoning effort (`EFFORT_PREFIXES`) differs by release of the encoder: the May preview's
takes "high" (default, no prefix) or "max" (the "Absolute maximum" prefix); DeepSeek-V4-Flash
-0731's takes "low" (default, no prefix), "high" (the preview's maximum prefix) or "max" (a new
"Beyond maximum" prefix). Either way the prefix goes before the first message, in think mode
only; chat mode ignores the effort, as the official encoders do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..checkpoint.config import PREVIEW
from ..errors import UsageError
from .tokenizer import ASSISTANT, BOS, DSML, EOS, LATEST_REMINDER, THINK, THINK_END, USER, Tokenizer

MODES = ("chat", "think")
ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")

_ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose"
    " the problem into its most fundamental components, trace every causal chain to its root, and resolve the"
    " underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain"
    " that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# encoder release -> effort -> prefix; the first effort listed is the default.
EFFORT_PREFIXES: dict[str, dict[str, str]] = {
    "0731": {"low": "", "high": _ABSOLUTE_MAX, "max": _BEYOND_MAX},
    "preview": {"high": "", "max": _ABSOLUTE_MAX},
}
LATEST = "0731"


def encoder_for(layout: str | None) -> str:
    """The encoder release that goes with a checkpoint's mtp.* layout (the preview's, or 0731's)."""
    return "preview" if layout == PREVIEW else LATEST


def effort_prefix(effort: str | None, encoder: str = LATEST) -> str:
    """Text put before the first message in think mode; UsageError for an effort the release lacks."""
    table = EFFORT_PREFIXES[encoder]
    effort = effort or next(iter(table))
    if effort not in table:
        raise UsageError(f"reasoning effort {effort!r} is not one of {', '.join(table)} (the {encoder} chat format)")
    return table[effort]


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made; `arguments` is a JSON object as text (OpenAI style)."""

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    reasoning: str = ""  # assistant: text between <think> and </think>
    tool_calls: tuple[ToolCall, ...] = ()  # assistant
    tool_call_id: str = ""  # tool: which call this result answers (orders results)
    unfinished: bool = False  # assistant: still being generated, so no EOS yet


@dataclass
class _Turn:
    """A message after tool results have been folded into user turns."""

    msg: Message
    # user turns only: (is_tool_result, text, tool_call_id) in arrival order
    blocks: list[tuple[bool, str, str]] = field(default_factory=list)


def one_turn(user: str, system: str | None = None) -> list[Message]:
    msgs = [Message("system", system)] if system is not None else []
    return msgs + [Message("user", user)]


def render(
    messages: Sequence[Message],
    mode: str = "chat",
    drop_thinking: bool = True,
    effort: str | None = None,
    encoder: str = LATEST,
) -> str:
    """Prompt text for `messages`; ends with the generation prefix when the last turn is a user's.

    `drop_thinking=False` keeps every turn's reasoning (the official encoder does this when
    tool schemas are declared). `effort`: the reasoning effort of `encoder`'s release (None:
    its default), prefixed in think mode only.
    """
    if mode not in MODES:
        raise UsageError(f"chat mode {mode!r} is not one of {', '.join(MODES)}")
    prefix = effort_prefix(effort, encoder)
    think = mode == "think"
    turns = _sort_tool_results(_merge_tool_results(messages))
    if think and drop_thinking:
        turns = _drop_old_reasoning(turns)
    last_user = _last_user_index(turns)
    parts = [BOS, prefix if think and turns else ""]
    for i, turn in enumerate(turns):
        parts.append(_render_turn(turn, think and (not drop_thinking or i > last_user)))
        nxt = turns[i + 1].msg.role if i + 1 < len(turns) else None
        if turn.msg.role in ("user", "developer") and nxt in (None, "assistant", "latest_reminder"):
            opens_think = think and (not drop_thinking or i >= last_user)
            parts.append(ASSISTANT + (THINK if opens_think else THINK_END))
    return "".join(parts)


def encode(
    tok: Tokenizer,
    messages: Sequence[Message],
    mode: str = "chat",
    drop_thinking: bool = True,
    effort: str | None = None,
    encoder: str = LATEST,
) -> list[int]:
    return tok.encode(render(messages, mode, drop_thinking, effort, encoder))


def from_openai(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Messages from OpenAI chat JSON (`reasoning_content`, `tool_calls`, `tool_call_id`)."""
    out = []
    for i, m in enumerate(messages):
        calls = tuple(
            ToolCall(
                name=c["function"]["name"],
                arguments=_arguments_text(c["function"].get("arguments", "{}")),
                id=c.get("id") or "",
            )
            for c in m.get("tool_calls") or ()
        )
        out.append(
            Message(
                role=m.get("role", ""),
                content=_text_of(m.get("content"), i),
                reasoning=m.get("reasoning_content") or "",
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id") or "",
            )
        )
    return out


def _merge_tool_results(messages: Sequence[Message]) -> list[_Turn]:
    turns: list[_Turn] = []
    for m in messages:
        if m.role not in ROLES:
            raise UsageError(f"message role {m.role!r} is not one of {', '.join(ROLES)}")
        if m.role in ("user", "tool"):
            block = (m.role == "tool", m.content, m.tool_call_id)
            if turns and turns[-1].msg.role == "user":
                turns[-1].blocks.append(block)
            else:
                turns.append(_Turn(Message("user"), [block]))
        else:
            turns.append(_Turn(m))
    return turns


def _sort_tool_results(turns: list[_Turn]) -> list[_Turn]:
    # Results go in the order of the calls of the latest assistant turn that made calls;
    # unknown ids rank as 0 and the sort is stable, as in the official encoder.
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


def _drop_old_reasoning(turns: list[_Turn]) -> list[_Turn]:
    last_user = _last_user_index(turns)
    kept = []
    for i, t in enumerate(turns):
        if i >= last_user or t.msg.role in ("user", "system", "latest_reminder"):
            kept.append(t)
        elif t.msg.role == "assistant":
            kept.append(_Turn(replace(t.msg, reasoning="")))
        # a developer turn before the last user turn is dropped whole
    return kept


def _last_user_index(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.msg.role in ("user", "developer")), default=-1)


def _render_turn(turn: _Turn, with_reasoning: bool) -> str:
    m = turn.msg
    if m.role == "system":
        return m.content
    if m.role == "user":
        return USER + "\n\n".join(
            f"<tool_result>{text}</tool_result>" if is_tool else text for is_tool, text, _ in turn.blocks
        )
    if m.role == "developer":
        if not m.content:
            raise UsageError("a developer message needs content")
        return USER + m.content
    if m.role == "latest_reminder":
        return LATEST_REMINDER + m.content
    reasoning = m.reasoning + THINK_END if with_reasoning else ""
    calls = _dsml_tool_calls(m.tool_calls) if m.tool_calls else ""
    return reasoning + m.content + calls + ("" if m.unfinished else EOS)


def _dsml_tool_calls(calls: tuple[ToolCall, ...]) -> str:
    """The DSML block: <｜DSML｜tool_calls> holding one <｜DSML｜invoke> per call."""
    invokes = []
    for c in calls:
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{str(is_str).lower()}">{value}</{DSML}parameter>'
            for key, value, is_str in _dsml_params(c)
        )
        invokes.append(f'<{DSML}invoke name="{c.name}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _dsml_params(call: ToolCall) -> list[tuple[str, str, bool]]:
    # Strings go in raw (string="true"); anything else as JSON. Arguments that are not
    # JSON become one string parameter named "arguments", as the official encoder does.
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        args = {"arguments": call.arguments}
    if not isinstance(args, dict):
        raise UsageError(f"tool call {call.name!r}: arguments must be a JSON object, got {call.arguments!r}")
    return [
        (k, v, True) if isinstance(v, str) else (k, json.dumps(v, ensure_ascii=False), False) for k, v in args.items()
    ]


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _text_of(content: Any, index: int) -> str:
    # OpenAI allows content as a list of parts; the official encoder joins the text parts
    # of a tool result with blank lines, and the same is done here for every role.
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise UsageError(f"message {index}: content part of type {kind!r}; only text is supported")
            texts.append(part.get("text") or "")
        return "\n\n".join(texts)
    raise UsageError(f"message {index}: content must be text or a list of text parts")
