"""`duet service install|uninstall|status`: run Duet in the background at login.

- **macOS**: a launchd *agent* (``~/Library/LaunchAgents/duet.<role>.plist``) that runs
  ``duet serve`` (role ``serve``, the default there) at login, restarts it when it fails, and logs
  to ``~/Library/Logs/duet/<role>.log`` (stdout) and ``<role>.err.log`` (stderr). ``--app
  /Applications/Duet.app`` runs the app bundle's executable instead, so macOS's Local Network
  Privacy attributes the agent to an app that declares ``NSLocalNetworkUsageDescription`` and
  ``NSBonjourServices`` (needed for mDNS and LAN peers; loopback needs no permission).
- **Linux**: a systemd *user* unit (``~/.config/systemd/user/duet-<role>.service``) that runs
  ``duet peer serve`` (role ``peer``, the default there) as the user who installs it, never root,
  with its options in an ``EnvironmentFile`` (``~/.config/duet/<role>.env``, ``DUET_ARGS=...``).
  It starts with the user's session; ``loginctl enable-linger USER`` starts it at boot. The
  system-wide unit for a dedicated ``duet`` account is ``packaging/linux/duet-peer.service``.

``--dry-run`` writes the files and prints the launchctl/systemctl commands without running them
(the tests use it with a temporary HOME). Options after ``--`` are passed to the command the
service runs: ``duet service install -- --model M --port 8000``.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_engine.errors import ConfigError
from mlx_engine.private_files import private_dir, write_private

ROLES = ("serve", "peer")
MANAGERS = ("launchd", "systemd")
ROLE_COMMAND = {"serve": ["serve"], "peer": ["peer", "serve"]}
ROLE_DESCRIPTION = {
    "serve": "Duet OpenAI-compatible server (duet serve)",
    "peer": "Duet prefill peer (duet peer serve)",
}
LABEL_PREFIX = "duet."
APP_EXECUTABLE = "Contents/MacOS/Duet"
APP_BUNDLE_ID = "org.duet-llm.duet"  # packaging/macos/app/Info.plist's CFBundleIdentifier
PLIST_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _fail(message: str) -> ConfigError:
    """A service that cannot be installed, removed or queried as asked (one line, exit 2)."""
    return ConfigError(message, "service")


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


def native_manager() -> str | None:
    return {"darwin": "launchd", "linux": "systemd"}.get(sys.platform)


def default_role(manager: str) -> str:
    return "serve" if manager == "launchd" else "peer"


def home() -> Path:
    return Path(os.path.expanduser("~"))


def log_dir() -> Path:
    """Where the service's own logs go: ``~/Library/Logs/duet`` on macOS; elsewhere the user log
    dir (systemd services log to the journal: ``journalctl --user -u duet-peer``)."""
    if sys.platform == "darwin":
        return home() / "Library" / "Logs" / "duet"
    from platformdirs import user_log_dir

    return Path(user_log_dir("duet", appauthor=False))


def _xdg_config() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or home() / ".config")


@dataclass(frozen=True)
class Service:
    """One service definition: where its files go and what it runs."""

    manager: str
    role: str

    @property
    def name(self) -> str:
        return f"{LABEL_PREFIX}{self.role}" if self.manager == "launchd" else f"duet-{self.role}.service"

    @property
    def unit_path(self) -> Path:
        if self.manager == "launchd":
            return home() / "Library" / "LaunchAgents" / f"{self.name}.plist"
        return _xdg_config() / "systemd" / "user" / self.name

    @property
    def env_path(self) -> Path | None:
        return None if self.manager == "launchd" else _xdg_config() / "duet" / f"{self.role}.env"

    @property
    def logs(self) -> list[str]:
        if self.manager == "launchd":
            d = home() / "Library" / "Logs" / "duet"
            return [str(d / f"{self.role}.log"), str(d / f"{self.role}.err.log")]
        return [f"journalctl --user -u {self.name}"]


def duet_executable(explicit: str | None = None) -> Path:
    """The ``duet`` script of this installation: next to the running Python (venv, pipx, Homebrew's
    libexec), named by the link on PATH that leads to it when there is one (``/opt/homebrew/bin/duet``
    outlives a ``brew upgrade``, the versioned Cellar path does not), else on PATH."""
    if explicit:
        path = Path(explicit).expanduser()
    else:
        beside = Path(sys.executable).parent / "duet"
        found = shutil.which("duet")
        if beside.is_file():
            same = found is not None and Path(found).resolve() == beside.resolve()
            path = Path(found) if same and found is not None else beside
        else:
            path = Path(found) if found else beside
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise _fail(f"no duet executable at {path}; pass --executable PATH")
    return path.absolute()


def program(service: Service, executable: Path | None, app: Path | None) -> list[str]:
    """The command line the service runs (without the user's extra options): ``executable``, or the
    app bundle's own executable."""
    if app is not None:
        executable = app / APP_EXECUTABLE
        if not executable.is_file():
            raise _fail(f"{app} is not a Duet app bundle (no {APP_EXECUTABLE})")
    assert executable is not None
    return [str(executable.absolute()), *ROLE_COMMAND[service.role]]


def launchd_plist(
    service: Service, argv: list[str], env: dict[str, str], *, app: Path | None = None
) -> dict[str, Any]:
    """The launchd agent: starts at login (RunAtLoad), restarted when it exits with an error."""
    logs = service.logs
    plist: dict[str, Any] = {
        "Label": service.name,
        "ProgramArguments": argv,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 30,
        "ProcessType": "Interactive",  # an inference server: no background CPU/GPU throttling
        "StandardOutPath": logs[0],
        "StandardErrorPath": logs[1],
        "WorkingDirectory": str(home()),
        "EnvironmentVariables": {"PATH": PLIST_PATH, "PYTHONUNBUFFERED": "1", **env},
    }
    if app is not None:  # Login Items settings and Local Network Privacy show the app, not python
        plist["AssociatedBundleIdentifiers"] = [APP_BUNDLE_ID]
    return plist


def systemd_user_unit(service: Service, argv: list[str]) -> str:
    """The systemd user unit: ``argv`` then ``$DUET_ARGS`` from the EnvironmentFile."""
    exec_start = " ".join(shlex.quote(a) for a in argv) + " $DUET_ARGS"
    return (
        f"# Written by `duet service install`; `duet service uninstall` removes it.\n"
        f"[Unit]\n"
        f"Description={ROLE_DESCRIPTION[service.role]}\n"
        f"\n"
        f"[Service]\n"
        f"Type=exec\n"
        f"EnvironmentFile={service.env_path}\n"
        f"Environment=PYTHONUNBUFFERED=1\n"
        f"ExecStart={exec_start}\n"
        f"Restart=on-failure\n"
        f"RestartSec=5\n"
        f"RestartPreventExitStatus=2\n"  # a bad option or model: fix the env file, no restart loop
        f"NoNewPrivileges=yes\n"
        f"\n"
        f"[Install]\n"
        f"WantedBy=default.target\n"
    )


def env_file(service: Service, args: list[str], env: dict[str, str]) -> str:
    for a in args:
        if not a or any(c.isspace() or c in "\"'\\$" for c in a):
            raise _fail(
                f"option {a!r} cannot go in a systemd EnvironmentFile word list (no spaces, quotes, "
                "backslashes or $): put such values in a file and pass its path"
            )
    lines = [
        f"# Options for `duet {' '.join(ROLE_COMMAND[service.role])}` run by {service.name} (systemd "
        "EnvironmentFile).",
        "# Edit, then: systemctl --user restart " + service.name,
        f"DUET_ARGS={' '.join(args)}",
    ]
    lines += [f"{k}={v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.replace("_", "").isalnum() or key[0].isdigit():
            raise _fail(f"--env {pair!r} is not NAME=VALUE")
        env[key] = value
    return env


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``path`` whole (a temporary file renamed over it). ``private``: a file that may hold a
    key (``--env``), created 0600, never readable by others even for a moment; otherwise 0644 (a
    unit file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:
        write_private(path, data)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    tmp.replace(path)


def _uid() -> int:
    return os.getuid()


def _commands(service: Service, action: str) -> list[list[str]]:
    if service.manager == "launchd":
        domain = f"gui/{_uid()}"
        if action == "start":
            return [["launchctl", "bootstrap", domain, str(service.unit_path)]]
        return [["launchctl", "bootout", f"{domain}/{service.name}"]]
    if action == "start":
        return [
            ["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", "--now", service.name],
        ]
    return [["systemctl", "--user", "disable", "--now", service.name]]


def _apply(cmds: list[list[str]], run: Runner | None, *, must: bool) -> list[str]:
    """Run the commands (or, with ``run`` None, only list them); returns them as text."""
    done = []
    for cmd in cmds:
        done.append(shlex.join(cmd))
        if run is None:
            continue
        try:
            res = run(cmd)
        except FileNotFoundError:
            raise _fail(f"{cmd[0]} is not on PATH: is this machine using {cmd[0]}?") from None
        if res.returncode != 0 and must:
            why = (res.stderr or res.stdout or "").strip().splitlines()
            raise _fail(f"`{shlex.join(cmd)}` failed: {why[-1] if why else 'exit ' + str(res.returncode)}")
    return done


def install(
    service: Service,
    extra: list[str],
    *,
    executable: str | None = None,
    app: Path | None = None,
    env: dict[str, str] | None = None,
    run: Runner | None = _run,
) -> dict[str, Any]:
    """Write the service's files and start it (``run`` None: write only and list the commands)."""
    env = dict(env or {})
    argv = program(service, None if app else duet_executable(executable), app)
    files = [str(service.unit_path)]
    if service.manager == "launchd":
        private_dir(Path(service.logs[0]).parent)  # ~/Library/Logs/duet: what the server logs is private
        data = plistlib.dumps(launchd_plist(service, argv + extra, env, app=app))
        if service.unit_path.is_file() and run is not None:  # reinstall: unload the old one first
            _apply(_commands(service, "stop"), run, must=False)
        _write(service.unit_path, data, private=True)  # --env may carry a key
    else:
        assert service.env_path is not None
        private_dir(service.env_path.parent)  # ~/.config/duet: Duet's own, 0700
        _write(service.env_path, env_file(service, extra, env).encode(), private=True)
        _write(service.unit_path, systemd_user_unit(service, argv).encode())
        files.append(str(service.env_path))
    try:
        commands = _apply(_commands(service, "start"), run, must=True)
    except ConfigError as e:  # not started: leave nothing behind that looks installed
        for f in files:
            Path(f).unlink(missing_ok=True)
        raise _fail(f"{e} (nothing installed)") from None
    return {"installed": files, "commands": commands, "started": run is not None, "logs": service.logs}


def uninstall(service: Service, *, run: Runner | None = _run) -> dict[str, Any]:
    """Stop the service and remove its files (a service that is not installed is an error)."""
    if not service.unit_path.is_file():
        raise _fail(f"{service.name} is not installed ({service.unit_path} does not exist)")
    commands = _apply(_commands(service, "stop"), run, must=False)
    removed = [str(service.unit_path)]
    service.unit_path.unlink()
    if service.env_path is not None and service.env_path.is_file():
        service.env_path.unlink()
        removed.append(str(service.env_path))
    if service.manager == "systemd":
        commands += _apply([["systemctl", "--user", "daemon-reload"]], run, must=False)
    return {"removed": removed, "commands": commands}


def _state(service: Service, run: Runner) -> dict[str, Any]:
    """Loaded/running state from launchctl or systemctl (None when the tool cannot answer)."""
    try:
        if service.manager == "launchd":
            res = run(["launchctl", "print", f"gui/{_uid()}/{service.name}"])
            if res.returncode != 0:
                return {"loaded": False, "running": False}
            return {"loaded": True, "running": "state = running" in res.stdout}
        active = run(["systemctl", "--user", "is-active", service.name]).stdout.strip()
        enabled = run(["systemctl", "--user", "is-enabled", service.name]).stdout.strip()
        return {"enabled": enabled == "enabled", "running": active == "active", "state": active or None}
    except FileNotFoundError:
        return {"running": None}


def status(service: Service, *, run: Runner | None = _run) -> dict[str, Any]:
    out: dict[str, Any] = {
        "manager": service.manager,
        "name": service.name,
        "file": str(service.unit_path),
        "installed": service.unit_path.is_file(),
        "logs": service.logs,
    }
    if out["installed"] and run is not None:
        out.update(_state(service, run))
    return out


def service_status(run: Runner | None = _run) -> dict[str, Any]:
    """Status of this platform's default service (for `duet doctor`); {} on other platforms."""
    manager = native_manager()
    if manager is None:
        return {}
    return status(Service(manager, default_role(manager)), run=run)


# --- the command ----------------------------------------------------------------------------------
def add_service_parser(sub: Any) -> None:
    p = sub.add_parser(
        "service",
        help="run duet in the background at login (launchd on macOS, systemd user unit on Linux)",
        description="Install, remove or inspect the background service: on macOS a launchd agent "
        "running `duet serve` at login (logs in ~/Library/Logs/duet/); on Linux a systemd user unit "
        "running `duet peer serve` as you, options in ~/.config/duet/peer.env.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="what it runs: serve or peer (default: serve on macOS, peer on Linux)",
    )
    common.add_argument(
        "--manager", choices=MANAGERS, default=None, help="launchd or systemd (default: this platform's)"
    )
    common.add_argument(
        "--dry-run",
        action="store_true",
        help="change files only and print the launchctl/systemctl commands instead of running them",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object")
    actions = p.add_subparsers(dest="action", metavar="{install,uninstall,status}", help="what to do")
    actions.required = True
    i = actions.add_parser(
        "install",
        parents=[common],
        help="write the service and start it (now and at every login)",
        description="Write the service's files and start it. Options after -- go to the command it "
        "runs: duet service install -- --model M --port 8000",
    )
    i.add_argument("--executable", default=None, metavar="PATH", help="the duet to run (default: this one)")
    i.add_argument(
        "--app",
        default=None,
        metavar="Duet.app",
        help="macOS: run the app bundle's executable, so Local Network permission applies to the agent",
    )
    i.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in the service's environment"
    )
    i.add_argument("extra", nargs="*", metavar="-- OPTION", help="options for the command the service runs")
    actions.add_parser(
        "uninstall",
        parents=[common],
        help="stop the service and remove its files",
        description="Stop the service, disable it and remove the files `duet service install` wrote.",
    )
    actions.add_parser(
        "status",
        parents=[common],
        help="is it installed, enabled, running; where it logs",
        description="Whether the service is installed, enabled and running, and where it logs.",
    )
    p.set_defaults(func=cmd_service)


def cmd_service(args: argparse.Namespace) -> int:
    import json

    manager = args.manager or native_manager()
    if manager is None:
        raise _fail(f"duet service supports macOS (launchd) and Linux (systemd), not {sys.platform}")
    if manager != native_manager() and not args.dry_run:
        raise _fail(f"{manager} is not this machine's service manager; use --dry-run to only write files")
    if getattr(args, "app", None) and manager != "launchd":
        raise _fail("--app is for macOS's launchd agent")
    service = Service(manager, args.role or default_role(manager))
    run = None if args.dry_run else _run
    if args.action == "install":
        app = Path(args.app).expanduser() if args.app else None
        out = install(
            service, list(args.extra), executable=args.executable, app=app, env=_parse_env(args.env), run=run
        )
    elif args.action == "uninstall":
        out = uninstall(service, run=run)
    else:
        out = status(service, run=run)
    if args.json:
        print(json.dumps(out))
        return 0
    for key, value in out.items():
        if isinstance(value, list):
            for item in value or ["-"]:
                print(f"{key}: {item}")
        else:
            print(f"{key}: {value}")
    return 0
