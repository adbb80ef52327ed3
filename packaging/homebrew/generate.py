"""Write packaging/homebrew/duet.rb, a Homebrew virtualenv formula, from a pip installation report.

The formula installs wheels only, the exact files pip resolves for an Apple Silicon Mac (macOS 14+,
Homebrew's Python 3.12): duet-llm's own wheel (the bundled model inside) is its main download, every
dependency (mlx, mlx-metal, ...) a resource, so `brew install` compiles nothing and needs no build backend in its
sandbox. They come from a pip installation report (`pip install --dry-run --report`), never written
by hand:

    # 1. build the wheels (or take them from PyPI once published)
    python -m build --wheel --outdir dist .
    # 2. resolve for macOS arm64 and write the formula (pip asks PyPI for the macOS wheels: network)
    python packaging/homebrew/generate.py --resolve --dist dist
    # or from a report made elsewhere, e.g. on the Mac with Homebrew's python3.12:
    #   python3.12 -m pip install --dry-run --ignore-installed --report report.json duet-llm
    python packaging/homebrew/generate.py --report report.json

A report's file:// URLs (a local build, a local mirror) become PyPI's canonical address,
``https://files.pythonhosted.org/packages/<python tag>/<initial>/<name>/<file>``, valid once that
file is on PyPI, with the SHA-256 of the local file: right only if that very file is uploaded.
Regenerate after each release, from PyPI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FORMULA = Path(__file__).resolve().parent / "duet.rb"
PYPI_FILES = "https://files.pythonhosted.org/packages"
PLATFORM = "macosx_14_0_arm64"
PYTHON = "3.12"
PROJECT = "duet-llm"


class GenerateError(Exception):
    """The report or the files do not make a formula (one line, exit 2)."""


@dataclass(frozen=True)
class Resource:
    name: str
    version: str
    url: str
    sha256: str


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pypi_url(name: str, filename: str) -> str:
    """PyPI's canonical address of a file it hosts: by python tag for wheels, `source` for sdists."""
    tag = filename[:-4].split("-")[-3] if filename.endswith(".whl") else "source"
    return f"{PYPI_FILES}/{tag}/{name[0].lower()}/{name}/{filename}"


def resource_of(item: dict) -> Resource:
    """One install item of a pip report as a formula resource."""
    meta, info = item["metadata"], item["download_info"]
    name, url = meta["name"], info["url"]
    archive = info.get("archive_info", {})
    sha = archive.get("hashes", {}).get("sha256") or (archive.get("hash") or "").removeprefix("sha256=")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.parse.unquote(parsed.path))
        if not path.is_file():
            raise GenerateError(f"{name}: {path} (from the report) does not exist here")
        sha = file_sha256(path)
        url = pypi_url(normalize(name), path.name)
    elif parsed.scheme != "https":
        raise GenerateError(f"{name}: {url} is not an https or file URL (a VCS or directory requirement?)")
    if not re.fullmatch(r"[0-9a-f]{64}", sha or ""):
        raise GenerateError(f"{name}: the report gives no sha256 for {url}")
    return Resource(normalize(name), meta["version"], url, sha)


def check_python(resources: list[Resource], python: str) -> None:
    """Every wheel must be for this Python (cpXY, abi3 or pure): the formula pins one python@X.Y."""
    cp = "cp" + python.replace(".", "")
    for r in resources:
        if not r.url.endswith(".whl"):
            raise GenerateError(
                f"{r.name}: {r.url} is an sdist; resolve with --only-binary=:all: so nothing compiles"
            )
        pytags, abi = r.url[:-4].split("-")[-3:-1]
        tags = pytags.split(".")
        if not (abi == "abi3" or cp in tags or (abi == "none" and any(t.startswith("py3") for t in tags))):
            raise GenerateError(f"{r.name}: {r.url.rsplit('/', 1)[-1]} is not a wheel for Python {python}")


