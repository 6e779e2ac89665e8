"""Token ids of a request: chat messages in the official V4 format, or a raw completion.

Owns: OpenAI chat JSON -> `chat.Message`s (through `chat.from_openai`), where the tool
schemas go (appended to the first system message, as the official encoder does with a
system message that carries `tools`; one with empty text is added when there is none),
thinking on or off, the reasoning-effort preamble, the sampling parameters, and the
`max_tokens` left within `--ctx`. Raw completions are BOS + text, as `dsv4 run --prompt`.

Thinking: DeepSeek's `thinking: {"type": "enabled"}` turns it on; without `thinking`, a
`reasoning_effort` other than "none" turns it on too; the default is off. The effort is
the checkpoint's chat format's own (`chat.EFFORT_PREFIXES`: 0731 low/high/max, the
preview high/max); "minimal" and "medium", and levels the format lacks, give its default,
"xhigh" its "max". With tools declared the official encoder keeps every turn's reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import UsageError
from ..text import chat
from ..text.chat import Message
from ..text.dsml import with_tools
from ..text.sampler import SamplingParams
from ..text.tokenizer import Tokenizer
from .schemas import ChatRequest, CompletionRequest, Sampling

# OpenAI's effort levels the V4 chat formats do not name: the format's default, or its top
_EFFORT_ALIASES = {"minimal": None, "medium": None, "xhigh": "max"}
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default, and DeepSeek's recommendation for V4 chat


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    thinking: bool  # the prompt opened <think>: the reply starts with reasoning
    tools: bool  # tool schemas were declared: parse DSML blocks into tool calls
    stops: tuple[str, ...]


def chat_prompt(tok: Tokenizer, req: ChatRequest, body: Mapping[str, Any], encoder: str = chat.LATEST) -> Prompt:
    """`body` is the request's JSON that `req` was validated from: messages and tool schemas
    are read from it as sent (the model reads the schemas' JSON text, keys in their order).
    `encoder`: the checkpoint's chat-format release (`chat.encoder_for`), for the effort."""
    thinking = _thinking(req)
    messages = chat.from_openai(body["messages"])
    tools_on = bool(req.tools) and req.tool_choice != "none"
    head = messages[0] if messages[0].role == "system" else None
    if tools_on:
        functions = [t["function"] for t in body["tools"]]
        head = replace(head or Message("system"), content=with_tools(head.content if head else "", functions))
    if head is not None:
        messages = [head, *(messages[1:] if messages[0].role == "system" else messages)]
    effort = _effort(req.reasoning_effort, encoder) if thinking else None
    text = chat.render(messages, "think" if thinking else "chat", drop_thinking=not tools_on, effort=effort,
                       encoder=encoder)  # fmt: skip
    return Prompt(tok.encode(text), thinking, tools_on, _stops(req.stop))


def completion_prompt(tok: Tokenizer, req: CompletionRequest) -> Prompt:
    if isinstance(req.prompt, str):
        if not req.prompt:
            raise UsageError("prompt is empty")
        ids = [tok.special.bos, *tok.encode(req.prompt)]
    else:
        bad = [i for i in req.prompt if not 0 <= i < tok.n_tokens]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary 0..{tok.n_tokens - 1}")
        ids = list(req.prompt)
    return Prompt(ids, False, False, _stops(req.stop))


def sampling(req: Sampling) -> SamplingParams:
    t = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    seed = req.seed if req.seed is not None and req.seed >= 0 else int(np.random.SeedSequence().entropy % 2**63)
    return SamplingParams(t, req.top_k or 0, 1.0 if req.top_p is None else req.top_p, req.min_p or 0.0, seed)


def max_new_tokens(requested: int | None, n_prompt: int, ctx: int) -> int:
    """What is asked for, or what is left, within --ctx; a prompt that fills it is refused."""
    room = ctx - n_prompt
    if room < 1:
        raise ContextError(
            f"the prompt is {n_prompt} tokens and the server's --ctx is {ctx}; shorten the conversation"
            " or restart the server with a larger --ctx"
        )
    return room if requested is None else min(requested, room)


class ContextError(UsageError):
    """The prompt does not fit in --ctx."""


def _thinking(req: ChatRequest) -> bool:
    if req.thinking is not None:
        return req.thinking.type == "enabled"
    return req.reasoning_effort is not None and req.reasoning_effort != "none"


def _effort(asked: str | None, encoder: str) -> str | None:
    """The chat format's own effort name for an OpenAI `reasoning_effort` (None: its default)."""
    if asked is None or asked == "none":
        return None
    if asked in chat.EFFORT_PREFIXES[encoder]:
        return asked
    alias = _EFFORT_ALIASES.get(asked)
    return alias if alias in chat.EFFORT_PREFIXES[encoder] else None


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
