"""Files that hold a user's data, created private: 0600 files in 0700 directories.

Everything Duet writes that carries what a user typed or was told (chat conversations, the input
history, the prefix cache's KV on disk, service files that may hold an API key) goes through these,
so it is private from the moment it exists, whatever the umask: a file is never created readable
and tightened afterwards (a ``chmod`` after the write leaves a window in which another user can
open it, and an open descriptor stays readable after the ``chmod``).

- ``private_dir``: a directory made 0700 (``mkdir(mode=0o700)``; one that exists and is this
  user's is tightened to 0700, so data written by an older version stops being readable).
- ``private_file``: a context manager yielding a temporary path beside the target, created 0600
  (``mkstemp``: ``O_CREAT | O_EXCL``, mode 0600); on a clean exit it replaces the target at once
  (``os.replace``: a reader sees the old file or the new one, never half of one), on an error it
  is removed. For writers that want a path (``mx.save_safetensors``).
- ``write_private``: ``private_file`` for bytes or text.
- ``unsafe_dir_reason``: why a directory someone else may write to is not safe to read back from
  (not owned by this user, or writable by group or others), or None.

Used by the engine (``kv_cache/prefix_disk.py``), the peers (``peer/trust/keys.py``,
``peer/rate.py``) and the app (``app/tui/store.py``, ``app/service.py``), which is why it lives here
(kernels <- mlx_engine <- peer <- app).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None  # None: no POSIX owners (Windows)


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a 0700 directory: created so (its missing parents get the default mode: they
    are shared places such as ``~/.local/share``), or, when it exists and belongs to this user,
    tightened to 0700. One that belongs to someone else is left as it is (``unsafe_dir_reason``
    says whether it may be trusted)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        p.mkdir(mode=DIR_MODE)
    except FileExistsError:
        st = p.stat()
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{p} is not a directory") from None
        uid = _uid()
        if (uid is None or st.st_uid == uid) and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(p, DIR_MODE)  # ours, from before files were private: close it
    return p


@contextlib.contextmanager
def private_file(path: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[Path]:
    """A new, empty temporary file beside ``path`` (same directory, so the replace is atomic),
    created 0600; write it, and leaving the block replaces ``path`` with it. ``suffix`` ends the
    temporary name (``mx.save_safetensors`` appends ``.safetensors`` to a name without it)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_private(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = False) -> None:
    """Write ``data`` (text as UTF-8) to ``path``, atomically, as a 0600 file. The directory must
    exist (``private_dir``). ``durable``: on disk (``fsync``) before it replaces ``path``, for files
    whose loss after a crash costs more than a rewrite (a peer's identity key, its paired peers)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with private_file(path) as tmp, open(tmp, "wb") as f:  # opening an existing file keeps its 0600
        f.write(raw)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def unsafe_dir_reason(path: str | os.PathLike[str]) -> str | None:
    """Why files in directory ``path`` could have been put there by someone else: it belongs to
    another user, or its group or others may write to it. None when it is safe (or on a system
    without POSIX owners)."""
    uid = _uid()
    if uid is None:
        return None
    st = os.stat(path)
    if st.st_uid != uid:
        return f"it belongs to another user (uid {st.st_uid})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        return f"its group or other users may write to it (mode {mode:04o})"
    return None
