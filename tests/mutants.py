"""Hand-made mutation testing of the engine core: re-apply each one-line bug and run its tests.

Each mutant is (file, exact original snippet, replacement). For every mutant the script copies
the repository (without .venv and .git) to a temporary directory, applies the mutant there (the
working tree is never touched), runs the test files that guard that code in the copy and reports
whether some test failed (caught) or all passed (survived). A snippet that is not found exactly
once is an error: the code moved, so the mutant must be updated, never silently skipped.

    .venv/bin/python tests/mutants.py                    # every mutant
    .venv/bin/python tests/mutants.py --only NAME ...    # some of them
    .venv/bin/python tests/mutants.py --list             # names and descriptions
    .venv/bin/python tests/mutants.py --baseline         # first run the unmutated copy
    .venv/bin/python tests/mutants.py --tests-at REV     # with tests/ as of a git revision
    .venv/bin/python tests/mutants.py --only NAME --tests tests/test_x.py   # other test files

``--tests-at`` measures an older suite against today's code (e.g. the score before a test was
written); test files that did not exist at that revision are left out. ``--baseline`` runs every
chosen test file on the unmutated copy first; tests that fail there (an older suite that no
longer fits today's code) are listed and deselected from the mutant runs, since they would
"catch" every mutant. Exit status: 0 when every mutant was caught, 1 when some survived, 2 on a
setup error. See tests/mutants.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(
    ".venv",
    ".git",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.egg-info",
    "build",
    "dist",
)
PER_TEST_TIMEOUT_S = 120  # a mutant that makes a test hang fails it instead of stalling the run
PER_MUTANT_TIMEOUT_S = 900

# Test files per guarded module, the direct guards first (runs stop at the first failure).
SCHEDULER = (
    "tests/test_scheduler.py",
    "tests/test_scheduler_properties.py",
    "tests/test_prefix_cache.py",
    "tests/test_engine_tiny.py",
    "tests/test_server.py",
)
ALLOCATOR = (
    "tests/test_kv_pool_growth.py",  # first: its direct checks fail fast where a property test may hang
    "tests/test_block_allocator.py",
    "tests/test_scheduler_properties.py",
    "tests/test_scheduler.py",
    "tests/test_prefix_cache.py",
    "tests/test_engine_tiny.py",
)
ENGINE = ("tests/test_prefix_cache.py", "tests/test_engine_tiny.py", "tests/test_server.py")
SAMPLER = ("tests/test_sampler.py", "tests/test_engine_tiny.py", "tests/test_server.py")
ATTENTION = ("tests/test_engine_tiny.py", "tests/test_kv_pool_in_place.py", "tests/test_prefix_cache.py")
STOPS = ("tests/test_stop_strings.py", "tests/test_engine_tiny.py", "tests/test_server.py")
KV_SOURCES = ("tests/test_kv_source.py", "tests/test_remote_prefill_engine.py", "tests/test_engine_tiny.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str


MUTANTS = [
    Mutant(
        "preempt-oldest",
        "mlx_engine/scheduler.py",
        "(s for s in self.running if s.request_id not in step.tokens), key=place.__getitem__",
        "(s for s in self.running if s.request_id not in step.tokens), key=lambda s: -place[s]",
        SCHEDULER,
        "out of blocks, the oldest running sequence is preempted instead of the newest",
    ),
    Mutant(
        "preempted-to-back",
        "mlx_engine/scheduler.py",
        "self.waiting.appendleft(seq)",
        "self.waiting.append(seq)",
        SCHEDULER,
        "a preempted sequence goes to the back of the queue instead of the front",
    ),
    Mutant(
        "prefix-match-whole-prompt",
        "mlx_engine/scheduler.py",
        "hit = self.alloc.match_prefix(seq.tokens, end, seq.cache_salt)",
        "hit = self.alloc.match_prefix(seq.tokens, end + 1, seq.cache_salt)",
        SCHEDULER,
        "a block-aligned prompt is matched in full, leaving no token to compute logits from",
    ),
    Mutant(
        "held-followers-dropped",
        "mlx_engine/scheduler.py",
        "self.waiting.extendleft(reversed(held))",
        "pass",
        SCHEDULER,
        "n > 1 choices held for their leader are never put back in the queue",
    ),
    Mutant(
        "admit-past-max-running",
        "mlx_engine/scheduler.py",
        "self.num_active < self.cfg.max_running",
        "self.num_active <= self.cfg.max_running",
        SCHEDULER,
        "one more sequence than max_running is admitted",
    ),
    Mutant(
        "running-ignores-budget",
        "mlx_engine/scheduler.py",
        "n = min(n, budget)\n            while not self._grow(seq, n, step.copies):",
        "pass\n            while not self._grow(seq, n, step.copies):",
        SCHEDULER,
        "a running prefill takes a whole chunk even past the step's token budget",
    ),
    Mutant(
        "release-registers-uncomputed",
        "mlx_engine/scheduler.py",
        "full, tail = divmod(seq.num_computed, self.bs)",
        "full, tail = divmod(len(seq.tokens), self.bs)",
        SCHEDULER,
        "a released sequence registers blocks whose KV was never (fully) computed",
    ),
    Mutant(
        "can-ever-fit-off-by-one",
        "mlx_engine/scheduler.py",
        "return -(-num_tokens // self.bs) <= self.alloc.num_blocks - 1",
        "return -(-num_tokens // self.bs) <= self.alloc.num_blocks",
        SCHEDULER,
        "a prompt one block larger than the pool is accepted (and then waits forever)",
    ),
    Mutant(
        "register-partial-block",
        "mlx_engine/scheduler.py",
        "full = min(seq.num_computed, seq.num_verified) // self.bs",
        "full = -(-min(seq.num_computed, seq.num_verified) // self.bs)",
        SCHEDULER,
        "a block is registered in the prefix index before it is fully computed",
    ),
    Mutant(
        "landed-in-one-layer",
        "mlx_engine/kv_cache/kv_source.py",
        "return min(r.end_from(t) for r in self.layers)",
        "return max(r.end_from(t) for r in self.layers)",
        KV_SOURCES,
        "a loading sequence counts tokens as computed (and indexes their blocks) once one layer landed",
    ),
    Mutant(
        "cancelled-load-stays-live",
        "mlx_engine/scheduler.py",
        "st = self.live_loads.pop(load_id)\n                assert st is not None",
        "st = self.live_loads.get(load_id)\n                assert st is not None",
        KV_SOURCES,
        "late frames of a cancelled load are still written, into blocks that were freed and reused",
    ),
    Mutant(
        "last-token-in-its-chunk",
        "mlx_engine/scheduler.py",
        "if self.cfg.last_token_alone and not seq.exact_grid and seq.num_computed < seq.num_prompt - 1:",
        "if False:",
        KV_SOURCES,
        "a decoder with a peer computes the prompt's last token inside its last chunk (logits differ from remote)",
    ),
    Mutant(
        "kv-apply-unbounded",
        "mlx_engine/engine/kv_transfer.py",
        "if isinstance(m, KVLayer) and budget <= 0:",
        "if False:",
        KV_SOURCES,
        "every queued KV frame is applied before the next step, stalling decode streams while a load arrives",
    ),
    Mutant(
        "cached-tokens-dropped",
        "mlx_engine/engine/outputs.py",
        "cached_tokens=seq.num_cached",
        "cached_tokens=0",
        ENGINE,
        "usage.cached_tokens reports no prefix hit instead of the request's own",
    ),
    Mutant(
        "sliding-window-dropped",
        "mlx_engine/kv_cache/paged_attention.py",
        "m = m & (self._k_pos > self._q_pos - window)",
        "pass",
        ATTENTION,
        "the sliding-window condition of the attention mask is dropped",
    ),
    Mutant(
        "min-p-before-temperature",
        "mlx_engine/sampling/sampler.py",
        "math.log(p.min_p) if p.min_p > 0",
        "math.log(p.min_p) / p.temperature if p.min_p > 0",
        SAMPLER,
        "min_p's threshold is taken on the logits before temperature scaling",
    ),
    Mutant(
        "evict-newest-first",
        "mlx_engine/kv_cache/block_allocator.py",
        "b, _ = self._free.popitem(last=False)",
        "b, _ = self._free.popitem(last=True)",
        ALLOCATOR,
        "allocation evicts the most recently released cached block instead of the coldest",
    ),
    Mutant(
        "free-head-first",
        "mlx_engine/kv_cache/block_allocator.py",
        "for b in reversed(blocks):",
        "for b in blocks:",
        ALLOCATOR,
        "a sequence's first blocks are released first, so its shared prefix is evicted before its tail",
    ),
    Mutant(
        "revived-block-stays-in-free-queue",
        "mlx_engine/kv_cache/block_allocator.py",
        "if self.ref[b] == 0:\n            self._free.pop(b)",
        "if self.ref[b] == 0:\n            self._free.get(b)",
        ALLOCATOR,
        "a cached block taken by a prefix hit stays allocatable (its KV can be overwritten)",
    ),
    Mutant(
        "stop-tie-goes-to-shorter",
        "mlx_engine/tokenization/stop_strings.py",
        "start + len(stop) < best[0]",
        "start + len(stop) <= best[0]",
        STOPS,
        "of two stop strings ending at the same place, the shorter wins",
    ),
    Mutant(
        "register-proposed-tokens",
        "mlx_engine/scheduler.py",
        "full = min(seq.num_computed, seq.num_verified) // self.bs",
        "full = seq.num_computed // self.bs",
        ("tests/test_scheduler_properties.py",),
        "a block holding unverified proposals enters the prefix cache, then is rewritten on rollback",
    ),
    Mutant(
        "keep-rejected-proposals",
        "mlx_engine/speculative/verify.py",
        "while n <= len(proposals) and n < len(results) and results[n - 1].token_id == proposals[n - 1]:",
        "while n <= len(proposals) and n < len(results):",
        ("tests/test_speculative.py",),
        "every proposed token is kept, equal to the sampled one or not",
    ),
]


def _test_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    preload = subprocess.run(
        [sys.executable, "-m", "mlx_engine.blas", "--preload"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _copy_tree(dest: Path, tests_at: str | None) -> None:
    shutil.copytree(ROOT, dest, ignore=COPY_IGNORE)
    if tests_at is not None:
        shutil.rmtree(dest / "tests")
        archive = subprocess.run(
            ["git", "archive", tests_at, "tests"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def _apply(tree: Path, m: Mutant) -> None:
    path = tree / m.file
    text = path.read_text()
    count = text.count(m.original)
    if count != 1:
        raise SystemExit(
            f"mutant {m.name}: its snippet occurs {count} times in {m.file} (expected once); "
            f"the code moved, update the mutant in tests/mutants.py:\n{m.original}"
        )
    path.write_text(text.replace(m.original, m.replacement))


def _check_imports_from(tree: Path, env: dict[str, str]) -> None:
    """The copy's own packages must be the ones imported (not the editable install's)."""
    out = subprocess.run(
        [sys.executable, "-c", "import mlx_engine, tests; print(mlx_engine.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if not out.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"the copy imports mlx_engine from {out.stdout.strip() or out.stderr!r}, not {tree}")


def _run_tests(
    tree: Path, tests: tuple[str, ...], env: dict[str, str], deselect: list[str], stop_first: bool = True
) -> tuple[str, str, float]:
    """(outcome, detail, seconds): outcome is caught, survived, hang or no-tests; without
    ``stop_first`` the detail lists every failing test, space-separated."""
    present = [t for t in tests if (tree / t).exists()]
    if not present:
        return "no-tests", "none of its test files exist", 0.0
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        *(["-x"] if stop_first else []),
        "-p",
        "no:cacheprovider",
        "--hypothesis-seed=0",
        "-o",
        f"timeout={PER_TEST_TIMEOUT_S}",
        *(f"--deselect={d}" for d in deselect),
        *present,
    ]
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=PER_MUTANT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return "hang", f"no result in {PER_MUTANT_TIMEOUT_S} s", time.monotonic() - t0
    dt = time.monotonic() - t0
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return "survived", f"{' '.join(present)} all pass", dt
    failed = list(dict.fromkeys(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)))
    if not stop_first and failed:
        return "caught", " ".join(failed), dt
    detail = failed[0] if failed else out.strip().splitlines()[-1] if out.strip() else f"exit {r.returncode}"
    if "Timeout" in out:
        return "hang", detail, dt
    return "caught", detail, dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--baseline", action="store_true", help="first check that the unmutated copy passes")
    ap.add_argument("--tests-at", metavar="REV", help="use tests/ as of this git revision")
    ap.add_argument(
        "--tests", nargs="+", metavar="FILE", help="run these test files instead of each mutant's own"
    )
    args = ap.parse_args()

    names = {m.name for m in MUTANTS}
    if args.only and (unknown := set(args.only) - names):
        print(f"unknown mutant(s): {', '.join(sorted(unknown))}; --list shows them", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:36} {m.file:32} {m.why}")
        return 0

    env = _test_env()
    results = []
    deselect: list[str] = []
    with tempfile.TemporaryDirectory(prefix="duet-mutants-") as tmp:
        if args.baseline:
            tree = Path(tmp) / "baseline"
            _copy_tree(tree, args.tests_at)
            _check_imports_from(tree, env)
            files = tuple(args.tests or dict.fromkeys(t for m in chosen for t in m.tests))
            outcome, detail, dt = _run_tests(tree, files, env, [], stop_first=False)
            if outcome == "caught":
                deselect = detail.split()
                detail = "failing on the unmutated tree, deselected: " + " ".join(deselect)
            elif outcome != "survived":
                print(f"the unmutated copy does not run: {outcome} {detail}", file=sys.stderr)
                return 2
            print(f"{'(baseline)':36} {'pass' if outcome == 'survived' else 'FAIL':9} {dt:6.1f}s  {detail}")
            shutil.rmtree(tree)
        for i, m in enumerate(chosen):
            tree = Path(tmp) / f"m{i}"
            _copy_tree(tree, args.tests_at)
            if i == 0:
                _check_imports_from(tree, env)
            _apply(tree, m)
            outcome, detail, dt = _run_tests(tree, tuple(args.tests or m.tests), env, deselect)
            shutil.rmtree(tree)
            results.append((m, outcome))
            print(f"{m.name:36} {outcome:9} {dt:6.1f}s  {detail}", flush=True)
    caught = sum(o in ("caught", "hang") for _, o in results)
    hangs = sum(o == "hang" for _, o in results)
    print(f"\ncaught {caught}/{len(results)}" + (f" ({hangs} only by a hang)" if hangs else ""))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
