"""The Hermes/Qwen tool-call parser, whole and streamed in arbitrary pieces; the tool-call grammar."""

from __future__ import annotations

import json
import random

import pytest

from app.server.chat import _with_tools_prompt
from app.server.tool_calls import ToolCallStream, parse_tool_calls

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'


def stream_parse(text: str, seed: int) -> tuple[str, list]:
    rng = random.Random(seed)
    s, items, i = ToolCallStream(), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        items += s.feed(text[i : i + n])
        i += n
    items += s.finish()
    return "".join(x for k, x in items if k == "content"), [x for k, x in items if k == "call"]


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
    assert s.feed("Hello <") == [("content", "Hello ")]
    assert s.feed("b>") == [("content", "<b>")]
    assert s.feed("<tool") == []
    assert s.feed('_call>{"name": "f", "arguments": {}}') == []
    items = s.feed("</tool_call>")
    assert [k for k, _ in items] == ["call"]


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
