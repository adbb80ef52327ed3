"""`duet chat` flows driven with Textual's pilot, on tiny random-weight models (no hub, no GPU)."""

from __future__ import annotations

import json
import threading
import time
from functools import partial

import pytest

from app.tui.app import ChatApp, key_label
from app.tui.backends import LocalBackend, Resources
from app.tui.model_picker import ModelRow
from app.tui.screens import ErrorScreen, HelpScreen, ModelPicker, SettingsScreen, SystemPromptEditor
from app.tui.settings import Sampling
from app.tui.store import NO_HISTORY_ENV, Store
from app.tui.widgets import MessageView, PromptInput
from mlx_engine import defaults
from mlx_engine.engine import EngineConfig
from mlx_engine.request import GenerationEvent, GenerationRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

BUNDLED_ROW = ModelRow("SmolLM2-135M-Instruct-Q4_1", "Q4_1", 90_000_000, "bundled")


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    d = tmp_path / "data"
    monkeypatch.setenv("DUET_DATA_DIR", str(d))
    monkeypatch.delenv(NO_HISTORY_ENV, raising=False)
    monkeypatch.setattr("app.tui.model_picker.local_models", lambda: [BUNDLED_ROW])
    return d


@pytest.fixture(autouse=True)
def count_handled_lines(monkeypatch):
    """Counts the lines the chat has finished handling (a message sent, a slash command run), so a
    test waits for that instead of for a pause that a loaded machine can outlast."""
    real = ChatApp.on_prompt_input_submitted

    async def counted(self, event):
        try:
            await real(self, event)
        finally:
            self.lines_handled = lines_handled(self) + 1

    monkeypatch.setattr(ChatApp, "on_prompt_input_submitted", counted)


def lines_handled(app) -> int:
    return getattr(app, "lines_handled", 0)


def make_app(model, **config) -> ChatApp:
    return ChatApp(
        None if model is None else str(model),
        load_backend=partial(LocalBackend.load, config=EngineConfig(**{"cache_gb": 0.02, **config})),
    )


