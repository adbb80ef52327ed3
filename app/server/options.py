"""The `duet serve` options, importable without the server's dependencies.

``duet generate`` and ``duet chat`` build the whole command line, ``serve`` included, on every
start: importing FastAPI and uvicorn for that cost about a second of their start-up.
"""

from __future__ import annotations

import argparse
from typing import Literal

from app.config_flags import add_config_flags
from mlx_engine.config import EngineConfig

API_KEY_ENV = "DUET_API_KEY"
DEFAULT_MAX_BODY_MB = 8.0
CacheIsolation = Literal["shared", "per-key"]
CACHE_ISOLATION_MODES: tuple[CacheIsolation, ...] = ("shared", "per-key")


def check_serve_args(args: argparse.Namespace) -> None:
    """The serve options no engine option covers, checked before anything loads."""
    from mlx_engine.errors import ConfigError

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}", "max_tokens")
    if getattr(args, "max_loaded", 1) < 1:
        raise ConfigError(f"--max-loaded must be at least 1, got {args.max_loaded}", "max_loaded")
    gb = getattr(args, "max_loaded_gb", None)
    if gb is not None and not gb > 0:
        raise ConfigError(f"--max-loaded-gb must be above 0, got {gb:g}", "max_loaded_gb")
    keep_alive_option(args)


def keep_alive_option(args: argparse.Namespace) -> float | None:
    """--keep-alive in seconds (None: never unload); ConfigError for a value that is no duration."""
    from mlx_engine.errors import ConfigError

    from .keep_alive import parse_keep_alive

    try:
        return parse_keep_alive(getattr(args, "keep_alive", "5m"), "--keep-alive")
    except ValueError as e:
        raise ConfigError(str(e), "keep_alive") from None


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
        "--embedding-model",
        default=None,
        metavar="PATH|REPO",
        help="also serve this embedding model at /v1/embeddings (a BERT sentence-transformers "
        "directory such as all-MiniLM-L6-v2, or a Qwen3-Embedding-style one; path or HF repo id)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens any reply may have, on every endpoint, whatever a request asks for, as "
        "llama.cpp's --n-predict (default: what the request asks, capped by the context; a model "
        "that rambles on past its answer stops here)",
    )
    add_config_flags(p, EngineConfig, ("max_queue", "max_running"))
    add_model_serving_args(p)


KEEP_ALIVE_ENV = "DUET_KEEP_ALIVE"
MAX_LOADED_ENV = "DUET_MAX_LOADED_MODELS"


def add_model_serving_args(p: argparse.ArgumentParser) -> None:
    """Several models in one server: what is loaded, for how long, how many at once."""
    import os

    p.add_argument(
        "--keep-alive",
        default=os.environ.get(KEEP_ALIVE_ENV) or "5m",
        metavar="DURATION",
        help="unload a model idle this long, as Ollama's keep_alive: '5m', '1h', '30s', seconds, 0 "
        f"(at once), -1 (never) (default 5m, or ${KEEP_ALIVE_ENV}); requests may set their own "
        "(Ollama's keep_alive, LM Studio's ttl). A model given with a single --model stays loaded",
    )
    p.add_argument(
        "--max-loaded",
        type=int,
        default=int(os.environ.get(MAX_LOADED_ENV) or 3),
        metavar="N",
        help="most models loaded at once; loading another unloads the least recently used idle one "
        f"(default 3, or ${MAX_LOADED_ENV}; as Ollama's OLLAMA_MAX_LOADED_MODELS)",
    )
    p.add_argument(
        "--max-loaded-gb",
        type=float,
        default=None,
        metavar="GiB",
        help="most memory the loaded models may hold together, weights and KV budgets (default: this "
        "machine's memory); loading past it unloads the least recently used idle model first",
    )
