"""Request bodies of the OpenAI API, as Pydantic models (they also make the OpenAPI schema).

Strict types: a string where OpenAI wants a number is a 400, as it is there. Unknown top-level
fields are rejected like OpenAI does; messages, tools and content parts tolerate extra keys
because clients round-trip whole response objects into them (``refusal``, ``annotations``...).
Range checks mirror OpenAI's documented limits; deeper checks (prompt length, token ids) need
the model and happen when a request is built.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Temperature = Annotated[float, Field(ge=0, le=2)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
MAX_N = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Open):
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Open):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    """Fields shared by chat and completions, including the non-OpenAI extensions."""

    model: str
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: str | None = None
    # extensions (vLLM / llama.cpp spell them the same way)
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored: bookkeeping fields that do not change the output
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class CompletionRequest(_Sampling):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None
