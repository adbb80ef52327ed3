"""The server's front door, as pure ASGI middleware: who may talk to the API, and how much.

Every HTTP request passes these checks in order, before any route runs or any body is parsed:

1. **Host** (DNS rebinding, Ollama's CVE-2024-28224). A web page can point a name it controls at
   127.0.0.1 and then call the API "same-origin"; the browser still sends that name as ``Host``.
   Allowed: IP literals (a browser that sends one really connected to that address), ``localhost``
   and ``*.localhost`` (which browsers resolve to loopback themselves), and ``--allowed-hosts``.
   Anything else is a 403.
2. **Origin** (cross-site requests). Browsers send ``Origin`` on cross-site and on POST requests;
   clients such as curl or the OpenAI SDK send none, and those pass. Allowed: ``--allowed-origins``,
   the server's own origin (the same host and port as the request's ``Host``) and loopback origins
   on the server's port. Anything else, ``null`` included, is a 403. CORS headers go only to
   ``--allowed-origins``: CORS stays closed by default.
3. **API key**, when one or more are set: every path but ``/health`` and ``/`` needs ``Authorization: Bearer
   KEY`` (or ``x-api-key: KEY``, as Anthropic's clients send it) with one of them (a constant-time comparison against each); 401 otherwise. CORS preflights
   from an allowed origin pass (browsers never send credentials on a preflight). The key that
   authenticated a request is recorded in the ASGI scope as ``scope["state"]["duet_key_id"]``, a
   short sha256 of it (never the key itself); with ``--cache-isolation per-key`` it also becomes the
   request's prefix-cache scope (``scope["state"]["duet_cache_scope"]``, see ``effective_cache_salt``).
4. **Body size**: a ``Content-Length`` above the limit is a 413 at once; a body without one is
   read incrementally and refused with a 413 as soon as it passes the limit. A body that does not
   arrive in time is a 408.
5. **Content type**: a request with a body must be ``application/json`` (or ``application/*+json``);
   anything else is a 415 (but for the Ollama API's routes from a client that sends no ``Origin``,
   i.e. no browser: ``curl -d`` sends its JSON as a form, as Ollama's own examples do). This is what keeps a cross-site ``text/plain`` form POST (which needs no
   CORS preflight) from being parsed as JSON, whatever FastAPI version is installed.

The body is read here, whole and within the limit, and handed to the app from memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .anthropic_errors import error_body as anthropic_error_body
from .anthropic_errors import is_anthropic_path
from .options import CACHE_ISOLATION_MODES, DEFAULT_MAX_BODY_MB, CacheIsolation

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/"})  # answer without the API key
DEFAULT_BODY_TIMEOUT_S = 60.0
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
KEY_ID_CHARS = 16  # hex digits of a key's sha256 that name it
KEY_ID_STATE = "duet_key_id"
CACHE_SCOPE_STATE = "duet_cache_scope"


def key_id(key: str) -> str:
    """A short, stable name for an API key that does not reveal it: its sha256's first hex digits."""
    return hashlib.sha256(key.encode()).hexdigest()[:KEY_ID_CHARS]


def effective_cache_salt(scope: Scope, body_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: with ``--cache-isolation per-key``, the id of the key
    that authenticated it followed by the body's ``cache_salt`` (so two keys never share cached
    blocks, whatever salts their clients send); otherwise the body's ``cache_salt`` alone."""
    cache_scope = (scope.get("state") or {}).get(CACHE_SCOPE_STATE)
    if cache_scope is None:
        return body_salt
    return f"key:{cache_scope}/{body_salt or ''}"


def split_host(value: str) -> tuple[str, int | None]:
    """``Host`` header value -> (lower-case name without brackets or trailing dot, port or None).
    Raises ValueError for a malformed value."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(value)
        port = rest[1:]
    else:
        name, _, port = value.partition(":") if value.count(":") == 1 else (value, "", "")
    if not name or (port and not port.isdigit()):
        raise ValueError(value)
    return name.rstrip("."), int(port) if port else None


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback_name(name: str) -> bool:
    """``localhost``, ``*.localhost`` or a loopback IP literal."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


_CURL_TYPES = ("application/x-www-form-urlencoded", "")


def is_ollama_path(path: str) -> bool:
    """The Ollama API's routes (app/server/ollama.py): errors in its shape, curl's form type read as JSON."""
    return path.startswith("/api/") and not path.startswith("/api/v1/")


