"""Conversations rendered exactly as DeepSeek's official V4.1 encoder (`encoding/encoding.py`) does.

Owns: the layout rules of DeepSeek-V4.1-Flash's encoder, as `Pieces` (the encoder's own text
vs message content), for the roles system, user, assistant, tool and latest_reminder.
A sibling of `chat_v4.py`, not a variant of it: the rules differ in many small places (the
turns both write alike are in `turns.py`).
Not here: the images themselves (`engine.images` expands each placeholder to its span), the
internal "task" tokens, the shared message types (`messages.py`), tokenization.

Layout (modes "chat" and "think"; the official names are "chat" and "thinking"):
  BOS, then each message with no separator. The first message is preceded by <｜System｜> when
  it is a system message or in think mode; in think mode that is followed by the effort line
  `Reasoning Effort: N (range 1-100, the higher the value, the more thorough the reasoning)`
  and a blank line.
  system            [<｜System｜> when not the first message] + text [+ "\\n\\n" + tools prompt]
                    [+ "\\n\\n" + response format]
  user              <｜User｜> + text blocks joined by "\\n\\n"; a tool result is the block
                    <tool_result>TEXT</tool_result>; consecutive user/tool messages merge
                    into one user turn
  latest_reminder   <｜latest_reminder｜> + text
  assistant         [reasoning + </think>] + content + [DSML tool calls, V4.1 tags] + EOS
  After a user turn, or a system message that is not the first, that is last or that an
  assistant/latest_reminder follows: <｜Assistant｜> then <think> (think mode, at or after the
  last user turn) or </think>.
"Last user turn" is the last user turn holding text (a turn of tool results only does not
count) or the last system message after the first: so the reasoning of the assistant turns
of a tool-calling loop stays, while in think mode the reasoning of assistant turns before it
is dropped, unless a system message declares tools (then every turn keeps its reasoning).

The `developer` role of V4 is gone: it is refused (the official encoder raises on it).
Reasoning effort: an int 1-100, or low/high/max = 50/75/100; the default is 75 ("high").
Tool-call arguments: a JSON object (as text, even text encoding JSON text, or as a value)
gives one parameter per key; anything else one parameter named "arguments" with the text as
sent. Images: an image part of a user message (`messages.ImagePart`) is the block
`<｜deepseek_image｜>`, joined to the other parts by a blank line as the encoder flattens
content parts; the placeholder typed in text is refused, as by the official encoder (so text
can never make one), as is an image part in any other role.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import UsageError
from . import dsml
from .messages import Message, Pieces, ToolCall, images_of, joined, text_of
from .turns import Tools, Turn, render_turn, sort_tool_results
from .vocab import ASSISTANT, BOS, IMAGE, SYSTEM, THINK, THINK_END

MODES = ("chat", "think")
ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
EFFORTS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_RANGE = (1, 100)
_EFFORT_LINE = "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def effort_value(effort: str | int | None) -> int:
    """The number an effort stands for; UsageError for anything but 1-100 or low/high/max."""
    if effort is None:
        effort = DEFAULT_EFFORT
    if isinstance(effort, str) and effort in EFFORTS:
        return EFFORTS[effort]
    if type(effort) is int and EFFORT_RANGE[0] <= effort <= EFFORT_RANGE[1]:
        return effort
    raise UsageError(f"reasoning effort {effort!r} is not an integer 1-100 or one of low, high, max (V4.1)")


def render(
    messages: Sequence[Message], mode: str = "chat", drop_thinking: bool = True, effort: str | int | None = None
) -> Pieces:
    """Prompt pieces for `messages`; ends with the generation prefix when the last turn asks
    for an answer. `drop_thinking=False` keeps every turn's reasoning (implied by tools)."""
    if mode not in MODES:
        raise UsageError(f"chat mode {mode!r} is not one of {', '.join(MODES)}")
    level = effort_value(effort)
    think = mode == "think"
    for i, m in enumerate(messages):
        _check(i, m)
    drop_thinking = drop_thinking and not any(m.tools for m in messages)
    turns = sort_tool_results(_merge_tool_results(messages))
    last_user = _last_user_index(turns)
    out = Pieces()
    out.ctl(BOS)
    for i, turn in enumerate(turns):
        role = turn.msg.role
        if i == 0 and think:
            out.ctl(SYSTEM + _EFFORT_LINE.format(n=level))  # a first system message follows it directly
        elif role == "system":
            out.ctl(SYSTEM)
        render_turn(out, turn, think and (not drop_thinking or i > last_user), _TOOLS)
        nxt = turns[i + 1].msg.role if i + 1 < len(turns) else None
        asks = role == "user" or (role == "system" and i > 0)
        if asks and nxt in (None, "assistant", "latest_reminder"):
            opens_think = think and (not drop_thinking or i >= last_user)
            out.ctl(ASSISTANT + (THINK if opens_think else THINK_END))
    return out


