"""``duet models``, ``duet rm``, ``duet show`` and ``duet ps``: the models on this machine
(``mlx_engine.loading.catalogue``) and the ones a running server holds (``GET /api/ps``)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from app.commands.server_api import loaded_models, loaded_names


def _server_args(p) -> None:
    p.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help="the Duet server to ask (default: $DUET_SERVER, else http://127.0.0.1:8000)",
    )


def add_models_parser(sub) -> None:
    """``duet models``, ``duet rm``, ``duet show``, ``duet ps``."""
    m = sub.add_parser(
        "models",
        help="list the bundled model and models in the local HF cache",
        description=(
            "List the models this machine can load: the bundled model and every GGUF quant and "
            "MLX/safetensors model in the local Hugging Face cache, with format, quant, size, context "
            "length, when each was last used and whether a running server (--server) holds it."
        ),
    )
    m.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    _server_args(m)
    m.set_defaults(func=cmd_models)

    rm = sub.add_parser(
        "rm",
        help="delete a model from the local HF cache",
        description=(
            "Delete a model's files from the Hugging Face cache: one GGUF quant (owner/repo:QUANT) "
            "or a whole MLX/safetensors model (owner/repo). The bundled model stays."
        ),
    )
    rm.add_argument("model", help="a name `duet models` lists")
    rm.set_defaults(func=cmd_rm)

    show = sub.add_parser(
        "show",
        help="what a model is: architecture, parameters, quant, context, chat format",
        description=(
            "Show a model's architecture, parameter count, quant mix (tensor types), context length, "
            "chat template family and reasoning/tool-call format, read from its headers (no weights load)."
        ),
    )
    show.add_argument("model", nargs="?", default="default", help="a name `duet models` lists, or a path")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_show)

    ps = sub.add_parser(
        "ps",
        help="list the models a running Duet server has loaded",
        description="List the models a running `duet serve` holds (its /api/ps): name, size, context, idle time left.",
    )
    _server_args(ps)
    ps.add_argument(
        "--api-key",
        default=None,
        help="the server's API key, sent as a Bearer token (default: $DUET_API_KEY)",
    )
    ps.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    ps.set_defaults(func=cmd_ps)


def human_size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def ago(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "never"
    s = max(0.0, (now or time.time()) - t)
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if s >= size:
            k = int(s // size)
            return f"{k} {unit}{'s' if k != 1 else ''} ago"
    return "just now"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def cmd_models(args) -> int:
    from mlx_engine.loading.catalogue import list_models

    entries = list_models()
    loaded = loaded_names(args.server)
    if args.json:
        out = [{**e.as_dict(), "loaded": (e.name in loaded) if loaded is not None else None} for e in entries]
        print(json.dumps(out, indent=2))
        return 0
    rows = [["NAME", "FORMAT", "QUANT", "SIZE", "CONTEXT", "LAST USED"] + (["LOADED"] if loaded else [])]
    for e in entries:
        row = [
            e.name + ("  (bundled)" if e.bundled else ""),
            e.format,
            e.quant or "-",
            human_size(e.size),
            str(e.context_length or "-"),
            ago(e.last_used),
        ]
        if loaded:
            row.append("yes" if e.name in loaded else "")
        rows.append(row)
    print(_table(rows))
    if len(entries) <= 1:
        print(
            "\n`duet pull owner/repo[:QUANT]` downloads more (e.g. bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M)"
        )
    return 0


def cmd_rm(args) -> int:
    from mlx_engine.loading.catalogue import remove_model

    entry = remove_model(args.model)
    print(f"deleted {entry.name} ({human_size(entry.size)})")
    return 0


def cmd_show(args) -> int:
    from mlx_engine.loading.describe import describe_model

    info = describe_model(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    params = info.get("parameters")
    types = info.get("tensor_types") or {}
    lines = [
        ("name", info.get("name")),
        ("path", info.get("path")),
        ("format", info.get("format")),
        ("architecture", info.get("architecture")),
        ("parameters", f"{params / 1e9:.2f}B ({params:,})" if params else None),
        ("quant", info.get("quant") or info.get("file_type")),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in types.items()) or None),
        ("context length", info.get("context_length")),
        ("size", human_size(info["size"]) if info.get("size") else None),
        ("chat template", info.get("chat_template")),
        ("reasoning", info.get("reasoning_format") or "none detected"),
        ("tool calls", info.get("tool_format")),
        ("thinking switch", info.get("thinking_switch")),
    ]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        if v is not None:
            print(f"{k.ljust(width)}  {v}")
    return 0


def _left(expires_at: Any) -> str:
    if not isinstance(expires_at, str) or not expires_at:
        return "-"
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    s = (when - datetime.now(when.tzinfo)).total_seconds()
    if s > 10 * 365 * 86400:
        return "forever"
    if s <= 0:
        return "expiring"
    return f"{int(s // 60)} min {int(s % 60)} s" if s >= 60 else f"{int(s)} s"


def cmd_ps(args) -> int:
    models = loaded_models(args.server, args.api_key, timeout=3.0)
    if args.json:
        print(json.dumps({"models": models}, indent=2))
        return 0
    if not models:
        print("no models loaded")
        return 0
    rows = [["NAME", "SIZE", "WEIGHTS", "KV BUDGET", "KV IN USE", "CONTEXT", "REQUESTS", "IDLE TIME LEFT"]]
    for m in models:
        ctx = m.get("context_length") or (m.get("details") or {}).get("context_length")
        rows.append(
            [
                str(m.get("name") or m.get("model")),
                human_size(m.get("size")),
                human_size(m.get("weights_bytes")),
                human_size(m.get("kv_budget_bytes")),
                human_size(m.get("kv_bytes")),
                str(ctx or "-"),
                str(m.get("running", "-")),
                _left(m.get("expires_at")),
            ]
        )
    print(_table(rows))
    return 0