async def until(pilot, cond, timeout: float = 60.0, what: str = "condition"):
    """Wait for a condition; the timeout is only a deadline for a hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)
    await pilot.pause()  # let what the condition announced (a screen, a widget) mount


async def loaded(pilot):
    await until(pilot, lambda: pilot.app.backend is not None, what="the model to load")


async def press_enter(pilot):
    """Enter in the prompt; returns once the app has handled the line it sent."""
    before = lines_handled(pilot.app)
    await pilot.press("enter")
    await until(pilot, lambda: lines_handled(pilot.app) > before, what="the app to handle the line")


async def type_and_send(pilot, text: str):
    pilot.app.prompt.focus()
    pilot.app.prompt.load_text(text)
    await press_enter(pilot)


async def reply_done(pilot):
    await until(pilot, lambda: not pilot.app.generating, what="the reply to finish")


async def greedy_reference(engine, messages, max_tokens) -> str:
    out = []
    req = GenerationRequest(
        messages=messages, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)
    )
    async for ev in engine.generate(req):
        out.append(ev.text)
    return "".join(out)


class EngineGate:
    """Holds the engine's model pass after ``passes`` passes until the test releases it: a reply
    that cannot finish before the test stops it, however fast the model is. Also records every
    ``engine.cancel`` call. Use as a context manager; leaving it releases the engine and restores it."""

    def __init__(self, engine, passes: int):
        self.engine, self.passes, self.calls = engine, passes, 0
        self.blocked = threading.Event()  # a pass is being held
        self.cancelled = threading.Event()  # engine.cancel was called
        self._open = threading.Event()
        self._forward, self._cancel = engine.runner.forward, engine.cancel

    def __enter__(self) -> EngineGate:
        self.engine.runner.forward = self._held_forward
        self.engine.cancel = self._spy_cancel
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.engine.runner.forward = self._forward
        del self.engine.cancel  # the class's method again

    def release(self) -> None:
        self._open.set()

    def _held_forward(self, rows):
        self.calls += 1
        if self.calls > self.passes and not self._open.is_set():
            self.blocked.set()
            if not self._open.wait(120):
                raise RuntimeError("the test never released the engine")
        return self._forward(rows)

    def _spy_cancel(self, request_id: str) -> None:
        self.cancelled.set()
        self._cancel(request_id)


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
        engine = app.backend.engine
        await type_and_send(pilot, "/temp 0")
        await type_and_send(pilot, "/max 1500")
        # the engine is held after 20 passes: the reply is mid-stream when Esc comes, however fast
        # the model runs and however late the key arrives
        with EngineGate(engine, passes=20) as gate:
            await type_and_send(pilot, "Write a very long story")
            await until(
                pilot,
                lambda: gate.blocked.is_set() and app.conv.messages[-1].content,
                what="streamed text, then the engine held",
            )
            # stats() is published between steps: the step the gate holds counts once it ends
            steps = engine.stats().steps + 1
            await pilot.press("escape")
            await reply_done(pilot)  # while the engine is still held: the stop does not wait for it
            reply = app.conv.messages[-1]
            assert reply.meta == "stopped"
            assert app.query(MessageView).last().query_one(".meta").render().plain == "stopped"
            assert gate.cancelled.is_set(), "Esc did not cancel the request in the engine"
            assert (s := engine.stats()).steps == steps - 1 and s.running == 1
        await until(
            pilot,
            lambda: (s := engine.stats()).running == 0 and s.kv_blocks_used == 0,
            what="the engine to drop the cancelled request",
        )
        assert engine.stats().steps == steps, "the engine ran another step for a stopped reply"
        expected = await greedy_reference(
            engine, [{"role": "user", "content": "Write a very long story"}], 20
        )
        assert reply.content and expected.startswith(reply.content), (
            "the text streamed before the stop is kept"
        )
        # the app keeps working after a stop
        await type_and_send(pilot, "/max 4")
        await type_and_send(pilot, "again")
        await reply_done(pilot)
        assert "prompt tok" in app.conv.messages[-1].meta  # a usage line, not an error
        assert len(app.conv.messages) == 4


class FloodBackend:
    """A backend that never pauses between events: the worst case of a model far faster than the UI
    (the engine's queue never blocks once the UI is behind). Stops only when closed."""

    name = "flood"
    context_length = None

    def __init__(self):
        self.events = 0
        self.closed = False
        self.events_at_stop: int | None = None  # events taken when the app called stop()

    def count_tokens(self, messages):
        return None

    async def stream(self, messages, sampling, think=None):
        try:
            while True:
                self.events += 1
                yield GenerationEvent("flood", "word ", [1])
        finally:
            self.closed = True

    def stop(self) -> None:
        self.events_at_stop = self.events

    def resources(self) -> Resources:
        return Resources()

    def peer_sources(self) -> list:
        return []

    def prefill_report(self, usage, request_id) -> dict:
        return {}

    def close(self) -> None:
        pass


async def test_escape_stops_a_reply_that_never_pauses(data_dir):
    backend = FloodBackend()
    app = ChatApp(None, load_backend=lambda spec: backend)
    async with app.run_test() as pilot:
        await loaded(pilot)
        await type_and_send(pilot, "flood me")
        await until(pilot, lambda: backend.events > 100, what="the flood to start")
        await pilot.press("escape")
        await reply_done(pilot)
        assert backend.events_at_stop is not None, "Esc did not stop the request in the backend"
        assert backend.closed, "the stream was abandoned instead of closed"
        # the worker hands the loop back after every event, and Esc cancels it: not one more event
        # is taken once the key is handled, however many were ready
        assert backend.events == backend.events_at_stop
        events = backend.events
        reply = app.conv.messages[-1]
        assert reply.meta == "stopped" and reply.content.startswith("word word")
        # the UI stays responsive: it takes the next line at once
        await type_and_send(pilot, "/temp 0.5")
        assert app.conv.sampling.temperature == 0.5
        assert backend.events == events, "the stopped stream kept running"


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
        for bad in ("/temp abc", "/top_p 0", "/max -3", "/max 0", "/temp"):
            await type_and_send(pilot, bad)
        assert app.conv.sampling == s.with_value("seed", "off"), "a bad value changed the settings"
        assert any("or auto" in n.message for n in app._notifications), "/max 0 should point at /max auto"
        await type_and_send(pilot, "/max auto")
        assert app.conv.sampling.max_tokens is None and "max auto" in app.conv.sampling.summary()
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
        for cmd in (
            "/model",
            "/system",
            "/temp",
            "/max",
            "/save",
            "/new",
            "/clear-history",
            "/history",
            "/peers",
            "/help",
        ):
            assert f"\n{cmd}" in text
        assert "/peers pair <code> <host[:port]>" in text and "/peers unpair <name>" in text
        assert "input_history.json" in text and f"{NO_HISTORY_ENV}=1" in text, (
            "the saved input history is told"
        )
        assert "auto" in text and "until the model stops" in text
        assert not app.query_one("#peers").display, "a peers panel with no peer to show"
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen), what="the help to close")

        await type_and_send(pilot, "/settings")
        assert isinstance(app.screen, SettingsScreen)
        assert app.screen.query_one("#max_tokens").value == "", "max tokens auto is an empty field"
        app.screen.query_one("#temperature").value = "1.5"
        app.screen.query_one("#max_tokens").value = "zero"
        await pilot.press("ctrl+s")
        await until(
            pilot, lambda: "max_tokens" in str(app.screen.query_one("#error").render()), what="the error line"
        )
        assert isinstance(app.screen, SettingsScreen), "a bad value was accepted"
        app.screen.query_one("#max_tokens").value = "64"
        await pilot.press("ctrl+s")
        await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the settings to close")
        assert (app.conv.sampling.temperature, app.conv.sampling.max_tokens) == (1.5, 64)
        await type_and_send(pilot, "/settings")
        app.screen.query_one("#max_tokens").value = ""
        await pilot.press("ctrl+s")
        await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the settings to close")
        assert app.conv.sampling.max_tokens is None, "an empty max tokens field is auto"

        await type_and_send(pilot, "/system")
        assert isinstance(app.screen, SystemPromptEditor)
        app.screen.query_one("#system").load_text("Answer in French.")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.conv.system == "Answer in French.", what="the system prompt")

        await type_and_send(pilot, "/model")
        assert isinstance(app.screen, ModelPicker)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ModelPicker), what="the picker to close")