def _with_json_type(headers: Any) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    return [*kept, (b"content-type", b"application/json")]


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case, the scheme's default port left out.
    Raises ValueError for anything that is not such an origin."""
    origin = origin.strip().lower().rstrip("/")
    if origin in ("*", "null"):
        return origin
    u = urlsplit(origin)
    if not u.scheme or not u.hostname or u.path or u.query or u.fragment or u.username:
        raise ValueError(origin)
    port = u.port  # raises ValueError when malformed
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    if port is None or port == _DEFAULT_PORTS.get(u.scheme):
        return f"{u.scheme}://{host}"
    return f"{u.scheme}://{host}:{port}"


@dataclass(frozen=True)
class SecurityPolicy:
    """What the middleware lets through. Build it with ``SecurityPolicy.build`` to validate the lists."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # any of them authenticates
    allowed_hosts: frozenset[str] = frozenset()  # names; "*.example.com" for subdomains; "*" for any
    allowed_origins: frozenset[str] = frozenset()  # normalized origins; "*" for any
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    cache_isolation: CacheIsolation = "shared"  # "per-key": each key has its own prefix cache
    # sha256 digests of the keys (compared instead of the keys: constant time whatever their length)
    key_digests: tuple[bytes, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        digests = tuple(hashlib.sha256(k.encode()).digest() for k in self.api_keys)
        object.__setattr__(self, "key_digests", digests)

    @property
    def api_key(self) -> str | None:
        """The first API key, or None when the server has none."""
        return self.api_keys[0] if self.api_keys else None

    @classmethod
    def build(
        cls,
        *,
        api_key: str | None = None,
        api_keys: list[str] | tuple[str, ...] = (),
        allowed_hosts: list[str] | tuple[str, ...] = (),
        allowed_origins: list[str] | tuple[str, ...] = (),
        max_body_mb: float = DEFAULT_MAX_BODY_MB,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        cache_isolation: str = "shared",
    ) -> SecurityPolicy:
        """``api_key`` and ``api_keys`` together: every key that authenticates (empty ones are
        dropped). Raises ValueError, naming the bad entry, for a malformed host or origin, and for a
        cache isolation that is unknown or, as ``per-key``, has no key to isolate by."""
        keys = tuple(dict.fromkeys(k for k in ([api_key] if api_key else []) + list(api_keys) if k))
        if cache_isolation not in CACHE_ISOLATION_MODES:
            raise ValueError(
                f"--cache-isolation must be one of {', '.join(CACHE_ISOLATION_MODES)}, got {cache_isolation!r}"
            )
        if cache_isolation == "per-key" and not keys:
            raise ValueError(
                "--cache-isolation per-key needs API keys to isolate by (--api-key-file, DUET_API_KEY or --api-key)"
            )
        hosts = set()
        for h in allowed_hosts:
            h = h.strip().lower().rstrip(".")
            if not h:
                continue
            bare = h[2:] if h.startswith("*.") else h
            if h != "*" and (not bare or any(c in bare for c in "/:*@ ")):
                raise ValueError(f"--allowed-hosts: {h!r} is not a host name (example: myhost.lan or *.lan)")
            hosts.add(h)
        origins = set()
        for o in allowed_origins:
            if not o.strip():
                continue
            try:
                origins.add(normalize_origin(o))
            except ValueError:
                raise ValueError(
                    f"--allowed-origins: {o!r} is not an origin (example: http://localhost:3000)"
                ) from None
        if max_body_mb <= 0:
            raise ValueError(f"--max-body-mb must be positive, got {max_body_mb}")
        return cls(
            api_keys=keys,
            allowed_hosts=frozenset(hosts),
            allowed_origins=frozenset(origins),
            max_body_bytes=int(max_body_mb * 2**20),
            body_timeout_s=body_timeout_s,
            cache_isolation=cache_isolation,
        )

    def host_allowed(self, name: str) -> bool:
        if is_ip(name) or name == "localhost" or name.endswith(".localhost"):
            return True
        if "*" in self.allowed_hosts or name in self.allowed_hosts:
            return True
        return any(h.startswith("*.") and name.endswith(h[1:]) for h in self.allowed_hosts)

    def origin_listed(self, origin: str) -> bool:
        """Explicitly allowed (``--allowed-origins``): these get CORS headers."""
        if "*" in self.allowed_origins:
            return True
        try:
            return normalize_origin(origin) in self.allowed_origins
        except ValueError:
            return False

    def origin_allowed(
        self, origin: str, scheme: str, host: tuple[str, int | None], server_port: int | None
    ) -> bool:
        """``host``: the request's (already allowed) Host; ``server_port``: the port it came in on."""
        if self.origin_listed(origin):
            return True
        try:
            o = urlsplit(normalize_origin(origin))
            o_port = o.port or _DEFAULT_PORTS.get(o.scheme)
        except ValueError:
            return False
        if o.scheme not in _DEFAULT_PORTS or not o.hostname:
            return False
        name, port = host
        if o.hostname == name and o_port == (port or _DEFAULT_PORTS.get(scheme)):
            return True  # same origin: a page this server served
        return is_loopback_name(o.hostname) and server_port is not None and o_port == server_port

    def authenticate(self, authorization: str) -> str | None:
        """The id (``key_id``) of the key an ``Authorization`` header carries, or None when it
        carries none of this server's keys. Every key is compared, in constant time, whichever
        matches: the time taken does not tell how many keys there are nor which one was close."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not self.key_digests:
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        match = -1
        for i, d in enumerate(self.key_digests):
            if hmac.compare_digest(digest, d):
                match = i
        return key_id(self.api_keys[match]) if match >= 0 else None

    def authorized(self, authorization: str) -> bool:
        return not self.api_keys or self.authenticate(authorization) is not None


def _error_body(status: int, message: str, type_: str, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class SecurityMiddleware:
    """Pure ASGI: checks a request and reads its body before the app sees it (see the module doc)."""

    def __init__(self, app: ASGIApp, policy: SecurityPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        p = self.policy
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        origin = headers.get("origin")
        cors = (
            [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if (origin is not None and p.origin_listed(origin))
            else []
        )

        async def refuse(status: int, message: str, type_: str, code: str | None, extra=()) -> None:
            body = _error_body(status, message, type_, code)
            if is_anthropic_path(scope.get("path", "")):
                body = json.dumps(anthropic_error_body(status, message)).encode()
            elif is_ollama_path(scope.get("path", "")):  # Ollama's shape: {"error": "..."}
                body = json.dumps({"error": message}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        *cors,
                        *extra,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})

        # 1. Host
        host_header = headers.get("host")
        host: tuple[str, int | None] = ("", None)
        if host_header is not None:  # HTTP/1.0 clients may omit it; browsers never do
            try:
                host = split_host(host_header)
            except ValueError:
                host = ("", None)
            if not host[0] or not p.host_allowed(host[0]):
                await refuse(
                    403,
                    f"Host {host_header!r} is not allowed; start the server with --allowed-hosts to serve it",
                    "permission_error",
                    "host_not_allowed",
                )
                return
        # 2. Origin
        server = scope.get("server") or (None, None)
        if origin is not None and not p.origin_allowed(origin, scope.get("scheme", "http"), host, server[1]):
            await refuse(
                403,
                f"Origin {origin!r} is not allowed; start the server with --allowed-origins to serve it",
                "permission_error",
                "origin_not_allowed",
            )
            return
        method = scope.get("method", "GET")
        if method == "OPTIONS" and cors and "access-control-request-method" in headers:
            await self.app(scope, receive, send)  # a CORS preflight: the CORS middleware answers it
            return
        # 3. API key
        # Anthropic's clients send the key as x-api-key; the others as a bearer token
        credential = headers.get("authorization") or (
            "Bearer " + headers["x-api-key"] if "x-api-key" in headers else ""
        )
        kid = p.authenticate(credential) if p.api_keys else None
        if kid is not None:
            state = scope.setdefault("state", {})
            state[KEY_ID_STATE] = kid
            if p.cache_isolation == "per-key":
                state[CACHE_SCOPE_STATE] = kid
        elif p.api_keys and scope.get("path") not in OPEN_PATHS:
            await refuse(
                401,
                "Incorrect API key provided."
                if credential
                else "Missing API key: send Authorization: Bearer KEY (or x-api-key: KEY).",
                "invalid_request_error",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        # 4. Body size by Content-Length
        length = headers.get("content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > p.max_body_bytes):
            await self._too_large(refuse)
            return
        has_body = (length is not None and int(length) > 0) or "transfer-encoding" in headers
        if method in _BODYLESS_METHODS and not has_body:
            await self.app(scope, receive, send)
            return
        # 5. Content type
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype in _CURL_TYPES and origin is None and is_ollama_path(scope.get("path", "")):
            # Ollama's own examples are `curl URL -d '{...}'`, sent as a form: from a client that is
            # no browser (no Origin; browsers send one on every POST), the body is read as the JSON it is
            ctype = "application/json"
            scope = {**scope, "headers": _with_json_type(scope.get("headers", ()))}
        if has_body or method not in _BODYLESS_METHODS:
            if not (
                ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))
            ):
                await refuse(
                    415,
                    f"Content-Type must be application/json, got {ctype or 'none'!r}",
                    "invalid_request_error",
                    "unsupported_media_type",
                )
                return
        # 4'. The body itself, incrementally, within the limit and the deadline
        body = await self._read_body(receive)
        if body is None:
            return  # the client went away
        if body == 413:
            await self._too_large(refuse)
            return
        if body == 408:
            await refuse(
                408,
                f"The request body did not arrive within {p.body_timeout_s:g} s",
                "invalid_request_error",
                "request_timeout",
                [(b"connection", b"close")],
            )
            return
        assert isinstance(body, bytes)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, refuse) -> None:
        mb = self.policy.max_body_bytes / 2**20
        await refuse(
            413,
            f"The request body is larger than this server accepts ({mb:g} MB; see --max-body-mb)",
            "invalid_request_error",
            "request_too_large",
        )

    async def _read_body(self, receive: Receive) -> bytes | int | None:
        """The whole body; 413 past the limit, 408 past the deadline, None if the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return 408
            try:
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                return 408
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.policy.max_body_bytes:
                return 413
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
