"""Record what an agent client sends: a loopback proxy in front of `duet serve`.

    python tests/capture_agent_requests.py --upstream http://127.0.0.1:8000 --port 8001 --out /tmp/claude.jsonl
    ANTHROPIC_BASE_URL=http://127.0.0.1:8001 ... claude -p "say hi"

Each request (method, path, query, the headers that shape it, the JSON body) is appended to ``--out``
as one JSON line, and forwarded to ``--upstream``; the response streams back as it comes.
``--force-tool NAME`` (``NAMESPACE.NAME`` for a Responses namespace tool) sets the first request
that offers that tool to require a call of it (``tool_choice``, in the request's own API shape), so
the client runs the call and its next request, the one recorded after it, carries a tool result.
Secrets (``authorization``, ``x-api-key``, cookies) are never written. ``tests/agent_fixtures.py
--from`` turns the lines into the fixtures under ``tests/data/agent_requests/`` that
``tests/test_agent_clients.py`` replays. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization", "chatgpt-account-id"}
DROPPED = {"host", "content-length", "connection", "accept-encoding"}


def _offers(body: dict, name: str) -> bool:
    """Whether a request's tools include ``name`` (``namespace.name`` inside a namespace tool)."""
    namespace, _, inner = name.rpartition(".")
    for t in body.get("tools") or []:
        if namespace and t.get("type") == "namespace" and t.get("name") == namespace:
            if any(x.get("name") == inner for x in t.get("tools") or []):
                return True
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if not namespace and fn.get("name") == name:
            return True
    return False


def force_tool(path: str, body: dict, name: str) -> dict:
    """``body`` with ``tool_choice`` naming ``name``, in the shape of the API ``path`` belongs to."""
    namespace, _, inner = name.rpartition(".")
    if path.endswith("/messages"):
        choice: dict = {"type": "tool", "name": name}
    elif path.endswith("/responses"):
        choice = {"type": "function", "name": inner, **({"namespace": namespace} if namespace else {})}
    else:
        choice = {"type": "function", "function": {"name": name}}
    return {**body, "tool_choice": choice}


def make_app(upstream: str, out: Path, force: str | None = None) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)
    lock = threading.Lock()
    pending = [force] if force else []

    async def proxy(request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = {"_raw": body.decode("utf-8", "replace")}
        record = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": {
                k: v for k, v in request.headers.items() if k not in SECRET_HEADERS and k not in DROPPED
            },
            "body": parsed,
        }
        with lock, out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        headers = {k: v for k, v in request.headers.items() if k not in DROPPED}
        if pending and isinstance(parsed, dict) and _offers(parsed, pending[0]):
            body = json.dumps(force_tool(request.url.path, parsed, pending.pop())).encode()
        req = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=body
        )
        resp = await client.send(req, stream=True)
        passed = {k: v for k, v in resp.headers.items() if k not in ("content-length", "transfer-encoding")}
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, headers=passed, background=None
        )

    methods = ["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", proxy, methods=methods)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", default="http://127.0.0.1:8000")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force-tool", default=None, metavar="NAME", help="require one call of this tool, once")
    a = p.parse_args()
    app = make_app(a.upstream, a.out, a.force_tool)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