def test_chat_sampling_defaults_are_the_shared_ones():
    s = Sampling()
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_tokens, s.seed) == (
        defaults.TEMPERATURE,
        defaults.TOP_P,
        defaults.TOP_K,
        defaults.MIN_P,
        defaults.MAX_TOKENS,
        None,
    )
    assert s.params().repetition_penalty == defaults.REPETITION_PENALTY
    assert Sampling(max_tokens=None).summary().endswith("max auto · seed random")


async def test_max_tokens_auto_runs_until_the_context_is_full(tiny_dirs, data_dir):
    # a KV cache of 12 blocks of 16 tokens: "until the context is full" is 192 tokens here
    app = make_app(tiny_dirs("llama"), cache_gb=0.0002)
    async with app.run_test() as pilot:
        await loaded(pilot)
        cap = (app.backend.engine.allocator.num_blocks - 1) * app.backend.engine.allocator.block_size
        await type_and_send(pilot, "/temp 0")  # greedy: this tiny model never says EOS early
        await type_and_send(pilot, "Write a very long story")
        await reply_done(pilot)
        reply = app.conv.messages[-1]
        assert reply.meta.endswith("· context full"), reply.meta
        assert app.last_usage.total_tokens == cap


async def test_input_keys_history_and_multiline(tiny_dirs, data_dir):
    Store(data_dir).save_history(["older message"])
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        prompt = app.query_one(PromptInput)

        async def press(key: str, text: str):
            await pilot.press(key)
            await until(pilot, lambda: prompt.text == text, what=f"{key} to give {text!r}")

        await type_and_send(pilot, "/max 2")
        await pilot.press(*"line one", "ctrl+j", *"line two")
        await until(pilot, lambda: prompt.text == "line one\nline two", what="the typed lines")
        await press_enter(pilot)
        await reply_done(pilot)
        assert app.conv.messages[0].content == "line one\nline two"
        await press("up", "line one\nline two")
        await press("up", "/max 2")
        await press("up", "older message")
        await pilot.press("up")  # the oldest line: Up stays there (the cursor goes to the line start)
        await until(pilot, lambda: prompt.cursor_location == (0, 0), what="the cursor at the start")
        assert prompt.text == "older message"
        await press("down", "/max 2")
        await press("down", "line one\nline two")
        await press("down", "")
        await pilot.press(*"draft")
        await until(pilot, lambda: prompt.text == "draft", what="the draft")
        await pilot.press("up")
        await until(pilot, lambda: prompt.cursor_location == (0, 0), what="Up to move the cursor")
        assert prompt.text == "draft", "Up on a typed draft must move the cursor, not replace the draft"
        # 80 columns: the sidebar starts hidden and Ctrl+B toggles it
        sidebar = app.query_one("#sidebar")
        assert not sidebar.display
        await pilot.press("ctrl+b")
        await until(pilot, lambda: sidebar.display, what="the sidebar to show")
        await pilot.press("ctrl+b")
        await until(pilot, lambda: not sidebar.display, what="the sidebar to hide")
        await pilot.press("ctrl+t")
        await until(pilot, lambda: not app.current_theme.dark, what="the light theme")


