"""Request bodies of Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/embed``...) and
their translation into the chat-completions fields Duet's chat call takes (``turns.prepare``).

Field names follow Ollama's docs/api.md and the official ``ollama`` Python client's ``_types.py``.
Bodies are open objects: fields this server has no use for are accepted and ignored (logged at debug
level), as Ollama ignores them. What is translated:

- ``messages``: ``system`` / ``user`` / ``assistant`` / ``tool``; an assistant's ``thinking`` goes
  back to the template as ``reasoning_content``; its ``tool_calls`` carry ``function.arguments`` as
  an object (JSON text for the chat call); a ``tool`` message names its tool with ``tool_name``
  (matched to the earlier call of that name for templates that want a call id). ``images`` are a
  400: the served models read text only.
- ``format``: ``"json"`` is the chat's ``response_format`` json_object, a JSON schema its
  json_schema, both enforced by the grammar engine.
- ``options``: temperature, top_p, top_k, min_p, seed, num_predict (max_tokens; -1 / -2: until the
  model stops or the context is full), stop, repeat_penalty (repetition_penalty), presence_penalty,
  frequency_penalty. ``num_ctx`` is checked against the loaded model's context (``check_num_ctx``);
  the rest (num_gpu, num_thread, mirostat...) do not apply here and are ignored.
- ``think``: true / false / "low" / "medium" / "high" as the chat call's ``reasoning_effort``.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .errors import APIError, bad_request
from .protocol import check_body

log = logging.getLogger("duet.server")

# Ollama's options that map onto the chat request (Ollama's name -> the chat field)
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
    "stop": "stop",
}
_HANDLED = {*_OPTIONS, "num_predict", "num_ctx"}
_THINK_LEVELS = ("low", "medium", "high")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Body(_Open):
    @model_validator(mode="before")
    @classmethod
    def _valid_body(cls, data: Any) -> Any:
        return check_body(data)


class FunctionCall(_Open):
    name: str
    arguments: dict[str, Any] | str | None = None  # an object in Ollama; JSON text tolerated


class ToolCall(_Open):
    id: str | None = None
    function: FunctionCall


class Message(_Open):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generating(_Body):
    model: str = ""
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None
    think: bool | str | None = None


class ChatRequest(_Generating):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class EmbedRequest(_Body):
    model: str = ""
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class LegacyEmbeddingsRequest(_Body):
    model: str = ""
    prompt: str | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class ModelRequest(_Body):
    """show / pull / delete: ``model`` (older clients send ``name``)."""

    model: str | None = None
    name: str | None = None
    stream: bool = True  # pull
    insecure: bool | None = None  # pull: no registry TLS here, ignored
    verbose: bool | None = None  # show

    @property
    def target(self) -> str:
        return self.model or self.name or ""


def parse(cls: type[BaseModel], raw: bytes) -> Any:
    """The body as ``cls``; a 400 (Ollama's shape, via APIError) for bad JSON or a wrong type."""
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise bad_request(f"invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) from None


# --- chat fields ------------------------------------------------------------------------------------
def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as chat-completions messages."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of earlier calls, oldest first
    for i, m in enumerate(messages):
        if m.images:
            raise bad_request(f"messages[{i}].images: images are not supported: this model reads text only")
        if m.role not in ("system", "user", "assistant", "tool"):
            raise bad_request(
                f"messages[{i}].role: {m.role!r} is not a role (system, user, assistant or tool)"
            )
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant":
            if m.thinking:
                d["reasoning_content"] = m.thinking
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                call_id = c.id or f"call_{i}_{j}"
                args = c.function.arguments
                text = args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": text},
                    }
                )
                unanswered.append((call_id, c.function.name))
            if calls:
                d["tool_calls"] = calls
        elif m.role == "tool":
            name = m.tool_name or (m.model_extra or {}).get("name")
            answered = m.tool_call_id or _answer(unanswered, name)
            if answered:
                d["tool_call_id"] = answered
            if isinstance(name, str) and name:
                d["name"] = name
        out.append(d)
    return out


def _answer(unanswered: list[tuple[str, str]], name: object) -> str | None:
    """The id of the oldest unanswered call of tool ``name`` (else the oldest call), taken."""
    for k, (call_id, call_name) in enumerate(unanswered):
        if call_name == name:
            del unanswered[k]
            return call_id
    return unanswered.pop(0)[0] if unanswered else None


