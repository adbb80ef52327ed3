"""The Hermes/Qwen tool-call parser, whole and streamed in arbitrary pieces (replies cut by
max_tokens included); the tool-call schema and grammar: definitions and references of several
tools' parameters embedded in one wrapper, and a tool without parameters."""

from __future__ import annotations

import json
import random
from typing import Annotated

import jsonschema
import pytest
from pydantic import BaseModel, Field
from tokenizers import Tokenizer as HFTokenizer

from app.server.chat import _with_tools_prompt
from mlx_engine.sampling.constraints import (
    GrammarFactory,
    json_schema_grammar,
    tool_call_grammar,
    tool_call_schema,
)
from mlx_engine.tokenization.tokenizer import Tokenizer
from mlx_engine.tokenization.tool_calls import ParsedToolCall, ToolCallStream, parse_tool_calls
from tests.tiny_models import tokenizer_json

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'


def stream_parse(
    text: str, seed: int, truncated: bool = False, names=(), forced: bool = False
) -> tuple[str, list]:
    rng = random.Random(seed)
    s, items, i = ToolCallStream(names, forced), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        items += s.feed(text[i : i + n])
        i += n
    items += s.finish(truncated)
    return "".join(x for x in items if isinstance(x, str)), [x for x in items if not isinstance(x, str)]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("plain answer, no calls", "plain answer, no calls", []),
        (CALL_A, None, [("get_weather", {"city": "Paris", "unit": "c"})]),
        (
            "Let me check.\n" + CALL_A + "\n" + CALL_B,
            "Let me check.\n",
            [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})],
        ),
        # arguments already JSON-encoded as a string, and the "parameters" spelling
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
        ('<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}</tool_call>', None, [("f", {"x": [1, 2]})]),
        # unclosed block whose body parses (EOS right after the JSON)
        ('<tool_call>\n{"name": "f", "arguments": {"q": "a<b"}}\n', None, [("f", {"q": "a<b"})]),
        (
            '<tool_call>{"name": "f", "arguments": {}}\n</tool_c',
            None,
            [("f", {})],
        ),  # close tag cut by max_tokens
        # not a call: stays content verbatim
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ("a < b and <tool_ca", "a < b and <tool_ca", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
)
def test_parse_whole_and_streamed(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    for seed in range(20):  # any split of the text gives the same result
        s_content, s_calls = stream_parse(text, seed)
        assert [(c.name, json.loads(c.arguments)) for c in s_calls] == calls
        # whitespace just before a call may be dropped when it arrives on its own
        assert s_content.rstrip() == (content or "").rstrip()


def test_stream_holds_back_only_possible_tags():
    s = ToolCallStream()
    assert s.feed("Hello <") == ["Hello "]
    assert s.feed("b>") == ["<b>"]
    assert s.feed("<tool") == []
    assert s.feed('_call>{"name": "f", "arguments": {}}') == []
    items = s.feed("</tool_call>")
    assert [type(x) for x in items] == [ParsedToolCall]


def test_tools_prompt_for_templates_without_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = _with_tools_prompt([{"role": "user", "content": "hi"}], tools)
    assert (
        msgs[0]["role"] == "system"
        and '"name": "f"' in msgs[0]["content"]
        and "<tool_call>" in msgs[0]["content"]
    )
    msgs = _with_tools_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools
    )
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.") and "<tools>" in msgs[0]["content"]


# --- replies cut by max_tokens ------------------------------------------------------------------

TOOL_NAMES = ("get_weather", "get_time", "now")


