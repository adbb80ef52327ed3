"""OpenAI-server benchmark: Duet vs mlx_lm.server (and llama.cpp's server) on the same model, same run.

    .venv/bin/python bench/serve.py [--servers duet,mlx_lm,llama_cpp] [--concurrency 1,2,4,8,16,32]
                                    [--max-tokens 48] [--poisson-rate 2] [--poisson-requests 32]
                                    [--llama-python /path/to/venv-with-llama-cpp-python/bin/python]

Each server runs alone (one after the other: two cores cannot host both), with the bundled
SmolLM2-135M: Duet serves the GGUF; mlx_lm.server gets the same weights exported as an MLX
directory (dense fp32, which is also what Duet computes with on CPU), and both get the same
OpenBLAS preload. Clients use the openai SDK, stream, greedy, one of 64 different ~40-token
prompts each. Per request: TTFT (send -> first content chunk) and inter-token latency (gaps
between content chunks); per level: aggregate completion tok/s over the level's wall time.
Then Poisson arrivals at a fixed rate. Writes bench/out/serve.json and docs/bench_serve.png.
llama.cpp's server (`llama-cpp-python[server]`, same GGUF file, all cores) runs when `llama_cpp` is
listed; it compiles llama.cpp on install (~15+ min here), so give it its own venv via --llama-python.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_engine.blas_preload import preload_env  # noqa: E402
from mlx_engine.loading.resolve import bundled_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
WORDS = (
    "river stone light garden north window paper music seven quiet engine orange market forest silver "
    "winter letter morning bridge number story yellow doctor island"
).split()


def export_mlx_dir(dest: Path) -> Path:
    """The bundled GGUF as an MLX/HF directory (dense fp32 weights, config, tokenizer)."""
    if (dest / "config.json").exists():
        return dest
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_engine.loading.loader import load_model

    lm = load_model(None, weights="dense")
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    (dest / "config.json").write_text(json.dumps(dataclasses.asdict(lm.model.args), indent=1))
    tok = lm.tokenizer
    (dest / "tokenizer.json").write_text(tok.backend.to_str())
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": tok.chat_template,
                "eos_token": tok.eos_token,
                "bos_token": tok.bos_token,
                "add_bos_token": tok.add_bos_token,
            }
        )
    )
    return dest


LLAMA_PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blas_env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(preload_env())  # LD_PRELOAD (and OPENBLAS_CORETYPE)
    return env


def start(name: str, port: int, mlx_dir: Path, max_conc: int) -> tuple[subprocess.Popen, str]:
    if name == "duet":
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--cache-gb", "1"]
        model = "default"
    elif name == "llama_cpp":
        gguf = str(bundled_model_path())
        cmd = [
            LLAMA_PYTHON,
            "-m",
            "llama_cpp.server",
            "--model",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "8192",
            "--n_threads",
            str(os.cpu_count()),
            "--model_alias",
            "smollm2",
        ]
        model = "smollm2"
    else:
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(mlx_dir),
            "--port",
            str(port),
            "--decode-concurrency",
            str(max_conc),
            "--prompt-concurrency",
            str(min(max_conc, 8)),
            "--log-level",
            "WARNING",
        ]
        model = str(mlx_dir)
    log = open(OUT / f"serve_{name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=blas_env(), cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc, model
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} server did not start")


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [
        f"Write a short story that uses these words: {' '.join(rng.choices(WORDS, k=24))}." for _ in range(n)
    ]


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    error = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
    except openai.OpenAIError as e:  # counted, not fatal: a server that drops clients shows it in the table
        error = f"{type(e).__name__}: {e}"
    return {
        "ttft": times[0] - t0 if times and not error else None,
        "itl": [b - a for a, b in zip(times, times[1:], strict=False)] if not error else [],
        "tokens": len(times) if not error else 0,
        "error": error,
    }


def summarize(results: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    itl = sorted(x for r in results for x in r["itl"])

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000 if xs else None

    toks = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "failed": sum(r["error"] is not None for r in results),
        "tokens": toks,
        "wall_s": wall,
        "tok_s": toks / wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "itl_mean_ms": statistics.fmean(itl) * 1000 if itl else None,
    }


async def level(base: str, model: str, conc: int, n_req: int, max_tokens: int, ps: list[str]) -> dict:
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600) as client:
        queue = list(range(n_req))
        results = []

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await one(client, model, ps[i % len(ps)], max_tokens))

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return summarize(results, time.perf_counter() - t)


async def poisson(base: str, model: str, rate: float, n_req: int, max_tokens: int, ps: list[str]) -> dict:
    rng = random.Random(1)
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600) as client:
        tasks = []
        t = time.perf_counter()
        for i in range(n_req):
            tasks.append(asyncio.create_task(one(client, model, ps[i % len(ps)], max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return summarize(results, time.perf_counter() - t)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, data in report["servers"].items():
        levels = data["levels"]
        c = [lv["concurrency"] for lv in levels]
        axes[0].plot(c, [lv["tok_s"] for lv in levels], "o-", label=name)
        axes[1].plot(c, [lv["ttft_p50_ms"] for lv in levels], "o-", label=f"{name} p50")
        axes[1].plot(c, [lv["ttft_p99_ms"] for lv in levels], "x--", label=f"{name} p99")
        axes[2].plot(c, [lv["itl_p50_ms"] for lv in levels], "o-", label=f"{name} p50")
        axes[2].plot(c, [lv["itl_p99_ms"] for lv in levels], "x--", label=f"{name} p99")
    for ax, title in zip(axes, ("aggregate tok/s", "TTFT (ms)", "inter-token latency (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.suptitle("SmolLM2-135M, CPU (2 cores), greedy, streamed chat completions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def table(report: dict) -> str:
    rows = [
        "| server | clients | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, data in report["servers"].items():
        for lv in data["levels"] + [
            {**data["poisson"], "concurrency": f"Poisson {report['poisson_rate']}/s"}
        ]:
            rows.append(
                f"| {name} | {lv['concurrency']} | {lv['tok_s']:.1f} | {ms(lv['ttft_p50_ms'])} / "
                f"{ms(lv['ttft_p99_ms'])} | {ms(lv['itl_p50_ms'])} / {ms(lv['itl_p99_ms'])} | "
                f"{lv['failed']} of {lv['requests']} |"
            )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="duet,mlx_lm")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--poisson-rate", type=float, default=1.0, help="arrivals per second")
    ap.add_argument("--poisson-requests", type=int, default=24)
    ap.add_argument(
        "--llama-python",
        default=sys.executable,
        help="python with llama-cpp-python[server] installed (for --servers ...,llama_cpp)",
    )
    args = ap.parse_args()
    global LLAMA_PYTHON
    LLAMA_PYTHON = args.llama_python
    OUT.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    mlx_dir = export_mlx_dir(OUT / "smollm2-135m-mlx-fp32")
    ps = prompts(64)
    report = {"max_tokens": args.max_tokens, "poisson_rate": args.poisson_rate, "servers": {}}
    for name in args.servers.split(","):
        port = free_port()
        proc, model = start(name, port, mlx_dir, max(levels))
        base = f"http://127.0.0.1:{port}/v1"
        try:
            asyncio.run(level(base, model, 2, 2, 8, ps))  # warm-up
            data = {"levels": []}
            for c in levels:
                r = asyncio.run(
                    level(base, model, c, max(4, c * args.requests_per_client), args.max_tokens, ps)
                )
                r["concurrency"] = c
                data["levels"].append(r)
                print(
                    f"{name:7s} c={c:3d}  {r['tok_s']:7.1f} tok/s  TTFT p50 {ms(r['ttft_p50_ms'])} ms  "
                    f"p99 {ms(r['ttft_p99_ms'])} ms  ITL p50 {ms(r['itl_p50_ms'])} ms  p99 {ms(r['itl_p99_ms'])} ms  "
                    f"failed {r['failed']}/{r['requests']}",
                    flush=True,
                )
            data["poisson"] = asyncio.run(
                poisson(base, model, args.poisson_rate, args.poisson_requests, args.max_tokens, ps)
            )
            print(f"{name:7s} Poisson {args.poisson_rate}/s: {data['poisson']}", flush=True)
            report["servers"][name] = data
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    (OUT / "serve.json").write_text(json.dumps(report, indent=1))
    plot(report, ROOT / "docs" / "bench_serve.png")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
