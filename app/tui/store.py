"""Conversations, input history and chat preferences, kept as JSON under the user data dir.

The directory is ``$DUET_DATA_DIR`` when set (tests point it at a tmp dir), else
platformdirs' user data dir for "duet". One file per conversation:
``<data>/conversations/<id>.json``; every line typed into the chat (for Up/Down recall):
``<data>/input_history.json``, unless saving it is off (``/history off``, kept in
``<data>/preferences.json``, or ``DUET_NO_HISTORY=1``).

What a user typed and was told is theirs alone: the directories are created 0700 (one from an
older version is tightened to 0700) and every file 0600, each written whole into a temporary file
created so and then renamed over the old one (``mlx_engine.private_files``).
"""

from __future__ import annotations

import builtins
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from platformdirs import user_data_dir

from mlx_engine.private_files import private_dir, write_private

from .settings import Sampling

HISTORY_LIMIT = 500
NO_HISTORY_ENV = "DUET_NO_HISTORY"


def data_dir() -> Path:
    return Path(os.environ.get("DUET_DATA_DIR") or user_data_dir("duet", appauthor=False))


@dataclass
class Message:
    role: str  # "system" is never stored here: the conversation's `system` field holds it
    content: str
    meta: str = ""  # a short line shown under assistant replies: timings, "stopped", an error


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    model: str = ""
    system: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    messages: list[Message] = field(default_factory=list)

    def chat_messages(self) -> list[dict]:
        """What the model sees: the system prompt, then every turn with text."""
        out = [{"role": "system", "content": self.system}] if self.system.strip() else []
        out += [{"role": m.role, "content": m.content} for m in self.messages if m.content]
        return out

    def display_title(self) -> str:
        if self.title:
            return self.title
        first = next((m.content for m in self.messages if m.role == "user"), "")
        return " ".join(first.split())[:60] or "New chat"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Conversation:
        return cls(
            id=str(d["id"]),
            title=d.get("title", ""),
            created=float(d.get("created", 0.0)),
            updated=float(d.get("updated", 0.0)),
            model=d.get("model", ""),
            system=d.get("system", ""),
            sampling=Sampling(**d.get("sampling", {})),
            messages=[Message(**m) for m in d.get("messages", [])],
        )


@dataclass
class Preferences:
    """Chat preferences kept between runs (``/history on|off``)."""

    save_input_history: bool = True

    @classmethod
    def from_json(cls, d: dict) -> Preferences:
        return cls(save_input_history=bool(d.get("save_input_history", True)))


def history_off_by_env() -> bool:
    """``DUET_NO_HISTORY=1`` (or true/yes/on) turns saving the input history off, whatever the preferences say."""
    return os.environ.get(NO_HISTORY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Store:
    def __init__(self, root: Path | None = None):
        self.root = root or data_dir()
        self.conv_dir = self.root / "conversations"

    def _write(self, path: Path, text: str) -> None:
        private_dir(self.root)
        if path.parent != self.root:
            private_dir(path.parent)
        write_private(path, text)  # 0600 from the start, and never half-written

    def save(self, conv: Conversation) -> Path:
        conv.updated = time.time()
        path = self.conv_dir / f"{conv.id}.json"
        self._write(path, json.dumps(conv.to_json(), ensure_ascii=False, indent=1))
        return path

    def load(self, conv_id: str) -> Conversation:
        return Conversation.from_json(
            json.loads((self.conv_dir / f"{conv_id}.json").read_text(encoding="utf-8"))
        )

    def delete(self, conv_id: str) -> None:
        (self.conv_dir / f"{conv_id}.json").unlink(missing_ok=True)

    def list(self) -> list[Conversation]:
        """Saved conversations, newest first; unreadable files are skipped."""
        out = []
        for p in self.conv_dir.glob("*.json"):
            try:
                out.append(Conversation.from_json(json.loads(p.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda c: c.updated, reverse=True)

    # --- input history (Up/Down on an empty input) --------------------------------
    @property
    def history_path(self) -> Path:
        return self.root / "input_history.json"

    def load_history(self) -> builtins.list[str]:
        try:
            items = json.loads(self.history_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return [s for s in items if isinstance(s, str)][-HISTORY_LIMIT:]

    def save_history(self, items: builtins.list[str]) -> None:
        self._write(self.history_path, json.dumps(items[-HISTORY_LIMIT:], ensure_ascii=False))

    def clear_history(self) -> bool:
        """Delete the saved input history; True if there was a file to delete."""
        try:
            self.history_path.unlink()
        except FileNotFoundError:
            return False
        return True

    # --- preferences ---------------------------------------------------------------
    @property
    def preferences_path(self) -> Path:
        return self.root / "preferences.json"

    def load_preferences(self) -> Preferences:
        try:
            d = json.loads(self.preferences_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return Preferences()
        return Preferences.from_json(d) if isinstance(d, dict) else Preferences()

    def save_preferences(self, prefs: Preferences) -> None:
        self._write(self.preferences_path, json.dumps(asdict(prefs), indent=1))
