"""CPU inference, side by side in one run: Duet vs llama.cpp vs mlx-lm on the same GGUF and threads.

    make bench-cpu          # builds llama-cpp-python once (build/wheels/), then runs this
    .venv/bin/python bench/cpu.py [--runs 5] [--threads N] [--models bundled,q4km]
                                  [--systems duet,llama.cpp,mlx-lm] [--profile] [--plot PNG]

Models: the bundled SmolLM2-135M-Instruct GGUF (Q4_1), and a Q4_K_M GGUF made from it by
llama.cpp's own quantizer (``llama_model_quantize``, requantizing allowed; cached under
``bench/out/``). Systems, each in processes of its own so their memory and threads never mix:

* **Duet**: ``Engine`` on the CPU backend (prompts are random, so the prefix cache only ever hits
  the long context, as the others reuse theirs), with its default adaptive n-gram speculation;
  **duet-nospec** (``--systems duet,duet-nospec,...``): the same with speculation off, one token per
  pass like the others; **duet-int8**: speculation off and ``--cpu-math int8`` (activations in 8
  bits and integer dot products, as llama.cpp computes); **duet-int16** and **duet-exact**: speculation
  off and that ``--cpu-math`` (int16, the default: activations to 2^-15 of each run of 32, two int8
  planes; exact: float32's accuracy, three planes);
* **llama.cpp**: llama-cpp-python, the same GGUF, ``n_threads`` = ``n_threads_batch`` = threads;
* **mlx-lm**: mlx-lm cannot read a GGUF (``mlx_lm.load`` takes safetensors only), so its
  generation loop (``generate_step``, under ``mlx_lm.generate``) runs on the model Duet's loader
  builds from the same GGUF: mlx-lm's loop and KV cache against Duet's engine, same weights.

Metrics, medians of ``--runs`` runs (random-token prompts, greedy, end-of-sequence ignored):
decode tok/s at batch 1 after a 64-token prompt and at a 1024-token context (``--long``; 32 tokens after
the first / time from the first to the last; the long context's tokens are computed once per worker and every
run decodes from them: Duet's prefix cache, llama.cpp's saved state, mlx-lm's trimmed cache),
prefill tok/s for a 512-token prompt (`--prefill`; its length / time to the first token), batch-16 aggregate decode
(16 streams of 16-token prompts: tokens after the last stream's first token / time until the
last token; Duet only, the others run one stream at a time, so its ratio is to llama.cpp's
single-stream decode at ctx 64), and from a
cold process (``--runs`` fresh ones after one warm-up): time from spawn to the first reply byte
on stdout and peak RSS, for a 128-token greedy reply to a chat prompt (``duet generate`` itself
for Duet). Ratios are to llama.cpp in the same run.

Under each table: the weights each system reads per decoded token (the file's bytes for llama.cpp,
the bytes as Duet holds them for Duet and mlx-lm) times its decode rate at ctx 64, against the
machine's read bandwidth on the same threads (``bench/membw.py``, measured before the runs).

``--profile`` adds Duet's decode-step decomposition: ops in one decode step (the lazy graph of the
forward pass, counted by primitive), the step time and time per op, and where a step's time goes
(matmuls, attention, norms, embedding, sampler, the rest: Python, scheduling, MLX dispatch) from
timers around each module (they evaluate per module, so the timed step is slower than the plain one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
CHAT_PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."
DECODE_TOKENS = 32
LONG = 1024  # the long context (--long): prefilled once per worker, then decoded from in every run
PREFILL = 512  # the prefill prompt's tokens (--prefill)
COLD_TOKENS = 128
SYSTEMS = ("duet", "llama.cpp", "mlx-lm")  # and "duet-nospec", on request
METRICS = [  # key, label, unit, higher is better
    ("decode_64", "decode, batch 1, ctx 64", "tok/s", True),
    ("decode_long", "decode, batch 1, ctx {long}", "tok/s", True),
    ("prefill", "prefill, {prefill} tokens", "tok/s", True),
    ("batch16", "decode, batch 16 aggregate (ratio: to 1 stream)", "tok/s", True),
    ("cold_ttft", "cold process to first token", "s", False),
    ("peak_rss", "peak RSS (128-token reply)", "MiB", False),
]


SHORT = {
    "decode_64": "decode\nctx 64",
    "decode_long": "decode\nctx {long}",
    "prefill": "prefill\n{prefill}",
    "batch16": "batch 16\n(vs 1 stream)",
    "cold_ttft": "cold start\nto 1st token",
    "peak_rss": "peak\nRSS",
}


def prompts(vocab: int, n: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for _ in range(count)]


def rates(times: list[float], prompt_len: int, t0: float) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from the arrival times of the generated tokens."""
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return prompt_len / (times[0] - t0), decode


