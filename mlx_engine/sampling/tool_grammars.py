"""Forced tool calls (``tool_choice`` required or a named tool) in each family's own syntax.

A grammar that writes Hermes JSON for every model makes a Qwen3-Coder or gpt-oss model write
what its template never showed it; these grammars write what the family's template shows, and
the family's parser (``tokenization/tool_formats.py``) reads it back:

- Hermes / Qwen (``hermes``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  (``constraints.tool_call_grammar``);
- Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``;
- Mistral: ``[TOOL_CALLS]NAME[ARGS]{...}`` where the template writes ``[ARGS]`` (v11 and later:
  Devstral, Magistral, Mistral Small 3.2), else ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``;
- Llama 3.x: ``{"name": ..., "parameters": {...}}``;
- Gemma 3 (``gemma_pythonic``): ````` ```tool_code\\nNAME(p=VALUE, ...)\\n``` `````;
- gpt-oss (harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.

Markers that are one token of the vocabulary (added tokens, special or not) are written as those
tokens (llguidance's ``<[id]>``): llguidance does not match added tokens as text. Families with no grammar here get the Hermes grammar, and that request's reply is
parsed as Hermes (``forced_syntax``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import llguidance as llg

from mlx_engine.sampling.constraints import JSON_OPTIONS, NO_PARAMETERS, tool_call_grammar, tool_call_schema
from mlx_engine.sampling.constraints import marker_literal as _lit
from mlx_engine.sampling.json_schema_closing import close_objects
from mlx_engine.tokenization.tool_formats import HERMES, ToolSyntax

# the syntaxes with a native forced-call grammar here
NATIVE = ("hermes", "qwen3_coder", "mistral", "llama3_json", "gemma_pythonic", "harmony")

SpecialId = Callable[[str], int | None]  # a marker's id when it is one added token, else None


def _json(schema: dict) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _params(tool: dict) -> dict:
    return close_objects(tool["function"].get("parameters") or NO_PARAMETERS)


def _alternatives(rules: list[str]) -> str:
    return " | ".join(rules)


def _lark(calls: list[str], parallel: bool, sep: str = '"\\n"') -> str:
    rules = [f"call{k}: {body}" for k, body in enumerate(calls)]
    call = "call: " + _alternatives([f"call{k}" for k in range(len(calls))])
    start = f"start: call ({sep} call)*" if parallel else "start: call"
    return llg.LLMatcher.grammar_from_lark("\n".join([start, call, *rules]) + "\n")


def _qwen3_coder(tools: list[dict], parallel: bool, special: SpecialId) -> str:
    calls = []
    for t in tools:
        params = _params(t)
        props = params.get("properties", {})
        parts = [_lit("<tool_call>", special), json.dumps(f"\n<function={t['function']['name']}>\n")]
        for p in params.get("required", list(props)):
            schema = props.get(p, {})
            # a string is written bare, on its line (what the template shows); others as JSON
            if schema.get("type") == "string" and all(isinstance(v, str) for v in schema.get("enum", [1])):
                value = "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")"
            elif schema.get("type") == "string":
                value = "/[^<\\n]+/"
            else:
                value = _json(schema)
            parts += [json.dumps(f"<parameter={p}>\n"), value, json.dumps("\n</parameter>\n")]
        parts += [json.dumps("</function>\n"), _lit("</tool_call>", special)]
        calls.append(" ".join(parts))
    return _lark(calls, parallel)


def _mistral(tools: list[dict], parallel: bool, special: SpecialId, header: bool) -> str:
    if header:
        calls = [
            f"{_lit('[TOOL_CALLS]', special)} {json.dumps(t['function']['name'])} {_lit('[ARGS]', special)} "
            + _json(_params(t))
            for t in tools
        ]
        return _lark(calls, parallel, sep='""')
    items = {"type": "array", "items": tool_call_schema(tools), "minItems": 1}
    if not parallel:
        items["maxItems"] = 1
    return llg.LLMatcher.grammar_from_lark(f"start: {_lit('[TOOL_CALLS]', special)} {_json(items)}\n")


def _llama3(tools: list[dict], parallel: bool) -> str:
    schema = tool_call_schema(tools, arguments_key="parameters")
    return _lark([_json(schema)], parallel, sep='"; "')


def _gemma(tools: list[dict], parallel: bool) -> str:
    calls = []
    for t in tools:
        params = _params(t)
        props = params.get("properties", {})
        args = [f"{json.dumps(p + '=')} {_json(props.get(p, {}))}" for p in params.get("required", [])]
        inner = ' ", " '.join(args) if args else ""
        calls.append(f"{json.dumps(t['function']['name'] + '(')} {inner} {json.dumps(')')}")
    body = 'call (", " call)*' if parallel else "call"
    rules = [f"call{k}: {c}" for k, c in enumerate(calls)]
    return llg.LLMatcher.grammar_from_lark(
        "\n".join(
            [
                f'start: "```tool_code\\n[" {body} "]\\n```"',
                "call: " + _alternatives([f"call{k}" for k in range(len(calls))]),
                *rules,
            ]
        )
        + "\n"
    )


def _harmony(tools: list[dict], special: SpecialId) -> str:
    calls = [
        " ".join(
            [
                _lit("<|channel|>", special),
                json.dumps(f"commentary to=functions.{t['function']['name']} "),
                _lit("<|constrain|>", special),
                '"json"',
                _lit("<|message|>", special),
                _json(_params(t)),
                _lit("<|call|>", special),
            ]
        )
        for t in tools
    ]
    return _lark(calls, False)  # <|call|> ends gpt-oss's turn: one call per reply


def forced_syntax(syntax: ToolSyntax | None, harmony: bool) -> ToolSyntax | None:
    """The syntax a forced call's reply is parsed in: the family's own when it has a grammar here,
    else Hermes (None for harmony, whose reply parser reads calls)."""
    if harmony:
        return None
    if syntax is None or syntax.name in NATIVE:
        return syntax
    return HERMES


def forced_call_grammar(
    tools: list[dict],
    parallel: bool,
    syntax: ToolSyntax | None,
    harmony: bool,
    special: SpecialId,
    template: str | None = None,
) -> str:
    """A grammar for one forced call (several with ``parallel``) to one of ``tools``, written the
    way the model's family writes calls (``syntax``: the model's, None for Hermes)."""
    if not tools:
        tool_call_schema(tools)  # raises the RequestError for no tools
    if harmony:
        return _harmony(tools, special)
    name = syntax.name if syntax is not None else "hermes"
    if name == "qwen3_coder":
        return _qwen3_coder(tools, parallel, special)
    if name == "mistral":
        return _mistral(tools, parallel, special, header="[ARGS]" in (template or ""))
    if name == "llama3_json":
        return _llama3(tools, parallel)
    if name == "gemma_pythonic":
        return _gemma(tools, parallel)
    return tool_call_grammar(tools, parallel, special)
