"""Snapshots (pytest-textual-snapshot) of the chat's main screens.

Deterministic by construction: the conversation comes from a fixed JSON file (no sampled
text), timestamps are fixed and shown in UTC, the model list is fixed, and each snapshot is
taken after the tiny model has loaded. Update with `pytest tests/test_tui_snapshots.py --snapshot-update`
after a deliberate UI change, and look at the new SVGs before committing them.
"""

from __future__ import annotations

import json
import time
from functools import partial

import pytest

from app.tui.app import ChatApp
from app.tui.backends import LocalBackend
from app.tui.model_picker import ModelRow
from app.tui.screens import ErrorScreen, HelpScreen, ModelPicker, SettingsScreen
from app.tui.settings import Sampling
from app.tui.store import Conversation, Message, Store
from mlx_engine.engine import EngineConfig

pytestmark = pytest.mark.timeout(120)

REPLY = """Sure. Here is a function that adds two numbers:

```python
def add(a: int, b: int) -> int:
    return a + b
```

- It takes **two** integers.
- It returns their sum."""


def conversation() -> Conversation:
    return Conversation(
        id="0123456789ab",
        title="Adding numbers",
        created=1_700_000_000.0,
        updated=1_700_000_000.0,
        model="llama",
        system="You are a helpful assistant.",
        sampling=Sampling(temperature=0.0, max_tokens=64),
        messages=[
            Message("user", "Write a Python function that adds two numbers."),
            Message("assistant", REPLY, "38 prompt tok · 41 reply tok · TTFT 52 ms · 63.0 tok/s"),
        ],
    )


@pytest.fixture
def chat_app(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    rows = [
        ModelRow("SmolLM2-135M-Instruct-Q4_1", "Q4_1", 90_000_000, "bundled"),
        ModelRow("HuggingFaceTB/SmolLM2-360M-Instruct", None, 724_000_000, "safetensors"),
        ModelRow("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", "Q4_K_M", 398_000_000, "gguf"),
    ]
    monkeypatch.setattr("app.tui.model_picker.local_models", lambda: rows)
    older = Conversation(
        id="ba9876543210",
        title="Trip to Lyon",
        created=1_699_000_000.0,
        updated=1_699_000_000.0,
        messages=[Message("user", "Plan a day in Lyon")],
    )
    conv_dir = Store().conv_dir
    conv_dir.mkdir(parents=True)
    for c in (conversation(), older):  # written directly: Store.save would stamp the current time
        (conv_dir / f"{c.id}.json").write_text(json.dumps(c.to_json()))

    monkeypatch.chdir(tiny_dirs("llama").parent)  # so the model is "llama", not a tmp path that changes

    def make(model="llama"):
        return ChatApp(model, load_backend=partial(LocalBackend.load, config=EngineConfig(cache_gb=0.02)))

    yield make
    monkeypatch.delenv("TZ")
    time.tzset()


async def until(pilot, cond) -> None:
    """Wait for a condition (the test's timeout is the deadline for a hang), then let it settle."""
    while not cond():
        await pilot.pause(0.02)
    await pilot.pause()


async def ready(pilot) -> None:
    await until(pilot, lambda: pilot.app.backend is not None)


async def still(pilot) -> None:
    """Stop cursors blinking (a blink would make the snapshot depend on timing)."""
    for screen in pilot.app.screen_stack:
        for w in screen.query("Input, TextArea"):
            w.cursor_blink = False
    await pilot.pause()


async def with_conversation(pilot) -> None:
    await ready(pilot)
    await pilot.app.open_conversation(Store().load("0123456789ab"))
    # the reply's Markdown has rendered its blocks (the code block is the last one to appear)
    await until(pilot, lambda: pilot.app.query("MessageView Markdown MarkdownFence"))
    await still(pilot)


def test_main_screen_80x24(snap_compare, chat_app):
    assert snap_compare(chat_app(), terminal_size=(80, 24), run_before=with_conversation)


def test_main_screen_wide_with_sidebar(snap_compare, chat_app):
    assert snap_compare(chat_app(), terminal_size=(120, 32), run_before=with_conversation)


def test_main_screen_light_theme(snap_compare, chat_app):
    async def light(pilot):
        await with_conversation(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: not pilot.app.current_theme.dark)
        await still(pilot)

    assert snap_compare(chat_app(), terminal_size=(100, 28), run_before=light)


def test_main_screen_with_peers_panel(snap_compare, chat_app, tmp_path, monkeypatch):
    """A paired machine (not advertising now): the peers panel appears above the input."""
    from peer.trust.keys import PairedPeers, load_identity

    monkeypatch.setenv("DUET_CONFIG_DIR", str(tmp_path / "duet_config"))
    PairedPeers().add("gpu-box", load_identity(tmp_path / "box", name="gpu-box").cert_pem)

    async def panel(pilot):
        await with_conversation(pilot)
        await until(pilot, lambda: pilot.app.peers_panel.display)
        await still(pilot)

    assert snap_compare(chat_app(), terminal_size=(100, 28), run_before=panel)


def test_help_screen(snap_compare, chat_app):
    async def help_(pilot):
        await ready(pilot)
        await pilot.press("f1")
        await until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))
        await still(pilot)

    assert snap_compare(chat_app(), terminal_size=(100, 40), run_before=help_)


def test_model_picker(snap_compare, chat_app):
    async def picker(pilot):
        await ready(pilot)
        await pilot.press("f2")
        await until(pilot, lambda: isinstance(pilot.app.screen, ModelPicker))
        await still(pilot)

    assert snap_compare(chat_app(), terminal_size=(80, 24), run_before=picker)


def test_settings_screen(snap_compare, chat_app):
    async def settings(pilot):
        await ready(pilot)
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        await still(pilot)

    assert snap_compare(chat_app(), terminal_size=(80, 24), run_before=settings)


def test_error_screen_for_a_bad_model(snap_compare, chat_app, tmp_path):
    async def error(pilot):
        await until(pilot, lambda: isinstance(pilot.app.screen, ErrorScreen))
        await still(pilot)

    assert snap_compare(chat_app("/nonexistent/model-dir"), terminal_size=(80, 24), run_before=error)
