"""A local Hugging Face hub for tests: the routes huggingface_hub 2.x calls, on 127.0.0.1.

    with HubServer({"owner/repo-GGUF": {"m.Q4_1.gguf": path_or_bytes}}) as hub:
        env = {"HF_ENDPOINT": hub.url, ...}

Routes (read off huggingface_hub's hf_api.py / file_download.py):

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: model info, ``sha`` and
  ``siblings`` (``?blobs=true``: with ``size``, ``blobId`` and ``lfs``)
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``?recursive=``): files with size, oid and lfs
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: a small file is answered here (``ETag``,
  ``X-Repo-Commit``); an LFS file (``.gguf``, ``.safetensors``) is a 302 to a second server, the
  "CDN" (another origin, as the real hub's is), with ``X-Linked-Etag`` (its sha256) and
  ``X-Linked-Size``; the CDN honours ``Range`` (206)
- errors: ``404`` + ``X-Error-Code: RepoNotFound`` for an unknown repo, ``401`` + ``GatedRepo``
  for a repo in ``gated``; ``stall_api``: the API waits (until ``release``) before answering

Faults on a file's body (the CDN): ``drop_after[file] = n`` sends n bytes and closes the connection;
``stall_after[file] = n`` sends n bytes and then waits until ``release()``; ``sent_event[file]`` is
set when the n bytes are out. Every request is recorded in ``requests`` (method, path, headers).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass
class _File:
    data: bytes | Path

    def read(self) -> bytes:
        return self.data.read_bytes() if isinstance(self.data, Path) else self.data

    @property
    def size(self) -> int:
        return self.data.stat().st_size if isinstance(self.data, Path) else len(self.data)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]


class HubServer:
    """The hub and its CDN, each a ThreadingHTTPServer on 127.0.0.1, port 0."""

    def __init__(self, repos: Mapping[str, Mapping[str, bytes | Path]], gated: tuple[str, ...] = ()):
        self.repos = {r: {name: _File(d) for name, d in files.items()} for r, files in repos.items()}
        self.gated = set(gated)
        self.drop_after: dict[str, int] = {}
        self.stall_after: dict[str, int] = {}
        self.sent_event: dict[str, threading.Event] = {}
        self.stall_api = False
        self.released = threading.Event()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._sha: dict[tuple[str, str], str] = {}
        self._by_sha: dict[str, _File] = {}
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=False))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=True))
        for s in (self.hub, self.cdn):
            s.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        self._threads = [
            threading.Thread(target=s.serve_forever, args=(0.02,), daemon=True) for s in (self.hub, self.cdn)
        ]

    def __enter__(self) -> HubServer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    def release(self) -> None:
        """Let stalled requests go on (and stop stalling)."""
        self.stall_after.clear()
        self.stall_api = False
        self.released.set()

    def record(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        with self._lock:
            self.requests.append(Request(method, path, {k.lower(): v for k, v in headers.items()}))

    def ranges(self, file: str) -> list[str]:
        """The Range headers of the GETs of ``file``'s body ("" for none)."""
        sha = next((s for (_, f), s in self._sha.items() if f == file), None)
        return [
            r.headers.get("range", "") for r in self.requests if r.method == "GET" and r.path == f"/cdn/{sha}"
        ]

    def sha256(self, repo: str, file: str) -> str:
        key = (repo, file)
        if key not in self._sha:
            f = self.repos[repo][file]
            self._sha[key] = hashlib.sha256(f.read()).hexdigest()
            self._by_sha[self._sha[key]] = f
        return self._sha[key]

    def is_lfs(self, file: str) -> bool:
        return file.endswith(_LFS_SUFFIXES)

    def git_oid(self, repo: str, file: str) -> str:
        return hashlib.sha1(f"{repo}/{file}".encode()).hexdigest()

    def file_entry(self, repo: str, name: str) -> dict:
        f = self.repos[repo][name]
        entry: dict = {"type": "file", "path": name, "size": f.size, "oid": self.git_oid(repo, name)}
        if self.is_lfs(name):
            entry["lfs"] = {"oid": self.sha256(repo, name), "size": f.size, "pointerSize": 134}
        return entry

    def file_for_sha(self, sha: str) -> tuple[str, _File] | None:
        for (_, name), s in self._sha.items():
            if s == sha:
                return name, self._by_sha[sha]
        return None


