"""Request bodies of the endpoints, checked by pydantic in strict mode.

Owns: the fields each endpoint reads, their types and ranges (a wrong type is a 400, not a
silent conversion: "12" is not a number), and the rules between fields (`stream_options`
needs `stream`, `top_logprobs` needs `logprobs`). Nothing is silently ignored: a field no
model here declares is a 400 naming it (`REFUSED` says why for the fields the official
clients know); a field whose only meaningful values here are the defaults (`store`,
`modalities`, `service_tier`, ...) takes only those. docs/serving.md lists every field of
every endpoint, and a test checks that table against these models and the clients' own.
Message lists are kept as the client's own JSON as well, so tool schemas reach the prompt
with their keys in the client's order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from ..engine.speculate import parse_setting
from ..errors import UsageError


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# Fields the official clients send that no endpoint here serves, and why (the 400's message).
REFUSED = {
    "audio": "audio output: this model writes text",
    "functions": "the deprecated function-calling fields: use tools",
    "function_call": "the deprecated function-calling fields: use tools and tool_choice",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not a tool of this server",
    "metadata": "completions are not stored here (store), so there is nothing to tag",
    "moderation": "no moderation runs here",
    "prompt_cache_options": "the prefix cache is the server's own (--kv-cache)",
    "prompt_cache_retention": "the prefix cache is the server's own (--kv-cache)",
    "best_of": "use n",
    "conversation": "conversations are not stored here: use previous_response_id",
    "prompt": "stored prompt templates are not served",
    "context_management": "context management is not served",
    "background": "background responses are not served",
    "background_options": "background responses are not served",
    "image": "this model writes text",
    "access_programs": "not served",
    "max_tool_calls": "use parallel_tool_calls",
    "container": "no code-execution container here",
    "mcp_servers": "no MCP connector here",
    "inference_geo": "the model runs on this machine",
    "speed": "there is one speed here",
    "diagnostics": "not served",
    "user_profile_id": "not served",
    "workspace_id": "not served",
    "refusal": "assistant refusals are not part of the DeepSeek chat format",
    "name": "the DeepSeek chat format has no participant names",
    "allowed_callers": "tools are called by the client here",
    "defer_loading": "every tool is in the prompt",
    "input_examples": "the DeepSeek tool prompt has no examples",
    "eager_input_streaming": "tool input is sent whole, once the call is complete",
    "output_schema": "the DeepSeek tool prompt has no output schemas",
    "async": "tools are called by the client here",
    "include_obfuscation": "the stream is not padded",
    "display": "the reasoning is shown whole",
    "context": "the chat format decides which turns keep their reasoning",
    "mode": "one reasoning mode here",
    "generate_summary": "reasoning is given whole, not summarised",
    "summary": "reasoning is given whole, not summarised",
    "verbosity": "not a setting of this model",
    "file_id": "files are not stored here: send the image inline, a data: URI in image_url",
}


Prob = Annotated[float, Field(ge=0, le=1)]
# -1 asks for a random seed (llama.cpp's clients send it); otherwise what numpy's generator takes
Seed = Annotated[int, Field(ge=-1, le=2**64 - 1)]
MAX_N = 16  # choices per request: each costs a whole generation here


def _speculate(value: Any) -> Any:
    """`speculate`: "auto", "off" or a draft length (0 = off); checked against the checkpoint's
    drafter when the job is made (`toolkit.make_job`)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError('give "auto", "off" or a draft length like 3')  # noqa: TRY004 (pydantic reports ValueError)
    try:
        return parse_setting(value, where="speculate")
    except UsageError as e:
        raise ValueError(str(e).removeprefix("speculate ")) from None


# a request's speculative decoding (docs/serving.md): None = the server's --speculate
Speculate = Annotated[Any, AfterValidator(_speculate)]


def only(value: bool | int) -> Any:
    """A field whose one meaningful value here is `value`, of `value`'s JSON type (a Literal
    would take 0 for false and true for 1: Python's equality)."""

    def check(given: Any) -> Any:
        if given != value:
            raise ValueError(f"only {str(value).lower()} is served here")
        return given

    return Annotated[type(value), AfterValidator(check)]


# the answer to an audio or file part, or an image where no image goes (a tool result, say)
TEXT_ONLY = "this model reads text only here (a V4.1 image goes in an image part of a user message)"


def _kind(value: Any, known: tuple[str, ...], default: str | None = None) -> str:
    """A content part's or block's `type` when this server reads that type, else "other"."""
    kind = value.get("type", default) if isinstance(value, dict) else None
    return kind if kind in known else "other"


def _unsupported(what: str, reads: str):
    """The schema of a part or block whose type is not read here: a 400 saying which types are."""

    def refuse(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"{what} {kind!r} is not supported: {reads}")

    return Annotated[Any, AfterValidator(refuse)]


