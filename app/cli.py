"""`duet` command line: generate, chat, serve, models."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from mlx_engine import __version__


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="GGUF file, HF/MLX model dir or HF repo id (default: bundled SmolLM2-135M)",
    )
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help="quantize the KV cache")
    p.add_argument("--cache-gb", type=float, default=None, help="KV cache budget in GiB")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=None,
        help="KV cache budget as a fraction of device memory (default: min(4 GiB, 0.15))",
    )
    p.add_argument(
        "--weights",
        choices=("auto", "dense", "quantized"),
        default="auto",
        help="weight format (auto: dense on CPU, quantized on Metal/CUDA)",
    )


def _engine_config(args):
    from mlx_engine.engine import EngineConfig

    return EngineConfig(
        kv_bits=args.kv_bits,
        cache_gb=args.cache_gb,
        cache_fraction=args.cache_fraction,
        weights=args.weights,
        **({"max_queue": args.max_queue} if getattr(args, "max_queue", None) else {}),
    )


def _load_engine(args):
    from mlx_engine.engine import Engine
    from mlx_engine.gguf_loader import GGUFError
    from mlx_engine.loader import ModelLoadError
    from mlx_engine.resolve import ModelNotFoundError

    try:
        return Engine.load(args.model, config=_engine_config(args))
    except (ModelNotFoundError, ModelLoadError, GGUFError) as e:
        print(f"duet: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _describe(engine) -> str:
    s = engine.stats()
    return (
        f"model {s.model} | {s.backend} | weights {s.weight_format} | BLAS {s.blas} | "
        f"KV {s.kv_blocks_total} blocks{' ' + str(s.kv_bits) + '-bit' if s.kv_bits else ''}"
    )


def cmd_generate(args) -> int:
    from mlx_engine.request import GenerationRequest, RequestError, SamplingParams

    engine = _load_engine(args)
    if not args.json:
        print(_describe(engine), file=sys.stderr)
    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    req = GenerationRequest(
        prompt=None if args.chat else args.prompt,
        messages=messages,
        max_tokens=args.max_tokens,
        sampling=SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        ),
        stop=args.stop or [],
    )

    async def run():
        text, ids, last = [], [], None
        async for ev in engine.generate(req):
            text.append(ev.text)
            ids.extend(ev.token_ids)
            if not args.json:
                print(ev.text, end="", flush=True)
            last = ev
        return "".join(text), ids, last

    try:
        text, ids, last = asyncio.run(run())
    except RequestError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    u = last.usage
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": last.finish_reason,
                    "usage": {
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "cached_tokens": u.cached_tokens,
                        "ttft_s": round(u.ttft_s, 4),
                        "prefill_tps": round(u.prefill_tps, 1),
                        "decode_tps": round(u.decode_tps, 1),
                    },
                }
            )
        )
    else:
        print(
            f"\n[{last.finish_reason}] prompt {u.prompt_tokens} tok, completion {u.completion_tokens} tok, "
            f"TTFT {u.ttft_s * 1000:.0f} ms, decode {u.decode_tps:.1f} tok/s",
            file=sys.stderr,
        )
    return 0 if last.finish_reason in ("stop", "length") else 1


def cmd_models(args) -> int:
    from mlx_engine.resolve import BUNDLED_NAME, bundled_model_path, cached_models

    try:
        print(f"{BUNDLED_NAME}  (bundled: {bundled_model_path()})")
    except FileNotFoundError as e:
        print(f"{BUNDLED_NAME}  (missing: {e})")
    for repo in cached_models():
        print(f"{repo}  (Hugging Face cache)")
    return 0


def cmd_chat(args) -> int:
    try:
        from app.tui.main import run_chat
    except ImportError:
        run_chat = None
    if run_chat is not None:
        return run_chat(args)
    return _line_chat(args)


def _line_chat(args) -> int:
    """Plain line REPL (used when the TUI is unavailable)."""
    from mlx_engine.request import GenerationRequest, SamplingParams

    engine = _load_engine(args)
    print(_describe(engine))
    print("Type a message; /quit to leave.")
    history: list[dict] = []
    try:
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                break
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            history.append({"role": "user", "content": line})
            req = GenerationRequest(
                messages=list(history), max_tokens=512, sampling=SamplingParams(temperature=0.7)
            )

            async def run(req=req):
                out = []
                async for ev in engine.generate(req):
                    print(ev.text, end="", flush=True)
                    out.append(ev.text)
                return "".join(out)

            history.append({"role": "assistant", "content": asyncio.run(run())})
            print()
    except KeyboardInterrupt:
        print()
    finally:
        engine.shutdown()
    return 0


def cmd_serve(args) -> int:
    from app.server.main import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet", description="Local LLMs: chat, generate, serve.")
    p.add_argument("--version", action="version", version=f"duet {__version__}")
    sub = p.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="complete a prompt and print the result")
    _add_model_args(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print JSON with token ids and usage")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="open the terminal chat")
    _add_model_args(c)
    c.add_argument("--server", default=None, help="talk to an OpenAI-compatible server at this URL instead")
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_model_args(s)
    from app.server.main import add_serve_args

    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    m = sub.add_parser("models", help="list the bundled model and models in the local HF cache")
    m.set_defaults(func=cmd_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) is None:
        build_parser().print_help()
        return 0
    if args.command in ("generate", "chat", "serve"):
        from mlx_engine.blas import reexec_with_openblas

        reexec_with_openblas()  # returns when already active or unavailable
    return args.func(args) or 0


if __name__ == "__main__":
    raise SystemExit(main())