def _handler(server: HubServer, cdn: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_GET(self) -> None:
            self._route("GET")

        def _send(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj: object, headers: Mapping[str, str] | None = None) -> None:
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _repo_error(self, repo: str) -> bool:
            if repo in server.gated:
                self._send(
                    401, b'{"error":"gated"}', {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"}
                )
                return True
            if repo not in server.repos:
                self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                return True
            return False

        def _route(self, method: str) -> None:
            parts = urlsplit(self.path)
            path, query = unquote(parts.path), parse_qs(parts.query)
            server.record(method, path, dict(self.headers))
            if cdn:
                return self._cdn(path)
            if server.stall_api:
                server.released.wait(60)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                return self._info(m.group(1))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            if m:
                return self._tree(
                    m.group(1), m.group(3) or "", query.get("recursive", ["false"])[0] == "true"
                )
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve(m.group(1), m.group(3))
            self._send(404, b"not found")

        def _info(self, repo: str) -> None:
            if self._repo_error(repo):
                return
            siblings = []
            for name in sorted(server.repos[repo]):
                e = server.file_entry(repo, name)
                sib: dict = {"rfilename": name, "size": e["size"], "blobId": e["oid"]}
                if "lfs" in e:
                    sib["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}
                siblings.append(sib)
            self._json(
                {
                    "id": repo,
                    "_id": repo,
                    "sha": COMMIT,
                    "private": False,
                    "gated": False,
                    "siblings": siblings,
                }
            )

        def _tree(self, repo: str, under: str, recursive: bool) -> None:
            if self._repo_error(repo):
                return
            out: list[dict] = []
            dirs: set[str] = set()
            prefix = f"{under.strip('/')}/" if under else ""
            for name in sorted(server.repos[repo]):
                if not name.startswith(prefix):
                    continue
                rest = name[len(prefix) :]
                if "/" in rest and not recursive:
                    d = prefix + rest.split("/", 1)[0]
                    if d not in dirs:
                        dirs.add(d)
                        out.append({"type": "directory", "path": d, "oid": server.git_oid(repo, d)})
                    continue
                out.append(server.file_entry(repo, name))
            self._json(out)

        def _resolve(self, repo: str, name: str) -> None:
            if self._repo_error(repo):
                return
            files = server.repos[repo]
            if name not in files:
                self._send(
                    404, b"entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
                )
                return
            f = files[name]
            if server.is_lfs(name):
                sha = server.sha256(repo, name)
                self._send(
                    302,
                    b"",
                    {
                        "Location": f"{server.cdn_url}/cdn/{sha}?name={quote(name)}",
                        "X-Repo-Commit": COMMIT,
                        "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(f.size),
                        "ETag": f'"{server.git_oid(repo, name)}"',
                    },
                )
                return
            headers = {
                "ETag": f'"{server.git_oid(repo, name)}"',
                "X-Repo-Commit": COMMIT,
                "Accept-Ranges": "bytes",
            }
            self._send(200, f.read(), headers)

        def _cdn(self, path: str) -> None:
            m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
            found = server.file_for_sha(m.group(1)) if m else None
            if found is None:
                self._send(404, b"no such blob")
                return
            name, f = found
            data = f.read()
            start = 0
            rng = self.headers.get("Range")
            if rng:
                rm = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                if rm:
                    start = int(rm.group(1))
            body = data[start:]
            self.send_response(206 if rng else 200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            drop, stall = server.drop_after.pop(name, None), server.stall_after.get(name)  # a drop: once
            cut = drop if drop is not None else stall
            if cut is not None and cut < len(body):
                self.wfile.write(body[:cut])
                self.wfile.flush()
                server.sent_event.setdefault(name, threading.Event()).set()
                if stall is not None:
                    server.released.wait(60)
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


def point_hf_at(monkeypatch, hub: HubServer, hf_home: Path) -> None:
    """In-process: huggingface_hub's settings (read once, at its import) pointed at ``hub`` and a cache
    under ``hf_home``, online. For a subprocess, ``subprocess_env`` sets the same through the environment."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def subprocess_env(hub: HubServer, hf_home: Path, **extra: str) -> dict[str, str]:
    import os

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE")
    }
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_XET="1", **extra)
    return env
