"""Each model family's tool-call syntax (``ToolSyntax``), and which one a model speaks.

Where a well-kept parser exists it is used: mlx-lm's ``mlx_lm.tool_parsers`` modules give the
markers and the body parser of Qwen3-Coder (``qwen3_coder``), Mistral / Devstral / Magistral
(``mistral``), LFM2-style pythonic calls (``pythonic``), Gemma 4 (``gemma4``), FunctionGemma
(``function_gemma``), GLM 4.5-4.7 (``glm47``), Kimi K2 (``kimi_k2``), MiniMax M2 (``minimax_m2``),
LongCat (``longcat``) and the others it has; mlx-lm's ``_infer_tool_parser`` chooses one from the
chat template or the vocabulary. What mlx-lm does not parse is here: Hermes/Qwen JSON calls (with
calls cut by ``max_tokens`` kept, ``tool_calls.cut_call_body``), Llama 3.x JSON calls (a reply that
is a ``{"name": ..., "parameters": ...}`` object, or ``<|python_tag|>`` then one) and Gemma 3's
pythonic calls in a ```` ```tool_code ```` block or a bare ``[f(x=1)]`` list. gpt-oss's harmony
format is not a tool syntax but a whole reply structure (``harmony.py``).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mlx_engine.tokenization.harmony import harmony_template
from mlx_engine.tokenization.mlx_lm_functions import pure_function
from mlx_engine.tokenization.tool_calls import ParsedToolCall, call_from_json, parse_call_body

BodyParser = Callable[[str, list[dict] | None], list[ParsedToolCall]]


@dataclass(frozen=True)
class ToolSyntax:
    """How one family writes tool calls: a block between an open marker (one of ``opens``) and
    ``close`` ("" : the block runs to the next open marker or the end of the reply), whose body
    ``parse`` turns into calls (none: not a call, the block stays content)."""

    name: str
    opens: tuple[str, ...]
    close: str
    parse: BodyParser = field(compare=False)
    # open markers that count only where the reply's answer begins, and belong to the body
    # (Llama 3's bare JSON object, a pythonic list)
    start_opens: frozenset[str] = frozenset()
    json_body: bool = False  # Hermes JSON bodies: a call cut by max_tokens is still recognised
    inner: tuple[str, ...] = ()  # markers inside a block (Mistral's ``[ARGS]``), read by ``parse``

    def parse_body(self, body: str, tools: list[dict] | None) -> list[ParsedToolCall]:
        try:
            return self.parse(body, tools)
        except Exception:  # noqa: BLE001 - a parser's failure means the text is not a call
            return []

    @property
    def markers(self) -> tuple[str, ...]:
        """The markers' texts (those that are special tokens must be decoded as text)."""
        return tuple(m for m in (*self.opens, self.close, *self.inner) if m and m not in self.start_opens)


def _hermes(body: str, _tools: list[dict] | None) -> list[ParsedToolCall]:
    call = parse_call_body(body.strip())
    return [call] if call is not None else []


def _json_sequence(text: str) -> list[object]:
    """The JSON values in ``text`` one after another (separated by whitespace, ``;`` or ``,``)."""
    dec, pos, out = json.JSONDecoder(), 0, list[object]()
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in ";,"):
            pos += 1
        if pos >= len(text):
            return out
        value, pos = dec.raw_decode(text, pos)
        out.append(value)


def _llama3(body: str, _tools: list[dict] | None) -> list[ParsedToolCall]:
    """Llama 3.1-3.3 custom-tool calls: ``{"name": ..., "parameters": {...}}``, one or several
    (3.2 separates them with ``;``), or a list of them."""
    values = _json_sequence(body.strip())
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = [call_from_json(v) for v in values]
    if not calls or any(c is None for c in calls):
        return []
    return [c for c in calls if c is not None]