def union_of(known: dict[str, Any], other: Any, default: str | None = None) -> Any:
    """The models of `known` types told apart by their `type` (`default` when it is missing);
    any other type validated as `other`."""
    names = tuple(known)
    # the tags show in an error's location; `toolkit.validate` drops them, as they are no JSON keys
    tagged = [Annotated[model, Tag(f"type={name}")] for name, model in known.items()]
    choice = Union[(*tagged, Annotated[other, Tag("type=other")])]  # a union built at run time
    return Annotated[choice, Discriminator(lambda v: f"type={_kind(v, names, default)}")]


class Sampling(_Body):
    model: str | None = None
    stream: bool = False
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Prob | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None  # an end-user id for the provider's records: a local server keeps none
    safety_identifier: str | None = None  # the same
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    prompt_cache_key: str | None = None  # the prefix cache matches the tokens themselves
    speculate: Speculate | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if getattr(self, "stream_options", None) is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self


class Function(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: Function


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str  # a data: URI (base64), or an http(s) URL with `dsv4 serve --allow-image-urls`
    detail: Literal["auto", "low", "high"] | None = None  # one size plan here: the checkpoint's


class ImageUrlPart(_Body):
    """An image (V4.1 checkpoints with a vision tower; `server.images` decodes it)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ChatPart = union_of({"text": TextPart, "image_url": ImageUrlPart}, _unsupported("content part", TEXT_ONLY))


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None  # a tool result's function name (its call id already says which); 400 on other roles

    @model_validator(mode="after")
    def _name_only_on_tool_results(self):
        if self.name is not None and self.role != "tool":
            raise ValueError(f"name: {REFUSED['name']} (a {self.role} message cannot carry one)")
        if self.content is None and self.role in ("user", "tool"):  # the chat format has no empty turn of theirs
            raise ValueError(f"content: a {self.role} message needs content (text), not null")
        return self


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: the call's arguments are grammar-constrained to `parameters`


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    function: NamedFunction


class Thinking(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # the reasoning is ended (</think>) at this many tokens


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: only(False) = False


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    thinking: Thinking | None = None
    # V4.1 also takes 1-100 (checked against the checkpoint's chat format in server/prompt.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | int | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None
    store: only(False) | None = None  # nothing is stored here
    modalities: list[Literal["text"]] | None = None
    verbosity: Literal["medium"] | None = None  # the default, the only one

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)]
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream_options: StreamOptions | None = None
    echo: only(False) = False
    suffix: None = None
    best_of: only(1) | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # legacy: the alternatives per token


class CacheControl(_Body):
    """Anthropic's cache breakpoint: the prefix cache here keeps every prompt's prefix anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # the reasoning is ended (</think>) at this many tokens

    @model_validator(mode="after")
    def _budget_with_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type enabled needs budget_tokens")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"budget_tokens: goes with thinking of type enabled, not {self.type}")
        return self


class AnthropicTool(_Body):
    # the names the chat format's tools take (FunctionDef's)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None  # true: the call's input is grammar-constrained to input_schema
    cache_control: CacheControl | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type tool needs a name, and only it takes one")
        return self


class AnthropicMetadata(_Body):
    user_id: str | None = None  # an end-user id for the provider's records: a local server keeps none


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # with thinking on
    format: JsonOutputFormat | None = None


class AnthropicText(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class AnthropicThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class AnthropicImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64: checked against the image's bytes (server.images)
    data: str | None = None  # base64
    url: str | None = None  # url: fetched only with `dsv4 serve --allow-image-urls`

    @model_validator(mode="after")
    def _fields_of_the_type(self):
        need = ("media_type", "data") if self.type == "base64" else ("url",)
        other = ("url",) if self.type == "base64" else ("media_type", "data")
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: a {self.type} source needs it")
        for name in other:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not a field of a {self.type} source")
        return self


class AnthropicImage(_Body):
    type: Literal["image"]
    source: AnthropicImageSource
    cache_control: CacheControl | None = None


AnthropicTextBlocks = list[union_of({"text": AnthropicText}, _unsupported("content block", TEXT_ONLY))]


class AnthropicToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | AnthropicTextBlocks | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


AnthropicBlock = union_of(
    {"text": AnthropicText, "thinking": AnthropicThinkingBlock, "tool_use": AnthropicToolUse,
     "tool_result": AnthropicToolResult, "image": AnthropicImage},
    _unsupported("content block", TEXT_ONLY),
)  # fmt: skip


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class CountRequest(_Body):
    """`POST /v1/messages/count_tokens`: a Messages request without max_tokens."""

    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | AnthropicTextBlocks | None = None
    thinking: AnthropicThinking | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class AnthropicRequest(CountRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    speculate: Speculate | None = None
