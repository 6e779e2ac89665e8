"""Request bodies of the endpoints, checked by pydantic in strict mode.

Owns: the fields each endpoint reads, their types and ranges (a wrong type is a 400, not a
silent conversion: "12" is not a number), and the fields accepted but ignored. Unknown
fields are ignored, as clients send many; `n` above 1 is refused (one sequence at a time).
Message lists are kept as the client's own JSON as well, so tool schemas reach the prompt
with their keys in the client's order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


Prob = Annotated[float, Field(ge=0, le=1)]


class Sampling(_Body):
    model: str | None = None
    stream: bool = False
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Prob | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1


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


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)]
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream_options: StreamOptions | None = None
    echo: Literal[False] = False
    suffix: None = None


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
