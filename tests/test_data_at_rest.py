"""Data at rest: what a user typed and was told stays theirs on disk.

Every file that holds user data (TUI conversations, input history and preferences, the prefix
cache's KV files, the service's env file and launchd agent) is *created* 0600 in a 0700 directory,
under the usual umask 0o022: never written readable and tightened afterwards (``writes`` records
the mode of each file Python opens for writing, at the moment it is opened). The prefix cache's
disk tier refuses a directory that someone else may write to, and loads a block file only when
its MAC (the prefix's tokens and every tensor, keyed by the tier's own secret) verifies: a planted,
corrupted or renamed file is a miss, logged and removed.
"""

from __future__ import annotations

import asyncio
import builtins
import io
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from app.cli import main
from app.tui.store import Conversation, Message, Preferences, Store
from mlx_engine.errors import ConfigError
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.prefix_disk import KEY_FILE, MAC_META, PrefixDiskTier
from mlx_engine.kv_cache.prefix_index import prefix_hash
from mlx_engine.private_files import private_dir, private_file, write_private
from tests.test_service import home  # noqa: F401  (a fixture)

BS = 4


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


# --- the prefix cache's disk tier ---------------------------------------------------------------


def pool() -> KVPool:
    return KVPool(4, 8, BS, 2, 32, mx.float32, 8)  # quantized: 3 arrays per K and per V


def tier(root: Path) -> PrefixDiskTier:
    return PrefixDiskTier(root, {"m": 1}, 2**30, block_size=BS, num_layers=2)


def test_disk_tier_files_are_created_0600_in_0700_directories(tmp_path):
    root = tmp_path / "kv"
    disk = tier(root)
    p = pool()
    tokens = list(range(1, 9))
    disk.save(tokens[:BS], p.read_block(1))
    disk.save(tokens, p.read_block(2))
    assert mode(root) == 0o700 and mode(disk.dir) == 0o700
    files = list(disk.dir.iterdir())
    assert {f.name for f in files} >= {"model.json", KEY_FILE, f"{prefix_hash(tokens)}.safetensors"}
    assert all(mode(f) == 0o600 for f in files), [(f.name, oct(mode(f))) for f in files]
    assert disk.load(tokens) is not None and disk.loaded == 1


def test_disk_tier_keeps_an_existing_directory_of_the_users_own_as_it_is(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)  # a directory the user chose: readable by others, writable by none
    disk = tier(root)
    assert mode(root) == 0o755 and mode(disk.dir) == 0o700


@pytest.mark.parametrize("loose", [0o775, 0o757, 0o1777], ids=oct)
def test_disk_tier_refuses_a_directory_others_may_write_to(tmp_path, loose):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, loose)
    with pytest.raises(ConfigError, match="group or other users may write") as e:
        tier(root)
    assert e.value.option == "disk_cache_dir"
    assert list(root.iterdir()) == []  # nothing written into it


