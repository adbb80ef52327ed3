"""Q4_K and Q5_K layers in 16-row panels against the row form, under exact or int8 math, on a GGUF's own layers.

    PYTHONPATH=. HF_HUB_OFFLINE=1 env $(.venv/bin/python -m mlx_engine.blas --env) \\
        .venv/bin/python bench/panel_layout.py --model bench/out/synthetic/llama-1b-Q4_K_M.gguf \\
        [--math exact] [--threads 1,2] [--rows 1,2,5,40] [--crossover 64,128,256,512] [--engine-runs 4]
    ... bench/panel_layout.py --model ... --rows-kept

Three measurements (AVX-512 VNNI only: elsewhere there is no panel kernel):

* **products**: layer 0's q_proj (2048 x 2048 at 1B) and gate_proj (8192 x 2048), Q4_K or Q5_K (a
  Q4_K_M or Q5_K_M file), as the loader makes them (row form) and in panels (``ext.panel_layout``),
  ``rows`` rows of x, each kernel thread count:
  the best of 15 batches of 16 calls in one ``mx.eval`` (the weights stay in L2/L3: the kernels'
  compute, not DRAM), and each form's max error against float64 relative to the output's magnitude;
* **crossover** (exact math): gate_proj in panels at many rows of x, the panel kernel on three planes
  of x against the dequantize kernel + MLX's GEMM (what ``quantized_matmul`` sends from
  ``dequantize_rows()`` rows on), best of 5;
* **rows kept** (``--rows-kept``): the layers that stay in rows (Q6_K, and Q4_K as the loader makes it),
  one row of x (decode) from DRAM: every layer of a kind (down_proj, v_proj, the LM head) in one
  ``mx.eval``, median of 7, µs a product and GB/s of weights, both maths;
* **engine**: Duet's engine (speculation off) on the whole model, its layers (Q4_K or Q5_K, and Q6_K)
  switched between the two forms run by run (interleaved, fresh prompts each run so no prefix is cached): decode tok/s at a
  64-token context (32 tokens) and prefill tok/s of a 512-token prompt, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def timed(fn, batches: int, pick=min) -> float:
    """Seconds a call of ``fn`` takes: ``pick`` (the best, or the median) of ``batches`` calls after a
    warm-up call."""
    fn()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return pick(times)


def products(model, rows: list[int], threads: list[int], math: str) -> None:
    import mlx.core as mx
    import numpy as np

    from cpu_kernels.spec import extension, set_threads

    ext = extension()
    layer = model.model.layers[0]
    print(f"\nproducts, {math} math: µs per call (weights in cache), max error / magnitude vs float64")
    print("| matrix | rows | threads | row form µs | panels µs | speed-up | row err | panel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, mod in (("q_proj", layer.self_attn.q_proj), ("gate_proj", layer.mlp.gate_proj)):
        forms = {"rows": (mod.weight, mod.scales, mod.biases)}
        forms["panels"] = ext.panel_layout(*forms["rows"], True)
        mx.eval(*forms["panels"])
        bits = mod.bits
        n, k = mod.weight.shape[0], mod.weight.shape[1] * 32 // bits
        w64 = np.array(ext.dequantize(*forms["rows"], 32, bits)).astype(np.float64)
        for m in rows:
            xs = [mx.random.normal((m, k)) for _ in range(16)]
            mx.eval(xs)
            ref = np.array(xs[0]).astype(np.float64) @ w64.T
            mag = np.abs(np.array(xs[0]).astype(np.float64)) @ np.abs(w64).T
            for t in threads:
                set_threads(t)
                us, err = {}, {}
                for form, (w, s, b) in forms.items():

                    def batch(w=w, s=s, b=b, xs=xs, bits=bits) -> None:
                        mx.eval([ext.quantized_matmul(x, w, s, b, 32, bits, int8=math == "int8") for x in xs])

                    us[form] = timed(batch, 15) / len(xs) * 1e6
                    y = np.array(ext.quantized_matmul(xs[0], w, s, b, 32, bits, int8=math == "int8"))
                    err[form] = float((np.abs(y - ref) / (mag + 1e-30)).max())
                print(
                    f"| {name} {n} x {k}, {bits}-bit | {m} | {t} | {us['rows']:.0f} | {us['panels']:.0f} | "
                    f"{us['rows'] / us['panels']:.2f}x | {err['rows']:.1e} | {err['panels']:.1e} |"
                )
    set_threads()


def rows_kept(model) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from cpu_kernels.spec import set_cpu_math

    def kinds(layer):
        return {"v_proj": layer.self_attn.v_proj, "down_proj": layer.mlp.down_proj}

    groups: dict[tuple[str, int], list] = {}
    for layer in model.model.layers:
        for name, mod in kinds(layer).items():
            groups.setdefault((name, mod.bits), []).append(mod)
    if "lm_head" in model:
        groups[("lm_head", model.lm_head.bits)] = [model.lm_head]
    print("\nrows kept: one row of x from DRAM, every layer of a kind in one eval (median of 7)")
    print("| layers | bits | math | µs a product | GB/s |")
    print("|---|---:|---|---:|---:|")
    for math in ("exact", "int8"):
        set_cpu_math(math)
        for (name, bits), mods in sorted(groups.items()):
            k = mods[0].weight.shape[-1] * 32 // bits
            x = mx.random.normal((1, 1, k))
            mx.eval(x)
            size = sum(a.nbytes for m in mods for _, a in tree_flatten(m.parameters()))
            t = timed(lambda mods=mods, x=x: mx.eval([m(x) for m in mods]), 7, statistics.median)
            print(
                f"| {len(mods)} x {name} | {bits} | {math} | {t / len(mods) * 1e6:.0f} | {size / t / 1e9:.1f} |"
            )
    set_cpu_math("exact")


def crossover(model, rows: list[int]) -> None:
    import mlx.core as mx

    from cpu_kernels.spec import extension

    ext = extension()
    mod = model.model.layers[0].mlp.gate_proj
    w, s, b = ext.panel_layout(mod.weight, mod.scales, mod.biases, True)
    mx.eval(w, s, b)
    bits = mod.bits
    k = mod.weight.shape[1] * 32 // bits
    print("\ncrossover, exact math, gate_proj in panels: ms per product")
    print("| rows | panel kernel, three planes | dequantize + GEMM |")
    print("|---:|---:|---:|")
    for m in rows:
        x = mx.random.normal((m, k))
        mx.eval(x)
        planes = timed(lambda x=x: mx.eval(ext.quantized_matmul(x, w, s, b, 32, bits, int8=False)), 5)
        gemm = timed(lambda x=x: mx.eval(mx.matmul(x, ext.dequantize(w, s, b, 32, bits).T)), 5)
        print(f"| {m} | {planes * 1e3:.1f} | {gemm * 1e3:.1f} |")


def engine(path: str, math: str, runs: int) -> None:
    import cpu  # bench/cpu.py's runners: the same engine set-up as the side-by-side benchmark

    from cpu_kernels.panels import use_panels

    r = (cpu.DuetInt8Runner if math == "int8" else cpu.DuetPlainRunner)(path, 0)
    try:
        r.generate(cpu.prompts(r.vocab, 32, 1, 99)[0], 8)
        decode: dict[str, list[float]] = {"rows": [], "panels": []}
        prefill: dict[str, list[float]] = {"rows": [], "panels": []}
        for i in range(runs):
            for j, form in enumerate(("panels", "rows")):
                use_panels(r.loaded.model, form == "panels")
                seed = 1000 * i + 10 * j
                t0, times = r.generate(cpu.prompts(r.vocab, 64, 1, seed)[0], 33)
                decode[form].append(cpu.rates(times, 64, t0)[1])
                t0, times = r.generate(cpu.prompts(r.vocab, 512, 1, seed + 1)[0], 1)
                prefill[form].append(cpu.rates(times, 512, t0)[0])
        print(f"\nengine, {math} math, speculation off, {runs} interleaved runs (medians)")
        print("| form | decode tok/s (ctx 64) | prefill tok/s (512) |")
        print("|---|---:|---:|")
        for form in ("rows", "panels"):
            print(
                f"| {form} | {statistics.median(decode[form]):.1f} | {statistics.median(prefill[form]):.1f} |"
            )
    finally:
        r.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", required=True, help="a Q4_K_M or Q5_K_M GGUF (bench/synthetic_gguf.py makes one)"
    )
    ap.add_argument("--math", choices=("exact", "int8"), default="exact")
    ap.add_argument("--threads", default="1,2", help="kernel threads for the products")
    ap.add_argument("--rows", default="1,2,5,40", help="rows of x for the products")
    ap.add_argument("--crossover", default="64,128,256,512", help="rows of x ('' to skip)")
    ap.add_argument("--engine-runs", type=int, default=4, help="0 to skip the engine")
    ap.add_argument("--rows-kept", action="store_true", help="time the layers left in rows, and stop")
    a = ap.parse_args()

    from cpu_kernels.spec import extension, set_cpu_math
    from mlx_engine.loading.loader import load_model

    ext = extension()
    if ext is None or not ext.panel_kernel():
        sys.exit("the panel kernel needs AVX-512 VNNI and the CPU kernels")
    set_cpu_math(a.math)
    model = load_model(a.model).model
    if a.rows_kept:
        return rows_kept(model)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    products(model, ints(a.rows), ints(a.threads), a.math)
    if a.math == "exact" and a.crossover:
        crossover(model, ints(a.crossover))
    del model
    if a.engine_runs:
        engine(a.model, a.math, a.engine_runs)


if __name__ == "__main__":
    main()
