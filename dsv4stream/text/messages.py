"""Conversations as data: the messages both chat renderers read, and a rendered prompt's pieces.

Owns: `Message` and `ToolCall`, `from_openai` (OpenAI chat JSON -> messages, keeping what the
official encoders read: content parts, tool-call arguments as sent, tool schemas and the
response format on system messages), and `Pieces`, the renderer's output: text marked as the
renderer's own (template text and control tokens) or as content (anything a message carries:
text, reasoning, tool names, arguments and results, tool schemas). `Tokenizer.encode_prompt`
turns pieces into ids so that content can never become a control token.
Not here: the layout of either release (`chat_v4.py`, `chat_v41.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError


@dataclass(frozen=True)
class ImagePart:
    """An image in a user message (V4.1): rendered as the image placeholder, a control token
    that only a structured part (never typed text) can produce. `data` is the file's bytes."""

    name: str
    data: bytes = field(repr=False)


Content = str | tuple[str | ImagePart, ...]  # a tuple: the parts of list content (text, V4.1 images)


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made. `arguments` as the client sent it: OpenAI's JSON object
    text, or an already-parsed JSON value (each release's encoder treats the two its own way)."""

    name: str
    arguments: Any = "{}"
    id: str = ""


@dataclass(frozen=True)
class Message:
    role: str
    content: Content = ""
    reasoning: str = ""  # assistant: text between <think> and </think>
    tool_calls: tuple[ToolCall, ...] = ()  # assistant
    tool_call_id: str = ""  # tool: which call this result answers (orders results)
    unfinished: bool = False  # assistant: still being generated, so no EOS yet
    # system (and V4's developer): OpenAI tool definitions ({"type": "function", "function":
    # {...}}), rendered as the tools prompt; their presence keeps every turn's reasoning.
    tools: tuple[Mapping[str, Any], ...] = ()
    response_format: Any = None  # system: a schema the reply must follow, appended as JSON


def one_turn(user: Content, system: str | None = None) -> list[Message]:
    msgs = [Message("system", system)] if system is not None else []
    return msgs + [Message("user", user)]


def joined(content: Content) -> str:
    """The text of content: parts joined by a blank line, as the official encoders join them.
    Image parts have no text: only a V4.1 user message renders them (`chat_v41`)."""
    if isinstance(content, str):
        return content
    if any(isinstance(p, ImagePart) for p in content):
        raise UsageError("an image can only be part of a user message, and only with a DeepSeek-V4.1 checkpoint")
    return "\n\n".join(content)  # type: ignore[arg-type]


def text_of(content: Content) -> str:
    """The text parts of content joined (image parts left out)."""
    return content if isinstance(content, str) else "\n\n".join(p for p in content if isinstance(p, str))


def images_of(messages: Sequence[Message]) -> list[ImagePart]:
    """The image parts of `messages`, in the order their placeholders are rendered."""
    return [p for m in messages if not isinstance(m.content, str) for p in m.content if isinstance(p, ImagePart)]


def with_images(text: str, images: Sequence[ImagePart]) -> Content:
    """A user message's content: the images, then the text (as `dsv4 run --image`)."""
    return (*images, text) if images else text


class Pieces:
    """A prompt being rendered: `ctl` appends the renderer's own text, `txt` message content."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bool]] = []  # (text, is_content)

    def ctl(self, text: str) -> None:
        if text:
            self.items.append((text, False))

    def txt(self, text: str) -> None:
        if text:
            self.items.append((text, True))

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.items)

    def after(self, offset: int) -> list[tuple[str, bool]] | None:
        """The pieces after the first `offset` characters, or None when `offset` falls inside
        a piece (the text there may not start a token)."""
        at = 0
        for k, (text, _) in enumerate(self.items):
            if at == offset:
                return self.items[k:]
            at += len(text)
        return [] if at == offset else None


def from_openai(
    messages: Sequence[Mapping[str, Any]], image: Callable[[Mapping[str, Any], str], ImagePart] | None = None
) -> list[Message]:
    """Messages from OpenAI chat JSON (`reasoning_content`, `tool_calls`, `tool_call_id`).

    Content may be text or a list of text parts; other parts (audio) are refused, and so are
    image parts unless `image` is given: it turns an `image_url` part (and the part's field
    name, `messages.I.content.J`) into an `ImagePart`. Null content is refused where the
    official encoders cannot render it (user and tool messages).
    Tool definitions are not messages: callers put them on a system message (`tools`).
    """
    out = []
    for i, m in enumerate(messages):
        role = m.get("role", "")
        content = m.get("content")
        if content is None and role in ("user", "tool"):
            raise UsageError(f"message {i}: a {role} message needs content (text), not null")
        calls = tuple(
            ToolCall(name=c["function"]["name"], arguments=c["function"].get("arguments", "{}"), id=c.get("id") or "")
            for c in m.get("tool_calls") or ()
        )
        out.append(
            Message(
                role=role,
                content=_content(content, i, image),
                reasoning=m.get("reasoning_content") or "",
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id") or "",
            )
        )
    return out


def _content(content: Any, index: int, image=None) -> Content:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts: list[str | ImagePart] = []
        for j, part in enumerate(content):
            if image is not None and isinstance(part, Mapping) and part.get("type") == "image_url":
                texts.append(image(part, f"messages.{index}.content.{j}"))
                continue
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise UsageError(f"message {index}: content part of type {kind!r}; only text is supported")
            text = part.get("text")
            if text is not None and not isinstance(text, str):
                raise UsageError(f"message {index}: a text part's text must be a string")
            texts.append(text or "")
        return tuple(texts)
    raise UsageError(f"message {index}: content must be text or a list of text parts")
