"""Ollama's model routes on ``duet serve``: ``GET /api/tags`` (every servable model), ``POST /api/show``
(what a model is, read from its files' headers: no weights are loaded), ``GET /api/ps`` (the loaded
ones, with ``expires_at``), ``POST /api/pull`` (a download from the Hugging Face hub with NDJSON
progress; the model is servable once pulled), ``DELETE /api/delete`` (a pulled model's files), the
embeddings (``POST /api/embed``, legacy ``/api/embeddings``, through the ``--embedding-model``'s
batcher) and ``GET /api/version``.

Ollama's digests are the sha256 of a model's blob; here ``digest`` is a sha256 of the model's name,
path, size and modification time: stable while the files are, without hashing gigabytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_engine import defaults
from mlx_engine.errors import DuetError, ModelNotFoundError

from .embeddings import EmbeddingBatcher, EmbeddingRequest, embeddings
from .errors import APIError, bad_request
from .metrics import ModelMetrics
from .ollama_protocol import EmbedRequest, LegacyEmbeddingsRequest, ModelRequest, ns, parse, rfc3339
from .registry import Loaded, ModelRegistry, ServedModel, keep_alive_seconds

log = logging.getLogger("duet.server")

# What /api/version reports. Ollama clients gate features on the server's version (thinking from 0.9,
# streamed tool calls from 0.8, VS Code's Ollama provider wants at least 0.6.4): 0.12.0 is recent
# enough for all of what this API implements, without claiming newer features (cloud models, web search).
OLLAMA_VERSION = "0.12.0"
FOREVER_S = 100 * 365 * 86400  # expires_at of a model that never unloads: a century ahead
NDJSON = "application/x-ndjson"
Resolver = Callable[[ModelRegistry, str | None], str]


def run_pull(spec: str, progress: Callable[[Any], None]) -> Any:
    """The download (``mlx_engine.loading.pull``): ``progress`` gets ``PullProgress`` records (status,
    file, digest, total, completed) on this thread; returns a ``PulledModel``. Tests replace this."""
    from mlx_engine.loading.pull import pull

    return pull(spec, progress=progress)


def remove_files(name: str) -> Any:
    """Delete a pulled model's files from the Hugging Face cache (``catalogue.remove_model``)."""
    from mlx_engine.loading.catalogue import remove_model

    return remove_model(name)


def describe(model: ServedModel) -> dict[str, Any]:
    """What ``duet show`` knows of a model, from its files' headers (no weights); {} when unknown."""
    from mlx_engine.loading.describe import describe_model

    try:
        return describe_model(model.spec or model.name)
    except (DuetError, OSError, ValueError) as e:
        log.debug("ollama: cannot describe %s: %s", model.name, e)
        return {}


def template_text(path: str | None) -> str | None:
    """The chat template of a model's files, read from its GGUF metadata or tokenizer config."""
    if not path:
        return None
    p = Path(path)
    try:
        if p.is_file():
            from mlx_engine.loading.gguf_file import read_gguf

            t = read_gguf(p).metadata.get("tokenizer.chat_template")
            return t if isinstance(t, str) else None
        jinja = p / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        cfg = json.loads((p / "tokenizer_config.json").read_text())
        t = cfg.get("chat_template")
        return t if isinstance(t, str) else None
    except (OSError, ValueError, DuetError):
        return None


def parameter_size(n: Any) -> str:
    if not isinstance(n, int) or n <= 0:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _format(fmt: Any) -> str:
    if fmt in ("hf_dir", "dir", "mlx", "safetensors"):
        return "safetensors"
    return str(fmt or "gguf")


