"""Data at rest: what a user typed and was told stays theirs on disk.

Every file that holds user data (TUI conversations, input history and preferences, the service's
env file and launchd agent) is *created* 0600 in a 0700 directory, under the usual umask 0o022:
never written readable and tightened afterwards (``writes`` records the mode of each file Python
opens for writing, at the moment it is opened).
"""

from __future__ import annotations

import builtins
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import main
from app.tui.store import Conversation, Message, Preferences, Store
from mlx_engine.private_files import private_dir, private_file, write_private
from tests.test_service import home  # noqa: F401  (a fixture)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def writes(monkeypatch) -> list[tuple[str, int]]:
    """(path, mode) of every file opened for writing through ``open``/``io.open``/``os.open``,
    its mode taken the moment it was opened (before anything is written into it)."""
    seen: list[tuple[str, int]] = []
    real_open, real_os_open = builtins.open, os.open

    def record(path, fd: int) -> None:
        if isinstance(path, (str, os.PathLike)):
            seen.append((os.fspath(path), stat.S_IMODE(os.fstat(fd).st_mode)))

    def tracing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            record(file, f.fileno())
        return f

    def tracing_os_open(path, flags, *args, **kwargs):
        fd = real_os_open(path, flags, *args, **kwargs)
        if flags & (os.O_WRONLY | os.O_RDWR):
            record(path, fd)
        return fd

    monkeypatch.setattr(builtins, "open", tracing_open)
    monkeypatch.setattr(io, "open", tracing_open)
    monkeypatch.setattr(os, "open", tracing_os_open)
    return seen


def written_under(writes: list[tuple[str, int]], root: Path) -> list[tuple[str, int]]:
    return [(p, m) for p, m in writes if Path(p).is_relative_to(root)]


# --- the helper ---------------------------------------------------------------------------------


def test_private_files_are_created_0600_in_0700_directories(tmp_path, writes):
    d = private_dir(tmp_path / "a" / "b")
    assert mode(d) == 0o700
    write_private(d / "f.json", "secret")
    assert (d / "f.json").read_text() == "secret" and mode(d / "f.json") == 0o600
    write_private(d / "f.json", b"again")  # replacing keeps it private
    assert (d / "f.json").read_bytes() == b"again" and mode(d / "f.json") == 0o600
    assert written_under(writes, tmp_path) and all(m == 0o600 for _, m in written_under(writes, tmp_path))
    assert sorted(p.name for p in d.iterdir()) == ["f.json"]  # no temporary file left behind


def test_an_existing_directory_of_ours_is_tightened_and_a_failed_write_leaves_nothing(tmp_path):
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    assert mode(private_dir(old)) == 0o700
    write_private(old / "keep", "old")
    with pytest.raises(RuntimeError), private_file(old / "keep") as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert (old / "keep").read_text() == "old" and sorted(p.name for p in old.iterdir()) == ["keep"]


# --- TUI conversations, input history, preferences ----------------------------------------------


def test_tui_store_files_are_created_private(tmp_path, writes):
    root = tmp_path / "data"
    store = Store(root)
    conv = Conversation(messages=[Message("user", "my medical question"), Message("assistant", "an answer")])
    path = store.save(conv)
    store.save_history(["my medical question"])
    store.save_preferences(Preferences(save_input_history=True))
    assert mode(root) == 0o700 and mode(root / "conversations") == 0o700
    for f in (path, store.history_path, store.preferences_path):
        assert mode(f) == 0o600, f
    opened = written_under(writes, root)
    assert opened and all(m == 0o600 for _, m in opened), opened  # never readable, even for a moment
    assert store.load(conv.id).messages[0].content == "my medical question"
    assert store.load_history() == ["my medical question"]


def test_tui_data_written_by_an_older_version_is_closed(tmp_path):
    root = tmp_path / "data"
    (root / "conversations").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    Store(root).save(Conversation(messages=[Message("user", "hi")]))
    assert mode(root) == 0o700 and mode(root / "conversations") == 0o700


# --- service files ------------------------------------------------------------------------------


@pytest.mark.usefixtures("home")  # a temporary HOME
@pytest.mark.parametrize(
    "manager, key_file, own_dir",
    [
        ("systemd", ".config/duet/peer.env", ".config/duet"),
        ("launchd", "Library/LaunchAgents/duet.serve.plist", "Library/Logs/duet"),
    ],
)
def test_service_files_that_may_hold_a_key_are_created_0600(manager, key_file, own_dir, writes, capsys):
    h = Path(os.environ["HOME"])
    rc = main(["service", "install", "--manager", manager, "--dry-run", "--env", "DUET_API_KEY=sk-secret"])
    assert rc == 0, capsys.readouterr().err
    path = h / key_file
    assert "sk-secret" in path.read_text()
    assert mode(path) == 0o600 and mode(h / own_dir) == 0o700
    opened = [m for p, m in writes if Path(p).parent == path.parent]
    assert opened and all(m == 0o600 for m in opened), opened  # created so, not chmod-ed after
    if manager == "systemd":  # the unit file holds no key: the usual 0644, in systemd's own directory
        assert mode(h / ".config/systemd/user/duet-peer.service") == 0o644