def _from_mlx_lm(module: ModuleType) -> BodyParser:
    def parse(body: str, tools: list[dict] | None) -> list[ParsedToolCall]:
        got = module.parse_tool_call(body, tools)
        calls = got if isinstance(got, list) else [got]
        out = []
        for c in calls:
            args = c.get("arguments", {})
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            json.loads(text)  # the arguments must be JSON (a ValueError: not a call)
            out.append(ParsedToolCall(c["name"], text))
        return out

    return parse


def _pythonic(body: str, tools: list[dict] | None) -> list[ParsedToolCall]:
    return _from_mlx_lm(_module("pythonic"))(body, tools)


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


HERMES = ToolSyntax("hermes", ("<tool_call>",), "</tool_call>", _hermes, json_body=True)
LLAMA3 = ToolSyntax("llama3_json", ("<|python_tag|>", "{"), "", _llama3, start_opens=frozenset({"{"}))
GEMMA_PYTHONIC = ToolSyntax(
    "gemma_pythonic", ("```tool_code", "["), "```", _pythonic, start_opens=frozenset({"["})
)
OURS = {s.name: s for s in (HERMES, LLAMA3, GEMMA_PYTHONIC)}

# mlx-lm's parsers this module offers by name (``--tool-format``)
MLX_LM_PARSERS = (
    "qwen3_coder",
    "mistral",
    "pythonic",
    "gemma4",
    "function_gemma",
    "glm47",
    "kimi_k2",
    "minimax_m2",
    "longcat",
    "minicpm5",
    "muse_spark",
    "kimi_k3",
)
TOOL_FORMATS = ("auto", "none", *OURS, *MLX_LM_PARSERS)


# the control tokens inside each family's call blocks (its tokenizer makes some of them special, and
# a decode must keep them for the parser)
_INNER = {
    "mistral": ("[ARGS]", "[CALL_ID]"),
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "gemma4": ('<|"|>',),
    "glm47": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
}


def mlx_lm_syntax(name: str) -> ToolSyntax:
    """An mlx-lm tool parser as a syntax; its JSON-bodied cousins keep Hermes's cut-call handling."""
    if name == "json_tools":
        return HERMES
    module = _module(name)
    start, end = module.tool_call_start, module.tool_call_end
    parse = _from_mlx_lm(module)
    if name == "mistral":
        parse = _without_call_ids(parse)
    return ToolSyntax(name, (start,), end, parse, inner=_INNER.get(name, ()))


_CALL_ID = re.compile(r"\[CALL_ID\][^\[]*")


def _without_call_ids(parse: BodyParser) -> BodyParser:
    """Mistral Small 3.2's templates write ``name[CALL_ID]id[ARGS]{...}``, and a model may copy
    them; mlx-lm's parser reads ``name[ARGS]`` only (it would take the id for the name)."""
    return lambda body, tools: parse(_CALL_ID.sub("", body), tools)


def syntax_named(name: str) -> ToolSyntax:
    if name in OURS:
        return OURS[name]
    if name in MLX_LM_PARSERS or name == "json_tools":
        return mlx_lm_syntax(name)
    raise ValueError(f"unknown tool format {name!r}: one of {', '.join(TOOL_FORMATS)}")


@dataclass
class _TemplateView:
    """What mlx-lm's ``_infer_tool_parser`` reads from a tokenizer."""

    chat_template: str | None
    vocab: dict[str, int]

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def infer_tool_syntax(template: str | None, vocab: dict[str, int]) -> ToolSyntax | None:
    """The syntax a model writes calls in: from its chat template, then its vocabulary; None when
    nothing says (the server then asks for Hermes calls in a system prompt and parses those)."""
    t = template or ""
    if harmony_template(template, vocab):
        return None  # harmony (gpt-oss): the reply parser is harmony.HarmonyParser
    name: Any = pure_function("_infer_tool_parser")(_TemplateView(template, vocab))
    if name is not None:
        return syntax_named(name)
    if "<|python_tag|>" in t or ('"parameters"' in t and "<|eot_id|>" in t):
        return LLAMA3
    if "tool_code" in t:
        return GEMMA_PYTHONIC
    if "<tool_call>" in t:
        return HERMES
    return None