class OllamaModels:
    """The routes (see the module doc); ``resolve`` maps a request's name onto a served one (a 404)."""

    def __init__(
        self,
        registry: ModelRegistry,
        batcher: EmbeddingBatcher | None,
        metrics: ModelMetrics,
        embedding_ids: tuple[str, ...],
        resolve: Resolver,
    ):
        self.registry, self.batcher, self.metrics = registry, batcher, metrics
        self.embedding_ids, self.resolve = embedding_ids, resolve
        self.started = time.time()
        self._described: dict[str, dict[str, Any]] = {}

    # --- what a model is -----------------------------------------------------------------------------
    def _path(self, model: ServedModel) -> str | None:
        path = model.info.get("path") or self._described.get(model.name, {}).get("path")
        if path:
            return str(path)
        if model.spec and Path(model.spec).expanduser().exists():
            return str(Path(model.spec).expanduser())
        return None

    def _modified(self, model: ServedModel) -> float:
        path = self._path(model)
        try:
            return Path(path).stat().st_mtime if path else self.started
        except OSError:
            return self.started

    def _digest(self, model: ServedModel) -> str:
        key = f"{model.name}\0{self._path(model)}\0{model.size_bytes}\0{self._modified(model)}"
        return hashlib.sha256(key.encode()).hexdigest()

    def _details(self, model: ServedModel) -> dict[str, Any]:
        info = {**self._described.get(model.name, {}), **{k: v for k, v in model.info.items() if v}}
        family = info.get("family") or info.get("architecture") or ""
        quant = info.get("quant") or info.get("file_type") or ""
        return {
            "parent_model": "",
            "format": _format(info.get("format")),
            "family": family,
            "families": [family] if family else None,
            "parameter_size": info.get("parameter_size") or parameter_size(info.get("parameters")),
            "quantization_level": str(quant),
        }

    def _entry(self, model: ServedModel) -> dict[str, Any]:
        return {
            "name": model.name,
            "model": model.name,
            "modified_at": rfc3339(self._modified(model)),
            "size": model.size_bytes,
            "digest": self._digest(model),
            "details": self._details(model),
        }

    def _embedding_entry(self) -> dict[str, Any] | None:
        if self.batcher is None or not self.embedding_ids:
            return None
        m = self.batcher.model
        path = Path(m.path)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0
        name = self.embedding_ids[0]
        return {
            "name": name,
            "model": name,
            "modified_at": rfc3339(path.stat().st_mtime if path.exists() else self.started),
            "size": size,
            "digest": hashlib.sha256(f"{name}\0{path}\0{size}".encode()).hexdigest(),
            "details": {
                "parent_model": "",
                "format": "safetensors",
                "family": "bert" if m.pooling != "last" else "",
                "families": None,
                "parameter_size": "",
                "quantization_level": "",
            },
        }

    async def tags(self, request: Request) -> Response:
        models = [self._entry(m) for m in self.registry.available()]
        emb = self._embedding_entry()
        if emb is not None:
            models.append(emb)
        return JSONResponse({"models": models})

    async def show(self, request: Request) -> Response:
        body: ModelRequest = parse(ModelRequest, await request.body())
        name = body.target
        emb = self._embedding_entry()
        if (
            emb is not None
            and self.batcher is not None
            and name.removesuffix(":latest") in self.embedding_ids
        ):
            m = self.batcher.model
            arch = emb["details"]["family"] or "embedding"
            return JSONResponse(
                {
                    "modelfile": f"# Modelfile generated by Duet\nFROM {m.path}\n",
                    "parameters": "",
                    "template": "",
                    "details": emb["details"],
                    "model_info": {
                        "general.architecture": arch,
                        f"{arch}.context_length": m.max_tokens,
                        f"{arch}.embedding_length": m.dim,
                    },
                    "capabilities": ["embedding"],
                    "modified_at": emb["modified_at"],
                }
            )
        model = self.registry.require(self.resolve(self.registry, name))
        if model.name not in self._described:
            self._described[model.name] = await asyncio.to_thread(describe, model)
        info = self._described[model.name]
        loaded = self.registry.get_loaded(model.name)
        template: str | None
        thinking = bool(info.get("reasoning_format"))
        if loaded is not None:
            tok = loaded.state.engine.tokenizer
            template = tok.chat_template
            thinking = bool(tok.reply_format.think or tok.reply_format.harmony)
        else:
            template = await asyncio.to_thread(template_text, self._path(model))
        details = self._details(model)
        arch = details["family"] or "unknown"
        context = info.get("context_length") or (
            loaded.state.engine.context_length if loaded is not None else None
        )
        model_info: dict[str, Any] = {"general.architecture": arch}
        if info.get("model_name"):
            model_info["general.name"] = info["model_name"]
        if info.get("parameters"):
            model_info["general.parameter_count"] = info["parameters"]
        if context:
            model_info[f"{arch}.context_length"] = context
        if info.get("vocab_size"):
            model_info[f"{arch}.vocab_size"] = info["vocab_size"]
        parameters = "\n".join(
            f"{k:<15} {v}"
            for k, v in (
                ("temperature", defaults.TEMPERATURE),
                ("top_k", defaults.TOP_K),
                ("top_p", defaults.TOP_P),
                ("min_p", defaults.MIN_P),
                ("repeat_penalty", defaults.REPETITION_PENALTY),
            )
        )
        source = self._path(model) or model.spec or model.name
        modelfile = f"# Modelfile generated by Duet\nFROM {source}\n"
        if template:
            modelfile += f'TEMPLATE """{template}"""\n'
        modelfile += "".join(f"PARAMETER {line}\n" for line in parameters.splitlines())
        capabilities = ["completion", "tools"] + (["thinking"] if thinking else [])
        return JSONResponse(
            {
                "modelfile": modelfile,
                "parameters": parameters,
                "template": template or "",
                "details": details,
                "model_info": model_info,
                "capabilities": capabilities,
                "modified_at": rfc3339(self._modified(model)),
            }
        )

    # --- what is loaded ------------------------------------------------------------------------------
    def _ps_entry(self, loaded: Loaded) -> dict[str, Any]:
        left = self.registry.expires_in(loaded)
        engine = loaded.state.engine
        on_gpu = engine.stats().backend in ("metal", "cuda")
        stats = engine.stats()
        kv_budget = stats.kv_blocks_total * stats.kv_block_bytes
        return {
            **self._entry(loaded.model),
            "size": loaded.footprint,
            "expires_at": rfc3339(time.time() + (FOREVER_S if left is None else left)),
            "size_vram": loaded.footprint if on_gpu else 0,
            "context_length": engine.context_length,
            # Duet's own: what the size is made of, and what runs (Ollama's clients ignore them)
            "weights_bytes": loaded.footprint - kv_budget,
            "kv_budget_bytes": kv_budget,
            "kv_bytes": stats.kv_bytes,
            "running": stats.running + stats.waiting,
        }

    async def ps(self, request: Request) -> Response:
        models = [self._ps_entry(m) for m in self.registry.loaded()]
        return JSONResponse({"models": models})

    # --- pull and delete -----------------------------------------------------------------------------
    async def pull(self, request: Request) -> Response:
        body: ModelRequest = parse(ModelRequest, await request.body())
        spec = body.target
        if not spec:
            raise bad_request("model is required")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        stop = threading.Event()

        def hook(p: Any) -> None:
            if stop.is_set():
                raise InterruptedError("the client went away")  # stops the pull; what is fetched stays
            if p.status == "success":
                return  # sent once the model is servable
            line: dict[str, Any] = {"status": p.status}
            if p.total is not None:
                line.update(
                    digest=f"sha256:{p.digest}" if p.digest else p.file, total=p.total, completed=p.completed
                )
            loop.call_soon_threadsafe(queue.put_nowait, line)

        task = asyncio.ensure_future(asyncio.to_thread(run_pull, spec, hook))

        async def finish() -> None:
            try:
                pulled = await task
            except DuetError as e:
                raise _pull_error(e) from None
            except Exception:
                log.exception("pulling %s failed", spec)
                raise APIError(
                    500, f"pulling {spec} failed (see the server log)", type="server_error"
                ) from None
            self._add(pulled, spec)

        if not body.stream:
            await finish()
            return JSONResponse({"status": "success"})

        async def lines() -> AsyncIterator[str]:
            try:
                while not task.done() or not queue.empty():
                    getter = asyncio.ensure_future(queue.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        continue
                    batch = [getter.result()]
                    while not queue.empty():
                        batch.append(queue.get_nowait())
                    for line in _coalesce(batch):
                        yield json.dumps(line) + "\n"
                try:
                    await finish()
                except APIError as e:
                    yield json.dumps({"error": e.message}) + "\n"
                    return
                yield json.dumps({"status": "success"}) + "\n"
            finally:
                if not task.done():  # the client left mid-pull: the next progress report stops it
                    stop.set()
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())

        return StreamingResponse(lines(), media_type=NDJSON)

    def _add(self, pulled: Any, spec: str) -> None:
        """A pulled model becomes servable (under its canonical name and the name it was pulled by)."""
        if self.registry.lookup(pulled.name) is not None:
            return
        names = (spec, f"hf.co/{pulled.name}", pulled.name.casefold())
        aliases = tuple(
            a for a in dict.fromkeys(names) if a != pulled.name and self.registry.lookup(a) is None
        )
        info = {
            "format": "gguf" if pulled.kind == "gguf" else "safetensors",
            "size_bytes": int(pulled.size),
            "path": str(pulled.path),
        }
        self.registry.add(ServedModel(pulled.name, str(pulled.path), aliases, info))

    async def delete(self, request: Request) -> Response:
        body: ModelRequest = parse(ModelRequest, await request.body())
        model = self.registry.require(self.resolve(self.registry, body.target))
        if model.spec is None or model.info.get("bundled"):
            raise bad_request(
                f"`{model.name}` is the bundled model, part of the install: it cannot be deleted"
            )
        if model.pinned:
            raise bad_request(
                f"`{model.name}` was loaded with --model for the server's life: it cannot be deleted"
            )
        await self.registry.remove(model.name)  # unloads it; no request finds it from here on
        try:
            await asyncio.to_thread(remove_files, model.name)
        except ModelNotFoundError:
            self.registry.add(model)
            raise bad_request(
                f"`{model.name}` is not a pulled model (in the Hugging Face cache): Duet deletes only those"
            ) from None
        except DuetError as e:
            self.registry.add(model)
            raise bad_request(str(e)) from None
        self._described.pop(model.name, None)
        return Response(status_code=200)

    # --- embeddings ----------------------------------------------------------------------------------
    async def _vectors(
        self, name: str, inputs: list[str], truncate: bool, dimensions: int | None
    ) -> tuple[list, int]:
        """(vectors, input tokens) through the embedding batcher (/v1/embeddings's checks and errors)."""
        name = name.removesuffix(":latest") if name.removesuffix(":latest") in self.embedding_ids else name
        payload: Any = inputs
        if self.batcher is not None and name in self.embedding_ids and truncate:
            model = self.batcher.model

            def cut() -> list[list[int]]:  # keep the last (special) token, as the model's input ends
                lists = model.tokenize(inputs)
                return [
                    ids if len(ids) <= model.max_tokens else ids[: model.max_tokens - 1] + ids[-1:]
                    for ids in lists
                ]

            payload = await asyncio.to_thread(cut)
        fields: dict[str, Any] = {"model": name, "input": payload}
        if dimensions is not None:
            fields["dimensions"] = dimensions
        try:
            req = EmbeddingRequest.model_validate(fields)
        except ValueError as e:
            raise bad_request(f"input: {e}") from None
        r = await embeddings(self.registry, self.batcher, self.metrics.embedding, self.embedding_ids, req)
        data = json.loads(bytes(r.body))
        return [d["embedding"] for d in data["data"]], int(data["usage"]["prompt_tokens"])

    async def _check_embedding_model(self, name: str, keep_alive: float | str | None) -> None:
        """A 400/404 unless ``name`` is the embedding model (the errors /v1/embeddings gives)."""
        if keep_alive is not None:
            keep_alive_seconds(keep_alive)  # checked; the embedding model stays loaded for the server's life
        if not name:
            raise bad_request("model is required")
        if self.batcher is None or name.removesuffix(":latest") not in self.embedding_ids:
            await self._vectors(name, ["x"], False, None)  # refused before anything is computed

    async def embed(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body: EmbedRequest = parse(EmbedRequest, await request.body())
        await self._check_embedding_model(body.model, body.keep_alive)
        inputs = [body.input] if isinstance(body.input, str) else list(body.input or [])
        vectors: list = []
        tokens = 0
        if any(inputs):  # none: Ollama's way to load the model, which is loaded already
            vectors, tokens = await self._vectors(body.model, inputs, body.truncate, body.dimensions)
        return JSONResponse(
            {
                "model": body.model,
                "embeddings": vectors,
                "total_duration": ns(time.perf_counter() - t0),
                "load_duration": 0,
                "prompt_eval_count": tokens,
            }
        )

    async def embeddings(self, request: Request) -> Response:
        body: LegacyEmbeddingsRequest = parse(LegacyEmbeddingsRequest, await request.body())
        await self._check_embedding_model(body.model, body.keep_alive)
        if not body.prompt:
            return JSONResponse({"embedding": []})
        vectors, _ = await self._vectors(body.model, [body.prompt], True, None)
        return JSONResponse({"embedding": vectors[0]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})


def _coalesce(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Progress lines queued faster than they were sent: the last of each run of the same status."""
    out: list[dict[str, Any]] = []
    for line in batch:
        if out and out[-1]["status"] == line["status"] and "total" in line and "total" in out[-1]:
            out[-1] = line
        else:
            out.append(line)
    return out


def _pull_error(e: DuetError) -> APIError:
    if isinstance(e, ModelNotFoundError):
        return APIError(404, str(e), code="model_not_found")
    return APIError(500, str(e), type="server_error")
