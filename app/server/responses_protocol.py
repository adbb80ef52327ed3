"""Request bodies of OpenAI's Responses API (``POST /v1/responses``).

Open objects, as clients (Codex, the Agents SDK) send fields that do not apply to a local model
(``reasoning``, ``include``, ``prompt_cache_key``, ``service_tier``...): those are accepted and
ignored. Typed fields are checked; a wrong type or an impossible value is a 400. Which input
items and tools a local text model can honour is decided by the adapter (``responses.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .protocol import check_body


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Open):
    type: Literal[
        "input_text",
        "output_text",
        "refusal",
        "input_image",
        "input_file",
        "input_audio",
        "reasoning_text",
        "summary_text",
    ]
    text: str | None = None
    refusal: str | None = None


class InputItem(_Open):
    """A message (``type`` "message" or absent), a ``function_call``, a ``function_call_output``
    or another item kind; the fields that matter depend on the kind."""

    type: (
        Literal[
            "message",
            "function_call",
            "function_call_output",
            "reasoning",
            "item_reference",
            "custom_tool_call",
            "custom_tool_call_output",
            "web_search_call",
            "file_search_call",
            "computer_call",
            "computer_call_output",
            "image_generation_call",
            "code_interpreter_call",
            "local_shell_call",
            "local_shell_call_output",
            "mcp_call",
            "mcp_list_tools",
            "mcp_approval_request",
            "mcp_approval_response",
        ]
        | None
    ) = None
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    status: str | None = None


class ToolDef(_Open):
    """A function tool (``{"type": "function", "name", "parameters", ...}``), a ``namespace`` of
    function tools (its ``tools`` an extra field) or a hosted tool; the adapter flattens namespaces
    and leaves hosted tools out (``responses_tools``)."""

    type: str
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(_Open):
    type: str
    name: str | None = None


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class ReasoningConfig(_Open):
    effort: Annotated[str, Field(max_length=32)] | None = None  # as the chat endpoint's reasoning_effort
    summary: str | None = None  # accepted; the reasoning comes whole, not summarised


class ResponsesRequest(_Open):
    model: Annotated[str, Field(min_length=1)]
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # extensions, as on the chat endpoint
    ignore_eos: bool | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # an extension, as on the chat endpoint
    metadata: dict[str, str] | None = None
    background: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_body(cls, data: Any) -> Any:
        return check_body(data)
