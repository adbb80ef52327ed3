"""The reasoning splitter (mlx_engine/tokenization/reasoning.py): thinking apart from the answer,
the same for any split of a reply into streamed pieces, no marker text in either part."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_engine.tokenization.reasoning import (
    ReasoningSplitter,
    ThinkMarkers,
    infer_markers,
    opens_thinking,
)

THINK = ThinkMarkers("<think>", "</think>")
MAGISTRAL = ThinkMarkers("[THINK]", "[/THINK]")

REPLIES = [  # (markers, starts inside, reply, reasoning, content)
    (
        THINK,
        False,
        "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.",
        "\nThe user wants 2+2.\n",
        "It is 4.",
    ),
    (THINK, True, "Okay, 2+2 is 4.\n</think>\n\n4", "Okay, 2+2 is 4.\n", "4"),  # R1 distill: prompt opened it
    (THINK, False, "No thinking here.", "", "No thinking here."),
    (THINK, False, "  <think>a</think>b", "a", "b"),
    (THINK, False, "<thinking> is not a marker", "", "<thinking> is not a marker"),
    (THINK, False, "Answer first <think>then this</think>", "", "Answer first <think>then this</think>"),
    (THINK, False, "<think>cut by max_tokens </thi", "cut by max_tokens ", ""),
    (THINK, False, "<think>ünïcødé 🤔</think>ответ", "ünïcødé 🤔", "ответ"),
    (THINK, False, "<think></think>\n\nhi", "", "hi"),  # Qwen3 with thinking off writes an empty section
    (MAGISTRAL, False, "[THINK]Let me see.[/THINK]Paris.", "Let me see.", "Paris."),
]


def run(markers, inside, pieces):
    s = ReasoningSplitter(markers, inside)
    r, c = "", ""
    for p in pieces:
        a, b = s.feed(p)
        r, c = r + a, c + b
    a, b = s.finish()
    return r + a, c + b


def test_known_replies_split_whole_and_token_by_token():
    for markers, inside, reply, reasoning, content in REPLIES:
        assert run(markers, inside, [reply]) == (reasoning, content), reply
        assert run(markers, inside, list(reply)) == (reasoning, content), reply


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_parts(data):
    markers, inside, reply, reasoning, content = data.draw(st.sampled_from(REPLIES))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=12)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
    assert run(markers, inside, pieces) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<>/thinkab \n", max_size=40), st.text(alphabet="<>/thinkab \n", max_size=40))
def test_no_marker_leaks_from_a_well_formed_reply(thought, answer):
    if "<think>" in thought or "</think>" in thought or answer.lstrip().startswith("<think"):
        return
    r, c = run(THINK, False, ["<think>" + thought + "</think>" + answer])
    assert r == thought and c == answer.lstrip() and "</think>" not in r


def test_markers_are_found_in_the_vocabulary_or_the_template():
    single = {"<think>", "</think>"}.__contains__
    assert infer_markers(None, single) == THINK
    assert infer_markers("{{ '[THINK]' }}...{{ '[/THINK]' }}", lambda t: False) == MAGISTRAL
    assert infer_markers("{{ messages }}", lambda t: False) is None
    assert infer_markers(None, {"<think>"}.__contains__) is None  # half a pair is no pair


def test_where_a_reply_starts():
    assert opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)  # thinking off
    assert not opens_thinking("<|im_start|>assistant\n", THINK)
    assert not opens_thinking("<think>x</think> then <think>", ThinkMarkers("[THINK]", "[/THINK]"))
