"""Does remote prefill overlap compute and transfer? A benchmark that can fail.

Two network namespaces joined by a veth pair (root; deleted with every process in them, always):
``duet``'s prefill peer in one, a decoding engine in the other, the peer's egress shaped with
``tc ... tbf``. In the same run, per round (medians of ``--rounds`` interleaved rounds):

- C0: the peer's prefill compute alone (its export path, frames dropped: no network), the mean of
  one run before and one after the round's two TTFT runs;
- T0: the same KV bytes alone over the shaped link (raw TCP, frames of the same size);
- O: fixed overheads: the PREFILL -> ACCEPT round trip and the decoder's last-token step (a prompt
  whose first N - 1 tokens are cached here);
- TTFT of a remote prefill with the KV streamed layer by layer (the peer's normal mode) and with the
  peer's send-after-prefill control (``PeerServer(send_after_prefill=True)``: exo's released design);

and reports ``E = (TTFT - O) / max(C0, T0)``: 1.0 is a perfect overlap, ~2.0 at the balance rate
(``T0 = C0``) is sending after the prefill. Link rates: unshaped (compute-bound), 100 Mbit
(transfer-bound) and the balance rate ``bytes / C0``; peer and decoder pinned to one core each
(``taskset``, one BLAS thread) and unpinned. Then TTFT local against remote per prompt length, with
the planner's prediction (peer/planner.py) for each run next to the measured TTFT.

    sudo .venv/bin/python bench/disagg.py [--tokens 2048] [--rounds 5] [--json out.json] [--plot docs/disagg.png]

Prompts are random token ids, a new one per run (no prefix-cache hit on either side). The model is
the bundled SmolLM2-135M GGUF (fp32 KV on CPU: 30 layers x 3 KV heads x 64 dims x K,V x 4 B = 46 KB
per token, 94 MB for 2K tokens: enough for the transfer to matter at 1 Gbit/s and below).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_engine.blas_preload import preload_env  # noqa: E402  (imports no MLX)

PORT, CTL_PORT = 7611, 7620  # overlapped peer; control (send-after) peer = PORT + 1; commands
WAIT = 60


# --- namespaces (as tests/test_peer_discovery.py) ---------------------------------------------------
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=WAIT)


def _kill_all_in(ns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=WAIT).stdout
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)


@contextlib.contextmanager
def namespaces():
    from tests.test_peer_discovery import _reap_orphaned_namespaces

    _reap_orphaned_namespaces()
    tag = secrets.token_hex(3)
    a, b = f"duet-{os.getpid()}-{tag}-a", f"duet-{os.getpid()}-{tag}-b"
    octet = int(tag[:2], 16) % 250 + 1
    ip_a, ip_b = f"10.214.{octet}.1", f"10.214.{octet}.2"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", f"dv{tag}a", "netns", a, "type", "veth", "peer", "name", f"dv{tag}b", "netns", b)
        for ns, ifname, ip in ((a, f"dv{tag}a", ip_a), (b, f"dv{tag}b", ip_b)):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, ip_a, b, ip_b, f"dv{tag}a"
    finally:
        for ns in made:
            _kill_all_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=WAIT)


def shape(ns: str, dev: str, rate_bps: float | None) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate_bps:
        rate = f"{int(rate_bps / 1000)}kbit"
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
            + ["burst", "256kb", "latency", "50ms"],
            check=True,
            capture_output=True,
        )


def _env(pinned: bool) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    if pinned:
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(preload_env())  # LD_PRELOAD (and OPENBLAS_CORETYPE)
    return env


def _cmd(ns: str, core: int | None, *argv: str) -> list[str]:
    pin = ["taskset", "-c", str(core)] if core is not None else []
    return ["ip", "netns", "exec", ns, *pin, sys.executable, str(Path(__file__).resolve()), *argv]


# --- engine set-up shared by both roles ----------------------------------------------------------
def _engine(args: argparse.Namespace) -> Any:
    from mlx_engine.engine import Engine, EngineConfig
    from mlx_engine.loading.resolve import bundled_model_path

    cfg = EngineConfig(cache_gb=1.0, prefill_chunk=args.chunk, max_batch_tokens=max(args.chunk, 512))
    return Engine.load(args.model or str(bundled_model_path()), config=cfg)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 40000)) for _ in range(n)]


# --- the peer -------------------------------------------------------------------------------------
def role_peer(args: argparse.Namespace) -> int:
    from peer.identity import local_hello
    from peer.server import EngineBackend, PeerServer, listen

    engine = _engine(args)
    hello = engine.run_on_worker(lambda: local_hello(engine), 300)
    backend = EngineBackend(engine)
    servers = [
        PeerServer(
            backend, hello, args.host, sock=listen(args.host, PORT + i), send_after_prefill=bool(i)
        ).start()
        for i in (0, 1)
    ]
    ctl = socket.create_server((args.host, CTL_PORT))
    print("ready", flush=True)
    vocab = engine.tokenizer.vocab_size
    while True:
        conn, _ = ctl.accept()
        with conn, conn.makefile("rwb") as f:
            for line in f:
                cmd, *rest = line.decode().split()
                if cmd == "C0":  # the export path alone: frames built and dropped
                    n, seed = int(rest[0]), int(rest[1])
                    done = threading.Event()
                    t0 = time.perf_counter()
                    engine.prefill_for_peer(
                        _prompt(vocab, n, seed),
                        0,
                        args.chunk,
                        lambda *a: None,
                        on_done=lambda *a, ev=done: ev.set(),
                    )
                    done.wait(600)
                    f.write(f"{time.perf_counter() - t0}\n".encode())
                    f.flush()
                elif cmd == "T0":  # raw bytes in frames of the same size, sent after the reply line
                    nbytes, frame = int(rest[0]), int(rest[1])
                    buf = memoryview(bytearray(frame))
                    f.write(b"go\n")
                    f.flush()
                    left = nbytes
                    while left > 0:
                        conn.sendall(buf[: min(frame, left)])
                        left -= frame
                elif cmd == "quit":
                    for s in servers:
                        s.close()
                    engine.shutdown()
                    return 0


# --- the decoder (one link configuration) --------------------------------------------------------
def role_decoder(args: argparse.Namespace) -> int:
    from mlx_engine.request import GenerationRequest, SamplingParams
    from peer.client import RemotePrefillSource

    class Switch(RemotePrefillSource):
        """Offers prompts only when switched on (``mode``: off, local = decide then decline, remote)."""

        mode = "off"

        def match(self, seq_tokens, start, end):
            if self.mode == "off":
                return 0
            if self.mode == "local":
                block = self.remote.block_size if self.remote is not None else 1
                queue_s = self.loads.queue_s(self.clock())
                self.offload.offers(
                    seq_tokens, start, end, queue_s, block
                )  # recorded: the planner learns local TTFTs too
                return 0
            return super().match(seq_tokens, start, end)

    engine = _engine(args)
    host = args.peer
    overlap = Switch(host, PORT, policy="always", name="overlap")
    control = Switch(host, PORT + 1, policy="always", name="send-after")
    for src in (overlap, control):
        engine.add_kv_source(src)
    engine.run_on_worker(lambda: None, 300)
    for src in (overlap, control):
        assert src.connect(wait_s=30), src.status()
    ctl = socket.create_connection((host, CTL_PORT))
    f = ctl.makefile("rwb")
    vocab = engine.tokenizer.vocab_size
    kvb = overlap.planner.kv_bytes_per_token
    layers = overlap.fmt.num_layers if overlap.fmt else 1

    def generate(prompt: list[int]) -> Any:
        async def go():
            req = GenerationRequest(
                prompt=prompt, max_tokens=1, sampling=SamplingParams(temperature=0.0), ignore_eos=True
            )
            last = None
            async for ev in engine.generate(req):
                last = ev
            return last

        return asyncio.run(go())

    def on(src: Switch | None, mode: str = "remote") -> None:
        for s in (overlap, control):
            s.mode = "off"
        if src is not None:
            src.mode = mode

    seed = [args.seed]

    def fresh(n: int) -> list[int]:
        seed[0] += 1
        return _prompt(vocab, n, seed[0])

    def c0(n: int) -> float:
        seed[0] += 1
        f.write(f"C0 {n} {seed[0]}\n".encode())
        f.flush()
        return float(f.readline())

    def t0(nbytes: int, frame: int) -> float:
        t = time.perf_counter()
        f.write(f"T0 {nbytes} {frame}\n".encode())
        f.flush()
        assert f.readline() == b"go\n"
        left = nbytes
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("the peer closed the T0 stream")
            left -= len(chunk)
        return time.perf_counter() - t

    def remote(src: Switch, n: int) -> dict[str, Any]:
        on(src)
        last = generate(fresh(n))
        u = last.usage
        assert u.prefill_location == f"remote:{src.name}", (u.prefill_location, u.fallback_reason)
        (info,) = src.loads_of(last.request_id)
        d = src.planner.decision(last.request_id)
        return {
            "ttft": u.ttft_s,
            "accept_s": info["accept_s"] or 0.0,
            "bytes": info["bytes"],
            "peer_compute_s": info["compute_s"],
            "predicted_remote": d.predicted_remote_s if d else None,
            "predicted_local": d.predicted_local_s if d else None,
        }

    def last_token_step(n: int) -> float:
        """TTFT of a prompt whose first n - 1 tokens are cached (n - 1 a whole number of blocks, so
        exactly one token is computed, as after a remote prefill)."""
        on(None)
        bs = engine.config.block_size
        p = fresh((n - 1) // bs * bs + 1)
        generate(p)
        last = generate(p)
        assert last.usage.prompt_tokens_computed == 1, last.usage.prompt_tokens_computed
        return last.usage.ttft_s

    out: dict[str, Any] = {"rounds": []}
    n = args.tokens
    nbytes = (n - 1) * kvb
    frame = nbytes // (layers * -(-(n - 1) // args.chunk))
    if args.rounds:
        remote(overlap, 64)  # warm-up: connections, allocations
        remote(control, 64)
        generate(fresh(64))
    for r in range(args.rounds):
        row: dict[str, Any] = {"C0_before": c0(n), "T0": t0(nbytes, frame), "step": last_token_step(n)}
        order = [(overlap, "overlap"), (control, "control")]
        for src, key in order if r % 2 == 0 else order[::-1]:
            row[key] = remote(src, n)
        # C0 brackets the two TTFT runs: on a shared machine its speed drifts between runs
        row["C0_after"] = c0(n)
        row["C0"] = (row["C0_before"] + row["C0_after"]) / 2
        out["rounds"].append(row)
    out["bytes"] = nbytes
    if args.sweep:
        sweep: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for m in args.sweep:
                on(overlap, "local")
                last = generate(fresh(m))
                d = overlap.planner.decision(last.request_id)
                loc = {"ttft": last.usage.ttft_s, "predicted": d.predicted_local_s if d else None}
                rem = remote(overlap, m)
                sweep.append({"round": r, "tokens": m, "local": loc, "remote": rem})
        out["sweep"] = sweep
    out["profile"] = overlap.planner.profile()
    print(json.dumps(out), flush=True)
    f.write(b"done\n")
    f.flush()
    return 0


def role_c0(args: argparse.Namespace) -> int:
    """The median of three C0 runs now (to set the balance rate right before it is used)."""
    with socket.create_connection((args.peer, CTL_PORT)) as ctl, ctl.makefile("rwb") as f:
        times = []
        for i in range(3):
            f.write(f"C0 {args.tokens} {args.seed + i}\n".encode())
            f.flush()
            times.append(float(f.readline()))
    print(statistics.median(times), flush=True)
    return 0


# --- the orchestrator ---------------------------------------------------------------------------------
def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    rounds = res["rounds"]
    c0 = _median([r["C0"] for r in rounds])
    t0 = _median([r["T0"] for r in rounds])
    out: dict[str, Any] = {"C0": c0, "T0": t0, "bytes": res["bytes"]}
    for key in ("overlap", "control"):
        o = [r["step"] + r[key]["accept_s"] for r in rounds]
        e = [(r[key]["ttft"] - oo) / max(r["C0"], r["T0"]) for r, oo in zip(rounds, o, strict=True)]
        # the same with the compute the peer reported for this very run (immune to load drifting
        # between the C0 run and this one on a shared machine)
        e_run = [
            (r[key]["ttft"] - oo) / max(r[key]["peer_compute_s"], r["T0"])
            for r, oo in zip(rounds, o, strict=True)
        ]
        out[key] = {
            "ttft": _median([r[key]["ttft"] for r in rounds]),
            "O": _median(o),
            "E": _median(e),
            "E_run": _median(e_run),
            "peer_compute_s": _median([r[key]["peer_compute_s"] for r in rounds]),
        }
    return out


def print_config(cfg: dict[str, Any], seconds: float | None = None) -> None:
    s, rate = cfg["summary"], cfg["rate_bps"]
    print(
        f"{'pinned' if cfg['pinned'] else 'unpinned':8} {cfg['link']:9} "
        f"{'-' if rate is None else f'{rate / 1e6:.0f} Mbit':>8}  C0={s['C0']:.3f} T0={s['T0']:.3f}  "
        f"streamed TTFT={s['overlap']['ttft']:.3f} E={s['overlap']['E']:.2f} ({s['overlap']['E_run']:.2f})  "
        f"send-after TTFT={s['control']['ttft']:.3f} E={s['control']['E']:.2f} ({s['control']['E_run']:.2f})"
        + ("" if seconds is None else f"  [{seconds:.0f} s]"),
        flush=True,
    )


def orchestrate(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench/disagg.py needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"tokens": args.tokens, "rounds": args.rounds, "configs": []}
    sweep = [256, 512, 1024, 2048] if args.sweep is None else args.sweep
    common = ["--tokens", str(args.tokens), "--chunk", str(args.chunk)] + (
        ["--model", args.model] if args.model else []
    )
    with namespaces() as (ns_a, ip_a, ns_b, ip_b, dev_a):
        for pinned in (True, False):
            env = _env(pinned)
            peer = subprocess.Popen(
                _cmd(ns_a, 0 if pinned else None, "--role", "peer", "--host", ip_a, *common),
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
                balance, kv_bytes = None, 0
                for link in ("unshaped", "100mbit", "balance"):
                    if link == "balance":  # T0 = C0 with C0 as the peer computes right now
                        p = subprocess.run(
                            _cmd(ns_b, None, "--role", "c0", "--peer", ip_a, "--seed", "77", *common),
                            env=env,
                            capture_output=True,
                            text=True,
                        )
                        balance = kv_bytes * 8 / float(p.stdout.strip().splitlines()[-1])
                    rate = {"unshaped": None, "100mbit": 100e6, "balance": balance}[link]
                    shape(ns_a, dev_a, rate)
                    argv = ["--role", "decoder", "--peer", ip_a, "--rounds", str(args.rounds), *common]
                    argv += ["--seed", str(random.randrange(1 << 30))]
                    if link == "unshaped" and not pinned and sweep:
                        argv += ["--sweep", ",".join(map(str, sweep))]
                    t = time.perf_counter()
                    p = subprocess.run(
                        _cmd(ns_b, 1 if pinned else None, *argv), env=env, capture_output=True, text=True
                    )
                    if p.returncode != 0:
                        print(p.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"decoder failed for {link} pinned={pinned}")
                    res = json.loads(p.stdout.strip().splitlines()[-1])
                    s = summarize(res)
                    kv_bytes = s["bytes"]
                    cfg = {"pinned": pinned, "link": link, "rate_bps": rate, "summary": s, "raw": res}
                    results["configs"].append(cfg)
                    print_config(cfg, time.perf_counter() - t)
            finally:
                peer.kill()
                peer.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report_sweep(results)
    if args.plot:
        plot(results, args.plot)
    return 0


def report_sweep(results: dict[str, Any]) -> None:
    sweep = next((c["raw"].get("sweep") for c in results["configs"] if c["raw"].get("sweep")), None)
    if not sweep:
        return
    print(
        "tokens  local TTFT  predicted  ratio  remote TTFT  predicted  ratio  (medians of rounds after the first)"
    )
    for m in sorted({s["tokens"] for s in sweep}):
        rows = [s for s in sweep if s["tokens"] == m and s["round"] > 0] or [
            s for s in sweep if s["tokens"] == m
        ]
        med = lambda f, rows=rows: _median([f(s) for s in rows if f(s) is not None] or [float("nan")])  # noqa: E731
        lm, lp = med(lambda s: s["local"]["ttft"]), med(lambda s: s["local"]["predicted"])
        rm, rp = med(lambda s: s["remote"]["ttft"]), med(lambda s: s["remote"]["predicted_remote"])
        print(f"{m:6}  {lm:10.3f}  {lp:9.3f}  {lp / lm:5.2f}  {rm:11.3f}  {rp:9.3f}  {rp / rm:5.2f}")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels, over, ctrl, over_run, ctrl_run = [], [], [], [], []
    for c in results["configs"]:
        labels.append(f"{c['link']}\n{'pinned' if c['pinned'] else 'unpinned'}")
        over.append(c["summary"]["overlap"]["E"])
        ctrl.append(c["summary"]["control"]["E"])
        over_run.append(c["summary"]["overlap"].get("E_run"))
        ctrl_run.append(c["summary"]["control"].get("E_run"))
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], over, 0.4, label="layer-streamed (Duet)")
    ax1.bar([i + 0.2 for i in x], ctrl, 0.4, label="send after prefill (control)")
    if all(v is not None for v in over_run + ctrl_run):
        ax1.plot([i - 0.2 for i in x], over_run, "k.", label="E against the run's own peer compute")
        ax1.plot([i + 0.2 for i in x], ctrl_run, "k.")
    ax1.axhline(1.15, color="g", ls="--", lw=1)
    ax1.axhline(1.7, color="r", ls="--", lw=1)
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set_ylabel("E = (TTFT - O) / max(C0, T0)")
    ax1.set_title(f"overlap, {results['tokens']}-token prompt")
    ax1.legend(fontsize=7)
    sweep = next((c["raw"].get("sweep") for c in results["configs"] if c["raw"].get("sweep")), None)
    if sweep:
        ms = sorted({s["tokens"] for s in sweep})

        def med(key: str, what: str) -> list[float]:
            return [
                _median([s[key][what] for s in sweep if s["tokens"] == m and s["round"] > 0 and s[key][what]])
                for m in ms
            ]

        ax2.plot(ms, med("local", "ttft"), "o-", label="local, measured")
        ax2.plot(ms, med("local", "predicted"), "x--", label="local, planner")
        ax2.plot(ms, med("remote", "ttft"), "s-", label="remote, measured")
        ax2.plot(ms, med("remote", "predicted_remote"), "+--", label="remote, planner")
        ax2.set_xlabel("prompt tokens")
        ax2.set_ylabel("TTFT, s")
        ax2.set_title("TTFT local vs remote (unshaped veth, unpinned)")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("orchestrate", "peer", "decoder", "c0"), default="orchestrate")
    ap.add_argument("--model", default=None, help="model (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length for E (default 2048)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk on both sides (default 256)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per configuration (default 5)")
    ap.add_argument(
        "--sweep",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=None,
        help="prompt lengths for TTFT local vs remote (default 256,512,1024,2048; empty: none)",
    )
    ap.add_argument("--host", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--plot", default=None, help="write the plot here (PNG)")
    ap.add_argument("--from-json", default=None, help="summarize a saved --json run instead of measuring")
    args = ap.parse_args()
    if args.role == "peer":
        return role_peer(args)
    if args.role == "decoder":
        return role_decoder(args)
    if args.role == "c0":
        return role_c0(args)
    if args.from_json:  # summarize (and plot) a saved run again
        results = json.loads(Path(args.from_json).read_text())
        for cfg in results["configs"]:
            cfg["summary"] = summarize(cfg["raw"])
            print_config(cfg)
        report_sweep(results)
        if args.plot:
            plot(results, args.plot)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
