"""`duet serve`: load the engine, build the app, run uvicorn with a graceful shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import sys
from pathlib import Path

import uvicorn

from mlx_engine.engine import Engine

from .app import create_app

log = logging.getLogger("duet.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def model_aliases(spec: str | None) -> tuple[str, ...]:
    """Names a client may use for the served model besides its id: what --model said, the
    file or directory name, and the file name without its extension."""
    if not spec:
        return ("default",)
    p = Path(spec)
    return (spec, str(p.expanduser().resolve()), p.name, p.stem)


class _Server(uvicorn.Server):
    """On SIGINT/SIGTERM, stop the engine first: in-flight requests finish with an error,
    so open streams end with an error chunk and ``[DONE]`` instead of holding the shutdown."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.engine.shutdown)
        await super().shutdown(sockets)


def _load(args) -> Engine:
    from app.cli import _engine_config
    from mlx_engine.loader import ModelLoadError
    from mlx_engine.resolve import ModelNotFoundError

    config = _engine_config(args)
    if getattr(args, "max_running", None):
        config = dataclasses.replace(config, max_running=args.max_running)
    try:
        return Engine.load(args.model, config=config)
    except (ModelNotFoundError, ModelLoadError) as e:
        print(f"duet: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if not is_loopback(args.host) and not args.api_key:
        log.warning(
            "binding %s without an API key: anyone who can reach this address can use the model; "
            "pass --api-key (or DUET_API_KEY) to require one",
            args.host,
        )
    engine = _load(args)
    app = create_app(engine, api_key=args.api_key, aliases=model_aliases(args.model))
    s = engine.stats()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"duet: serving {engine.model_name} ({s.backend}, {s.weight_format} weights, {s.kv_blocks_total} KV blocks) "
        f"at http://{host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=10
    )
    server = _Server(config, engine)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0
