"""Request bodies of Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Open objects throughout: clients such as Claude Code send fields this server has no use for
(``cache_control`` on blocks, ``context_management``, ``metadata``, beta fields), and those are
accepted and ignored (the adapter logs them at debug level). ``system`` messages inside
``messages`` (Claude Code's ``mid-conversation-system`` beta) are accepted: where the model's chat
template can render a system turn there, it stays in place, else it joins the system prompt
(``mlx_engine/tokenization/system_turns.py``). What is typed is checked, and a wrong type is a 400
in Anthropic's shape. Which block and tool types a local text model can honour is decided by the
adapter (``anthropic.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .protocol import check_body


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Body(_Open):
    @model_validator(mode="before")
    @classmethod
    def _valid_body(cls, data: Any) -> Any:
        return check_body(data)


class ContentBlock(_Open):
    """Any content block; the fields that matter depend on ``type``."""

    # text, tool_use, tool_result, thinking are read; image, document and the server-tool
    # blocks are refused by the adapter with a message that names them
    type: Annotated[str, Field(min_length=1, max_length=64)]
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class InputMessage(_Open):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class TextBlockParam(_Open):
    type: Literal["text"]
    text: str


class Tool(_Open):
    """A client tool (``type`` absent or ``custom``); server tools have other types."""

    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Open):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    format: OutputFormat | None = None
    effort: str | None = None  # low / medium / high / max: the chat call's reasoning_effort


class ThinkingConfig(_Open):
    """``{"type": "enabled", "budget_tokens": N}``, ``{"type": "adaptive"}`` or ``{"type": "disabled"}``."""

    type: Annotated[str, Field(min_length=1, max_length=32)]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class CountTokensRequest(_Body):
    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None  # extension, as on the chat endpoint
    metadata: dict[str, Any] | None = None  # user_id: accepted and ignored
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    context_management: dict[str, Any] | None = None  # edits of a server-side context: ignored
    service_tier: str | None = None  # ignored