@pytest.mark.parametrize(
    "text, forced, content, calls",
    [
        # cut inside the arguments: the call, with the arguments text generated so far
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
            False,
            None,
            [("get_weather", '{"city": "Pa')],
        ),
        ('Sure.\n<tool_call>\n{"name": "now", "arguments": {', False, "Sure.\n", [("now", "{")]),
        # cut inside the name: completed when only one tool fits
        ('<tool_call>\n{"name": "get_w', False, None, [("get_weather", "")]),
        ('<tool_call>\n{"name": "get_', False, '<tool_call>\n{"name": "get_', []),  # two tools fit
        # a first call whole, the second cut
        (CALL_B + '\n<tool_call>\n{"name": "now", "argu', False, None, [("now", "{}"), ("now", "")]),
        # cut inside the opening tag: markup, never content
        ("<tool_ca", True, "", []),
        ("Hi <tool_", False, "Hi ", []),
        ("a <", False, "a <", []),  # too short to be taken for a tag outside a forced call
    ],
)
def test_reply_cut_inside_a_tool_call_still_gives_the_call(text, forced, content, calls):
    got_content, got_calls = parse_tool_calls(text, truncated=True, names=TOOL_NAMES, forced=forced)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for seed in range(10):
        s_content, s_calls = stream_parse(text, seed, truncated=True, names=TOOL_NAMES, forced=forced)
        assert [(c.name, c.arguments) for c in s_calls] == calls
        assert s_content.rstrip() == (content or "").rstrip()
    # the same text ended by EOS is not a call: it stays content, as before
    if not got_calls or text.startswith(CALL_B):
        return
    assert parse_tool_calls(text, truncated=False, names=TOOL_NAMES)[1] == []


def test_forced_call_cut_in_its_opening_tag_is_the_only_tool():
    content, calls = parse_tool_calls("<tool_ca", truncated=True, names=["now"], forced=True)
    assert [(c.name, c.arguments) for c in calls] == [("now", "")] and content is None


# --- the tool-call schema: $defs and $ref of several tools ----------------------------------------

Short = Annotated[str, Field(max_length=8)]


class Address(BaseModel):  # what pydantic writes for nested models: $defs + "#/$defs/Address"
    street: Short
    zip: Annotated[int, Field(ge=0, le=99999)]


class Person(BaseModel):
    name: Short
    homes: Annotated[list[Address], Field(max_length=2)]


class Node(BaseModel):  # recursive: the root itself is a $ref into $defs
    label: Short
    children: Annotated[list[Node], Field(max_length=2)] = []


def _tool(name: str, parameters: dict | None) -> dict:
    fn: dict = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


# a second "Address" of another shape, in draft-07 "definitions"; a root self-reference "#"; a
# property named like a data keyword holding a reference; a reference inside instance data
SHIP = {
    "definitions": {
        "Address": {"type": "object", "properties": {"port": {"type": "string"}}, "required": ["port"]}
    },
    "type": "object",
    "properties": {
        "to": {"$ref": "#/definitions/Address"},
        "enum": {"$ref": "#/definitions/Address"},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        "note": {"const": {"$ref": "#/definitions/Address"}},
    },
    "required": ["to"],
    "additionalProperties": False,
}
TOOLS = [
    _tool("person", Person.model_json_schema()),
    _tool("ship", SHIP),
    _tool("tree", Node.model_json_schema()),
]


@pytest.mark.parametrize(
    "call, valid",
    [
        ({"name": "person", "arguments": {"name": "Ann", "homes": [{"street": "Main", "zip": 1}]}}, True),
        (
            {"name": "person", "arguments": {"name": "Ann", "homes": [{"port": "Oslo"}]}},
            False,
        ),  # ship's Address
        ({"name": "person", "arguments": {"name": "Ann", "homes": [{"street": "Main", "zip": "1"}]}}, False),
        ({"name": "ship", "arguments": {"to": {"port": "Oslo"}, "enum": {"port": "Rome"}}}, True),
        ({"name": "ship", "arguments": {"to": {"street": "Main", "zip": 1}}}, False),  # person's Address
        (
            {"name": "ship", "arguments": {"to": {"port": "A"}, "next": {"to": {"port": "B"}, "next": None}}},
            True,
        ),
        ({"name": "ship", "arguments": {"to": {"port": "A"}, "next": {"to": {"port": "B"}, "x": 1}}}, False),
        (
            {"name": "ship", "arguments": {"to": {"port": "A"}, "note": {"$ref": "#/definitions/Address"}}},
            True,
        ),
        (
            {
                "name": "tree",
                "arguments": {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]},
            },
            True,
        ),
        ({"name": "tree", "arguments": {"label": "a", "children": [{"children": []}]}}, False),
    ],
)
def test_tool_call_schema_keeps_each_tools_references(call, valid):
    schema = tool_call_schema(TOOLS)
    assert set(schema["$defs"]) >= {"person.Address", "ship.Address", "tree.Node"}
    ok = jsonschema.Draft202012Validator(schema).is_valid(call)
    assert ok == valid
    # the grammar the model is held to agrees with the schema
    assert _grammar_accepts(tool_call_grammar(TOOLS, parallel=False), call) == valid


