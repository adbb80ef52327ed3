"""`duet serve`: check the options, take the port, load the engine, build the app, run uvicorn
with a graceful shutdown.

The listening socket is bound before the model loads, so a port that is taken is a one-line
error at once, and the "serving" line is printed only once the server accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import faulthandler
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from mlx_engine.errors import ConfigError

from .common import ServerState
from .options import API_KEY_ENV, DEFAULT_MAX_BODY_MB
from .options import add_serve_args as add_serve_args  # where the CLI and tests found it
from .registry import ModelRegistry, ServedModel
from .security import SecurityPolicy

log = logging.getLogger("duet.server")

LISTEN_BACKLOG = 2048


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def model_aliases(spec: str | list[str] | None) -> tuple[str, ...]:
    """Names a client may use for the served model besides its id: what --model said, the
    file or directory name, and the file name without its extension."""
    if isinstance(spec, list):
        spec = spec[0] if len(spec) == 1 else None
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
    """Prints ``banner`` once it listens. On SIGINT/SIGTERM, stops the engines first: in-flight
    requests finish with an error, so open streams end with an error chunk and ``[DONE]``
    instead of holding the shutdown."""

    def __init__(self, config: uvicorn.Config, registry: ModelRegistry, banner: str = ""):
        super().__init__(config)
        self.registry = registry
        self.banner = banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None) -> None:
        self.registry.stop_reaping()
        await asyncio.to_thread(self.registry.shutdown)
        await super().shutdown(sockets)


def _load_embedder(spec: str | None):
    """The --embedding-model, loaded (a ModelLoadError is the CLI's one-line error)."""
    if not spec:
        return None
    from mlx_engine.embeddings import EmbeddingModel
    from mlx_engine.errors import ModelLoadError
    from mlx_engine.loading.resolve import resolve_model

    src = resolve_model(spec)
    if src.kind != "hf_dir":
        raise ModelLoadError(
            f"--embedding-model {spec}: an embedding model is an HF model directory, not a {src.kind}"
        )
    return EmbeddingModel.load(src.path, name=src.name)


def served_models(specs: list[str] | None) -> list[ServedModel]:
    """The models a server answers for: each ``--model`` (resolved now: a missing one, or one that
    must be pulled, is dealt with before the server starts; one alone is pinned), or, with none,
    every local model (``local_models``)."""
    from mlx_engine.loading.resolve import resolve_model

    if not specs:
        return local_models()
    out = []
    for spec in specs:
        src = resolve_model(spec)
        size = src.path.stat().st_size if src.path.is_file() else _dir_size(src.path)
        info = {"format": src.kind, "size_bytes": size}
        out.append(ServedModel(src.name, spec, model_aliases(spec), info, pinned=len(specs) == 1))
    return out


def local_models() -> list[ServedModel]:
    """Every model on this machine Duet can load (``mlx_engine.loading.catalogue``): the bundled one,
    then the Hugging Face cache's, one per GGUF quant, each by the name ``duet models`` shows."""
    from mlx_engine.loading.catalogue import list_models

    out = []
    for e in list_models():
        info = {
            "format": e.format,
            "quant": e.quant,
            "size_bytes": e.size,
            "context_length": e.context_length,
            "architecture": e.architecture,
            "path": str(e.path),
        }
        aliases = ("default",) if e.bundled else (f"hf.co/{e.name}", e.name.casefold())
        out.append(ServedModel(e.name, None if e.bundled else str(e.path), aliases, info))
    return out


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def build_registry(args, policy: SecurityPolicy, embedding_ids: tuple[str, ...]) -> ModelRegistry:
    """The registry of the served models, with a loader that builds each model's engine through
    ``app.launch.build_engine`` (the one engine builder) with this command line's options."""
    from app.launch import build_engine
    from app.options import engine_config
    from app.peer_options import peer_spec
    from mlx_engine.backend import total_memory_bytes

    from .app import server_state
    from .options import keep_alive_option

    config, peers = engine_config(args), peer_spec(args)
    max_tokens = getattr(args, "max_tokens", None)

    def load(model: ServedModel) -> ServerState:
        engine = build_engine(model.spec, config, peers)
        try:
            state = server_state(
                engine, model.ids, api_key=policy.api_key, max_tokens=max_tokens, embedding_ids=embedding_ids
            )
            # before serving: built in a first request, these would stall the event loop (they hold the GIL)
            state.grammars.prepare()
            engine.tokenizer.prepare()
        except BaseException:
            engine.shutdown()
            raise
        return state

    gb = getattr(args, "max_loaded_gb", None)
    registry = ModelRegistry(
        served_models(args.model),
        load,
        discover=None if args.model else local_models,
        max_loaded=getattr(args, "max_loaded", 3),
        keep_alive=keep_alive_option(args),
        memory_limit=int(gb * 2**30) if gb else total_memory_bytes(),
    )
    for model in registry.available():
        if model.pinned:  # one --model: loaded now, as a single-model server always did
            registry.adopt(model, load(model))
    return registry


def serve(args) -> int:
    from app.fd_limit import raise_fd_limit

    from .app import create_app
    from .connections import connection_cap, protocol_class, rate_limit_logs

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's stack to stderr, for a stuck server
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    policy = security_policy(args)
    sock = listen(args.host, args.port)
    try:
        embedder = _load_embedder(getattr(args, "embedding_model", None))
        embedding_ids: tuple[str, ...] = ()
        if embedder is not None:
            embedding_ids = tuple(dict.fromkeys([embedder.name, *model_aliases(args.embedding_model)]))
        registry = build_registry(args, policy, embedding_ids)
    except BaseException:
        sock.close()
        raise
    # after loading: importing mlx_lm.utils (lazily, when a model loads) sets the limit to 2048/4096
    fd_limit = raise_fd_limit()
    port = sock.getsockname()[1]
    app = create_app(
        registry=registry,
        security=policy,
        docs=bool(getattr(args, "docs", False)),
        embedder=embedder,
        embedding_aliases=embedding_ids,
        max_tokens=getattr(args, "max_tokens", None),
    )
    host = f"[{args.host.strip('[]')}]" if ":" in args.host else args.host
    loaded = registry.loaded()
    if len(loaded) == 1 and loaded[0].model.pinned:
        engine = loaded[0].state.engine
        s = engine.stats()
        what = f"{engine.model_name} ({s.backend}, {s.weight_format} weights, {s.kv_blocks_total} KV blocks)"
    else:
        names = [m.name for m in registry.available()]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        what = f"{len(names)} model{'s' if len(names) != 1 else ''} ({shown}; loaded on first use)"
    banner = f"duet: serving {what} at http://{host}:{port}/v1"
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
    server = _Server(config, registry, banner)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        registry.shutdown()
        sock.close()
    return 0
