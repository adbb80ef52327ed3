"""`duet serve`: check the options, take the port, load the engine, build the app, run uvicorn
with a graceful shutdown.

The listening socket is bound before the model loads, so a port that is taken is a one-line
error at once, and the "serving" line is printed only once the server accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from mlx_engine.errors import ConfigError

from .security import CACHE_ISOLATION_MODES, DEFAULT_MAX_BODY_MB, SecurityPolicy

if TYPE_CHECKING:
    from mlx_engine.engine import Engine

log = logging.getLogger("duet.server")

API_KEY_ENV = "DUET_API_KEY"
LISTEN_BACKLOG = 2048


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The `duet serve` options (the model and cache options come from the CLI's shared set)."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only); any other address "
        "needs an API key, or --insecure-no-key",
    )
    p.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health; a key given here "
        f"shows in `ps`, so prefer --api-key-file or the {API_KEY_ENV} environment variable",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API keys from this file, one per line (blank lines and lines starting "
        "with # are ignored); any of them is accepted",
    )
    p.add_argument(
        "--cache-isolation",
        choices=CACHE_ISOLATION_MODES,
        default="shared",
        help="'shared' (default): all clients share the prefix cache, so a hit is fast for everyone "
        "but a client can tell from usage.cached_tokens whether a prompt beginning was sent before; "
        "'per-key': each API key gets its own prefix cache (needs a key; no hits across keys, and "
        "nothing cached goes to the disk cache)",
    )
    p.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOST[,HOST...]",
        help="Host header names to serve besides IP addresses, localhost and *.localhost (protects "
        "against DNS rebinding); '*.example.lan' for subdomains, '*' for any (repeatable)",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN[,ORIGIN...]",
        help="browser origins allowed to call the API, with CORS headers, e.g. http://localhost:3000 "
        "for a web UI; '*' for any (repeatable; default: none but the server's own)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"largest request body in MB; larger ones get 413 (default {DEFAULT_MAX_BODY_MB:g})",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="serve the API docs at /docs, /redoc and /openapi.json (off by default; /docs loads "
        "scripts from a CDN; behind the API key when one is set)",
    )
    p.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="allow a non-loopback --host without an API key (anyone who can reach it can use the model)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="most requests waiting for a slot (default 256); more get 429, and one request "
        "with more sequences than this gets 400",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="most sequences generated at once, the batch size (default 64); also the most "
        "sequences (prompts x n) one request may ask for",
    )


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


def _split_list(values: list[str] | None) -> list[str]:
    return [x.strip() for v in values or () for x in v.split(",") if x.strip()]


def parse_key_file(text: str) -> tuple[str, ...]:
    """The keys of an API key file: one per line, surrounding blanks stripped; blank lines and
    lines starting with ``#`` are skipped, and a repeated key counts once."""
    keys = (line.strip() for line in text.splitlines())
    return tuple(dict.fromkeys(k for k in keys if k and not k.startswith("#")))


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key-file (one key or several), else --api-key, else $DUET_API_KEY; an empty key
    means no key."""
    key_file = getattr(args, "api_key_file", None)
    key = getattr(args, "api_key", None)
    if key_file and key:
        raise ConfigError("give --api-key or --api-key-file, not both", "api_key")
    if key_file:
        try:
            text = Path(key_file).expanduser().read_text()
        except OSError as e:
            raise ConfigError(
                f"cannot read --api-key-file {key_file}: {e.strerror}", "api_key_file"
            ) from None
        keys = parse_key_file(text)
        if not keys:
            raise ConfigError(f"--api-key-file {key_file} is empty (no key lines)", "api_key_file")
        return keys
    if key is None:
        key = os.environ.get(API_KEY_ENV, "")
    return (key.strip(),) if key.strip() else ()


def api_key(args: argparse.Namespace) -> str | None:
    """The first of ``api_keys``, or None when there is none."""
    keys = api_keys(args)
    return keys[0] if keys else None


def security_policy(args: argparse.Namespace) -> SecurityPolicy:
    """The checked security options; raises ConfigError for a bad one, and for a non-loopback
    --host without a key unless --insecure-no-key."""
    keys = api_keys(args)
    host = args.host
    if not is_loopback(host) and not keys:
        if not getattr(args, "insecure_no_key", False):
            raise ConfigError(
                f"--host {host} without an API key would let anyone who can reach this address use the "
                f"model: set one with --api-key-file, {API_KEY_ENV} or --api-key (or pass --insecure-no-key)",
                "host",
            )
        log.warning(
            "binding %s without an API key: anyone who can reach this address can use the model", host
        )
    for name in ("max_queue", "max_running"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}", name)
    try:
        return SecurityPolicy.build(
            api_keys=keys,
            allowed_hosts=_split_list(getattr(args, "allowed_hosts", None)),
            allowed_origins=_split_list(getattr(args, "allowed_origins", None)),
            max_body_mb=getattr(args, "max_body_mb", DEFAULT_MAX_BODY_MB),
            cache_isolation=getattr(args, "cache_isolation", "shared"),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; ConfigError (one line) when that is not possible."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {port}", "port")
    bare = host.strip("[]")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on --host {host}: {e.strerror}", "host") from None
    sock = socket.socket(family, kind, proto)
    try:
        if os.name != "nt":  # let a restarted server take its port back from TIME_WAIT sockets
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        where = f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            msg = f"cannot listen on {where}: the port is already in use (another server?); choose another --port"
        elif e.errno == errno.EACCES:
            msg = f"cannot listen on {where}: permission denied (ports below 1024 need privileges)"
        else:
            msg = f"cannot listen on {where}: {e.strerror or e}"
        raise ConfigError(msg, "port") from None
    return sock


class _Server(uvicorn.Server):
    """Prints ``banner`` once it listens. On SIGINT/SIGTERM, stops the engine first: in-flight
    requests finish with an error, so open streams end with an error chunk and ``[DONE]``
    instead of holding the shutdown."""

    def __init__(self, config: uvicorn.Config, engine: Engine, banner: str = ""):
        super().__init__(config)
        self.engine = engine
        self.banner = banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.engine.shutdown)
        await super().shutdown(sockets)


def _load(args) -> Engine:
    from app.cli import _engine_config, _load_engine

    config = _engine_config(args)
    if getattr(args, "max_running", None):
        config = dataclasses.replace(config, max_running=args.max_running)
    return _load_engine(args, config)  # with its --peers connected


def serve(args) -> int:
    from .app import create_app
    from .connections import connection_cap, protocol_class, raise_fd_limit, rate_limit_logs

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    policy = security_policy(args)
    fd_limit = raise_fd_limit()
    sock = listen(args.host, args.port)
    try:
        engine = _load(args)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    app = create_app(
        engine, aliases=model_aliases(args.model), security=policy, docs=bool(getattr(args, "docs", False))
    )
    s = engine.stats()
    host = f"[{args.host.strip('[]')}]" if ":" in args.host else args.host
    banner = (
        f"duet: serving {engine.model_name} ({s.backend}, {s.weight_format} weights, {s.kv_blocks_total} KV blocks) "
        f"at http://{host}:{port}/v1"
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=port,
        http=protocol_class(max_connections=connection_cap(fd_limit)),
        log_level="info",
        timeout_graceful_shutdown=10,
        backlog=LISTEN_BACKLOG,
    )
    rate_limit_logs()
    server = _Server(config, engine, banner)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
        sock.close()
    return 0
