"""Asking a running ``duet serve`` what it holds: ``GET /api/ps`` (Ollama's shape), for ``duet ps`` and
the "loaded" column of ``duet models``."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from mlx_engine.errors import ConfigError

DEFAULT_SERVER = "http://127.0.0.1:8000"


def server_base(url: str | None) -> str:
    """The server's root URL: ``--server``, else ``$DUET_SERVER``, else 127.0.0.1:8000 (a trailing /v1 dropped)."""
    base = (url or os.environ.get("DUET_SERVER") or DEFAULT_SERVER).rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    return base


def loaded_models(url: str | None, api_key: str | None = None, timeout: float = 1.0) -> list[dict[str, Any]]:
    """The server's ``/api/ps`` models. Raises ``ConfigError`` when nothing answers there."""
    base = server_base(url)
    req = urllib.request.Request(f"{base}/api/ps", headers={"Accept": "application/json"})
    key = api_key or os.environ.get("DUET_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        hint = " (pass --api-key or set DUET_API_KEY)" if e.code in (401, 403) else ""
        raise ConfigError(
            f"the server at {base} answered HTTP {e.code} to /api/ps{hint}", "--server"
        ) from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(
            f"no Duet server answers at {base} ({reason}); start one with `duet serve`, or pass --server URL",
            "--server",
        ) from None
    models = body.get("models") if isinstance(body, dict) else None
    return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []


def loaded_names(url: str | None, api_key: str | None = None) -> set[str] | None:
    """Names of the models a running server holds; None when no server answers (quietly)."""
    try:
        models = loaded_models(url, api_key, timeout=0.5)
    except ConfigError:
        return None
    return {str(m.get(k)) for m in models for k in ("name", "model") if m.get(k)}