def _check(i: int, m: Message) -> None:
    if m.role not in ROLES:
        hint = "; put its text in a system message" if m.role == "developer" else ""
        raise UsageError(f"message {i}: role {m.role!r} is not one of {', '.join(ROLES)} (V4.1 chat format){hint}")
    if m.role != "user" and images_of([m]):
        raise UsageError(f"message {i}: an image can only be part of a user message, not of a {m.role} message")
    for what, text in (("content", text_of(m.content)), ("reasoning", m.reasoning)):
        if IMAGE in text:
            raise UsageError(
                f"message {i}: its {what} holds the image placeholder {IMAGE} as text; give images as image parts"
            )


def _merge_tool_results(messages: Sequence[Message]) -> list[Turn]:
    turns: list[Turn] = []
    for m in messages:
        if m.role == "tool":
            block = [(True, joined(m.content), m.tool_call_id)]
        elif m.role == "user":
            parts = (m.content,) if isinstance(m.content, str) else m.content
            block = [(False, text, "") for text in parts]
        else:
            turns.append(Turn(m))
            continue
        if turns and turns[-1].msg.role == "user":
            turns[-1].blocks.extend(block)
        elif m.role == "tool":
            turns.append(Turn(Message("user"), block))
        else:
            turns.append(Turn(m, block))
    return turns


def _last_user_index(turns: list[Turn]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        t = turns[i]
        if t.msg.role == "system" and i > 0:
            return i
        if t.msg.role == "user" and not (t.blocks and all(is_tool for is_tool, _, _ in t.blocks)):
            return i
    return -1


def _function(tool: Any) -> dict[str, Any]:
    """The function definition the tools prompt lists: the encoder qualifies its name with a
    namespace (`ns::name`, from the tool or the function) and drops the namespace key."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise UsageError(f"a tool definition needs a 'function' object with a name, got {str(tool)[:60]!r}")
    function = dict(function)
    if tool.get("namespace") is not None:
        function["namespace"] = tool["namespace"]
    namespace = function.pop("namespace", None)
    if isinstance(namespace, Mapping) and "name" not in namespace:
        raise UsageError(f"tool {function['name']!r}: a namespace object needs a name")
    ns_name = namespace["name"] if isinstance(namespace, Mapping) else namespace
    function["name"] = qualified_name(function["name"], ns_name)
    if isinstance(namespace, Mapping) and namespace.get("description"):
        function["description"] = namespace["description"] + "\n" + (function.get("description") or "")
    return function


def qualified_name(name: str, namespace: Any = None) -> str:
    """A tool name as the encoder writes it: `ns::name`; at most one `::` (UsageError otherwise)."""
    if namespace is not None and not isinstance(namespace, str):
        raise UsageError(f"tool {name!r}: its namespace must be text, got {namespace!r}")
    prefix, sep, bare = name.partition("::")
    if sep:
        if namespace not in (None, prefix):
            raise UsageError(f"tool {name!r}: its namespace {prefix!r} differs from {namespace!r}")
        namespace, name = prefix, bare
    if "::" in name or (namespace is not None and "::" in namespace):
        raise UsageError(f"tool name {name!r}: a name or namespace may not contain '::'")
    return name if namespace is None else f"{namespace}::{name}"


def _params(call: ToolCall) -> list[tuple[str, str, bool]]:
    # Strings go in raw (string="true"); anything else as JSON (`dsml.param_text`). JSON text is decoded up to
    # twice (clients send double-encoded arguments); what is still not an object becomes one
    # "arguments" parameter holding the arguments as sent.
    args = call.arguments
    for _ in range(2):
        if not isinstance(args, str):
            break
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # the encoder catches every exception here
            break
    if not isinstance(args, dict):
        args = {"arguments": call.arguments}
    return [(str(k), *dsml.param_text(v, dsml.V41)) for k, v in args.items()]


_TOOLS = Tools(dsml.V41, _function, qualified_name, _params)
