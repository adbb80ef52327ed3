"""Each model family's replies taken apart (issue 31): the format found from the template and the
vocabulary, a recorded reply (thinking, then two calls with nested JSON arguments and a fake end
marker inside a string) parsed the same token by token and whole, for any split into chunks, with
no marker text in the answer; tool calls and results rendered back in the family's own format;
a forced call's grammar writes what the family's parser reads; thinking switched off through
``reasoning_effort`` where the template allows it."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from app.server.chat import _message_dicts
from app.server.protocol import ChatCompletionRequest
from mlx_engine.sampling.constraints import GrammarFactory
from mlx_engine.sampling.tool_grammars import forced_call_grammar, forced_syntax
from mlx_engine.tokenization.detokenizer import StreamingDetokenizer
from mlx_engine.tokenization.reasoning import opens_thinking
from mlx_engine.tokenization.reply_parser import ReplyParser, ToolParsing
from mlx_engine.tokenization.tokenizer import Tokenizer
from tests.family_fixtures import ARGS_A, FAMILIES, THOUGHT, TOOLS, Family

NAMES = ("get_weather", "search")
_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer(f: Family) -> Tokenizer:
    if f.name not in _TOKENIZERS:
        tj, cfg = f.tokenizer()
        _TOKENIZERS[f.name] = Tokenizer(
            HFTokenizer.from_str(tj), eos_tokens=[f.eos], chat_template=f.template, bos_token=cfg["bos_token"]
        )
    return _TOKENIZERS[f.name]


def parser(f: Family, tok: Tokenizer, tools: bool = True) -> ReplyParser:
    return ReplyParser(tok.reply_format, True, f.opens_thinking, ToolParsing(NAMES, TOOLS) if tools else None)


def decoded_pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    """What the engine's output stage hands the parser for each token (OutputProcessor.token)."""
    detok, out = StreamingDetokenizer(tok), []
    for i in ids:
        marker = tok.special_markers.get(i)
        out.append(detok.add(i) if marker is None else detok.flush() + marker)
    out.append(detok.flush())
    return out


def run(p: ReplyParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning, content, calls = "", "", []
    for piece in pieces:
        got = p.feed(piece)
        reasoning, content, calls = reasoning + got.reasoning, content + got.content, calls + got.calls
    got = p.finish()
    reasoning, content, calls = reasoning + got.reasoning, content + got.content, calls + got.calls
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.name)
def test_the_format_is_found_from_template_and_vocabulary(f):
    fmt = tokenizer(f).reply_format
    assert fmt.harmony == f.harmony
    assert ((fmt.think.start, fmt.think.end) if fmt.think else None) == f.think
    assert (fmt.tools.name if fmt.tools else None) == f.tools


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.reply], ids=lambda f: f.name)
def test_a_recorded_reply_token_by_token_and_whole(f):
    tok = tokenizer(f)
    ids = tok.encode(f.reply, add_special_tokens=False)
    pieces = decoded_pieces(tok, ids)
    assert "".join(pieces) == f.reply  # markers that are special tokens come back as text
    expected = (f.reasoning, f.content, f.calls)
    assert run(parser(f, tok), pieces) == expected
    assert run(parser(f, tok), ["".join(pieces)]) == expected


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.reply], ids=lambda f: f.name)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=30))
def test_any_split_gives_the_same_parse_and_no_marker_in_the_answer(f, cuts):
    tok = tokenizer(f)
    text = f.reply
    points = sorted({c % len(text) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    reasoning, content, calls = run(parser(f, tok), pieces)
    assert (reasoning, content, calls) == (f.reasoning, f.content, f.calls)
    for marker in tok.reply_format.markers:
        assert marker not in content


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.calls], ids=lambda f: f.name)
def test_without_tools_a_call_stays_in_the_answer(f):
    tok = tokenizer(f)
    _, content, calls = run(parser(f, tok, tools=False), [f.reply])
    assert calls == [] and "Zürich" in content


