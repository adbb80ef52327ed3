"""The chat's model picker (app/tui/model_picker.py, issue 33), driven with Textual's pilot: the
bundled model listed with its quant and size, a pull whose progress bar advances step by step (a
fake puller that waits on events, never on a clock) and whose model joins the list and loads, a
failed pull shown in the screen, and a server's models with which are loaded."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from textual.widgets import OptionList, ProgressBar, Static

from app.server.app import create_app
from app.tui import model_picker
from app.tui.app import ChatApp
from app.tui.backends import LocalBackend, RemoteBackend
from app.tui.model_picker import ModelPicker, ModelRow, PullStep, local_models, picker_rows, server_rows
from mlx_engine.engine import EngineConfig
from mlx_engine.errors import ModelNotFoundError
from mlx_engine.loading.resolve import BUNDLED_NAME, bundled_model_path
from tests.test_model_registry import real_registry, served
from tests.test_tui import count_handled_lines, loaded, type_and_send, until  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DUET_NO_HISTORY", raising=False)


def make_app(model) -> ChatApp:
    return ChatApp(str(model), load_backend=partial(LocalBackend.load, config=EngineConfig(cache_gb=0.02)))


async def open_picker(pilot) -> ModelPicker:
    await pilot.press("f2")
    await until(pilot, lambda: isinstance(pilot.app.screen, ModelPicker), what="the model picker")
    screen = pilot.app.screen
    assert isinstance(screen, ModelPicker)
    return screen


class FakePuller:
    """Reports the steps it is given one at a time, each once the test sets its event; then returns
    ``row`` or raises ``error``."""

    def __init__(self, steps: list[PullStep], row: ModelRow | None = None, error: Exception | None = None):
        self.steps, self.row, self.error = steps, row, error
        self.go = [threading.Event() for _ in steps]
        self.reported = [threading.Event() for _ in steps]
        self.specs: list[str] = []

    def __call__(self, spec: str, progress) -> ModelRow:
        self.specs.append(spec)
        for step, go, reported in zip(self.steps, self.go, self.reported, strict=True):
            assert go.wait(60), "the test never let the pull go on"
            progress(step)
            reported.set()
        if self.error is not None:
            raise self.error
        assert self.row is not None
        return self.row


def test_the_catalogue_adapter_lists_the_bundled_model_with_quant_and_size():
    rows = local_models()  # the test session's Hugging Face cache is empty: the bundled model only
    assert rows[0] == ModelRow(BUNDLED_NAME, "Q4_1", bundled_model_path().stat().st_size, "bundled")
    both = picker_rows(rows, ["/models/mine", BUNDLED_NAME])
    assert [r.spec for r in both] == [BUNDLED_NAME, "/models/mine"] and both[1].note == "recent"
    assert "Q4_1" in rows[0].label("") and "MiB" in rows[0].label("")
    assert rows[0].label(BUNDLED_NAME).startswith("● ")


async def test_the_picker_lists_the_bundled_model_and_switches_to_a_choice(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        picker = await open_picker(pilot)
        specs = [spec for spec, _ in picker.choices]
        assert specs[0] == BUNDLED_NAME and str(tiny_dirs("llama")) in specs
        label = picker.choices[0][1]
        assert "Q4_1" in label and "MiB" in label and "bundled" in label
        shown = str(picker.query_one("#models", OptionList).get_option_at_index(0).prompt)
        assert shown == label
        # Enter on the highlighted (first) model switches the chat to it, through the usual load
        await pilot.press("enter")
        await until(pilot, lambda: app.backend is not None and app.backend.name != "llama", what="the switch")
        assert app.model_spec == BUNDLED_NAME and not isinstance(app.screen, ModelPicker)


async def test_a_pull_shows_its_progress_and_adds_the_model(tiny_dirs, data_dir, monkeypatch):
    pulled = ModelRow(str(tiny_dirs("qwen3")), "Q4_K_M", 4000, "pulled")  # a path: it loads offline
    fake = FakePuller(
        [
            PullStep("pulling manifest"),
            PullStep("pulling model.gguf", 1000, 4000),
            PullStep("pulling model.gguf", 3000, 4000),
            PullStep("success", 4000, 4000),
        ],
        row=pulled,
    )
    monkeypatch.setattr(model_picker, "pull_model", fake)
    app = make_app(tiny_dirs("llama"))
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        picker = await open_picker(pilot)
        bar = picker.query_one("#pull-bar", ProgressBar)
        status = picker.query_one("#pull-status", Static)
        picker.query_one("#spec").value = "someone/tiny-GGUF:Q4_K_M"
        picker.query_one("#spec").focus()
        await pilot.press("enter")
        await until(pilot, lambda: picker.pulling is not None, what="the pull to start")
        assert fake.specs == ["someone/tiny-GGUF:Q4_K_M"] and isinstance(app.screen, ModelPicker)
        for i, (progress, total) in enumerate([(0, None), (1000, 4000), (3000, 4000)]):
            fake.go[i].set()
            await until(pilot, fake.reported[i].is_set, what=f"step {i}")
            await until(
                pilot, lambda p=progress, t=total: (bar.progress, bar.total) == (p, t), what="the bar"
            )
        assert "1000 B of" not in str(status.render()) and "2.9 KiB of 3.9 KiB" in str(status.render())
        fake.go[3].set()
        await until(pilot, lambda: picker.pulling is None, what="the pull to finish")
        assert bar.percentage == 1.0 and "Pulled" in str(status.render())
        assert picker.rows[-1] == pulled
        options = picker.query_one("#models", OptionList)
        assert options.highlighted == len(picker.rows) - 1 and options.has_focus
        await pilot.press("enter")  # loads the pulled model
        await until(pilot, lambda: app.backend is not None and app.backend.name == "qwen3", what="the load")


async def test_a_failed_pull_shows_the_error_in_the_screen(tiny_dirs, data_dir, monkeypatch):
    fake = FakePuller(
        [PullStep("pulling manifest")],
        error=ModelNotFoundError("someone/missing is not on huggingface.co (HTTP 404)"),
    )
    monkeypatch.setattr(model_picker, "pull_model", fake)
    app = make_app(tiny_dirs("llama"))
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        picker = await open_picker(pilot)
        picker.query_one("#spec").value = "someone/missing"
        picker.query_one("#spec").focus()
        await pilot.press("enter")
        fake.go[0].set()
        await until(pilot, lambda: picker.pulling is None and fake.reported[0].is_set(), what="the failure")
        status = picker.query_one("#pull-status", Static)
        await until(pilot, lambda: status.has_class("-error"), what="the error shown")
        assert "someone/missing failed: someone/missing is not on huggingface.co" in str(status.render())
        assert app.screen is picker and app.is_running and app.backend.name == "llama"
        assert [r.spec for r in picker.rows] == [spec for spec, _ in picker.choices]
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ModelPicker), what="the picker to close")


async def test_the_real_puller_offline_is_a_clear_error_in_the_screen(tiny_dirs, data_dir):
    app = make_app(tiny_dirs("llama"))  # the suite runs with HF_HUB_OFFLINE=1 and an empty cache
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        picker = await open_picker(pilot)
        picker.query_one("#spec").value = "someone/not-downloaded:Q4_K_M"
        picker.query_one("#spec").focus()
        await pilot.press("enter")
        status = picker.query_one("#pull-status", Static)
        await until(pilot, lambda: status.has_class("-error"), what="the error shown")
        assert "someone/not-downloaded" in str(status.render()) and app.screen is picker


class _Card:
    def __init__(self, id: str, **extra):
        self.id, self.model_extra = id, extra


def test_server_rows_show_each_models_state():
    rows = server_rows(
        [
            _Card("alpha", loaded=True, status="loaded", quant="Q4_K_M", size_bytes=2**30),
            _Card("beta", loaded=False, status="unloaded"),
        ]
    )
    assert rows == [ModelRow("alpha", "Q4_K_M", 2**30, "loaded"), ModelRow("beta", None, None, "unloaded")]
    assert "1.0 GiB" in rows[0].label("alpha") and rows[0].label("alpha").endswith("loaded")


async def test_with_a_server_the_picker_shows_which_models_are_loaded(tiny_dirs, data_dir):
    reg, _ = real_registry({"alpha": tiny_dirs("llama"), "beta": tiny_dirs("qwen3")})
    try:
        with served(create_app(registry=reg)) as url:
            app = ChatApp("alpha", load_backend=partial(RemoteBackend.connect, url), remote=True)
            async with app.run_test(size=(100, 30)) as pilot:
                await loaded(pilot)
                await type_and_send(pilot, "/max 2")
                await type_and_send(pilot, "hi")  # loads alpha on the server
                await until(pilot, lambda: not app.generating, what="the reply")
                picker = await open_picker(pilot)
                await until(
                    pilot,
                    lambda: (
                        [(r.spec, r.note) for r in picker.rows] == [("alpha", "loaded"), ("beta", "unloaded")]
                    ),
                    what="the server's model states",
                )
                assert picker.query_one("#pull").display is False
                picker.query_one("#models", OptionList).highlighted = 1
                await pilot.press("enter")  # switch to beta
                await until(
                    pilot, lambda: app.backend is not None and app.backend.name == "beta", what="beta"
                )
    finally:
        reg.shutdown()
