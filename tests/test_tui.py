"""`duet chat` flows driven with Textual's pilot, on tiny random-weight models (no hub, no GPU)."""

from __future__ import annotations

import json
import time
from functools import partial

import pytest

from app.tui.app import ChatApp, key_label
from app.tui.backends import LocalBackend
from app.tui.screens import ErrorScreen, HelpScreen, ModelPicker, SettingsScreen, SystemPromptEditor
from app.tui.store import Store
from app.tui.widgets import MessageView, PromptInput
from mlx_engine.engine import EngineConfig
from mlx_engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    d = tmp_path / "data"
    monkeypatch.setenv("DUET_DATA_DIR", str(d))
    monkeypatch.setattr("app.tui.app.cached_models", lambda: [])
    return d


def make_app(model) -> ChatApp:
    return ChatApp(
        None if model is None else str(model),
        load_backend=partial(LocalBackend.load, config=EngineConfig(cache_gb=0.02)),
    )


async def until(pilot, cond, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)
    await pilot.pause()  # let what the condition announced (a screen, a widget) mount


async def loaded(pilot):
    await until(pilot, lambda: pilot.app.backend is not None, what="the model to load")


async def type_and_send(pilot, text: str):
    pilot.app.prompt.focus()
    pilot.app.prompt.load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def reply_done(pilot):
    await pilot.pause(0.05)
    await until(pilot, lambda: not pilot.app.generating, what="the reply to finish")
    await pilot.pause()


async def greedy_reference(engine, messages, max_tokens) -> str:
    out = []
    req = GenerationRequest(
        messages=messages, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)
    )
    async for ev in engine.generate(req):
        out.append(ev.text)
    return "".join(out)


async def test_send_message_streams_reply_and_saves(tiny_dirs, data_dir, monkeypatch):
    appended: list[str] = []
    real_append = MessageView.append

    async def spy(self, text):
        appended.append(text)
        await real_append(self, text)

    monkeypatch.setattr(MessageView, "append", spy)
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/temp 0")
        await type_and_send(pilot, "/max 24")
        await type_and_send(pilot, "Hello there")
        assert app.generating or app.conv.messages[-1].content, "sending did not start a reply"
        await reply_done(pilot)
        user, reply = app.conv.messages
        assert (user.role, user.content) == ("user", "Hello there")
        assert reply.role == "assistant" and reply.content
        assert len(appended) > 1, "the reply arrived in one piece instead of streaming token by token"
        assert "".join(appended) == reply.content
        expected = await greedy_reference(
            app.backend.engine, [{"role": "user", "content": "Hello there"}], 24
        )
        assert reply.content == expected
        views = app.query(MessageView)
        assert [v.role for v in views] == ["user", "assistant"]
        assert "reply tok" in reply.meta and "tok/s" in reply.meta
        status = str(app.query_one("#status").render())
        assert "llama" in status and "/2,048" in status and "tok/s" in status and "KV" in status
        assert app.context_used == reply_usage_total(app)
        assert app.prompt.text == ""
    saved = list((data_dir / "conversations").glob("*.json"))
    assert len(saved) == 1
    d = json.loads(saved[0].read_text())
    assert [m["content"] for m in d["messages"]] == ["Hello there", expected]
    assert d["sampling"]["temperature"] == 0.0 and d["sampling"]["max_tokens"] == 24
    assert json.loads((data_dir / "input_history.json").read_text()) == ["/temp 0", "/max 24", "Hello there"]


def reply_usage_total(app) -> int:
    return app.last_usage.prompt_tokens + app.last_usage.completion_tokens


