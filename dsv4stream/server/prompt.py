"""Token ids of a request: chat messages in the checkpoint's official format, or a raw completion.

Owns: OpenAI chat JSON -> `chat.Message`s (through `chat.from_openai`), where the tool
schemas and a `json_schema` response format's schema go (on the first system message, as the
official encoders render a system message that carries `tools` and `response_format`; one
with empty text is added when there is none; the grammar that enforces the format is
`server/grammar.py`'s), thinking on or off,
the reasoning effort, the sampling parameters, and the `max_tokens` left within `--ctx`.
Chat prompts are encoded by `chat.encode`: message content is only ever text, whatever
control tokens it spells; a V4.1 image part (`image_url`, decoded by `server.images`) is the
image placeholder, joined to the parts around it by a blank line as DeepSeek's encoder joins
content blocks, and then its span, keyed by the image for the prefix cache (`Prompt.images`). Raw completions are BOS + text parsed as the tokenizer does
(control-token text becomes those tokens), as `dsv4 run --prompt`.

Thinking: DeepSeek's `thinking: {"type": "enabled"}` turns it on; without `thinking`, a
`reasoning_effort` other than "none" turns it on too; the default is off. The effort is
the checkpoint's chat format's own (`chat.parse_effort`): V4.1 takes an integer 1-100 or
low/high/max (50/75/100); V4 its release's names (0731 low/high/max, the preview
high/max). "minimal" and "medium", and names the format lacks, give its default, "xhigh"
its "max". With tools declared the official encoders keep every turn's reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import UsageError
from ..text import chat, dsml
from ..text.chat import Message
from ..text.image import ImageInput
from ..text.messages import ImagePart, images_of
from ..text.sampler import SamplingParams
from ..text.tokenizer import Tokenizer
from .images import ImagePolicy, PromptImages, keyed_prompt, load
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
    grammar: dsml.Grammar = dsml.V4  # the release's DSML tags, to read the reply's calls
    images: PromptImages | None = None  # V4.1: the images; `ids` then hold their keyed spans


def _image_reader(policy: ImagePolicy | None, inputs: dict[int, ImageInput]):
    """`chat.from_openai`'s hook: an image_url part -> an ImagePart, its decoded image kept in
    `inputs` by the part's id (a bad image: ImageError naming the part's url field)."""

    def read(part: Mapping[str, Any], where: str) -> ImagePart:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        data, inp = load(policy, url, f"{where}.image_url.url")
        p = ImagePart(where, data)
        inputs[id(p)] = inp
        return p

    return read


def chat_prompt(
    tok: Tokenizer, req: ChatRequest, body: Mapping[str, Any], encoder: str = chat.LATEST,
    images: ImagePolicy | None = None,
) -> Prompt:  # fmt: skip
    """`body` is the request's JSON that `req` was validated from: messages and tool schemas
    are read from it as sent (the model reads the schemas' JSON text, keys in their order).
    `encoder`: the checkpoint's chat-format release (`chat.encoder_for`), for the effort.
    `images`: the server's image policy (image parts are refused without one)."""
    thinking = _thinking(req)
    inputs: dict[int, ImageInput] = {}
    messages = chat.from_openai(body["messages"], _image_reader(images, inputs))
    tools_on = bool(req.tools) and req.tool_choice != "none"
    declared: dict[str, Any] = {}
    if tools_on:
        declared["tools"] = tuple(body["tools"])
    schema = _response_schema(body.get("response_format"))
    if schema is not None:
        declared["response_format"] = schema
    if declared:
        if messages[0].role == "system":
            messages[0] = replace(messages[0], **declared)
        else:
            messages.insert(0, Message("system", **declared))
    effort = _effort(req.reasoning_effort, encoder) if thinking else None
    ids = chat.encode(tok, messages, "think" if thinking else "chat", effort=effort, encoder=encoder)
    parts = images_of(messages)  # in the order the prompt holds their placeholders
    if not parts or images is None or images.image_token_id is None:
        return Prompt(ids, thinking, tools_on, _stops(req.stop), chat.grammar(encoder))
    found = tuple(inputs[id(p)] for p in parts)
    keyed = keyed_prompt(ids, found, images.image_token_id)
    return Prompt(keyed, thinking, tools_on, _stops(req.stop), chat.grammar(encoder),
                  PromptImages(found, images.image_token_id))  # fmt: skip


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


def _effort(asked: str | int | None, encoder: str) -> str | int | None:
    """The chat format's own effort for an OpenAI `reasoning_effort` (None: its default).
    A number (or digits) is V4.1's 1-100, refused on V4; a name the format lacks is aliased."""
    if asked is None or asked == "none":
        return None
    if isinstance(asked, int) or asked.strip().isdigit():
        try:
            return chat.parse_effort(asked, encoder)
        except UsageError:
            raise UsageError(
                f"reasoning_effort {asked!r}: this checkpoint's chat format ({encoder}) takes {chat.effort_help(encoder)}"
            ) from None
    if asked in chat.effort_choices(encoder)["names"]:
        return asked
    alias = _EFFORT_ALIASES.get(asked)
    return alias if alias in chat.effort_choices(encoder)["names"] else None


def _response_schema(response_format: Any) -> Any:
    """The JSON schema of a `json_schema` response format (what the encoders' "## Response
    Format" section shows the model), else None: `text` and `json_object` name no schema."""
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    return spec.get("schema") if isinstance(spec, Mapping) else None


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