# what each family's template writes for an assistant turn's call and the tool's result
ROUND_TRIP = {
    "qwen3": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "when": {"day": "tomorrow", '
        '"hours": [9, 12]}}}\n</tool_call><|im_end|>\n',
        "<|im_start|>user\n<tool_response>\n14°C\n</tool_response><|im_end|>\n",
    ],
    "qwen3_coder": [
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=when>\n"
        '{"day": "tomorrow", "hours": [9, 12]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n',
        "<|im_start|>user\n<tool_response>\n14°C\n</tool_response>\n<|im_end|>\n",
    ],
    "gpt_oss": [
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Zürich", '
        '"when": {"day": "tomorrow", "hours": [9, 12]}}<|call|>',
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"14°C"<|end|>',
    ],
    "magistral": [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "when": {"day": "tomorrow", "hours": [9, 12]}}</s>',
        "[TOOL_RESULTS]14°C[/TOOL_RESULTS]",
    ],
    "llama3": [
        '{"name": "get_weather", "parameters": {"city": "Zürich", "when": {"day": "tomorrow", "hours": [9, 12]}}}'
        "<|eot_id|>",
        '<|start_header_id|>ipython<|end_header_id|>\n\n"14°C"<|eot_id|>',
    ],
    "gemma3": [
        '```tool_code\n[get_weather(city="Zürich", when={"day": "tomorrow", "hours": [9, 12]})]\n```<end_of_turn>\n',
        "<start_of_turn>user\n```tool_output\n14°C\n```<end_of_turn>\n",
    ],
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_a_tool_round_trip_renders_in_the_family_format(name):
    f = next(x for x in FAMILIES if x.name == name)
    tok = tokenizer(f)
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Zürich tomorrow?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": THOUGHT,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": json.dumps(ARGS_A, ensure_ascii=False),
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "14°C"},
            ],
        }
    )
    text = tok.apply_chat_template(_message_dicts(body, True), True, TOOLS)
    for part in ROUND_TRIP[name]:
        assert part in text, (part, text)


def test_earlier_thinking_is_dropped_or_kept_as_each_template_wants():
    # Qwen3 keeps the thinking of the turn after the last user message (a tool-call loop) only
    tok = tokenizer(next(f for f in FAMILIES if f.name == "qwen3"))
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "old thought"},
        {"role": "user", "content": "c"},
    ]
    assert "old thought" not in tok.apply_chat_template(msgs)


@pytest.mark.parametrize(
    "f", [f for f in FAMILIES if f.think and f.think[0] == "<think>"], ids=lambda f: f.name
)
def test_where_the_reply_starts_is_read_from_the_rendered_prompt(f):
    tok = tokenizer(f)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert opens_thinking(prompt, tok.reply_format.think) == f.opens_thinking


def test_reasoning_effort_none_switches_thinking_off_where_the_template_can():
    qwen = tokenizer(next(f for f in FAMILIES if f.name == "qwen3"))
    kw = qwen.reply_format.thinking_kwargs("none")
    assert kw == {"enable_thinking": False}
    prompt = qwen.apply_chat_template([{"role": "user", "content": "hi"}], template_kwargs=kw)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking(prompt, qwen.reply_format.think)
    oss = tokenizer(next(f for f in FAMILIES if f.name == "gpt_oss"))
    for effort, line in (
        ("high", "Reasoning: high"),
        ("none", "Reasoning: low"),
        (None, "Reasoning: medium"),
    ):
        kw = oss.reply_format.thinking_kwargs(effort)
        assert line in oss.apply_chat_template([{"role": "user", "content": "hi"}], template_kwargs=kw)


def _walk(tok: Tokenizer, grammar: str, seed: int) -> list[int]:
    """Tokens a grammar lets through, chosen at random (a model with random weights)."""
    c = GrammarFactory(tok).constraint(grammar, "tool_choice")
    rng, ids = random.Random(seed), []
    for _ in range(600):
        if c.is_finished():
            break
        allowed = [int(i) for i in c.allowed_tokens().nonzero()[0] if i not in tok.eos_token_ids]
        if not allowed:
            break
        t = rng.choice(allowed)
        c.accept(t)
        ids.append(t)
    return ids


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.calls], ids=lambda f: f.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_forced_call_is_written_in_the_family_syntax_and_parsed_back(f, seed):
    tok = tokenizer(f)
    fmt = tok.reply_format
    fn = TOOLS[0]["function"]
    params = {
        **fn["parameters"],
        "properties": {k: v for k, v in fn["parameters"]["properties"].items() if k != "when"},
    }
    forced = [{"type": "function", "function": {**fn, "parameters": params}}]  # closed: a walk ends
    grammar = forced_call_grammar(forced, False, fmt.tools, fmt.harmony, tok.added_id, f.template)
    ids = _walk(tok, grammar, seed)
    text = "".join(decoded_pieces(tok, ids))
    native = {
        "qwen3": "<tool_call>\n{",
        "qwen3_coder": "<function=get_weather>",
        "gpt_oss": "to=functions.get_weather",
        "magistral": "[TOOL_CALLS]get_weather[ARGS]{",
        "llama3": '{"name": "get_weather", "parameters": {',
        "gemma3": "```tool_code\n[get_weather(city=",
    }[f.name]
    assert text.startswith(native) or native in text, text
    syntax = forced_syntax(fmt.tools, fmt.harmony)
    p = ReplyParser(
        fmt,
        True,
        False,
        ToolParsing(("get_weather",), forced, True, syntax if syntax is not fmt.tools else None),
    )
    reasoning, content, calls = run(p, [text])
    assert content.strip() == "" and len(calls) == 1, (text, content, calls)
    name, args = calls[0]
    assert name == "get_weather"
    jsonschema.validate(args, params)