async def test_escape_stops_mid_stream_and_frees_the_engine(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/max 1500")
        await type_and_send(pilot, "/temp 0")  # greedy: this tiny model's reply runs all 1500 tokens
        await type_and_send(pilot, "Write a very long story")
        await until(
            pilot,
            lambda: len(app.conv.messages) == 2 and len(app.conv.messages[-1].content) > 5,
            what="some streamed text",
        )
        await pilot.press("escape")
        await reply_done(pilot)
        reply = app.conv.messages[-1]
        assert reply.meta == "stopped"
        assert 5 < len(reply.content)
        assert app.query(MessageView).last().query_one(".meta").render().plain == "stopped"
        engine = app.backend.engine
        await until(
            pilot,
            lambda: engine.stats().running == 0 and engine.allocator.num_used == 0,
            what="the engine to drop the cancelled request",
        )
        assert engine.stats().steps < 1500, "the request ran to max_tokens instead of stopping"
        # the app keeps working after a stop (in a new chat: how long the stopped reply grew depends
        # on timing, and with it the history could outgrow the tiny model's 2048-token context)
        await type_and_send(pilot, "/new")
        await type_and_send(pilot, "/max 4")
        await type_and_send(pilot, "again")
        await reply_done(pilot)
        assert "prompt tok" in app.conv.messages[-1].meta  # a usage line, not an error
        assert len(app.conv.messages) == 2


async def test_slash_commands_and_settings(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        for cmd in ("/temp 0.3", "/top_p 0.8", "/top_k 5", "/min_p 0.1", "/max 7", "/seed 42"):
            await type_and_send(pilot, cmd)
        s = app.conv.sampling
        assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_tokens, s.seed) == (0.3, 0.8, 5, 0.1, 7, 42)
        await type_and_send(pilot, "/seed off")
        assert app.conv.sampling.seed is None
        for bad in ("/temp abc", "/top_p 0", "/max -3", "/temp"):
            await type_and_send(pilot, bad)
        assert app.conv.sampling == s.with_value("seed", "off"), "a bad value changed the settings"
        await type_and_send(pilot, "/system You are terse.")
        assert app.conv.system == "You are terse."
        assert app.conv.chat_messages() == [{"role": "system", "content": "You are terse."}]

        await type_and_send(pilot, "/nonsense")
        assert any("Unknown command /nonsense" in n.message for n in app._notifications)

        await type_and_send(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        text = app.screen.plain
        for b in ChatApp.BINDINGS:
            assert key_label(b.key) in text, b.key
        for cmd in ("/model", "/system", "/temp", "/save", "/new", "/help"):
            assert f"\n{cmd}" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        await type_and_send(pilot, "/settings")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature").value = "1.5"
        app.screen.query_one("#max_tokens").value = "zero"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen), "a bad value was accepted"
        assert "max_tokens" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#max_tokens").value = "64"
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        assert (app.conv.sampling.temperature, app.conv.sampling.max_tokens) == (1.5, 64)

        await type_and_send(pilot, "/system")
        assert isinstance(app.screen, SystemPromptEditor)
        app.screen.query_one("#system").load_text("Answer in French.")
        await pilot.press("ctrl+s")
        assert app.conv.system == "Answer in French."

        await type_and_send(pilot, "/model")
        assert isinstance(app.screen, ModelPicker)
        await pilot.press("escape")
        assert not isinstance(app.screen, ModelPicker)


async def test_input_keys_history_and_multiline(tiny_dirs, data_dir):
    Store(data_dir).save_history(["older message"])
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/max 2")
        await pilot.press(*"line one", "ctrl+j", *"line two")
        assert app.prompt.text == "line one\nline two"
        await pilot.press("enter")
        await reply_done(pilot)
        assert app.conv.messages[0].content == "line one\nline two"
        prompt = app.query_one(PromptInput)
        await pilot.press("up")
        assert prompt.text == "line one\nline two"
        await pilot.press("up")
        assert prompt.text == "/max 2"
        await pilot.press("up")
        assert prompt.text == "older message"
        await pilot.press("up")
        assert prompt.text == "older message"
        await pilot.press("down", "down")
        assert prompt.text == "line one\nline two"
        await pilot.press("down")
        assert prompt.text == ""
        await pilot.press(*"draft")
        await pilot.press("up")
        assert prompt.text == "draft", "Up on a typed draft must move the cursor, not replace the draft"
        # 80 columns: the sidebar starts hidden and Ctrl+B toggles it
        sidebar = app.query_one("#sidebar")
        assert not sidebar.display
        await pilot.press("ctrl+b")
        assert sidebar.display
        await pilot.press("ctrl+b")
        assert not sidebar.display
        await pilot.press("ctrl+t")
        assert not app.current_theme.dark


async def test_regenerate_copy_and_new_chat(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        for cmd in ("/temp 0", "/max 12", "hi"):
            await type_and_send(pilot, cmd)
        await reply_done(pilot)
        first = app.conv.messages[-1].content
        await pilot.press("ctrl+o")
        assert app.clipboard == first
        await type_and_send(pilot, "/temp 1")
        await type_and_send(pilot, "/seed 7")
        await pilot.press("ctrl+r")
        await reply_done(pilot)
        assert [m.role for m in app.conv.messages] == ["user", "assistant"]
        assert len(app.query(MessageView)) == 2
        second = app.conv.messages[-1].content
        assert second and second != first  # sampled at temperature 1 with another seed
        views = app.query(MessageView)
        views.first().focus()
        await pilot.press("c")
        assert app.clipboard == "hi"
        old_id = app.conv.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.conv.messages == [] and app.conv.id != old_id
        assert len(app.query(MessageView)) == 0
        assert app.conv.sampling.seed == 7, "a new chat keeps the sampling settings"
        assert Store(data_dir).load(old_id).messages[-1].content == second


async def test_save_and_reload_conversation(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test(size=(120, 36)) as pilot:
        await loaded(pilot)
        for cmd in ("/max 6", "/system Be brief.", "first question"):
            await type_and_send(pilot, cmd)
        await reply_done(pilot)
        await type_and_send(pilot, "/save Trip plans")
        conv_id, saved_msgs = app.conv.id, [(m.role, m.content) for m in app.conv.messages]
        assert (data_dir / "conversations" / f"{conv_id}.json").exists()
        await type_and_send(pilot, "/new")
        assert app.conv.messages == []
        lv = app.query_one("#conversations")
        assert lv.display and len(lv.children) == 1
        lv.focus()
        lv.index = 0
        await pilot.press("enter")
        await pilot.pause()
        assert app.conv.id == conv_id
        assert [(m.role, m.content) for m in app.conv.messages] == saved_msgs
        assert [v.content for v in app.query(MessageView)] == [c for _, c in saved_msgs]
        assert app.conv.system == "Be brief." and app.conv.title == "Trip plans"
        assert app.context_used and app.context_used > 0

    # a new run lists it and continues it
    app2 = make_app(tiny_dirs("llama"))
    async with app2.run_test(size=(120, 36)) as pilot:
        await loaded(pilot)
        lv = app2.query_one("#conversations")
        assert len(lv.children) == 1
        assert "Trip plans" in str(lv.children[0].query_one("Label").render())
        lv.focus()
        lv.index = 0
        await pilot.press("enter")
        await pilot.pause()
        await type_and_send(pilot, "follow-up")
        await reply_done(pilot)
        assert [m.role for m in app2.conv.messages] == ["user", "assistant", "user", "assistant"]
    assert len(Store(data_dir).load(conv_id).messages) == 4


async def test_bad_model_path_shows_error_then_pick_another(tiny_dirs, data_dir, tmp_path):
    app = make_app(tmp_path / "no-such-model")
    async with app.run_test() as pilot:
        await until(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the error screen")
        msg = str(app.screen.query_one("#message").render())
        assert "no-such-model" in msg and "not found" in msg
        assert app.screen.query_one("#quit"), "with no model loaded the alternative is to quit"
        await pilot.click("#pick")
        await pilot.pause()
        assert isinstance(app.screen, ModelPicker)
        app.screen.query_one("#spec").value = str(tiny_dirs("llama"))
        app.screen.query_one("#spec").focus()
        await pilot.press("enter")
        await loaded(pilot)
        assert app.backend.name == "llama"
        assert not isinstance(app.screen, ErrorScreen | ModelPicker)
        # a repo id offline is a clear error too, and the loaded model stays
        await type_and_send(pilot, "/model someone/not-downloaded")
        await until(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the offline error")
        msg = str(app.screen.query_one("#message").render())
        assert "someone/not-downloaded" in msg and ("HF_HUB_OFFLINE" in msg or "cache" in msg)
        await pilot.click("#keep")
        assert app.backend.name == "llama"


async def test_switch_model_mid_conversation(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    qwen = tiny_dirs("qwen3")
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/max 5")
        await type_and_send(pilot, "hello")
        await reply_done(pilot)
        old = app.backend
        await pilot.press("f2")
        assert isinstance(app.screen, ModelPicker)
        app.screen.query_one("#spec").value = str(qwen)
        app.screen.query_one("#spec").focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.backend is not old, what="the second model")
        assert app.backend.name == "qwen3" and app.conv.model == "qwen3"
        await until(pilot, lambda: not old.engine._thread.is_alive(), what="the old engine to shut down")
        await type_and_send(pilot, "and now?")
        await reply_done(pilot)
        assert len(app.conv.messages) == 4 and app.conv.messages[-1].content
        assert app.query(MessageView).last().label == "qwen3"
        # the picker lists the bundled model and what was loaded before
        await pilot.press("f2")
        labels = [spec for spec, _ in app.screen.choices]
        assert labels[0] == "SmolLM2-135M-Instruct-Q4_1" and str(tiny_dirs("llama")) in labels
        await pilot.press("escape")


async def test_generation_error_is_inline_and_app_keeps_running(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/max 3")
        await type_and_send(pilot, "word " * 2500)  # longer than the 2048-token context
        await reply_done(pilot)
        reply = app.conv.messages[-1]
        assert reply.meta.startswith("error:") and "context" in reply.meta
        assert app.query(MessageView).last().has_class("-error")
        await type_and_send(pilot, "/new")
        await type_and_send(pilot, "short")
        await reply_done(pilot)
        assert not app.conv.messages[-1].meta.startswith("error")
        # a failure while streaming lands inline too: the model pass fails from the 12th step on
        # (deterministic, unlike racing a shutdown against a reply that may reach EOS first)
        runner = app.backend.engine.runner
        real_forward, calls = runner.forward, []

        def failing_forward(rows):
            calls.append(1)
            if len(calls) > 12:
                raise RuntimeError("injected failure")
            return real_forward(rows)

        runner.forward = failing_forward
        await type_and_send(pilot, "/max 1500")
        await type_and_send(pilot, "/temp 0")
        await type_and_send(pilot, "Write a very long story")
        await reply_done(pilot)
        assert app.conv.messages[-1].meta == "error: generation failed: injected failure"
        assert app.conv.messages[-1].content, "the text streamed before the error is kept"


async def test_ctrl_c_quits_and_saves(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "/max 3")
        await type_and_send(pilot, "remember me")
        await reply_done(pilot)
        engine = app.backend.engine
        await pilot.press("ctrl+c")
        await pilot.pause()
    assert app.return_code == 0
    assert not engine._thread.is_alive(), "the engine thread outlived the app"
    (saved,) = Store(data_dir).list()
    assert saved.messages[0].content == "remember me"
