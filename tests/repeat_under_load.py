"""Run tests many times in a row while every core is kept busy: the flakiness check of CONTRIBUTING.md.

    .venv/bin/python tests/repeat_under_load.py --runs 20 tests/test_tui.py tests/test_tui_remote.py
    .venv/bin/python tests/repeat_under_load.py --runs 20 --timing      # every test marked as timing-sensitive

One busy-loop process per CPU core spins for the whole run (a shared CI box at its worst), and each pytest
run is a fresh process with the suite's environment (offline, OpenBLAS preloaded). It stops at the first
failing run unless --keep-going, prints the pass count, and exits non-zero if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Tests that involve timing, threads, subprocesses or the network: what the flakiness check covers by default.
TIMING_SENSITIVE = [
    "tests/test_tui.py",
    "tests/test_tui_remote.py",
    "tests/test_tui_tmux.py",
    "tests/test_engine_tiny.py",
    "tests/test_server.py",
    "tests/test_server_main.py",
    "tests/test_server_harness.py",
    "tests/test_server_security.py",
    "tests/test_cli.py",
    "tests/test_fair_scheduling.py",
    "tests/test_peer_accept.py",  # a flood of connections against the handshake caps and deadline
    "tests/test_peer_bounds.py",  # load deadlines, idle connections, unpairing while connected
    "tests/test_peer_local_auth.py",
    "tests/test_engine_stats.py",  # snapshots polled while requests come and go
    "tests/test_agent_clients.py",  # the real claude / codex against a `duet serve` subprocess
]


def _spin() -> None:
    while True:
        pass


def _suite_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    preload = subprocess.run(
        [sys.executable, "-m", "mlx_engine.blas", "--env"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    env.update(kv.partition("=")[::2] for kv in preload)  # LD_PRELOAD (and OPENBLAS_CORETYPE)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help="pytest paths or node ids")
    ap.add_argument("--runs", type=int, default=20, help="how many runs in a row (default 20)")
    ap.add_argument("--timing", action="store_true", help="add every timing-sensitive test file that exists")
    ap.add_argument(
        "--busy", type=int, default=os.cpu_count() or 2, help="busy-loop processes (default: one per core)"
    )
    ap.add_argument("--keep-going", action="store_true", help="do not stop at the first failing run")
    args = ap.parse_args()
    tests = list(args.tests) + ([t for t in TIMING_SENSITIVE if (ROOT / t).exists()] if args.timing else [])
    if not tests:
        ap.error("name some tests or pass --timing")
    env = _suite_env()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    passed = failed = 0
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            r = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                cwd=ROOT,
                env=env,
            )
            ok = r.returncode == 0
            passed, failed = passed + ok, failed + (not ok)
            print(
                f"run {i}/{args.runs}: {'pass' if ok else 'FAIL'} in {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            if not ok and not args.keep_going:
                break
    finally:
        for p in spinners:
            p.terminate()
    print(
        f"{passed} passed, {failed} failed, of {passed + failed} runs with {args.busy} busy cores: {' '.join(tests)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
