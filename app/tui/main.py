"""Entry point for `duet chat` (called by app.cli with its parsed arguments)."""

from __future__ import annotations

from functools import partial

from .app import ChatApp
from .backends import LocalBackend, RemoteBackend
from .peers import PeerDirectory


def build_app(args) -> ChatApp:
    if getattr(args, "server", None):
        return ChatApp(args.model, load_backend=partial(RemoteBackend.connect, args.server), remote=True)
    from app.options import engine_config  # the one builder: every engine option, checked
    from app.peer_options import peer_spec, peers_auto

    config = engine_config(args)
    # --peers auto: the panel also lists the peers advertised on --interface (every interface without)
    browse = list(getattr(args, "interface", None) or ()) if peers_auto(args) else None
    return ChatApp(
        args.model,
        load_backend=partial(LocalBackend.load, config=config, peers=peer_spec(args)),
        peers=PeerDirectory(browse),
    )


def run_chat(args) -> int:
    app = build_app(args)
    try:
        app.run()
    finally:
        app.close_backend()
    return app.return_code or 0
