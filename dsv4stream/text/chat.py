"""A checkpoint's chat format: one entry point over the renderer of each encoder release.

Owns: which encoder a checkpoint uses (`encoder_for`: "preview" and "0731" are V4's,
`chat_v4.py`; "v41" is V4.1's, `chat_v41.py`), reasoning-effort values as users give them
(`parse_effort`, `effort_choices`), its DSML grammar, and rendering and encoding a
conversation; each release is one entry of `FORMATS`. Encoding goes through `Tokenizer.encode_prompt`: message content (user,
system and tool text, assistant history and reasoning, tool names and arguments, tool
schemas) is tokenized as plain text, so text that spells `<｜User｜>`, `<｜end▁of▁sentence｜>`,
`<｜System｜>`, `<think>` or a DSML tag can never become a control token; only the renderer
writes those. The rendered text itself is exactly the official encoder's.
Raw text (`dsv4 run --prompt`, `dsv4 tokenize`, /v1/completions) is `Tokenizer.encode`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint.config import PREVIEW, V4, V41
from ..errors import UsageError
from . import chat_v4, chat_v41, dsml
from .chat_v4 import EFFORT_PREFIXES, effort_prefix
from .messages import Message, Pieces, ToolCall, from_openai, one_turn
from .tokenizer import Tokenizer

__all__ = [
    "EFFORT_PREFIXES",
    "ENCODERS",
    "FORMATS",
    "LATEST",
    "MODES",
    "Message",
    "ToolCall",
    "effort_choices",
    "effort_help",
    "effort_prefix",
    "encode",
    "encoder_for",
    "family_of",
    "from_openai",
    "grammar",
    "one_turn",
    "parse_effort",
    "pieces",
    "render",
]

MODES = ("chat", "think")
LATEST = "0731"  # V4's current encoder


@dataclass(frozen=True)
class Format:
    """One encoder release: its family, DSML tags, reasoning efforts and renderer."""

    family: str
    grammar: dsml.Grammar
    effort: Callable[[str | int], str | int]  # a user's effort in the release's terms, or UsageError
    effort_help: str  # the efforts it takes, in words
    choices: dict[str, Any]  # for a UI: see `effort_choices`
    render: Callable[[Sequence[Message], str, bool, str | int | None], Pieces]


def _v4(encoder: str) -> Format:
    names = list(EFFORT_PREFIXES[encoder])

    def effort(value: str | int) -> str:
        if not isinstance(value, str) or value not in names:
            raise UsageError(f"reasoning effort {value!r} is not one of {', '.join(names)} (the {encoder} chat format)")
        return value

    def render(messages: Sequence[Message], mode: str, drop_thinking: bool, effort: str | int | None) -> Pieces:
        if effort is not None and not isinstance(effort, str):
            raise UsageError(f"reasoning effort {effort!r}: the {encoder} chat format names its levels")
        return chat_v4.render(messages, mode, drop_thinking, effort, encoder)

    choices = {"names": names, "values": None, "default": names[0], "range": None}
    return Format(V4, dsml.V4, effort, ", ".join(names), choices, render)


def _v41_effort(value: str | int) -> str | int:
    """V4.1: an integer 1-100 (also as digits) or low/high/max."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    chat_v41.effort_value(value)
    return value


_V41_CHOICES = {
    "names": list(chat_v41.EFFORTS),
    "values": dict(chat_v41.EFFORTS),
    "default": chat_v41.DEFAULT_EFFORT,
    "range": list(chat_v41.EFFORT_RANGE),
}
# The one encoder switch: every question about a release is a look-up here.
FORMATS: dict[str, Format] = {
    "preview": _v4("preview"),
    "0731": _v4("0731"),
    "v41": Format(V41, dsml.V41, _v41_effort, "an integer 1-100, or low, high, max", _V41_CHOICES, chat_v41.render),
}
ENCODERS = tuple(FORMATS)


def _format(encoder: str) -> Format:
    try:
        return FORMATS[encoder]
    except KeyError:
        raise UsageError(f"chat format {encoder!r} is not one of {', '.join(ENCODERS)}") from None


def encoder_for(layout: str | None, family: str = V4) -> str:
    """The encoder release of a checkpoint: V4.1's, or V4's by its mtp.* layout (preview or 0731)."""
    if family == V41:
        return "v41"
    return "preview" if layout == PREVIEW else LATEST


def family_of(encoder: str) -> str:
    return _format(encoder).family


def grammar(encoder: str) -> dsml.Grammar:
    """The DSML tag names of the encoder's release."""
    return _format(encoder).grammar


def parse_effort(value: str | int | None, encoder: str) -> str | int | None:
    """A reasoning effort as a user gives it (CLI text, JSON value) in the encoder's own terms,
    or UsageError. V4: a name of its release; V4.1: an integer 1-100 (digits) or low/high/max."""
    return None if value is None else _format(encoder).effort(value)


def effort_help(encoder: str) -> str:
    """The efforts the encoder takes, in words."""
    return _format(encoder).effort_help


def effort_choices(encoder: str) -> dict[str, Any]:
    """What a reasoning effort may be, for a UI: named levels (in order, with the number each
    stands for on V4.1), the default, and V4.1's numeric range (None on V4)."""
    return copy.deepcopy(_format(encoder).choices)


def pieces(
    messages: Sequence[Message],
    mode: str = "chat",
    drop_thinking: bool = True,
    effort: str | int | None = None,
    encoder: str = LATEST,
) -> Pieces:
    """The prompt as the renderer's own text and message content; see `render`."""
    return _format(encoder).render(messages, mode, drop_thinking, effort)


def render(
    messages: Sequence[Message],
    mode: str = "chat",
    drop_thinking: bool = True,
    effort: str | int | None = None,
    encoder: str = LATEST,
) -> str:
    """Prompt text for `messages`, exactly as the official encoder of `encoder` writes it;
    it ends with the generation prefix when the last turn asks for an answer.

    `drop_thinking=False` keeps every turn's reasoning (the official encoders do this when
    a message declares tools). `effort`: the reasoning effort (None: the release's default),
    rendered in think mode only.
    """
    return pieces(messages, mode, drop_thinking, effort, encoder).text


def encode(
    tok: Tokenizer,
    messages: Sequence[Message],
    mode: str = "chat",
    drop_thinking: bool = True,
    effort: str | int | None = None,
    encoder: str | None = None,
) -> list[int]:
    """Token ids of the rendered conversation, content tokenized as plain text (see the module
    docstring). `encoder` defaults to the tokenizer's family (0731's encoder for V4)."""
    encoder = encoder or ("v41" if tok.family == V41 else LATEST)
    if family_of(encoder) != tok.family:
        raise UsageError(f"the {encoder} chat format needs a {family_of(encoder)} tokenizer, not {tok.family}")
    return tok.encode_prompt(pieces(messages, mode, drop_thinking, effort, encoder).items)
