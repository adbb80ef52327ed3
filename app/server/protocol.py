"""Request bodies of the OpenAI API, as Pydantic models (they also make the OpenAPI schema).

Every field of OpenAI's current chat-completions and completions request schemas is declared
here with its type, so what official clients and frameworks send is accepted: the fields that
apply are honoured, the others (``IGNORED``: billing, caching, moderation, audio, web search...)
are type-checked and then ignored, logged at debug level. A wrong type or an impossible value is
a 400. An unknown top-level field is a 400 too, as at OpenAI (a typo such as ``max_token`` would
otherwise pass silently); nested objects (messages, tools, content parts, options) tolerate extra
keys because clients round-trip whole response objects into them.

Strict types: a string where OpenAI wants a number is a 400, as it is there. Range checks mirror
OpenAI's documented limits; deeper checks (prompt length, token ids) need the model and happen
when a request is built. Strings must be valid Unicode: a lone UTF-16 surrogate (``"\\ud800"``,
which JSON allows) is a 400 naming the field, and so is nesting deeper than ``MAX_DEPTH``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

Temperature = Annotated[float, Field(ge=0, le=2)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
MAX_N = 16
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


MAX_DEPTH = 100  # JSON nesting: deeper bodies would exhaust the recursion of what parses them later


def _body_problem(value: Any) -> tuple[str, str] | None:
    """(error kind, where as a param path) for the first string holding a lone surrogate or the
    first container nested deeper than MAX_DEPTH; None when the body has neither."""
    stack = [(value, "", 0)]
    while stack:
        v, at, depth = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return "invalid_unicode", at
            continue
        if isinstance(v, dict | list) and depth > MAX_DEPTH:
            return "too_deep", at
        if isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return "invalid_unicode", at
                stack.append((x, f"{at}.{k}" if at else str(k), depth + 1))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v))
    return None


def check_body(data: Any) -> Any:
    """A request body's ``mode="before"`` check (every endpoint's): no lone surrogates, no
    nesting deeper than MAX_DEPTH; a PydanticCustomError naming the field otherwise."""
    problem = _body_problem(data)
    if problem is None:
        return data
    kind, where = problem
    where = where if len(where) <= 80 else where[:80] + "..."
    message = {
        "invalid_unicode": "{param}: the text contains a lone UTF-16 surrogate (such as \\ud800), which "
        "is not valid Unicode; send the text as UTF-8 or escape whole surrogate pairs",
        "too_deep": f"{{param}}: nested more than {MAX_DEPTH} levels deep",
    }[kind]
    raise PydanticCustomError(kind, message, {"param": where or "body"})


class StreamOptions(_Open):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no obfuscation field is sent: ignored


class _Sampling(_Strict):
    """A request body: fields shared by chat and completions, including the extensions."""

    # fields of OpenAI's schema that are accepted and ignored (they do not change the output here)
    IGNORED: ClassVar[tuple[str, ...]] = ("user",)

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
    # prefix-cache isolation (vLLM's spelling): a prompt reuses cached KV only of the same salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_body(cls, data: Any) -> Any:
        return check_body(data)

    def ignored_fields(self) -> list[str]:
        """The fields this request set that the server accepts but does not act on."""
        return sorted(f for f in self.IGNORED if f in self.model_fields_set)


# --- messages --------------------------------------------------------------------------------


class ContentPart(_Open):
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    refusal: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str


class CustomCall(_Open):
    name: str
    input: str


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function", "custom"] = "function"
    function: FunctionCall | None = None
    custom: CustomCall | None = None

    @model_validator(mode="after")
    def _has_body(self) -> ToolCall:
        if self.type == "function" and self.function is None:
            raise ValueError("a tool call of type function needs a function object")
        if self.type == "custom" and self.custom is None:
            raise ValueError("a tool call of type custom needs a custom object")
        return self


class Message(_Open):
    """Any of OpenAI's message kinds; ``function`` is the legacy spelling of a tool result."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # legacy assistant call
    refusal: str | None = None  # an assistant's earlier refusal
    # an assistant's earlier thinking, as llama.cpp and vLLM return it (``reasoning`` is
    # OpenRouter's and Ollama's name): to the template, which keeps or drops it as its family does
    reasoning_content: str | None = None
    reasoning: str | None = None
    audio: dict[str, Any] | None = None  # a reference to earlier audio output: ignored


# --- tools -----------------------------------------------------------------------------------


class FunctionDef(_Open):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Open):
    type: Literal["function"]
    function: FunctionDef


class CustomToolDef(_Open):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class CustomTool(_Open):
    """Free-form (non-JSON) tools: accepted by the schema, refused with a clear message."""

    type: Literal["custom"]
    custom: CustomToolDef


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomToolChoice(_Open):
    type: Literal["custom"]
    custom: NamedFunction


class AllowedTools(_Open):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class AllowedToolsChoice(_Open):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoiceObject = Annotated[
    NamedToolChoice | NamedCustomToolChoice | AllowedToolsChoice, Field(discriminator="type")
]


# --- options ---------------------------------------------------------------------------------


class JsonSchemaSpec(_Open):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


# --- the two endpoints -----------------------------------------------------------------------


class ChatCompletionRequest(_Sampling):
    IGNORED: ClassVar[tuple[str, ...]] = (
        "audio",
        "metadata",
        "moderation",
        "prediction",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "store",
        "user",
        "verbosity",
        "web_search_options",
    )

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    # the legacy spelling of tools / tool_choice (answered in the legacy function_call shape)
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    modalities: list[str] | None = None  # only ["text"] can be honoured
    # thinking: none/minimal turn it off where the family can (Qwen3's enable_thinking), low..high
    # go to templates that read them (gpt-oss's "Reasoning: ..." line); other values (xhigh, ...)
    # are accepted and read as high
    reasoning_effort: Annotated[str, Field(max_length=32)] | None = None
    # extra variables for the chat template, as vLLM and llama.cpp take them
    chat_template_kwargs: dict[str, Any] | None = None
    # a cap on the thinking section's tokens (llama.cpp's --reasoning-budget per request)
    thinking_budget: Annotated[int, Field(ge=0)] | None = None
    # accepted and ignored (IGNORED): bookkeeping, caching and hosted-only features
    audio: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    moderation: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


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
