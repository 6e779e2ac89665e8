"""Conversations rendered exactly as DeepSeek's official V4 encoder (`encoding_dsv4.py`) does.

Owns: the layout rules of the V4 releases' encoder (the May preview and V4-Flash-0731 differ
only in their reasoning-effort prefixes), for the roles system, user, assistant, tool,
developer and latest_reminder, as `Pieces` (the encoder's own text vs message content).
Not here: the shared message types (`messages.py`), the turns both releases write alike
(`turns.py`), tokenization (`Tokenizer.encode_prompt`), the internal "task" tokens (not
supported).

Layout (modes "chat" and "think"; the official names are "chat" and "thinking"):
  BOS, [in think mode, the reasoning-effort prefix], then each message with no separator:
  system            its text [+ "\\n\\n" + tools prompt] [+ "\\n\\n" + response format]
  user              <｜User｜> + text blocks joined by "\\n\\n"; a tool result is the block
                    <tool_result>TEXT</tool_result>; consecutive user/tool messages merge
                    into one user turn
  developer         <｜User｜> + text [+ tools, response format] (dropped before the last user
                    turn when thinking)
  latest_reminder   <｜latest_reminder｜> + text
  assistant         [reasoning + </think>] + content + [DSML tool calls] + EOS
  After a user/developer turn that is last, or that an assistant/latest_reminder follows:
  <｜Assistant｜> then <think> (think mode, at or after the last user turn) or </think>.
  In think mode the reasoning of assistant turns before the last user turn is dropped,
  unless a message declares tools (then every turn keeps its reasoning).

Reasoning effort (`EFFORT_PREFIXES`) differs by release of the encoder: the May preview's
takes "high" (default, no prefix) or "max" (the "Absolute maximum" prefix); DeepSeek-V4-Flash
-0731's takes "low" (default, no prefix), "high" (the preview's maximum prefix) or "max" (a new
"Beyond maximum" prefix). Either way the prefix goes before the first message, in think mode
only; chat mode ignores the effort, as the official encoders do.

Tool-call arguments: JSON object text gives one parameter per key; text that is not JSON, or a
value that is not text, becomes one parameter named "arguments" (as the encoder's `json.loads`
fallback does); JSON text that is not an object is refused (the encoder fails on it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..errors import UsageError
from . import dsml
from .messages import Message, Pieces, ToolCall, joined
from .turns import Tools, Turn, declarations, render_turn, sort_tool_results
from .vocab import ASSISTANT, BOS, THINK, THINK_END, USER

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


def effort_prefix(effort: str | None, encoder: str) -> str:
    """Text put before the first message in think mode; UsageError for an effort the release lacks."""
    table = EFFORT_PREFIXES[encoder]
    effort = effort or next(iter(table))
    if effort not in table:
        raise UsageError(f"reasoning effort {effort!r} is not one of {', '.join(table)} (the {encoder} chat format)")
    return table[effort]


def render(
    messages: Sequence[Message],
    mode: str = "chat",
    drop_thinking: bool = True,
    effort: str | None = None,
    encoder: str = "0731",
) -> Pieces:
    """Prompt pieces for `messages`; ends with the generation prefix when the last turn is a user's.

    `drop_thinking=False` keeps every turn's reasoning (also implied by tools declared on any
    message, as in the official encoder). `effort`: the reasoning effort of `encoder`'s
    release (None: its default), prefixed in think mode only.
    """
    if mode not in MODES:
        raise UsageError(f"chat mode {mode!r} is not one of {', '.join(MODES)}")
    prefix = effort_prefix(effort, encoder)
    think = mode == "think"
    drop_thinking = drop_thinking and not any(m.tools for m in messages)
    turns = sort_tool_results(_merge_tool_results(messages))
    if think and drop_thinking:
        turns = _drop_old_reasoning(turns)
    last_user = _last_user_index(turns)
    out = Pieces()
    out.ctl(BOS)
    if think and turns:
        out.ctl(prefix)
    for i, turn in enumerate(turns):
        _render_turn(out, turn, think and (not drop_thinking or i > last_user))
        nxt = turns[i + 1].msg.role if i + 1 < len(turns) else None
        if turn.msg.role in ("user", "developer") and nxt in (None, "assistant", "latest_reminder"):
            opens_think = think and (not drop_thinking or i >= last_user)
            out.ctl(ASSISTANT + (THINK if opens_think else THINK_END))
    return out


def _merge_tool_results(messages: Sequence[Message]) -> list[Turn]:
    turns: list[Turn] = []
    for m in messages:
        if m.role not in ROLES:
            raise UsageError(f"message role {m.role!r} is not one of {', '.join(ROLES)}")
        if m.role in ("user", "tool"):
            block = (m.role == "tool", joined(m.content), m.tool_call_id)
            if turns and turns[-1].msg.role == "user":
                turns[-1].blocks.append(block)
            else:
                turns.append(Turn(Message("user"), [block]))
        else:
            turns.append(Turn(m))
    return turns


def _drop_old_reasoning(turns: list[Turn]) -> list[Turn]:
    last_user = _last_user_index(turns)
    kept = []
    for i, t in enumerate(turns):
        if i >= last_user or t.msg.role in ("user", "system", "latest_reminder"):
            kept.append(t)
        elif t.msg.role == "assistant":
            kept.append(Turn(replace(t.msg, reasoning="")))
        # a developer turn before the last user turn is dropped whole
    return kept


def _last_user_index(turns: list[Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.msg.role in ("user", "developer")), default=-1)


def _render_turn(out: Pieces, turn: Turn, with_reasoning: bool) -> None:
    m = turn.msg
    if m.role != "developer":
        render_turn(out, turn, with_reasoning, _TOOLS)
        return
    if not joined(m.content):
        raise UsageError("a developer message needs content")
    out.ctl(USER)
    out.txt(joined(m.content))
    declarations(out, m, _TOOLS)


def _function(tool: Any) -> Any:
    try:
        return tool["function"]
    except (KeyError, TypeError):
        raise UsageError(f"a tool definition needs a 'function' object, got {str(tool)[:60]!r}") from None


def _params(call: ToolCall) -> list[tuple[str, str, bool]]:
    # Strings go in raw (string="true"); anything else as JSON (`dsml.param_text`).
    try:
        args = json.loads(call.arguments)
    except (TypeError, ValueError, RecursionError):  # the encoder catches every exception here
        args = {"arguments": call.arguments}
    if not isinstance(args, dict):
        raise UsageError(f"tool call {call.name!r}: arguments must be a JSON object, got {call.arguments!r}")
    return [(str(k), *dsml.param_text(v, dsml.V4)) for k, v in args.items()]


_TOOLS = Tools(dsml.V4, _function, str, _params)  # names as sent
