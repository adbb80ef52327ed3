"""Constrained decoding with llguidance: JSON schemas, JSON mode and forced tool calls.

The engine only knows the ``Constraint`` protocol (request.py); this module is the one place
that knows the grammar library. llguidance was chosen because it installs from PyPI as one
small abi3 wheel with no dependencies (xgrammar pulls in torch; outlines-core precomputes an
index over the whole vocabulary per schema, which takes seconds for large vocabularies), it
computes each token mask on the fly in tens of microseconds on CPU, and it accepts the
tokenizer as the `tokenizers` JSON every model here already has (GGUF ones included).

    grammars = GrammarFactory(engine.tokenizer)
    req.constraint = grammars.constraint(json_schema_grammar(schema))
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np

from mlx_engine.request import RequestError
from mlx_engine.sampling.json_schema_closing import close_objects
from mlx_engine.sampling.json_schema_embedding import embed_schemas
from mlx_engine.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Canonical compact JSON ("a": 1, "b": 2): bounded, deterministic whitespace, and the layout
# instruction-tuned models write anyway. Free whitespace lets a weak model pad forever.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def json_schema_grammar(schema: dict | bool) -> str:
    """A grammar for one JSON value matching ``schema`` (``{"type": "object"}`` for JSON mode)."""
    if isinstance(schema, bool):
        if not schema:
            raise RequestError("invalid JSON schema: false allows no value at all", "response_format")
        schema = {}
    closed: dict = close_objects(schema)  # only declared properties: see json_schema_closing
    try:
        return llg.LLMatcher.grammar_from_json_schema(closed, overrides=JSON_OPTIONS)
    except Exception as e:  # the library reports unusable schemas as ValueError, TypeError or its own
        raise RequestError(f"invalid JSON schema: {e}", "response_format") from e


def tool_call_schema(tools: list[dict], arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call ``{"name": ..., "arguments": {...}}`` to one of ``tools``
    (OpenAI function tools), whose arguments match that function's ``parameters``
    (``arguments_key``: Llama 3 calls them ``parameters``)."""
    if not tools:
        raise RequestError("tool_choice needs at least one tool", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    # no parameters means none at all, and objects take only their declared properties (an open
    # object lets a weak model invent keys forever); each tool's $defs move to the wrapper's
    # root so that its $refs still resolve
    params = [close_objects(t["function"].get("parameters") or NO_PARAMETERS) for t in tools]
    params, defs = embed_schemas(params, names)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: p},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for name, p in zip(names, params, strict=True)
    ]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, **({"$defs": defs} if defs else {})}


def marker_literal(text: str, token_id: Callable[[str], int | None]) -> str:
    """A marker in a lark grammar: the token itself (``<[id]>``) when it is one added token of the
    vocabulary (llguidance does not match added tokens as text), else its text."""
    i = token_id(text)
    return f"<[{i}]>" if i is not None else json.dumps(text)


def tool_call_grammar(
    tools: list[dict], parallel: bool = True, token_id: Callable[[str], int | None] = lambda _: None
) -> str:
    """Hermes/Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    ``tools`` are OpenAI function tools; each call's arguments must match that function's
    ``parameters`` schema. With ``parallel`` the model may emit several calls in a row. ``token_id``:
    the id of a marker that is one token of the vocabulary (Qwen's ``<tool_call>``), which the
    grammar must write as that token (llguidance does not match added tokens as text).
    """
    schema = {**tool_call_schema(tools), "x-guidance": JSON_OPTIONS}
    lit = marker_literal
    call = (
        f'call: {lit(TOOL_CALL_OPEN, token_id)} "\\n" %json {json.dumps(schema)} "\\n" '
        f"{lit(TOOL_CALL_CLOSE, token_id)}"
    )
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return llg.LLMatcher.grammar_from_lark(f"{start}\n{call}\n")


class GrammarConstraint:
    """One request's grammar state; implements the engine's ``Constraint`` protocol."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int, eos_ids: list[int]):
        self._m = matcher
        self._vocab = vocab_size
        self._eos = eos_ids

    def allowed_tokens(self) -> np.ndarray:
        if self._m.is_error():  # cannot happen while the engine samples from our masks; end cleanly
            mask = np.zeros(self._vocab, dtype=bool)
            mask[self._eos] = True
            return mask
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)

    def accept(self, token_id: int) -> None:
        self._m.consume_token(token_id)

    def is_finished(self) -> bool:
        return self._m.is_stopped()

    def copy(self) -> GrammarConstraint:
        return GrammarConstraint(self._m.deep_copy(), self._vocab, self._eos)


class GrammarFactory:
    """Compiles grammars for one tokenizer (the llguidance tokenizer is built once)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll: llg.LLTokenizer | None = None

    def _ll_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll is None:
                tok = self.tokenizer
                eos = sorted(tok.eos_token_ids) or None
                self._ll = llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
            return self._ll

    def prepare(self) -> None:
        """Build the llguidance tokenizer now. It holds the GIL for its whole build (~0.3 s for a
        49k vocabulary on an idle core, seconds on a loaded one), so built in a server's first
        constrained request, even on a worker thread, it stalls the event loop and every other
        request with it; a server calls this before it serves."""
        self._ll_tokenizer()

    def constraint(self, grammar: str, param: str = "response_format") -> GrammarConstraint:
        """A fresh constraint; raises RequestError (for ``param``) when the grammar does not compile."""
        ll = self._ll_tokenizer()
        try:
            matcher = llg.LLMatcher(ll, grammar, log_level=0)
        except Exception as e:
            raise RequestError(f"cannot build a grammar: {e}", param) from e
        if matcher.is_error():
            raise RequestError(f"cannot build a grammar: {matcher.get_error()}", param)
        return GrammarConstraint(matcher, self.tokenizer.vocab_size, sorted(self.tokenizer.eos_token_ids))