def project_info() -> tuple[str, str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    license_ = project["license"] if isinstance(project["license"], str) else project["license"]["text"]
    return project["description"], license_, project["name"]


def render(main: Resource, resources: list[Resource], *, python: str) -> str:
    desc, license_, name = project_info()
    desc = desc.split(":")[0]  # Homebrew wants a short description
    blocks = "\n".join(
        f'  resource "{r.name}" do\n    url "{r.url}"\n    sha256 "{r.sha256}"\n  end\n'
        for r in sorted(resources, key=lambda r: r.name)
    )
    return f'''# Generated by packaging/homebrew/generate.py from a pip report; do not edit by hand.
# Wheels for macOS arm64 and Python {python}; regenerate after each release (docs/install.md).
class Duet < Formula
  include Language::Python::Virtualenv

  desc "{desc}"
  homepage "https://pypi.org/project/{name}/"
  url "{main.url}"
  sha256 "{main.sha256}"
  license "{license_}"

  depends_on arch: :arm64
  depends_on macos: :sonoma
  depends_on "python@{python}"

{blocks}
  def install
    virtualenv_create(libexec, "python{python}")
    # duet-llm and every resource are wheels pip resolved for this platform: copied under their own
    # file names (pip reads them) and installed as they are, so nothing compiles
    wheels = buildpath/"duet-wheels"
    wheels.mkpath
    cp cached_download, wheels/File.basename(stable.url)
    resources.each do |r|
      r.fetch
      cp r.cached_download, wheels/File.basename(r.url)
    end
    system Formula["python@{python}"].opt_libexec/"bin/python", "-m", "pip", "--python=#{{libexec}}/bin/python",
           "install", "--no-deps", "--no-index", "--no-compile", *wheels.children
    bin.install_symlink libexec/"bin/duet"
  end

  def post_install
    (var/"log/duet").mkpath
  end

  def caveats
    <<~EOS
      `brew services start duet` runs `duet serve` (loopback only) at login.
      Prefill peers over the network need Local Network permission, which a background
      service started by launchd does not get: see the Duet app bundle in docs/install.md.
    EOS
  end

  service do
    run [opt_bin/"duet", "serve"]
    keep_alive crashed: true
    log_path var/"log/duet/serve.log"
    error_log_path var/"log/duet/serve.err.log"
  end

  test do
    assert_equal "duet #{{version}}", shell_output("#{{bin}}/duet --version").strip
    out = shell_output("#{{bin}}/duet generate --raw --prompt 'The capital of France is' --temperature 0 " \\
                       "--max-tokens 4 --json")
    assert_match "finish_reason", out
  end
end
'''


def formula_from_report(report: dict, python: str) -> str:
    main, resources = None, []
    for item in report.get("install") or []:
        res = resource_of(item)
        if res.name == PROJECT:
            main = res
        else:
            resources.append(res)
    if main is None:
        raise GenerateError(f"the report does not install {PROJECT}")
    check_python([main, *resources], python)
    return render(main, resources, python=python)


# pip's --platform picks wheels for the target but evaluates environment markers (sys_platform ==
# 'linux' ...) for the machine it runs on; this runs pip with the target Mac's marker values.
PIP_FOR_MAC = """
import sys
import pip._vendor.packaging.markers as markers
_default = markers.default_environment
_mac = dict(sys_platform="darwin", platform_system="Darwin", os_name="posix", platform_machine="arm64",
            platform_release="24.0.0", platform_version="", implementation_name="cpython",
            platform_python_implementation="CPython", python_version=sys.argv[1],
            python_full_version=sys.argv[1] + ".0")
markers.default_environment = lambda: {**_default(), **_mac}
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def resolve(dist: Path, python: str) -> dict:
    """Ask pip what an Apple Silicon Mac with Python ``python`` would install (wheels only)."""
    wheels = sorted(dist.glob("duet_llm-*.whl"))
    if not wheels:
        raise GenerateError(f"no duet_llm wheel in {dist}: build it first (python -m build --wheel)")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-c", PIP_FOR_MAC, python, "install", "--dry-run", "--ignore-installed"]
        cmd += ["--quiet", "--report", str(report), "--only-binary=:all:", "--platform", PLATFORM]
        cmd += ["--python-version", python, "--implementation", "cp", "--target", str(Path(tmp) / "t")]
        cmd += ["--find-links", str(dist), str(wheels[-1])]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise GenerateError("pip could not resolve: " + (res.stderr.strip().splitlines() or ["?"])[-1])
        return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write the Homebrew formula from a pip installation report.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--report", type=Path, help="a `pip install --dry-run --report` JSON file")
    src.add_argument("--resolve", action="store_true", help="run pip for macOS arm64 (needs PyPI) on --dist")
    ap.add_argument("--dist", type=Path, default=ROOT / "dist", help="where the built wheels are (--resolve)")
    ap.add_argument("--python", default=PYTHON, help=f"Homebrew's Python version (default {PYTHON})")
    ap.add_argument("--out", type=Path, default=FORMULA, help="the formula to write (- for stdout)")
    args = ap.parse_args(argv)
    try:
        report = resolve(args.dist, args.python) if args.resolve else json.loads(args.report.read_text())
        text = formula_from_report(report, args.python)
    except (GenerateError, OSError, ValueError, KeyError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
