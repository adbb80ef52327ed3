"""The chat app shows a thinking model's reasoning apart from its answer (issue 31): dimmed in a
section of its own that folds away when the answer starts, ``t`` opens it again, the reply's
meta line counts the thinking tokens, and ``/think`` sets thinking for the replies after it."""

from __future__ import annotations

import pytest
from textual.widgets import Collapsible

from app.tui.widgets import MessageView
from tests.test_tui import count_handled_lines, data_dir, loaded, make_app, reply_done, type_and_send  # noqa: F401
from tests.tiny_models import make_thinking_model_dir

THOUGHT = "Greeting: answer warmly"
ANSWER = "Hello! Nice to see you."


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return make_thinking_model_dir(tmp_path_factory.mktemp("thinker"), f"<think>{THOUGHT}</think> {ANSWER}")


async def test_thinking_is_shown_apart_and_folds_when_the_answer_starts(thinker, data_dir):  # noqa: F811
    app = make_app(thinker)
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/temp 0")
        await type_and_send(pilot, "/think off")
        assert app.think == "off"
        await type_and_send(pilot, "/think bogus")
        assert app.think == "off"  # refused, unchanged
        await type_and_send(pilot, "/think auto")
        assert app.think is None
        await type_and_send(pilot, "hi")
        await reply_done(pilot)
        reply = app.conv.messages[-1]
        assert reply.content == ANSWER  # no thinking and no marker in the answer
        view = list(app.query(MessageView))[-1]
        assert view.reasoning == THOUGHT
        fold = view.query_one(Collapsible)
        assert fold.collapsed  # the answer began: the thinking folded away
        assert "thinking" in reply.meta
        view.focus()
        await pilot.press("t")
        assert not fold.collapsed
        await pilot.press("t")
        assert fold.collapsed
