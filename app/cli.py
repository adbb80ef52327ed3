"""`duet` command line: generate, chat, serve, models, peer, peers, doctor, service.

Every command checks its arguments (engine options, sampling values, the model's files) before
anything is loaded, and ``main`` is the one place that turns a ``DuetError`` into a one-line
``duet: error: <message>`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import TYPE_CHECKING

from app.config_flags import add_config_flags, config_values, flag
from app.peer_options import add_peer_args, check_peer_args, peer_spec
from mlx_engine import __version__, defaults
from mlx_engine.config import EngineConfig
from mlx_engine.errors import ConfigError, ContextLengthError, DuetError, RequestError

if TYPE_CHECKING:
    from mlx_engine.request import SamplingParams

EXIT_ERROR = 2  # a bad argument, model or request (argparse uses 2 for bad usage too)


# the EngineConfig fields every command that loads a model takes as flags (app/config_flags.py)
MODEL_FLAGS = (
    "context_length",
    "kv_bits",
    "kv_dtype",
    "cache_gb",
    "cache_fraction",
    "weights",
    "speculative",
    "draft_model",
)


# --- arguments ----------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="GGUF file, HF/MLX model directory or Hugging Face repo id (default: the bundled "
        "SmolLM2-135M-Instruct)",
    )
    add_config_flags(p, EngineConfig, MODEL_FLAGS)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = defaults
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.MAX_TOKENS,
        help="most tokens to generate (default: until the model stops or its context is full)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=d.TEMPERATURE,
        help=f"sampling temperature, 0 = greedy (default {d.TEMPERATURE:g})",
    )
    p.add_argument(
        "--top-p", type=float, default=d.TOP_P, help=f"nucleus sampling mass, 1 = off (default {d.TOP_P:g})"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=d.TOP_K,
        help=f"sample from the k likeliest tokens, 0 = off (default {d.TOP_K})",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=d.MIN_P,
        help=f"drop tokens below this fraction of the likeliest one's probability, 0 = off (default {d.MIN_P:g})",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=d.REPETITION_PENALTY,
        help=f"penalise tokens already in the prompt or output, 1 = off (default {d.REPETITION_PENALTY:g})",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="random seed, for the same output again (default: random)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet", description="Local LLMs: chat, generate, serve.")
    p.add_argument("--version", action="version", version=f"duet {__version__}")
    sub = p.add_subparsers(dest="command")

    g = sub.add_parser(
        "generate",
        help="answer one prompt and print the reply",
        description="Answer one prompt: it goes through the model's chat template when the model has "
        "one (like `ollama run`), or as plain text to complete with --raw. Sampling defaults are "
        "Ollama's.",
    )
    _add_model_args(g)
    add_peer_args(g)
    g.add_argument(
        "--prompt", "-p", required=True, help="the prompt (a user message, or text to complete with --raw)"
    )
    _add_sampling_args(g)
    g.add_argument("--stop", action="append", help="stop when the reply contains this text (repeatable)")
    template = g.add_mutually_exclusive_group()
    template.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text for the model to continue, without the chat template",
    )
    template.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template (the default; kept for older scripts)",
    )
    g.add_argument(
        "--json", action="store_true", help="print one JSON object: text, token ids, usage, timings"
    )
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat",
        help="chat in the terminal",
        description="Chat in a full-screen terminal app. Without a terminal (e.g. `echo hi | duet chat`) "
        "it reads one message per line from stdin and prints each reply on stdout.",
    )
    _add_model_args(c)
    add_peer_args(c)
    c.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="talk to an OpenAI-compatible server at this URL instead of loading a model",
    )
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...).",
    )
    _add_model_args(s)
    add_peer_args(s)
    from app.server.options import add_serve_args  # not app.server.main: no FastAPI here

    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    from app.commands.pairing import add_peers_parser
    from app.commands.peer import add_peer_parser

    add_peer_parser(sub, _add_model_args)

    add_peers_parser(sub)

    m = sub.add_parser(
        "models",
        help="list the bundled model and models in the local HF cache",
        description="List the bundled model and the models in the local Hugging Face cache.",
    )
    m.set_defaults(func=cmd_models)

    from app.doctor import add_doctor_parser
    from app.service import add_service_parser

    add_doctor_parser(sub)
    add_service_parser(sub)
    return p


# --- checks before anything loads ---------------------------------------------------------
def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The one place command-line arguments become an ``EngineConfig`` (generate, chat, serve),
    checked: a bad option raises ``ConfigError`` naming its flag."""
    from app.doctor import check_mlx_install

    check_mlx_install()  # before anything imports MLX: a missing Linux backend is one line
    check_peer_args(args)
    given = config_values(args, EngineConfig)
    if given.get("draft_model") is not None:
        given.setdefault("speculative", "draft")  # --draft-model alone: speculate with it
    config = EngineConfig(**given)
    config.validate(spell=flag)
    return config


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Checked sampling options (``ConfigError`` naming the flag) and ``--max-tokens``."""
    from mlx_engine.request import SamplingParams

    if args.max_tokens is not None and args.max_tokens <= 0:
        raise ConfigError(
            f"--max-tokens must be a positive integer, not {args.max_tokens} "
            "(leave it out to generate until the model stops)",
            "max_tokens",
        )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    try:
        params.validate()
    except RequestError as e:
        value = getattr(args, e.param, None) if e.param else None
        raise ConfigError(f"{e} (got {flag(e.param)} {value})" if e.param else str(e), e.param) from None
    return params


def check_model_args(args: argparse.Namespace) -> None:
    from mlx_engine.loading.preflight import check_model

    check_model(args.model)
    if getattr(args, "draft_model", None) is not None:
        check_model(args.draft_model)


def use_fast_blas() -> None:
    """Re-execute once with OpenBLAS preloaded where that helps (returns if not needed); after the
    checks, so a bad argument fails at once."""
    from mlx_engine.blas import reexec_with_openblas

    reexec_with_openblas()


def load_engine(args: argparse.Namespace, config: EngineConfig):
    """The engine the options name, with its --peers connected (``app.launch.build_engine``)."""
    from app.launch import build_engine

    return build_engine(args.model, config, peer_spec(args))


def _describe(engine) -> str:
    s = engine.stats()
    return (
        f"model {s.model} | {s.backend} | weights {s.weight_format} | BLAS {s.blas} | "
        f"KV {s.kv_blocks_total} blocks {s.kv_format}"
    )


# --- commands -------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from mlx_engine.request import GenerationRequest
    from peer.attach import peer_usage

    sampling = sampling_params(args)
    config = engine_config(args)
    check_model_args(args)
    use_fast_blas()
    with load_engine(args, config) as engine:
        if not args.json:
            print(_describe(engine), file=sys.stderr)
        chat = not args.raw and engine.tokenizer.chat_template is not None
        req = GenerationRequest(
            prompt=None if chat else args.prompt,
            messages=[{"role": "user", "content": args.prompt}] if chat else None,
            max_tokens=args.max_tokens,
            sampling=sampling,
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

        text, ids, last = asyncio.run(run())
    u = last.usage
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": last.finish_reason,
                    "chat_template": chat,
                    "usage": {
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "cached_tokens": u.cached_tokens,
                        "ttft_s": round(u.ttft_s, 4),
                        "prefill_tps": round(u.prefill_tps, 1),
                        "decode_tps": round(u.decode_tps, 1),
                        "speculative": u.speculative,
                        **peer_usage(u, engine, req.request_id),
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
    if last.error:
        print(f"duet: error: {last.error}", file=sys.stderr)
    return 0 if last.finish_reason in ("stop", "length") else 1


def cmd_models(args) -> int:
    from mlx_engine.loading.resolve import BUNDLED_NAME, bundled_model_path, cached_models

    try:
        print(f"{BUNDLED_NAME}  (bundled: {bundled_model_path()})")
    except FileNotFoundError as e:
        print(f"{BUNDLED_NAME}  (missing: {e})")
    for repo in cached_models():
        print(f"{repo}  (Hugging Face cache)")
    return 0


def _local_engine_flags(args) -> list[str]:
    """The options of ``args`` (a ``duet chat`` command line) that differ from their defaults and
    configure the local engine: every one but --model and --server."""
    defaults = vars(build_parser().parse_args(["chat"]))
    return [
        "--" + name.replace("_", "-")
        for name, value in vars(args).items()
        if name not in ("model", "server", "func") and name in defaults and value != defaults[name]
    ]


def cmd_chat(args) -> int:
    if args.server and (ignored := _local_engine_flags(args)):
        raise ConfigError(
            f"{', '.join(ignored)}: with --server the chat loads no model, so the server's own settings "
            f"apply (give these to `duet serve` there)",
            "server",
        )
    config = engine_config(args)
    if not args.server:
        check_model_args(args)
    use_fast_blas()
    if sys.stdin.isatty() and sys.stdout.isatty():
        try:
            from app.tui.main import run_chat
        except ImportError:  # no Textual: the line chat still works
            return line_chat(args, config, interactive=True)
        return run_chat(args)
    return line_chat(args, config, interactive=False)


def line_chat(args, config: EngineConfig, *, interactive: bool) -> int:
    """Chat one line at a time: each line of stdin is a user message, each reply is streamed to
    stdout. ``interactive`` adds a banner and a prompt; without it (a pipe) stdout holds the
    replies only, one per line. The oldest exchanges are dropped when the conversation outgrows
    the model's context. Returns 1 if any reply failed."""
    from app.tui.backends import BackendError, LocalBackend, RemoteBackend
    from app.tui.settings import Sampling

    backend: LocalBackend | RemoteBackend
    if args.server:
        try:
            remote = RemoteBackend.connect(args.server, args.model)
        except BackendError as e:  # unreachable, or no such model there
            raise ConfigError(str(e), "server") from None
        backend, banner = remote, f"server {remote.url} | model {remote.name}"
    else:
        engine = load_engine(args, config)
        backend, banner = LocalBackend(engine), _describe(engine)
    sampling = Sampling()
    history: list[dict] = []
    failed = False

    async def reply(messages: list[dict]) -> tuple[str, str | None]:
        out: list[str] = []
        async for ev in backend.stream(messages, sampling):
            if ev.text:
                print(ev.text, end="", flush=True)
                out.append(ev.text)
            if ev.finished:
                return "".join(out), ev.error if ev.finish_reason == "error" else None
        return "".join(out), None

    try:
        if interactive:
            print(banner)
            print("Type a message; /quit to leave.")
        while True:
            try:
                line = input("> " if interactive else "").strip()
            except EOFError:
                break
            if not line:
                continue
            if interactive and line in ("/quit", "/exit"):
                break
            turn = [*history, {"role": "user", "content": line}]
            try:
                while True:
                    try:
                        text, error = asyncio.run(reply(turn))
                        break
                    except ContextLengthError:
                        if len(turn) < 3:  # this message alone does not fit
                            raise
                        del turn[:2]  # forget the oldest exchange and try again
            except RequestError as e:  # this message is refused; the chat goes on without it
                text, error = "", str(e)
            if error is None or text:
                print()  # ends the reply's line
            if error is None:
                history = [*turn, {"role": "assistant", "content": text}]
            else:
                failed = True
                print(f"duet: error: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print()
    finally:
        backend.close()
    return 1 if failed else 0


def cmd_serve(args) -> int:
    from app.server.options import check_serve_args

    engine_config(args)
    check_serve_args(args)
    check_model_args(args)
    use_fast_blas()
    from app.server.main import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    try:
        return args.func(args) or 0
    except DuetError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # the reader went away (`duet ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
