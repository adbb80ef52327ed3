"""``duet serve``: the OpenAI/Anthropic-compatible HTTP server (app/server/)."""

from __future__ import annotations

from app.options import add_model_args, check_model_args, engine_config, use_fast_blas
from app.peer_options import add_peer_args


def add_serve_parser(sub) -> None:
    """``duet serve``."""
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...).",
    )
    add_model_args(s, several=True)
    add_peer_args(s)
    from app.server.options import add_serve_args  # not app.server.main: no FastAPI here

    add_serve_args(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from app.server.options import check_serve_args

    engine_config(args)
    check_serve_args(args)
    if args.model and len(args.model) == 1:
        check_model_args(args)  # one model: checked (and pulled) before anything loads
    use_fast_blas()
    from app.server.main import serve

    return serve(args)