def test_tool_without_parameters_takes_no_arguments():
    for parameters in (None, {}):
        tools = [_tool("now", parameters)]
        schema = tool_call_schema(tools)
        assert jsonschema.Draft202012Validator(schema).is_valid({"name": "now", "arguments": {}})
        assert not jsonschema.Draft202012Validator(schema).is_valid({"name": "now", "arguments": {"x": 1}})
        grammar = tool_call_grammar(tools, parallel=False)
        assert _grammar_accepts(grammar, {"name": "now", "arguments": {}})
        assert not _grammar_accepts(grammar, {"name": "now", "arguments": {"x": 1}})


class OpenAddress(BaseModel):  # as instructor and LangChain declare models: no additionalProperties
    city: Short


class OpenPerson(BaseModel):
    name: Short
    home: OpenAddress


def test_grammars_never_write_undeclared_keys():
    """A small model held to an open object copies the schema's own "title" and "type" into it
    until max_tokens: forced calls and response formats take only the declared properties."""
    args = {"name": "Ann", "home": {"city": "Oslo"}}
    schema = OpenPerson.model_json_schema()
    tool_grammar = tool_call_grammar([_tool("person", schema)], parallel=False)
    assert _grammar_accepts(tool_grammar, {"name": "person", "arguments": args})
    fmt_grammar = json_schema_grammar(schema)
    assert _accepts(fmt_grammar, json.dumps(args, separators=(", ", ": ")))
    for extra in ({**args, "title": "OpenPerson"}, {**args, "home": {"city": "Oslo", "type": "object"}}):
        jsonschema.validate(extra, schema)  # valid for the client's schema, but never generated
        assert not _grammar_accepts(tool_grammar, {"name": "person", "arguments": extra})
        assert not _accepts(fmt_grammar, json.dumps(extra, separators=(", ", ": ")))


def test_a_missing_definition_is_still_an_error():
    from mlx_engine.request import RequestError

    broken = _tool("f", {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nowhere"}}})
    with pytest.raises(RequestError, match="Nowhere"):
        _factory().constraint(tool_call_grammar([broken]), "tool_choice")


_FACTORY: list[GrammarFactory] = []


def _factory() -> GrammarFactory:
    if not _FACTORY:
        tok = Tokenizer(HFTokenizer.from_str(tokenizer_json()), eos_tokens=["<|im_end|>"])
        _FACTORY.append(GrammarFactory(tok))
    return _FACTORY[0]


def _grammar_accepts(grammar: str, call: dict) -> bool:
    """Whether the tool-call grammar lets a model write exactly this call."""
    return _accepts(grammar, "<tool_call>\n" + json.dumps(call, separators=(", ", ": ")) + "\n</tool_call>")


def _accepts(grammar: str, text: str) -> bool:
    factory = _factory()
    ids = factory.tokenizer.encode(text, add_special_tokens=False)
    constraint = factory.constraint(grammar, "tool_choice")
    for t in ids:
        if not constraint.allowed_tokens()[t]:
            return False
        constraint.accept(t)
    return constraint.is_finished() or bool(
        constraint.allowed_tokens()[next(iter(factory.tokenizer.eos_token_ids))]
    )
