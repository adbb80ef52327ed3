"""`duet` command line: the parser of every command (each in app/commands/, app/doctor.py,
app/service.py) and ``main``.

Every command checks its arguments (engine options, sampling values, the model's files) before
anything is loaded, and ``main`` is the one place that turns a ``DuetError`` into a one-line
``duet: error: <message>`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from app.commands.chat import add_chat_parser
from app.commands.generate import add_generate_parser
from app.commands.models import add_models_parser
from app.commands.pairing import add_peers_parser
from app.commands.peer import add_peer_parser
from app.commands.pull import add_pull_parser
from app.commands.serve import add_serve_parser
from app.doctor import add_doctor_parser
from app.options import add_model_args
from app.service import add_service_parser
from mlx_engine import __version__
from mlx_engine.errors import DuetError

EXIT_ERROR = 2  # a bad argument, model or request (argparse uses 2 for bad usage too)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet", description="Local LLMs: chat, generate, serve.")
    p.add_argument("--version", action="version", version=f"duet {__version__}")
    sub = p.add_subparsers(dest="command")

    add_generate_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    add_peer_parser(sub, add_model_args)
    add_peers_parser(sub)
    add_pull_parser(sub)
    add_models_parser(sub)  # models, rm, show, ps
    add_doctor_parser(sub)
    add_service_parser(sub)
    return p


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