def test_disk_tier_refuses_a_directory_of_another_user(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(ConfigError, match="belongs to another user") as e:
        tier(root)
    assert e.value.option == "disk_cache_dir"


def test_a_loose_fingerprint_directory_of_ours_is_tightened(tmp_path):
    disk = tier(tmp_path / "kv")
    os.chmod(disk.dir, 0o777)
    tier(tmp_path / "kv")  # ours: tightened back to 0700
    assert mode(disk.dir) == 0o700


def saved(tmp_path: Path) -> tuple[PrefixDiskTier, list[int], Path]:
    disk = tier(tmp_path / "kv")
    p = pool()
    p.arrays()[0][:] = mx.random.uniform(shape=p.arrays()[0].shape)  # not all zeros: changes show
    tokens = list(range(1, 9))
    disk.save(tokens[:BS], p.read_block(1))
    disk.save(tokens, p.read_block(2))
    return disk, tokens, disk.dir / f"{prefix_hash(tokens)}.safetensors"


def read(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    data, meta = mx.load(str(path), return_metadata=True)
    assert isinstance(data, dict) and isinstance(meta, dict)
    return data, meta


def test_a_planted_block_file_is_a_miss_logged_and_removed(tmp_path, caplog):
    disk, tokens, path = saved(tmp_path)
    data, _ = read(path)
    # the right name and every shape and dtype right, but other values and no MAC: what an
    # attacker who could write the directory would plant to steer the model
    planted = {k: mx.zeros_like(v) for k, v in data.items()}
    mx.save_safetensors(str(path), planted)
    with caplog.at_level(logging.WARNING, logger="mlx_engine.engine"):
        assert disk.load(tokens) is None
    assert not path.exists() and disk.rejected == 1 and disk.loaded == 0
    assert "not signed by this cache" in caplog.text and path.name in caplog.text
    assert disk.load(tokens[:BS]) is not None  # the block before it is still a hit


def test_a_changed_or_renamed_block_file_is_a_miss(tmp_path):
    disk, tokens, path = saved(tmp_path)
    data, meta = read(path)
    changed = dict(data)
    changed["0"] = data["0"] + 1  # one tensor changed, its MAC kept
    mx.save_safetensors(str(path), changed, metadata=meta)
    assert disk.load(tokens) is None and not path.exists()
    # a genuine file of one prefix, copied under the name of another: the tokens are in the MAC
    first = disk.dir / f"{prefix_hash(tokens[:BS])}.safetensors"
    other = [9, 9, 9, 9]
    (disk.dir / f"{prefix_hash(other)}.safetensors").write_bytes(first.read_bytes())
    assert disk.load(other) is None
    assert disk.load(tokens[:BS]) is not None and disk.rejected == 2


def test_a_file_signed_with_another_tiers_key_is_a_miss(tmp_path):
    disk, tokens, path = saved(tmp_path)
    elsewhere = PrefixDiskTier(tmp_path / "other", {"m": 1}, 2**30, block_size=BS, num_layers=2)
    foreign = elsewhere.dir / path.name
    foreign.write_bytes(path.read_bytes())  # a valid file of another cache (another key)
    assert elsewhere.load(tokens) is None and elsewhere.rejected == 1
    assert disk.load(tokens) is not None  # in its own cache it verifies


def test_the_key_survives_a_restart_and_a_malformed_key_is_replaced(tmp_path, caplog):
    disk, tokens, _ = saved(tmp_path)
    assert tier(tmp_path / "kv").load(tokens) is not None  # the same key: files written before load
    (disk.dir / KEY_FILE).write_bytes(b"short")
    with caplog.at_level(logging.WARNING, logger="mlx_engine.engine"):
        again = tier(tmp_path / "kv")
    assert "malformed" in caplog.text and len((disk.dir / KEY_FILE).read_bytes()) == 32
    assert mode(disk.dir / KEY_FILE) == 0o600
    assert again.load(tokens) is None  # signed with the old key: recomputed


def test_a_missing_block_file_is_a_plain_miss(tmp_path, caplog):
    disk, tokens, path = saved(tmp_path)
    path.unlink()  # trimmed, or removed by another process, after match saw it
    with caplog.at_level(logging.WARNING, logger="mlx_engine.engine"):
        assert disk.load(tokens) is None
    assert disk.rejected == 0 and caplog.text == ""


def test_block_files_carry_their_mac_in_the_metadata(tmp_path):
    _, _, path = saved(tmp_path)
    _, meta = read(path)
    assert len(meta[MAC_META]) == 64 and int(meta[MAC_META], 16) >= 0


def test_an_engine_recomputes_a_planted_block_and_its_output_is_the_models(tiny_dirs, tmp_path):
    from mlx_engine.engine import Engine, EngineConfig
    from mlx_engine.loading.loader import load_model
    from tests.test_engine_tiny import assert_no_leaks, prompts, reference_greedy, req

    loaded = load_model(str(tiny_dirs("llama")))
    (base,) = prompts(loaded.tokenizer.vocab_size, [50], seed=5)
    cfg = EngineConfig(cache_gb=0.01, disk_cache_dir=str(tmp_path / "kv"))
    first = Engine(loaded, cfg)
    asyncio.run(_run(first, req(base, 2)))
    first.shutdown()  # 3 full blocks on disk
    (second,) = (tmp_path / "kv").rglob(f"{prefix_hash(base[:32])}.safetensors")
    data, meta = read(second)
    mx.save_safetensors(str(second), {k: v * 0 + 7 for k, v in data.items()}, metadata=meta)  # MAC kept
    assert mode(second.parent) == 0o700
    engine = Engine(loaded, cfg)
    try:
        follow = base + [5, 6, 7]
        events = asyncio.run(_run(engine, req(follow, 8)))
        usage = events[-1].usage
        assert usage.cached_tokens == 16  # the first block only: the planted one and what follows it computed
        assert engine.disk.rejected == 1 and not second.exists()
        assert [t for ev in events for t in ev.token_ids] == reference_greedy(loaded.model, follow, 8)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


async def _run(engine, request) -> list:
    return [ev async for ev in engine.generate(request)]