def test_anthropic_and_responses_thinking_controls_reach_the_chat_call():
    from app.server.anthropic import chat_fields as messages_fields
    from app.server.anthropic_protocol import MessagesRequest
    from app.server.responses import chat_fields as responses_fields
    from app.server.responses_protocol import ResponsesRequest
    from app.server.responses_tools import ResponseTools

    base = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    off = messages_fields(MessagesRequest.model_validate({**base, "thinking": {"type": "disabled"}}))
    assert off["reasoning_effort"] == "none"
    capped = messages_fields(
        MessagesRequest.model_validate({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    )
    assert capped["thinking_budget"] == 1024 and "reasoning_effort" not in capped
    high = messages_fields(MessagesRequest.model_validate({**base, "output_config": {"effort": "max"}}))
    assert high["reasoning_effort"] == "high"
    # an earlier turn's thinking block goes back to the template (as reasoning_content)
    turn = messages_fields(
        MessagesRequest.model_validate(
            {
                **base,
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "hmm", "signature": ""},
                            {"type": "text", "text": "b"},
                        ],
                    },
                    {"role": "user", "content": "c"},
                ],
            }
        )
    )
    assert turn["messages"][1]["reasoning_content"] == "hmm"

    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "reasoning": {"effort": "low"},
            "chat_template_kwargs": {"enable_thinking": False},
            "input": [
                {"role": "user", "content": "a"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "plan"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "14°C"},
            ],
        }
    )
    fields = responses_fields(body, [], ResponseTools())
    assert fields["reasoning_effort"] == "low" and fields["chat_template_kwargs"] == {
        "enable_thinking": False
    }
    assert fields["messages"][1]["reasoning_content"] == "plan" and fields["messages"][1]["tool_calls"]


def test_overrides_a_corrected_template_and_a_named_format(tmp_path):
    from mlx_engine.config import EngineConfig
    from mlx_engine.errors import ConfigError

    f = next(x for x in FAMILIES if x.name == "magistral")
    tj, cfg = f.tokenizer()
    tok = Tokenizer(HFTokenizer.from_str(tj), eos_tokens=[f.eos], chat_template=None)
    assert tok.reply_format.tools is None  # no template: nothing says how it calls tools
    tok.configure_replies(template=f.template)  # --chat-template FILE's text
    assert tok.reply_format.tools.name == "mistral" and tok.reply_format.think is not None
    assert "[INST]hi[/INST]" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.special_markers  # [THINK], [TOOL_CALLS], [ARGS] decode as text for the parser
    tok.configure_replies("none", "hermes", f.template)  # --reasoning-format none --tool-format hermes
    assert tok.reply_format.think is None and tok.reply_format.tools.name == "hermes"
    for bad, option in (
        ({"tool_format": "nope"}, "tool_format"),
        ({"reasoning_format": "raw"}, "reasoning_format"),
        ({"chat_template": str(tmp_path / "missing.jinja")}, "chat_template"),
        ({"reasoning_budget": -1}, "reasoning_budget"),
    ):
        with pytest.raises(ConfigError) as e:
            EngineConfig(**bad).validate(memory_bytes=2**34)
        assert e.value.option == option


def test_mistral_calls_with_call_ids_keep_their_names():
    from mlx_engine.tokenization.tool_formats import syntax_named

    calls = syntax_named("mistral").parse_body('get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}', None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_an_effort_above_high_reads_as_high_and_is_never_a_400():
    oss = tokenizer(next(f for f in FAMILIES if f.name == "gpt_oss"))
    assert oss.reply_format.thinking_kwargs("xhigh") == {"reasoning_effort": "high"}
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "xhigh"}
    )
    assert body.reasoning_effort == "xhigh"
