"""Where the time from ``duet generate`` to the first token goes, in fresh processes.

Two measurements, each the median of ``--runs`` fresh processes (the files are in the page
cache after the first, as they are for a user who runs it twice):

* **cold**: the real ``duet generate --prompt P --max-tokens 1 --temperature 0``, from spawning
  the process to the first byte of the reply on its stdout, and the process's peak RSS;
* **phases**: this script re-runs itself as a child that goes through ``duet generate``'s own
  steps (``app.options``'s functions, in ``duet generate``'s order) and times each: interpreter start, imports,
  argument checks, the model check, the model load split into its parts (GGUF metadata, tensor
  decode, tokenizer, mlx-lm model module, weight re-layout), the engine (KV pool), the prompt
  template and the first token. A part is timed by wrapping the function everywhere it is
  referenced, so the numbers are inclusive: nested parts are also inside their parent.

    .venv/bin/python bench/startup.py [--model PATH.gguf] [--runs 5] [--profile]

``--profile`` adds a cProfile of one child run (the top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a haiku about rain"
# (label, module, attribute path): inclusive time of each call, summed over the run
PARTS = [
    ("model check (preflight)", "mlx_engine.loading.preflight", "check_model"),
    ("load_model", "mlx_engine.loading.loader", "load_model"),
    ("  GGUF metadata parse", "mlx_engine.loading.gguf_file", "read_gguf"),
    ("  tensor read + decode", "mlx_engine.loading.gguf_loader", "read_tensors"),
    ("  tokenizer from GGUF", "mlx_engine.tokenization.gguf_tokenizer", "tokenizer_from_gguf"),
    ("  mlx-lm model module", "mlx_engine.loading.mlx_lm_lazy", "import_module"),
    ("  weight re-layout (CPU)", "mlx_engine.loading.loader", "_input_major_weights"),
    ("engine build", "mlx_engine.engine.core", "EngineCore.__init__"),
    ("  KV pool allocation", "mlx_engine.kv_cache.kv_pool", "KVPool.__init__"),
    ("prompt template + tokenize", "mlx_engine.engine.inputs", "InputProcessor.prompt_ids"),
]


# --- the child: duet generate's steps, timed ------------------------------------------------
def _wrap_everywhere(timings: dict[str, float]) -> None:
    """Replace each PARTS function, wherever a loaded mlx_engine/app module holds it, by a timer."""
    import functools
    import importlib

    for label, module, attr in PARTS:
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue

        def timed(*a, _fn=fn, _label=label, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                timings[_label] = timings.get(_label, 0.0) + time.perf_counter() - t

        functools.update_wrapper(timed, fn)
        setattr(owner, name, timed)
        if path:
            continue
        for mod in list(sys.modules.values()):  # `from x import f` bindings elsewhere
            if getattr(mod, "__name__", "").startswith(("mlx_engine", "app", "peer")):
                for k, v in list(vars(mod).items()):
                    if v is fn:
                        setattr(mod, k, timed)


def child(model: str | None) -> None:
    t0 = float(os.environ["_BENCH_T0"])
    stamps = {"interpreter start": time.monotonic() - t0}
    t = time.monotonic()
    import asyncio

    import app.cli as cli
    import mlx_engine.engine.api  # noqa: F401  (what Engine.load imports first, timed with the imports)
    import mlx_engine.loading.gguf_loader  # noqa: F401
    import mlx_engine.loading.preflight  # noqa: F401
    from app import options

    stamps["imports"] = time.monotonic() - t
    timings: dict[str, float] = {}
    _wrap_everywhere(timings)
    argv = ["generate", "--prompt", PROMPT, "--max-tokens", "1", "--temperature", "0"]
    if model:
        argv += ["--model", model]
    t = time.monotonic()
    args = cli.build_parser().parse_args(argv)
    sampling = options.sampling_params(args)
    config = options.engine_config(args)
    stamps["argument checks"] = time.monotonic() - t
    t = time.monotonic()
    options.check_model_args(args)
    options.use_fast_blas()
    stamps["model check + BLAS"] = time.monotonic() - t
    t = time.monotonic()
    engine = options.load_engine(args, config)
    stamps["Engine.load"] = time.monotonic() - t
    from mlx_engine.request import GenerationRequest

    req = GenerationRequest(messages=[{"role": "user", "content": PROMPT}], max_tokens=1, sampling=sampling)

    async def first() -> None:
        async for _ in engine.generate(req):
            return

    t = time.monotonic()
    asyncio.run(first())
    stamps["template + prefill + first token"] = time.monotonic() - t
    stamps["total to first token"] = time.monotonic() - t0
    engine.shutdown()
    print(json.dumps({"stamps": stamps, "parts": timings}))


# --- the parent ------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    return env


def run_child(model: str | None, profile: bool = False) -> dict:
    env = _env()
    env["_BENCH_T0"] = repr(time.monotonic())
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-s", "cumulative"]
    cmd += [__file__, "--child"] + (["--model", model] if model else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    if profile:
        return {"profile": out.stdout}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cold(model: str | None) -> tuple[float, float, float]:
    """(seconds to the first reply byte, seconds to exit, peak RSS MiB) of the real CLI."""
    duet = Path(sys.executable).parent / "duet"
    cmd = [str(duet), "generate", "--prompt", PROMPT, "--max-tokens", "1", "--temperature", "0"]
    if model:
        cmd += ["--model", model]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    assert p.stdout is not None
    p.stdout.read(1)
    first = time.monotonic() - t0
    p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"duet generate failed with exit code {p.returncode}")
    return first, time.monotonic() - t0, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF or model directory (default: the bundled model)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also cProfile one child run")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the medians here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.model)
        return
    run_cold(a.model)  # page cache, compiled bytecode
    cold = [run_cold(a.model) for _ in range(a.runs)]
    runs = [run_child(a.model) for _ in range(a.runs)]
    med = statistics.median
    print(f"duet generate, {a.runs} fresh processes each, medians (model: {a.model or 'bundled'})")
    print(
        f"  real CLI: first reply byte {med(c[0] for c in cold):.2f} s, exit {med(c[1] for c in cold):.2f} s, "
        f"peak RSS {med(c[2] for c in cold):.0f} MiB"
    )
    print("  phases (in order; their sum is the total):")
    result: dict[str, dict[str, float]] = {"stamps": {}, "parts": {}}
    for key in runs[0]["stamps"]:
        v = med(r["stamps"][key] for r in runs)
        result["stamps"][key] = v
        print(f"    {key:34s} {v * 1000:8.0f} ms")
    print("  parts (inclusive; indented ones are inside the one above):")
    for label, _, _ in PARTS:
        vals = [r["parts"].get(label) for r in runs]
        if any(v is None for v in vals):
            continue
        v = med(vals)
        result["parts"][label] = v
        print(f"    {label:34s} {v * 1000:8.0f} ms")
    result["cold"] = {
        "first_byte_s": med(c[0] for c in cold),
        "exit_s": med(c[1] for c in cold),
        "peak_rss_mib": med(c[2] for c in cold),
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.profile:
        print(run_child(a.model, profile=True)["profile"][:6000])


if __name__ == "__main__":
    main()