# --- Duet ------------------------------------------------------------------------------------
class DuetRunner:
    speculative = "ngram"  # Duet's default: prompt lookup, adaptive (the same tokens as without)
    cpu_math: str | None = None  # the default (int16, or what DUET_CPU_MATH says)

    def __init__(self, model: str, threads: int):
        from mlx_engine.engine import Engine, EngineConfig
        from mlx_engine.loading.loader import load_model

        self.loaded = load_model(model)
        self.engine = Engine(
            self.loaded,
            EngineConfig(
                max_batch_tokens=512,
                prefill_chunk=512,
                max_running=16,
                speculative=self.speculative,
                cpu_math=self.cpu_math,
            ),
        )
        self.vocab = self.loaded.tokenizer.vocab_size

    def describe(self) -> str:
        s = self.engine.stats()
        return f"weights {s.weight_format}, BLAS {s.blas}"

    def streams(self, batch: list[list[int]], n: int) -> tuple[float, list[list[float]]]:
        import asyncio

        from mlx_engine.request import GenerationRequest, SamplingParams

        reqs = [
            GenerationRequest(prompt=p, max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)
            for p in batch
        ]

        async def one(r) -> list[float]:
            times = []
            async for ev in self.engine.generate(r):
                now = time.perf_counter()
                times.extend([now] * len(ev.token_ids))
            return times

        async def go():
            t0 = time.perf_counter()
            return t0, await asyncio.gather(*(one(r) for r in reqs))

        return asyncio.run(go())

    def generate(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        t0, (times,) = self.streams([prompt], n)
        return t0, times

    def prepare_long(self, prompt: list[int]) -> None:
        self.long = prompt
        self.generate(prompt, 1)  # now in the prefix cache (other prompts are random: no hits)

    def decode_long(self, n: int) -> tuple[float, list[float]]:
        return self.generate(self.long, n)

    def shutdown(self) -> None:
        self.engine.shutdown()


# --- llama.cpp -------------------------------------------------------------------------------
class LlamaCppRunner:
    def __init__(self, model: str, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=model,
            n_ctx=max(2048, LONG + 128, PREFILL + 64),
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.vocab = self.llm.n_vocab()

    def describe(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}"

    def generate(self, prompt: list[int], n: int, reset: bool = True) -> tuple[float, list[float]]:
        if reset:
            self.llm.reset()  # no KV reuse from the previous run
        times: list[float] = []
        t0 = time.perf_counter()
        # reset=False goes through: llama-cpp-python's own default (True) compares the prompt with the
        # tokens it holds and, finding no common prefix with decode_long's one token, clears the
        # restored context, so that "ctx 1024" decoded from an empty one (runs before 2026-12-07's J2)
        stream = self.llm.generate(
            prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=reset
        )
        for _ in stream:
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return t0, times

    def prepare_long(self, prompt: list[int]) -> None:
        self.long = prompt
        self.llm.reset()
        self.llm.eval(prompt[:-1])
        self.long_state = self.llm.save_state()

    def decode_long(self, n: int) -> tuple[float, list[float]]:
        self.llm.load_state(self.long_state)  # the first 1023 tokens' KV: one token left to eval
        t0, times = self.generate(self.long[-1:], n, reset=False)
        if self.llm.n_tokens != len(self.long) + len(times) - 1:  # the context was kept, not cleared
            raise RuntimeError(
                f"llama.cpp decoded from {self.llm.n_tokens - len(times)} tokens, not {len(self.long)}"
            )
        return t0, times

    def shutdown(self) -> None:
        self.llm.close()


# --- mlx-lm ----------------------------------------------------------------------------------
class MlxLmRunner:
    def __init__(self, model: str, threads: int):
        from mlx_engine.loading.loader import load_model

        self.loaded = load_model(model)
        self.vocab = self.loaded.tokenizer.vocab_size

    def describe(self) -> str:
        from importlib.metadata import version

        return f"mlx-lm {version('mlx-lm')} generate_step on Duet's model ({self.loaded.weight_format})"

    def generate(self, prompt: list[int], n: int, cache=None) -> tuple[float, list[float]]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        times = []
        t0 = time.perf_counter()
        for _ in generate_step(
            mx.array(prompt),
            self.loaded.model,
            max_tokens=n,
            sampler=lambda x: mx.argmax(x, -1),
            prompt_cache=cache,
        ):
            times.append(time.perf_counter())
        return t0, times

    def prepare_long(self, prompt: list[int]) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.long = prompt
        self.long_cache = make_prompt_cache(self.loaded.model)
        mx.eval(self.loaded.model(mx.array([prompt[:-1]]), cache=self.long_cache))

    def decode_long(self, n: int) -> tuple[float, list[float]]:
        from mlx_lm.models.cache import trim_prompt_cache

        out = self.generate(self.long[-1:], n, cache=self.long_cache)
        trim_prompt_cache(self.long_cache, self.long_cache[0].offset - (len(self.long) - 1))
        return out

    def shutdown(self) -> None:
        pass


class DuetPlainRunner(DuetRunner):
    """Duet with speculative decoding off: what its forward passes alone do (llama.cpp and mlx-lm
    here decode one token per pass)."""

    speculative = "off"


class DuetInt8Runner(DuetPlainRunner):
    """Duet with ``--cpu-math int8`` (activations in 8 bits, integer dot products, as llama.cpp) and
    speculation off."""

    cpu_math = "int8"


class DuetInt16Runner(DuetPlainRunner):
    """Duet with ``--cpu-math int16`` (the default: activations to 2^-15 of each run of 32, two int8
    planes where exact math takes three) and speculation off, whatever DUET_CPU_MATH says."""

    cpu_math = "int16"


class DuetExactRunner(DuetPlainRunner):
    """Duet with ``--cpu-math exact`` (activations at float32's accuracy) and speculation off."""

    cpu_math = "exact"


RUNNERS = {
    "duet": DuetRunner,
    "duet-nospec": DuetPlainRunner,
    "duet-int8": DuetInt8Runner,
    "duet-int16": DuetInt16Runner,
    "duet-exact": DuetExactRunner,
    "llama.cpp": LlamaCppRunner,
    "mlx-lm": MlxLmRunner,
}


def one_run(r, i: int) -> dict[str, float]:
    p64, pfill = (prompts(r.vocab, n, 1, 1000 * i + n)[0] for n in (64, PREFILL))
    out = {}
    t0, times = r.generate(p64, DECODE_TOKENS + 1)
    out["decode_64"] = rates(times, 64, t0)[1]
    t0, times = r.decode_long(DECODE_TOKENS + 1)
    out["decode_long"] = rates(times, LONG, t0)[1]
    t0, times = r.generate(pfill, 1)
    out["prefill"] = rates(times, PREFILL, t0)[0]
    if isinstance(r, DuetRunner):
        t0, streams = r.streams(prompts(r.vocab, 16, 16, 7000 + i), DECODE_TOKENS + 1)
        start = max(s[0] for s in streams)
        end = max(s[-1] for s in streams)
        after = sum(1 for s in streams for t in s if t > start)
        out["batch16"] = after / (end - start)
    return out


def speed_worker(system: str, model: str, threads: int) -> None:
    """Serve runs one at a time on stdin (``run I``, ``profile``, ``quit``), a JSON line each, so the
    parent interleaves the systems run by run: a machine whose load changes during the benchmark
    then shifts every system alike."""
    r = RUNNERS[system](model, threads)
    r.generate(prompts(r.vocab, 32, 1, 99)[0], 8)  # warm-up
    r.prepare_long(prompts(r.vocab, LONG, 1, 4242)[0])
    print(json.dumps({"describe": r.describe()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            print(json.dumps(one_run(r, int(cmd[1]))), flush=True)
        elif cmd[0] == "profile":
            print(json.dumps(profile_duet(r) if isinstance(r, DuetRunner) else {}), flush=True)
        else:
            break
    r.shutdown()


# --- the decode step, taken apart (Duet) -------------------------------------------------------
def count_ops(model, ctx: int) -> dict[str, int]:
    """Primitives in the lazy graph of one decode step of ``model`` as Duet's engine runs it: the paged
    KV pool (ctx tokens cached), the model runner's attention path (the CPU kernels when built), argmax."""
    import re
    import tempfile

    import mlx.core as mx

    from mlx_engine.kv_cache import paged_attention
    from mlx_engine.kv_cache.kv_pool import KVPool
    from mlx_engine.model_runner import ModelRunner, Row

    args, block_size = model.args, 16
    blocks = list(range(1, ctx // block_size + 3))
    pool = KVPool(
        args.num_hidden_layers,
        len(blocks) + 1,
        block_size,
        args.num_key_value_heads,
        getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,
    )
    runner = ModelRunner(model, pool)
    runner.forward([Row(list(range(100, 100 + ctx)), 0, blocks)])
    every, paged_attention.ASYNC_EVERY = paged_attention.ASYNC_EVERY, 1 << 30  # the whole graph, lazy
    try:
        token = mx.argmax(runner.lazy_logits([Row([42], ctx, blocks)])[:, -1, :], axis=-1)
    finally:
        paged_attention.ASYNC_EVERY = every
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, token)
        dot = Path(f.name).read_text()
    counts: dict[str, int] = {}
    for m in re.finditer(r'label\s*=\s*"([A-Za-z0-9_]+)', dot):
        name = m.group(1)
        counts[name] = counts.get(name, 0) + 1
    return counts


def profile_duet(r: DuetRunner) -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_engine.engine import core as engine_mod  # where the engine calls the sampler

    model = r.loaded.model
    ops = count_ops(model, 64)
    n_ops = sum(v for k, v in ops.items() if k not in ("Load",))
    # the plain step: decode at ctx 64, no timers
    plain = []
    for p in prompts(r.vocab, 64, 3, 5):
        t0, times = r.generate(p, 33)
        plain.append(rates(times, 64, t0)[1])
    step_us = 1e6 / statistics.median(plain)

    acc: dict[str, float] = {}

    class Timed(nn.Module):
        def __init__(self, inner, label: str):
            super().__init__()
            self.inner, self.label = inner, label

        def __call__(self, *a, **kw):
            t = time.perf_counter()
            y = self.inner(*a, **kw)
            mx.eval(y)
            acc[self.label] = acc.get(self.label, 0.0) + time.perf_counter() - t
            return y

        def as_linear(self, x):  # a tied embedding used as the LM head
            t = time.perf_counter()
            y = self.inner.as_linear(x)
            mx.eval(y)
            acc["matmul: LM head"] = acc.get("matmul: LM head", 0.0) + time.perf_counter() - t
            return y

    inner_model = model.model
    for layer in inner_model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, Timed(getattr(attn, name), "matmul: attention projections"))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, name, Timed(getattr(layer.mlp, name), "matmul: MLP"))
        layer.self_attn = Timed(attn, "attention block")
        layer.input_layernorm = Timed(layer.input_layernorm, "norms")
        layer.post_attention_layernorm = Timed(layer.post_attention_layernorm, "norms")
    inner_model.norm = Timed(inner_model.norm, "norms")
    inner_model.embed_tokens = Timed(inner_model.embed_tokens, "embedding")
    if "lm_head" in model:
        model.lm_head = Timed(model.lm_head, "matmul: LM head")
    real_forward, real_sample = r.engine.runner.forward, engine_mod.sample

    def forward(*a, **kw):
        t = time.perf_counter()
        try:
            return real_forward(*a, **kw)
        finally:
            acc["forward (all)"] = acc.get("forward (all)", 0.0) + time.perf_counter() - t

    def sample(*a, **kw):
        t = time.perf_counter()
        try:
            return real_sample(*a, **kw)
        finally:
            acc["sampler"] = acc.get("sampler", 0.0) + time.perf_counter() - t

    r.engine.runner.forward = forward
    engine_mod.sample = sample
    steps = 32
    try:
        (p,) = prompts(r.vocab, 64, 1, 6)
        r.generate(p, 1)
        acc.clear()
        t0, times = r.generate(p, 1)  # the prefill and first token alone, taken off below
        prefill, prefill_wall = dict(acc), times[-1] - t0
        acc.clear()
        t0, times = r.generate(p, steps + 1)
        wall = times[-1] - t0 - prefill_wall
    finally:
        engine_mod.sample = real_sample
        del r.engine.runner.forward
    per_step = {k: (v - prefill.get(k, 0.0)) / steps * 1e6 for k, v in acc.items()}
    attn_core = per_step.get("attention block", 0.0) - per_step.get("matmul: attention projections", 0.0)
    parts = {
        "matmul: attention projections": per_step.get("matmul: attention projections", 0.0),
        "matmul: MLP": per_step.get("matmul: MLP", 0.0),
        "matmul: LM head": per_step.get("matmul: LM head", 0.0),
        "embedding": per_step.get("embedding", 0.0),
        "attention (RoPE, KV write, paged attention)": attn_core,
        "norms": per_step.get("norms", 0.0),
        "sampler": per_step.get("sampler", 0.0),
    }
    parts["rest (Python, scheduler, residual adds, dispatch)"] = wall / steps * 1e6 - sum(parts.values())
    return {
        "ops_per_step": n_ops,
        "ops_by_primitive": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "plain_step_us": step_us,
        "us_per_op": step_us / max(n_ops, 1),
        "timed_step_us": wall / steps * 1e6,
        "parts_us": parts,
    }


# --- cold processes --------------------------------------------------------------------------
def cold_worker(system: str, model: str, threads: int) -> None:
    """Load and answer CHAT_PROMPT; the reply's text goes to stdout as it comes."""
    if system == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        for chunk in llm.create_chat_completion(
            [{"role": "user", "content": CHAT_PROMPT}], max_tokens=COLD_TOKENS, temperature=0.0, stream=True
        ):
            text = chunk["choices"][0]["delta"].get("content") or ""
            sys.stdout.write(text or "\u200b")
            sys.stdout.flush()
        return
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_engine.loading.loader import load_model

    loaded = load_model(model)
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": CHAT_PROMPT}], True, None)
    for tok, _ in generate_step(
        mx.array(ids), loaded.model, max_tokens=COLD_TOKENS, sampler=lambda x: mx.argmax(x, -1)
    ):
        sys.stdout.write(loaded.tokenizer.decode([int(tok)]) or "\u200b")
        sys.stdout.flush()


def env(threads: int) -> dict[str, str]:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    e.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), DUET_CPU_THREADS=str(threads))
    try:
        from mlx_engine.blas_preload import preload_env

        e.update(preload_env())  # LD_PRELOAD, and OPENBLAS_CORETYPE where the CPU needs one
    except ImportError:
        pass
    return e


def cold_run(system: str, model: str, threads: int) -> tuple[float, float]:
    if system.startswith("duet"):
        cmd = [
            str(Path(sys.executable).parent / "duet"),
            "generate",
            "--prompt",
            CHAT_PROMPT,
            "--model",
            model,
        ]
        cmd += ["--max-tokens", str(COLD_TOKENS), "--temperature", "0"]
        cmd += ["--speculative", RUNNERS[system].speculative]
        if RUNNERS[system].cpu_math:
            cmd += ["--cpu-math", RUNNERS[system].cpu_math]
    else:
        cmd = [sys.executable, __file__, "--cold-worker", system, "--model", model, "--threads", str(threads)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env(threads), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    assert p.stdout is not None
    p.stdout.read(1)
    first = time.monotonic() - t0
    p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd[:4])}... failed")
    return first, usage.ru_maxrss / 1024


# --- models ----------------------------------------------------------------------------------
def bundled() -> str:
    from mlx_engine.loading.resolve import bundled_model_path

    return str(bundled_model_path())


def have_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def q4_k_m(src: str) -> str:
    """A Q4_K_M GGUF of ``src`` by llama.cpp's own quantizer (cached in bench/out/); without
    llama-cpp-python, the same type mix by tests/gguf_quantize.py (round-to-nearest blocks)."""
    OUT.mkdir(parents=True, exist_ok=True)
    if not have_llama_cpp():
        dst = OUT / (Path(src).name.split(".")[0] + "-Q4_K_M-rtn.gguf")
        if not dst.exists():
            import gguf

            from tests.gguf_quantize import q4_k_m_type, requantize

            reader = gguf.GGUFReader(src)
            n_layers = int(reader.get_field("llama.block_count").contents())
            tied = not any(t.name == "output.weight" for t in reader.tensors)
            requantize(Path(src), dst, lambda name, cols: q4_k_m_type(name, cols, n_layers, tied))
        return str(dst)
    dst = OUT / (Path(src).name.split(".")[0] + "-Q4_K_M.gguf")
    if dst.exists():
        return str(dst)
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(src.encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")
    tmp.rename(dst)
    return str(dst)


# --- the parent ------------------------------------------------------------------------------
class Worker:
    def __init__(self, system: str, model: str, threads: int):
        cmd = [
            sys.executable,
            __file__,
            "--speed-worker",
            system,
            "--model",
            model,
            "--threads",
            str(threads),
            "--long",
            str(LONG),
            "--prefill",
            str(PREFILL),
        ]
        self.system = system
        self.p = subprocess.Popen(
            cmd, env=env(threads), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.describe = self.ask(None)["describe"]

    def ask(self, command: str | None) -> dict:
        assert self.p.stdin is not None and self.p.stdout is not None
        if command is not None:
            self.p.stdin.write(command + "\n")
            self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.system} worker died (exit code {self.p.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        self.p.wait()


def settle() -> None:
    time.sleep(0.5)  # OpenMP and BLAS threads of the previous run spin a little before they sleep


def weight_traffic(path: str, threads: int) -> dict[str, float]:
    """What a batch-1 decode step reads of the weights (GB per token: the file's bytes for llama.cpp,
    the bytes as Duet holds them for Duet and mlx-lm on Duet's model; ``synthetic_gguf.decode_bytes``)
    and the machine's memory bandwidth on ``threads`` cores (``membw.measure``, GB/s)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import membw
    from synthetic_gguf import decode_bytes

    b = decode_bytes(Path(path))
    bw = membw.measure(threads, mb=256, repeats=3)
    return {
        "file_gb_per_token": b["file_active_gb_per_token"],
        "duet_gb_per_token": b["duet_active_gb_per_token"],
        "read_gbps": bw["read"],
        "triad_gbps": bw["triad"],
    }


def measure(path: str, systems: list[str], threads: int, runs: int, profile: bool) -> dict[str, dict]:
    """Every metric of every system on one model, the systems interleaved run by run."""
    workers = {s: Worker(s, path, threads) for s in systems}
    res: dict[str, dict] = {s: {"describe": w.describe} for s, w in workers.items()}
    res["_traffic"] = weight_traffic(path, threads)
    res["_lengths"] = {"long": LONG, "prefill": PREFILL}
    for s in systems:
        cold_run(s, path, threads)  # warm-up: page cache, bytecode, compiled kernels
    for i in range(runs):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for s in order:
            settle()
            for k, v in workers[s].ask(f"run {i}").items():
                res[s].setdefault(k, []).append(v)
        for s in order:
            settle()
            first, rss = cold_run(s, path, threads)
            res[s].setdefault("cold_ttft", []).append(first)
            res[s].setdefault("peak_rss", []).append(rss)
        print(f"    run {i + 1}/{runs} done", flush=True)
    if profile and "duet" in workers:
        res["duet"]["profile"] = workers["duet"].ask("profile")
    for w in workers.values():
        w.close()
    return res


def table(results: dict, systems: list[str]) -> str:
    med = statistics.median
    lines = []
    for model, by_system in results.items():
        lines.append(f"\n**{model}**\n")
        head = (
            "| metric | "
            + " | ".join(systems)
            + " | "
            + " | ".join(f"{s} / llama.cpp" for s in systems if s != "llama.cpp")
        )
        lines.append(head + " |")
        lines.append("|---|" + "---:|" * (len(systems) + len([s for s in systems if s != "llama.cpp"])))
        for key, label, unit, _ in METRICS:
            vals = {s: med(by_system[s][key]) if by_system[s].get(key) else None for s in systems}
            cells = [
                ("—" if vals[s] is None else f"{vals[s]:.3g}" if unit == "s" else f"{vals[s]:.0f}")
                for s in systems
            ]
            base = vals.get("llama.cpp")
            if key == "batch16":
                base = med(by_system["llama.cpp"]["decode_64"]) if "llama.cpp" in by_system else None
            ratios = [
                "—" if vals[s] is None or not base else f"{vals[s] / base:.2f}x"
                for s in systems
                if s != "llama.cpp"
            ]
            label = label.format(long=results_long(by_system), prefill=results_prefill(by_system))
            lines.append(f"| {label} ({unit}) | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        lines.append(traffic_line(by_system, systems))
    return "\n".join(lines)


def results_long(by_system: dict) -> int:
    return by_system.get("_lengths", {}).get("long", 1024)


def results_prefill(by_system: dict) -> int:
    return by_system.get("_lengths", {}).get("prefill", 512)


def _old_keys(results: dict) -> dict:
    """A run saved before ``--long``/``--prefill``: its keys named the default lengths."""
    for by_system in results.values():
        for runs in by_system.values():
            for old, new in (("decode_1024", "decode_long"), ("prefill_512", "prefill")):
                if isinstance(runs, dict) and old in runs:
                    runs[new] = runs.pop(old)
    return results


def traffic_line(by_system: dict, systems: list[str]) -> str:
    """Weights read per second at decode (ctx 64) by each system, against the machine's bandwidth."""
    t = by_system.get("_traffic")
    if not t:
        return ""
    parts = []
    for s in systems:
        if not by_system[s].get("decode_64"):
            continue
        per_token = t["file_gb_per_token"] if s == "llama.cpp" else t["duet_gb_per_token"]
        gbps = statistics.median(by_system[s]["decode_64"]) * per_token
        read, triad = 100 * gbps / t["read_gbps"], 100 * gbps / t["triad_gbps"]
        parts.append(f"{s} {per_token:.3g} GB/token, {gbps:.1f} GB/s ({read:.0f}% / {triad:.0f}%)")
    return (
        f"\nWeights read at decode, ctx 64: {'; '.join(parts)}. In brackets: % of the machine's read "
        f"bandwidth {t['read_gbps']:.1f} GB/s / of its STREAM triad {t['triad_gbps']:.1f} GB/s (issue 34's "
        "reference), on these threads (bench/membw.py)."
    )


def plot(results: dict, systems: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = statistics.median
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
    for ax, (model, by_system) in zip(axes[0], results.items(), strict=True):
        keys = [m for m in METRICS]
        width = 0.8 / len(systems)
        for j, s in enumerate(systems):
            ys = []
            for key, _, _, higher in keys:
                base_key = "decode_64" if key == "batch16" else key
                base = by_system.get("llama.cpp", {}).get(base_key)
                v = by_system[s].get(key)
                if not v or not base:
                    ys.append(0.0)
                    continue
                ratio = med(v) / med(base)
                ys.append(ratio if higher else 1 / ratio)
            ax.bar([i + j * width for i in range(len(keys))], ys, width, label=s)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        lengths = {"long": results_long(by_system), "prefill": results_prefill(by_system)}
        ax.set_xticklabels([SHORT[m[0]].format(**lengths) for m in keys], fontsize=7)
        ax.set_ylabel("relative to llama.cpp (higher is better;\ntime and memory inverted)", fontsize=8)
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    global LONG, PREFILL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--long", type=int, default=LONG, help="the long context's tokens (decode from it)")
    ap.add_argument("--prefill", type=int, default=PREFILL, help="the prefill prompt's tokens")
    ap.add_argument("--models", default="bundled,q4km", help="comma-separated: bundled, q4km, or GGUF paths")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--profile", action="store_true", help="add Duet's decode-step decomposition")
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", default=str(OUT / "cpu.json"), metavar="PATH")
    ap.add_argument("--from-json", default=None, metavar="PATH", help="print and plot a saved run")
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--speed-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cold-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    LONG, PREFILL = a.long, a.prefill
    if a.speed_worker:
        speed_worker(a.speed_worker, a.model, a.threads)
        return
    if a.cold_worker:
        cold_worker(a.cold_worker, a.model, a.threads)
        return

    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        saved["results"] = _old_keys(saved["results"])
        systems = [s for s in RUNNERS if all(s in r for r in saved["results"].values())]
        print(table(saved["results"], systems))
        if a.plot:
            plot(saved["results"], systems, a.plot)
        return
    systems = [s for s in a.systems.split(",") if s]
    if "llama.cpp" in systems and not have_llama_cpp():
        print("llama-cpp-python is not installed (make bench-deps): llama.cpp left out", flush=True)
        systems.remove("llama.cpp")
    models = {}
    for m in a.models.split(","):
        path = bundled() if m == "bundled" else q4_k_m(bundled()) if m == "q4km" else m
        models[f"{Path(path).name}"] = path
    print(f"{a.threads} threads, {a.runs} runs, systems {', '.join(systems)}", flush=True)
    results: dict[str, dict[str, dict]] = {}
    for name, path in models.items():
        print(f"  {name}", flush=True)
        results[name] = measure(path, systems, a.threads, a.runs, a.profile)
        for s in systems:
            print(f"    {s}: {results[name][s]['describe']}", flush=True)
    print(table(results, systems))
    for name, by_system in results.items():
        prof = by_system.get("duet", {}).get("profile")
        if prof:
            print(
                f"\nDuet decode step on {name} (ctx 64): {prof['ops_per_step']} ops, plain step "
                f"{prof['plain_step_us']:.0f} µs = {prof['us_per_op']:.1f} µs/op; timed step {prof['timed_step_us']:.0f} µs:"
            )
            for k, v in prof["parts_us"].items():
                print(f"  {k:52s} {v:8.0f} µs  {100 * v / prof['timed_step_us']:5.1f}%")
            print(
                "  ops by primitive: "
                + ", ".join(f"{k} {v}" for k, v in list(prof["ops_by_primitive"].items())[:14])
            )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"threads": a.threads, "runs": a.runs, "results": results}, indent=1))
    if a.plot:
        plot(results, systems, a.plot)


if __name__ == "__main__":
    main()
