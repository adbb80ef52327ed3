"""``duet chat``: the full-screen chat (app/tui/), or a line chat on stdin/stdout without a terminal."""

from __future__ import annotations

import argparse
import asyncio
import sys

from app.options import add_model_args, check_model_args, describe, engine_config, load_engine, use_fast_blas
from app.peer_options import add_peer_args
from mlx_engine.config import EngineConfig
from mlx_engine.errors import ConfigError, ContextLengthError, RequestError


def add_chat_args(c: argparse.ArgumentParser) -> None:
    add_model_args(c)
    add_peer_args(c)
    c.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="talk to an OpenAI-compatible server at this URL instead of loading a model",
    )


def add_chat_parser(sub) -> None:
    """``duet chat``."""
    c = sub.add_parser(
        "chat",
        help="chat in the terminal",
        description="Chat in a full-screen terminal app. Without a terminal (e.g. `echo hi | duet chat`) "
        "it reads one message per line from stdin and prints each reply on stdout.",
    )
    add_chat_args(c)
    c.set_defaults(func=cmd_chat)


def local_engine_flags(args) -> list[str]:
    """The options of ``args`` (a ``duet chat`` command line) that differ from their defaults and
    configure the local engine: every one but --model and --server."""
    p = argparse.ArgumentParser()
    add_chat_args(p)
    defaults = vars(p.parse_args([]))
    return [
        "--" + name.replace("_", "-")
        for name, value in vars(args).items()
        if name not in ("model", "server", "func") and name in defaults and value != defaults[name]
    ]


def cmd_chat(args) -> int:
    if args.server and (ignored := local_engine_flags(args)):
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
        backend, banner = LocalBackend(engine), describe(engine)
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