async def test_input_history_can_be_cleared_and_turned_off(tiny_dirs, data_dir, monkeypatch):
    store = Store(data_dir)
    store.save_history(["a secret I typed"])
    history = data_dir / "input_history.json"

    async def session(*lines: str, env_off: bool = False) -> ChatApp:
        if env_off:
            monkeypatch.setenv(NO_HISTORY_ENV, "1")
        else:
            monkeypatch.delenv(NO_HISTORY_ENV, raising=False)
        app = make_app(tiny_dirs("llama"))
        async with app.run_test() as pilot:
            await loaded(pilot)
            for line in lines:
                await type_and_send(pilot, line)
            if lines[0] == "/clear-history":
                assert not history.exists(), "/clear-history did not delete the file"
                # Up recalls the line sent since, and a second Up stays there: the older line is gone
                await pilot.press("up")
                await until(pilot, lambda: app.prompt.text == lines[-1], what="Up to recall the last line")
                await pilot.press("up")
                await until(pilot, lambda: app.prompt.cursor_location == (0, 0), what="the second Up")
                assert app.prompt.text == lines[-1], "a cleared line is still recalled"
        return app

    await session("/clear-history", "/temp 0.5")
    assert json.loads(history.read_text()) == ["/temp 0.5"], "saving goes on after a clear"
    # the saved setting: off is kept between runs, and nothing is written while it is off
    await session("/history off", "/temp 0.6")
    assert json.loads((data_dir / "preferences.json").read_text())["save_input_history"] is False
    await session("/clear-history", "/temp 0.7")
    assert not history.exists()
    app = await session("/history on", "/temp 0.8")
    assert json.loads(history.read_text()) == ["/history on", "/temp 0.8"]
    assert app.saves_history
    # DUET_NO_HISTORY=1 turns it off whatever the setting says
    history.unlink()
    app = await session("/temp 0.9", "/history on", env_off=True)
    assert not history.exists() and not app.saves_history
    assert any(NO_HISTORY_ENV in n.message for n in app._notifications), (
        "/history on must say why it stays off"
    )


async def test_regenerate_copy_and_new_chat(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test() as pilot:
        await loaded(pilot)
        for cmd in ("/temp 0", "/max 12", "hi"):
            await type_and_send(pilot, cmd)
        await reply_done(pilot)
        first_reply = app.conv.messages[-1]
        first = first_reply.content
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.clipboard == first, what="the reply on the clipboard")
        await type_and_send(pilot, "/temp 1")
        await type_and_send(pilot, "/seed 7")
        await pilot.press("ctrl+r")
        await until(
            pilot,
            lambda: app.conv.messages[-1] is not first_reply and not app.generating,
            what="the regenerated reply",
        )
        assert [m.role for m in app.conv.messages] == ["user", "assistant"]
        assert len(app.query(MessageView)) == 2
        second = app.conv.messages[-1].content
        assert second and second != first  # sampled at temperature 1 with another seed
        views = app.query(MessageView)
        views.first().focus()
        await pilot.press("c")
        await until(pilot, lambda: app.clipboard == "hi", what="the message on the clipboard")
        old_id = app.conv.id
        await pilot.press("ctrl+n")
        await until(pilot, lambda: app.conv.id != old_id and not app.query(MessageView), what="the new chat")
        assert app.conv.messages == []
        assert app.conv.sampling.seed == 7, "a new chat keeps the sampling settings"
        assert Store(data_dir).load(old_id).messages[-1].content == second


async def open_first_listed(pilot, lv, conv_id: str, n_messages: int):
    lv.focus()
    lv.index = 0
    await pilot.press("enter")
    await until(
        pilot,
        lambda: (
            pilot.app.conv.id == conv_id
            and len(pilot.app.query(MessageView)) == n_messages
            and pilot.app.focused is pilot.app.prompt
        ),
        what="the conversation to open",
    )


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
        await open_first_listed(pilot, lv, conv_id, len(saved_msgs))
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
        await open_first_listed(pilot, lv, conv_id, len(saved_msgs))
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
        await until(pilot, lambda: isinstance(app.screen, ModelPicker), what="the model picker")
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
        await until(pilot, lambda: not isinstance(app.screen, ErrorScreen), what="the error to close")
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
        await until(pilot, lambda: isinstance(app.screen, ModelPicker), what="the model picker")
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
        await until(pilot, lambda: isinstance(app.screen, ModelPicker), what="the model picker")
        labels = [spec for spec, _ in app.screen.choices]
        assert labels[0] == "SmolLM2-135M-Instruct-Q4_1" and str(tiny_dirs("llama")) in labels
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ModelPicker), what="the picker to close")


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
