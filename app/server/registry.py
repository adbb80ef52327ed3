"""The models one ``duet serve`` can answer for, and the engines loaded for them.

Each loaded model is its own ``Engine`` (built through ``app.launch.build_engine`` by the loader the
server passes in) wrapped in its own ``ServerState``. A request names a model; ``acquire`` finds it
(a 404 that lists what is available otherwise), loads it on first use (one load at a time; requests
for a model that is loading wait for that load), and hands out a ``Lease``. While a lease is held or
its engine has requests running or waiting, a model is *busy* and is never unloaded.

Unloading, as Ollama, LM Studio and llama.cpp's router do it:
- **idle TTL**: a model idle for its keep-alive (``--keep-alive``, default 5 minutes; per request
  Ollama's ``keep_alive`` or LM Studio's ``ttl``) is unloaded by the reaper; a negative keep-alive
  keeps it loaded, 0 unloads it as soon as it is idle;
- **room**: before a load, while ``max_loaded`` models are loaded or the loaded models' footprints
  plus the new one's would pass ``memory_limit``, the least recently used idle model is unloaded.
  When every loaded model is busy the load waits for one to go idle.

A model that fails to load is a clear error for the requests that asked for it; the others keep
being served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_engine.huge_pages import release_huge_pages
from mlx_engine.mlx_tree import flat_parameters

from .common import ServerState
from .errors import APIError
from .keep_alive import parse_keep_alive

log = logging.getLogger("duet.server")

DEFAULT_KEEP_ALIVE = 300.0  # seconds, as Ollama's OLLAMA_KEEP_ALIVE default (5m)
DEFAULT_MAX_LOADED = 3  # as Ollama's OLLAMA_MAX_LOADED_MODELS
REAP_INTERVAL = 1.0
RESCAN_INTERVAL = 2.0  # seconds between two looks for models pulled while the server runs


@dataclass(frozen=True)
class ServedModel:
    """A model the server may load: ``name`` is the id clients use (``/v1/models``), ``aliases``
    other names accepted for it, ``spec`` what ``build_engine`` takes (a path or the bundled model's
    None), ``info`` what is known without loading it (format, quant, size_bytes, context_length,
    path, family), and ``pinned``: loaded at start and never unloaded (``--model`` given once, as a
    single-model server always was)."""

    name: str
    spec: str | None
    aliases: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)
    pinned: bool = False

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([self.name, *[a for a in self.aliases if a]]))

    @property
    def size_bytes(self) -> int:
        return int(self.info.get("size_bytes") or 0)


@dataclass
class Loaded:
    """A loaded model: its state, when it was loaded and last used, its keep-alive (seconds; None:
    for ever), the leases out and its footprint (weights + KV budget, bytes)."""

    model: ServedModel
    state: ServerState
    loaded_at: float  # wall clock (time.time) for the API
    last_used: float  # the registry's clock
    keep_alive: float | None
    footprint: int
    leases: int = 0

    @property
    def busy(self) -> bool:
        """Leases out, or requests running or waiting in its engine."""
        if self.leases > 0:
            return True
        s = self.state.engine.stats()
        return s.running + s.waiting > 0


class Lease:
    """A model held for one request: ``state`` to serve it with; ``release()`` once the request has
    been submitted to the engine (from then on the engine's own counts keep the model busy)."""

    def __init__(self, registry: ModelRegistry, loaded: Loaded):
        self.registry, self.loaded, self._held = registry, loaded, True

    @property
    def state(self) -> ServerState:
        return self.loaded.state

    def release(self) -> None:
        if self._held:
            self._held = False
            self.registry._release(self.loaded)


Loader = Callable[[ServedModel], ServerState]


def keep_alive_seconds(value: Any, param: str = "keep_alive") -> float | None:
    """``parse_keep_alive`` for a request field: a bad value is a 400 naming ``param``."""
    try:
        return parse_keep_alive(value, param)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


class ModelRegistry:
    """The servable models and the loaded ones (see the module doc). Used from the event loop only;
    loads run in a worker thread."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        loader: Loader,
        *,
        max_loaded: int = DEFAULT_MAX_LOADED,
        keep_alive: float | None = DEFAULT_KEEP_ALIVE,
        memory_limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        discover: Callable[[], Sequence[ServedModel]] | None = None,
    ):
        """``discover``: lists the models there are now (``duet serve`` with no --model: the local
        models); asked again, in a worker thread, at most every ``RESCAN_INTERVAL`` seconds before a
        request is served (``refresh``), so a model pulled while the server runs is servable."""
        if max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")
        self._models: list[ServedModel] = []
        self._by_id: dict[str, ServedModel] = {}
        for m in models:
            self.add(m)
        self.discover, self._scanned = discover, clock()
        self.loader, self.max_loaded, self.keep_alive = loader, max_loaded, keep_alive
        self.memory_limit, self.clock = memory_limit, clock
        self._loaded: dict[str, Loaded] = {}
        self._loading: dict[str, asyncio.Task[Loaded]] = {}
        self._load_lock: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None  # set when a model goes idle or unloads
        self._reaper: asyncio.Task[None] | None = None
        # requests waiting on a load: busy too (a model that has just loaded is not unloaded for room
        # before its requests take their leases)
        self._waiting: dict[str, int] = {}
        self.waiting_for_room = 0  # loads waiting for a loaded model to go idle
        self._closed = False
        self.failures: dict[str, str] = {}  # the last load error of each model that failed
        self.embedding_ids: tuple[str, ...] = ()  # the embedding model's names: a 400 for chat

    # --- what there is ----------------------------------------------------------------------------
    def add(self, model: ServedModel) -> None:
        """Make ``model`` servable (a model pulled while the server runs); a known name is kept."""
        if model.name in self._by_id:
            return
        self._models.append(model)
        for i in model.ids:
            self._by_id.setdefault(i, model)

    async def remove(self, name: str) -> None:
        """Stop serving the model ``name`` (its files are being deleted), unloading it: a 409 while
        it loads or answers requests. No request finds it from the moment this is called."""
        model = self._by_id.get(name)
        if model is None:
            return
        loaded = self._loaded.get(model.name)
        if model.name in self._loading or (loaded is not None and self.busy(loaded)):
            raise APIError(409, f"`{model.name}` is loading or answering requests; try again when it is idle")
        self._models.remove(model)
        self._by_id = {i: m for i, m in self._by_id.items() if m is not model}
        if loaded is not None:
            await self._unload(loaded, "removed")

    async def refresh(self) -> None:
        """Ask ``discover`` for the models there are now, in a worker thread (it reads the cache and
        GGUF headers), at most every RESCAN_INTERVAL seconds."""
        if self.discover is None or self.clock() - self._scanned < RESCAN_INTERVAL:
            return
        self._scanned = self.clock()
        try:
            found = await asyncio.to_thread(self.discover)
        except Exception as e:  # a cache that cannot be read now: what is known stays servable
            log.warning("listing the local models failed: %s", e)
            return
        for model in found:
            self.add(model)

    def available(self) -> list[ServedModel]:
        return list(self._models)

    def lookup(self, name: str | None) -> ServedModel | None:
        return self._by_id.get(name or "")

    def require(self, name: str | None) -> ServedModel:
        """The model named, or a 404 that lists the available ones."""
        model = self.lookup(name)
        if model is None and name in self.embedding_ids:
            chat = self._models[0].name if self._models else "a chat model"
            raise APIError(
                400,
                f"The model `{name}` is an embedding model: it serves /v1/embeddings only. Chat with `{chat}`.",
                param="model",
                code="model_not_chat",
            )
        if model is None:
            names = ", ".join(f"`{m.name}`" for m in self._models) or "none"
            raise APIError(
                404,
                f"The model `{name}` does not exist. Available models: {names}.",
                param="model",
                code="model_not_found",
            )
        return model

    def loaded(self) -> list[Loaded]:
        return list(self._loaded.values())

    def get_loaded(self, name: str | None) -> Loaded | None:
        model = self.lookup(name)
        return self._loaded.get(model.name) if model is not None else None

    def is_loading(self, name: str) -> bool:
        model = self.lookup(name)
        return model is not None and model.name in self._loading

    def busy(self, loaded: Loaded) -> bool:
        """Leases out, requests waiting on its load, or requests in its engine."""
        return self._waiting.get(loaded.model.name, 0) > 0 or loaded.busy

    def expires_in(self, loaded: Loaded) -> float | None:
        """Seconds until an idle model is unloaded (None: never; a busy one counts from now)."""
        if loaded.model.pinned or loaded.keep_alive is None:
            return None
        idle = 0.0 if self.busy(loaded) else self.clock() - loaded.last_used
        return max(0.0, loaded.keep_alive - idle)

    # --- using a model ----------------------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: float | None | object = ...) -> Lease:
        """Hold the named model for a request, loading it first if it is not loaded. ``keep_alive``
        (seconds, None: for ever; left out: the server's default, as each Ollama request sets it)
        sets how long it stays loaded once idle."""
        model = self.require(name)
        loaded = self._loaded.get(model.name)
        if loaded is None:
            self._waiting[model.name] = self._waiting.get(model.name, 0) + 1
            try:
                loaded = await self._load(model)
            finally:  # the lease below is taken in the same step: never neither counted
                self._waiting[model.name] -= 1
                if not self._waiting[model.name]:
                    del self._waiting[model.name]
        loaded.leases += 1
        loaded.last_used = self.clock()
        if not model.pinned:
            loaded.keep_alive = self.keep_alive if keep_alive is ... else keep_alive  # type: ignore[assignment]
        return Lease(self, loaded)

    async def load(self, name: str, keep_alive: float | None | object = ...) -> Loaded:
        """Load the named model now (the load endpoints); a loaded one just gets its keep-alive."""
        lease = await self.acquire(name, keep_alive)
        lease.release()
        return lease.loaded

    async def unload(self, name: str) -> str:
        """Unload the named model: "unloaded", "not_loaded", or "pending" for a busy one (unloaded
        when its requests end: its keep-alive becomes 0). A pinned model cannot be unloaded (409)."""
        model = self.require(name)
        loaded = self._loaded.get(model.name)
        if loaded is None:
            return "not_loaded"
        if model.pinned:
            raise APIError(
                409,
                f"`{model.name}` was loaded with --model and stays loaded for the server's life",
                param="model",
                code="model_pinned",
            )
        if self.busy(loaded):
            loaded.keep_alive = 0.0
            return "pending"
        await self._unload(loaded, "unload asked")
        return "unloaded"

    def _release(self, loaded: Loaded) -> None:
        loaded.leases -= 1
        loaded.last_used = self.clock()
        self._signal()

    # --- loading and unloading --------------------------------------------------------------------
    def _events(self) -> tuple[asyncio.Lock, asyncio.Event]:
        if self._load_lock is None or self._changed is None:
            self._load_lock, self._changed = asyncio.Lock(), asyncio.Event()
        return self._load_lock, self._changed

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _load(self, model: ServedModel) -> Loaded:
        task = self._loading.get(model.name)
        if task is None:
            task = asyncio.ensure_future(self._load_now(model))
            self._loading[model.name] = task
            task.add_done_callback(lambda _t: self._loading.pop(model.name, None))
        # a waiter that goes away (its client hung up) leaves the load running for the others
        return await asyncio.shield(task)

    async def _load_now(self, model: ServedModel) -> Loaded:
        lock, _ = self._events()
        async with lock:  # one load at a time: the room check sees every model that holds memory
            if model.name in self._loaded:
                return self._loaded[model.name]
            await self._make_room(model)
            log.info("loading model %s", model.name)
            t0 = time.perf_counter()
            try:
                state = await asyncio.to_thread(self.loader, model)
                if self._closed:  # the server stopped while this loaded
                    await asyncio.to_thread(state.engine.shutdown)
                    raise APIError(503, "the server is shutting down", type="server_error")
            except APIError:
                raise
            except Exception as e:
                self.failures[model.name] = str(e)
                log.error("model %s failed to load: %s", model.name, e)
                raise APIError(
                    500,
                    f"The model `{model.name}` failed to load: {e}",
                    type="server_error",
                    param="model",
                    code="model_load_failed",
                ) from None
            self.failures.pop(model.name, None)
            loaded = self.adopt(model, state)
            log.info("loaded model %s in %.1f s", model.name, time.perf_counter() - t0)
            self._ensure_reaper()
            return loaded

    def _over(self, incoming: int) -> bool:
        if len(self._loaded) >= self.max_loaded:
            return True
        if self.memory_limit is None or not self._loaded:
            return False
        held = sum(m.footprint for m in self._loaded.values())
        return held + incoming > self.memory_limit

    async def _make_room(self, model: ServedModel) -> None:
        """Unload least recently used idle models until ``model`` fits; wait while all are busy."""
        _, changed = self._events()
        while self._over(model.size_bytes):
            idle = [m for m in self._loaded.values() if not m.model.pinned and not self.busy(m)]
            if idle:
                victim = min(idle, key=lambda m: m.last_used)
                await self._unload(victim, f"room for {model.name}")
                continue
            if not any(not m.model.pinned for m in self._loaded.values()):
                raise APIError(
                    503,
                    f"cannot load `{model.name}`: the models loaded with --model fill the limit "
                    f"(--max-loaded {self.max_loaded}"
                    + (f", {self.memory_limit / 2**30:.1f} GiB" if self.memory_limit else "")
                    + ")",
                    type="server_error",
                    code="model_capacity",
                )
            changed.clear()
            self.waiting_for_room += 1
            try:  # a busy model goes idle when its requests end; look again at least every second
                await asyncio.wait_for(changed.wait(), REAP_INTERVAL)
            except TimeoutError:
                pass
            finally:
                self.waiting_for_room -= 1

    async def _unload(self, loaded: Loaded, why: str) -> None:
        if self._loaded.get(loaded.model.name) is not loaded:
            return
        del self._loaded[loaded.model.name]
        log.info("unloading model %s (%s)", loaded.model.name, why)
        await asyncio.to_thread(loaded.state.engine.shutdown)
        # its buffers' heap ranges back to small pages (mlx_engine/huge_pages.py)
        # (off the event loop: it first waits for a collapse still moving them, seconds for a big model)
        weights = [v for _, v in flat_parameters(loaded.state.engine.loaded.model)]
        await asyncio.to_thread(release_huge_pages, weights)
        self._signal()

    # --- the reaper -------------------------------------------------------------------------------
    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def reap(self) -> list[str]:
        """Unload every idle model past its keep-alive; returns their names."""
        now, gone = self.clock(), []
        for loaded in list(self._loaded.values()):
            if loaded.model.pinned or loaded.keep_alive is None:
                continue
            if self.busy(loaded):
                loaded.last_used = now  # idle time counts from the end of its last request
                continue
            if now - loaded.last_used >= loaded.keep_alive:
                await self._unload(loaded, f"idle for {loaded.keep_alive:g} s")
                gone.append(loaded.model.name)
        return gone

    async def _reap_forever(self) -> None:
        while self._loaded:
            _, changed = self._events()
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), REAP_INTERVAL)
            except TimeoutError:
                pass
            try:
                await self.reap()
            except Exception:  # never let one failed shutdown stop the reaping
                log.exception("unloading an idle model failed")

    def adopt(self, model: ServedModel, state: ServerState) -> Loaded:
        """Register a loaded model's state (also an engine loaded before the event loop runs: the
        pinned ``--model``)."""
        loaded = Loaded(
            model,
            state,
            loaded_at=time.time(),
            last_used=self.clock(),
            keep_alive=None if model.pinned else self.keep_alive,
            footprint=footprint(state),
        )
        self._loaded[model.name] = loaded
        return loaded

    def stop_reaping(self) -> None:
        """Cancel the reaper, from any thread (on its event loop's own)."""
        task = self._reaper
        if task is None or task.done():
            return
        loop = task.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task.cancel()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)

    def shutdown(self) -> None:
        """Stop the reaper and every loaded engine (the server is stopping; any thread). A load still
        running shuts its engine down when it ends."""
        self._closed = True
        self.stop_reaping()
        for loaded in list(self._loaded.values()):
            loaded.state.engine.shutdown()


def footprint(state: ServerState) -> int:
    """What a loaded model holds: its weights and its KV cache's budget, in bytes."""
    engine = state.engine
    s = engine.stats()
    return int(engine.loaded.weight_bytes) + s.kv_blocks_total * s.kv_block_bytes