def tool_fields(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    if not tools:
        return {}
    out = []
    for i, t in enumerate(tools):
        if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(
                f"tools[{i}]: only function tools are supported ({{'type': 'function', 'function': {{...}}}})"
            )
        out.append({"type": "function", "function": t["function"]})
    return {"tools": out}


def format_fields(fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    """``format`` as the chat's ``response_format``."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}}
    raise bad_request(f'format: {fmt!r} is not a format: "json" or a JSON schema')


def think_fields(think: bool | str | None) -> dict[str, Any]:
    """``think`` as the chat call's thinking control (templates without a switch keep their default)."""
    if think is None:
        return {}
    if think is True:
        return {"reasoning_effort": "on"}
    if think is False:
        return {"reasoning_effort": "none"}
    if think in _THINK_LEVELS:
        return {"reasoning_effort": think}
    raise bad_request(f'think: {think!r} must be true, false, "low", "medium" or "high"')


def option_fields(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` as chat-completions sampling fields (``num_ctx`` is checked by the route)."""
    out: dict[str, Any] = {}
    if not options:
        return out
    for name, field in _OPTIONS.items():
        value = options.get(name)
        if value is None:
            continue
        if name == "repeat_penalty" and isinstance(value, int | float) and value <= 0:
            continue  # Ollama: 0 is off
        out[field] = value
    n = options.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise bad_request("options.num_predict must be an integer")
        if n > 0:  # -1: until the model stops, -2: until the context is full
            out["max_tokens"] = n
    ignored = sorted(k for k in options if k not in _HANDLED)
    if ignored:
        log.debug("ollama: ignoring options %s", ", ".join(ignored))
    return out


def check_num_ctx(options: dict[str, Any] | None, context_length: int) -> None:
    """``num_ctx``: fine up to the loaded model's context (the engine sizes it; nothing to change)."""
    n = (options or {}).get("num_ctx")
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int):
        raise bad_request("options.num_ctx must be an integer")
    if n > context_length:
        raise bad_request(
            f"options.num_ctx {n} is more than this model's context of {context_length} tokens "
            "(Duet sizes the context when it loads the model: see duet serve --context-length)"
        )
    log.debug("ollama: num_ctx %d ignored (the model's context is %d)", n, context_length)


def sampling_fields(body: _Generating, model: str) -> dict[str, Any]:
    """What chat and generate share: the model, format, options and think."""
    return {
        "model": model,
        **format_fields(body.format),
        **option_fields(body.options),
        **think_fields(body.think),
    }


def chat_fields(body: ChatRequest, model: str) -> dict[str, Any]:
    """The chat-completions request an Ollama chat request is (``model``: the served name)."""
    return {
        **sampling_fields(body, model),
        "messages": chat_messages(body.messages or []),
        **tool_fields(body.tools),
    }


def generate_fields(body: GenerateRequest, model: str) -> dict[str, Any]:
    """A templated /api/generate: the system prompt and the prompt as a two-message chat."""
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.prompt or ""})
    return {**sampling_fields(body, model), "messages": messages}


def check_generate(body: GenerateRequest) -> None:
    """What /api/generate cannot honour here, refused with a reason."""
    if body.images:
        raise bad_request("images are not supported: this model reads text only")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported by this server")
    if body.template:
        raise bad_request(
            "template overrides are not supported: Duet renders the model's own chat template "
            "(send raw: true with a prompt formatted as you want it)"
        )
    if body.context:
        raise bad_request(
            "context (deprecated in Ollama) is not supported: continue a conversation with /api/chat"
        )
    if body.raw and body.format:
        raise bad_request("format cannot be combined with raw: true here; use the templated prompt")


# --- replies -------------------------------------------------------------------------------------------
def tool_call_out(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A parsed tool call in Ollama's shape: ``function.arguments`` an object."""
    try:
        args = json.loads(arguments)
    except ValueError:  # cut short by num_predict
        args = {}
    return {
        "id": call_id,
        "function": {"index": index, "name": name, "arguments": args if isinstance(args, dict) else {}},
    }


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def ollama_error(e: APIError) -> dict[str, str]:
    return {"error": e.message}
