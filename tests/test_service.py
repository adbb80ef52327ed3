"""`duet service install|uninstall|status` with a temporary HOME: the launchd agent and the systemd user
unit it writes, the commands it would run (never run here: --dry-run or a recording runner), and its
one-line errors. Nothing is ever enabled on the machine running the tests."""

from __future__ import annotations

import configparser
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from app import service
from app.cli import main
from mlx_engine.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DUET = Path(sys.executable).parent / "duet"


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return h


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["service", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def unit(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    cp.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    cp.read_string(path.read_text())
    return cp


class Recorder:
    """Stands in for subprocess.run: records each command, answers with a fixed result."""

    def __init__(self, returncode: int = 0, stdout: str = "", stderr: str = ""):
        self.calls: list[list[str]] = []
        self.result = (returncode, stdout, stderr)

    def __call__(self, cmd):
        self.calls.append(list(cmd))
        rc, out, err = self.result
        return subprocess.CompletedProcess(list(cmd), rc, out, err)


def test_systemd_user_unit_runs_peer_serve_with_an_environment_file(home, capsys):
    rc, out, err = run(
        capsys, "install", "--manager", "systemd", "--dry-run", "--", "--host", "0.0.0.0", "--port", "7611"
    )
    assert rc == 0, err
    unit_path = home / ".config/systemd/user/duet-peer.service"
    env_path = home / ".config/duet/peer.env"
    u = unit(unit_path)
    assert u["Service"]["EnvironmentFile"] == str(env_path)
    assert u["Service"]["ExecStart"] == f"{DUET} peer serve $DUET_ARGS"
    assert "User" not in u["Service"]  # a user unit: runs as whoever installed it, never root
    assert u["Install"]["WantedBy"] == "default.target"
    assert u["Service"]["RestartPreventExitStatus"] == "2"  # a config error is not retried in a loop
    assert "DUET_ARGS=--host 0.0.0.0 --port 7611\n" in env_path.read_text()
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600
    # the commands it would run, printed and not run
    assert "commands: systemctl --user daemon-reload" in out
    assert "commands: systemctl --user enable --now duet-peer.service" in out
    assert "started: False" in out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_user_unit_passes_systemd_analyze_verify(home, capsys):
    assert run(capsys, "install", "--manager", "systemd", "--dry-run", "--", "--port", "7611")[0] == 0
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(home / ".config/systemd/user/duet-peer.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


def test_launchd_agent_runs_serve_at_login_and_logs_under_library_logs(home, capsys):
    rc, out, err = run(
        capsys,
        "install",
        "--manager",
        "launchd",
        "--dry-run",
        "--env",
        "DUET_API_KEY=k",
        "--",
        "--port",
        "8000",
    )
    assert rc == 0, err
    path = home / "Library/LaunchAgents/duet.serve.plist"
    with path.open("rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "duet.serve"
    assert plist["ProgramArguments"] == [str(DUET), "serve", "--port", "8000"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restarted after a crash, not after a clean stop
    logs = home / "Library/Logs/duet"
    assert plist["StandardOutPath"] == str(logs / "serve.log")
    assert plist["StandardErrorPath"] == str(logs / "serve.err.log")
    assert logs.is_dir()  # launchd does not create it
    assert plist["EnvironmentVariables"]["DUET_API_KEY"] == "k"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it may hold a key
    assert "AssociatedBundleIdentifiers" not in plist
    assert f"commands: launchctl bootstrap gui/{service._uid()} {path}" in out


def test_launchd_agent_through_the_app_bundle_names_its_bundle_id(home, tmp_path, capsys):
    app = tmp_path / "Duet.app"
    exe = app / "Contents/MacOS/Duet"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert run(capsys, "install", "--manager", "launchd", "--dry-run", "--app", str(app))[0] == 0
    with (home / "Library/LaunchAgents/duet.serve.plist").open("rb") as f:
        plist = plistlib.load(f)
    assert plist["ProgramArguments"] == [str(exe), "serve"]
    with (ROOT / "packaging/macos/app/Info.plist").open("rb") as f:
        bundle_id = plistlib.load(f)["CFBundleIdentifier"]
    assert plist["AssociatedBundleIdentifiers"] == [bundle_id]


def test_install_then_uninstall_runs_the_service_manager_commands(home):
    rec = Recorder()
    svc = service.Service("systemd", "peer")
    service.install(svc, ["--port", "7611"], run=rec)
    assert rec.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "duet-peer.service"],
    ]
    assert service.status(svc, run=Recorder(stdout="active\n"))["running"] is True
    rec = Recorder()
    out = service.uninstall(svc, run=rec)
    assert rec.calls == [
        ["systemctl", "--user", "disable", "--now", "duet-peer.service"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    assert not svc.unit_path.exists() and svc.env_path is not None and not svc.env_path.exists()
    assert set(out["removed"]) == {str(svc.unit_path), str(svc.env_path)}


def test_reinstalling_a_launchd_agent_unloads_the_old_one_first(home):
    svc = service.Service("launchd", "serve")
    service.install(svc, [], run=Recorder())
    rec = Recorder()
    service.install(svc, ["--port", "9000"], run=rec)
    domain = f"gui/{service._uid()}"
    assert rec.calls == [
        ["launchctl", "bootout", f"{domain}/duet.serve"],
        ["launchctl", "bootstrap", domain, str(svc.unit_path)],
    ]


def test_a_failing_service_manager_is_one_line(home):
    svc = service.Service("systemd", "peer")
    with pytest.raises(ConfigError) as e:
        service.install(svc, [], run=Recorder(1, stderr="noise\nFailed to connect to bus: No medium found\n"))
    assert str(e.value) == (
        "`systemctl --user daemon-reload` failed: Failed to connect to bus: No medium found (nothing installed)"
    )
    assert not svc.unit_path.exists() and svc.env_path is not None and not svc.env_path.exists()


def test_status_of_an_uninstalled_service_runs_nothing(home, capsys):
    rec = Recorder()
    st = service.status(service.Service("systemd", "peer"), run=rec)
    assert st["installed"] is False and rec.calls == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["uninstall", "--manager", "systemd", "--dry-run"], "duet-peer.service is not installed"),
        (["install", "--manager", "systemd", "--dry-run", "--", "--model", "a b"], "cannot go in a systemd"),
        (["install", "--manager", "systemd", "--dry-run", "--env", "1X=y"], "is not NAME=VALUE"),
        (["install", "--manager", "systemd", "--dry-run", "--app", "/x.app"], "--app is for macOS"),
        (["install", "--dry-run", "--executable", "/nonexistent/duet"], "no duet executable at"),
    ],
)
def test_bad_service_requests_are_one_line(home, capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("duet: error: ") and message in err


def test_a_foreign_service_manager_needs_dry_run(home, capsys):
    foreign = "systemd" if service.native_manager() == "launchd" else "launchd"
    rc, out, err = run(capsys, "install", "--manager", foreign)
    assert rc == 2 and "is not this machine's service manager" in err
    assert not (home / "Library").exists() and not (home / ".config").exists()


def test_the_service_runs_this_duet_through_its_stable_link_on_path(home, tmp_path, monkeypatch):
    bindir = tmp_path / "homebrew-bin"
    bindir.mkdir()
    (bindir / "duet").symlink_to(DUET)  # like /opt/homebrew/bin/duet -> Cellar/duet/X/libexec/bin/duet
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    assert service.duet_executable() == bindir / "duet"
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / "duet").write_text("#!/bin/sh\n")
    (other / "duet").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}:{os.environ['PATH']}")
    assert service.duet_executable() == DUET  # another install's duet first on PATH: not that one
