"""llama.cpp's tokenizer routes: ``POST /tokenize``, ``/detokenize`` and ``/apply-template``.

- ``/tokenize`` ``{"content": str, "add_special": false, "parse_special": true, "with_pieces":
  false}`` -> ``{"tokens": [id, ...]}``; with pieces, ``[{"id": id, "piece": str}, ...]``, a piece
  that is not valid UTF-8 on its own (half of a character) given as its list of byte values.
  ``add_special`` adds BOS where the model wants one; ``parse_special=false`` reads control-token
  text (``<|im_start|>``) as plain text.
- ``/detokenize`` ``{"tokens": [id, ...]}`` -> ``{"content": str}`` (special tokens written out, as
  llama.cpp does); an id outside the vocabulary is a 400.
- ``/apply-template`` a chat request's body -> ``{"prompt": str}``: the chat template applied with
  the generation prompt, through the same path ``/v1/chat/completions`` takes (``ChatCall``: the
  tools prompt of a template that knows no tools, ``reasoning_effort``, ``chat_template_kwargs``),
  so ``/tokenize`` of it with ``add_special`` gives the ids the chat endpoint prompts with.

Each takes an optional ``"model"`` (as llama.cpp's router does). Without one: the first loaded
model (the ``--model`` one, where the server has it), else the first the server can serve (loaded
then, as any request for it would).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from mlx_engine.tokenization.tokenizer import Tokenizer

from .chat import ChatCall
from .common import ServerState
from .errors import bad_request
from .model_routes import with_model
from .protocol import ChatCompletionRequest
from .registry import ModelRegistry

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # as llama.cpp: fields it does not know are ignored
    content: StrictStr
    add_special: StrictBool = False
    parse_special: StrictBool = True
    with_pieces: StrictBool = False
    model: StrictStr | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[StrictInt] = Field(default_factory=list)
    model: StrictStr | None = None


class ApplyTemplateRequest(ChatCompletionRequest):
    """A chat request whose ``model`` may be left out."""

    model: str | None = None  # type: ignore[assignment]


def default_model(registry: ModelRegistry) -> str | None:
    """The model a request that names none is for: the first loaded (the pinned ``--model`` one is
    loaded first), else the first available; None when there is none (a 404 then)."""
    loaded = registry.loaded()
    if loaded:
        return loaded[0].model.name
    available = registry.available()
    return available[0].name if available else None


def tokenize(tokenizer: Tokenizer, body: TokenizeRequest) -> dict[str, Any]:
    ids = tokenizer.encode(
        body.content, add_special_tokens=body.add_special, parse_special=body.parse_special
    )
    if not body.with_pieces:
        return {"tokens": ids}
    pieces = _Pieces(tokenizer)
    return {"tokens": [{"id": i, "piece": pieces(i)} for i in ids]}


def detokenize(tokenizer: Tokenizer, tokens: list[int]) -> dict[str, Any]:
    check_ids(tokenizer, tokens, "tokens")
    return {"content": tokenizer.decode(tokens, skip_special_tokens=False)}


def check_ids(tokenizer: Tokenizer, ids: list[int], param: str) -> None:
    """A 400 naming the first id that is not in the vocabulary."""
    vocab = tokenizer.vocab_size
    for k, i in enumerate(ids):
        if not 0 <= i < vocab or tokenizer.backend.id_to_token(i) is None:
            raise bad_request(
                f"token id {i} is outside the vocabulary (0..{vocab - 1})", f"{param}[{k}]", "invalid_token"
            )


def apply_template(state: ServerState, body: ApplyTemplateRequest) -> dict[str, Any]:
    """The prompt text the chat endpoint would feed the model for ``body``'s messages."""
    call = ChatCall(state, body.model_copy(update={"model": state.model_id}), None)
    prompt = state.engine.tokenizer.apply_chat_template(
        call.messages, True, call.template_tools, call.template_kwargs
    )
    return {"prompt": prompt}


class _Pieces:
    """Each token's own text, as llama.cpp's ``with_pieces`` gives it: the token's bytes (a
    byte-level BPE's or a byte-fallback token's raw bytes, SentencePiece's ``▁`` as a space),
    as a string when they are valid UTF-8, else as a list of byte values."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        decoder = tokenizer.backend.decoder
        kinds = json.dumps(json.loads(decoder.__getstate__())) if decoder is not None else ""
        self.byte_level = '"ByteLevel"' in kinds
        self.metaspace = '"Metaspace"' in kinds or '"▁"' in kinds

    def __call__(self, token_id: int) -> str | list[int]:
        tok = self.tokenizer.backend.id_to_token(token_id)
        if tok is None:
            return ""
        if self.tokenizer.added_id(tok) == token_id:  # an added token: its text as it is
            return tok
        raw: bytes | None = None
        fallback = _BYTE_FALLBACK.fullmatch(tok)
        if fallback is not None:
            raw = bytes([int(fallback.group(1), 16)])
        elif self.byte_level and all(c in _byte_decoder() for c in tok):
            raw = bytes(_byte_decoder()[c] for c in tok)
        if raw is None:
            return tok.replace("▁", " ") if self.metaspace else self.tokenizer.piece(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as, back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def install_tokenize_routes(api: Callable[..., Any], registry: ModelRegistry) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/apply-template`` (``api``: create_app's registrar;
    these paths have no /v1 form at llama.cpp, so they are registered bare)."""

    def named(model: str | None) -> str | None:
        return model if model is not None else default_model(registry)

    @api("POST", "/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> Response:
        async def run(state: ServerState) -> Response:
            return JSONResponse(await asyncio.to_thread(tokenize, state.engine.tokenizer, body))

        return await with_model(registry, named(body.model), run)

    @api("POST", "/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        async def run(state: ServerState) -> Response:
            return JSONResponse(await asyncio.to_thread(detokenize, state.engine.tokenizer, body.tokens))

        return await with_model(registry, named(body.model), run)

    @api("POST", "/apply-template")
    async def apply_template_route(body: ApplyTemplateRequest) -> Response:
        async def run(state: ServerState) -> Response:
            return JSONResponse(await asyncio.to_thread(apply_template, state, body))

        return await with_model(registry, named(body.model), run)
