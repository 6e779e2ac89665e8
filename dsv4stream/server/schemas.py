"""Request bodies of the endpoints, checked by pydantic in strict mode.

Owns: the fields each endpoint reads, their types and ranges (a wrong type is a 400, not a
silent conversion: "12" is not a number), and the rules between fields (`stream_options`
needs `stream`, `top_logprobs` needs `logprobs`). Unknown fields are ignored, as clients
send many (docs/serving.md lists what each endpoint reads).
Message lists are kept as the client's own JSON as well, so tool schemas reach the prompt
with their keys in the client's order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


Prob = Annotated[float, Field(ge=0, le=1)]
# -1 asks for a random seed (llama.cpp's clients send it); otherwise what numpy's generator takes
Seed = Annotated[int, Field(ge=-1, le=2**64 - 1)]
MAX_N = 16  # choices per request: each costs a whole generation here


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

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if getattr(self, "stream_options", None) is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class Function(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: Function


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class Thinking(_Body):
    type: Literal["enabled", "disabled"]


class StreamOptions(_Body):
    include_usage: bool = False


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
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    thinking: Thinking | None = None
    # V4.1 also takes 1-100 (checked against the checkpoint's chat format in server/prompt.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | int | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)]
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream_options: StreamOptions | None = None
    echo: Literal[False] = False
    suffix: None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # legacy: the alternatives per token


class AnthropicRequest(_Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    thinking: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CountRequest(_Body):
    """`POST /v1/messages/count_tokens`: a Messages request without max_tokens."""

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
