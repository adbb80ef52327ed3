"""``Engine``: the public face of the engine. One worker thread owns the model and runs the core's
steps; callers on any thread or event loop submit requests and get their events back.

    engine = Engine.load(None)                      # the bundled model
    async for ev in engine.generate(GenerationRequest(messages=[...])):
        print(ev.text, end="")

Leaving the ``async for`` early cancels the request, and its KV blocks are released before the
next step. ``shutdown()`` (or leaving ``with Engine.load(...) as engine:``) stops the worker and
waits for it; engines still running when the interpreter exits are shut down by an ``atexit``
hook. The worker blocks on its mailbox (``messages.py``) whenever no step can run.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import replace
from typing import Any

import mlx.core as mx

from cpu_kernels.spec import set_cpu_math
from mlx_engine.backend import backend_name
from mlx_engine.blas import warn_if_slow
from mlx_engine.config import EngineConfig
from mlx_engine.context_length import context_length
from mlx_engine.engine.build import engine_numerics
from mlx_engine.engine.core import EngineCore
from mlx_engine.engine.kv_transfer import Export, OnLayer
from mlx_engine.engine.messages import (
    AddSource,
    Call,
    Cancel,
    KVDone,
    KVFailed,
    KVLayer,
    Mailbox,
    MailboxSink,
    Message,
    RemoveSource,
    Shutdown,
    Submit,
    SubmitExport,
    Wake,
)
from mlx_engine.engine.outputs import NO_KEY, RequestState, flush_outbox
from mlx_engine.engine.stats import EngineStats, engine_stats, fixed_stats
from mlx_engine.errors import EngineShutDownError, QueueFullError, RequestError
from mlx_engine.huge_pages import use_huge_pages
from mlx_engine.kv_cache.kv_source import KVSource
from mlx_engine.loading.cpu_layout import use_panel_layout
from mlx_engine.loading.identity import model_fingerprint
from mlx_engine.loading.loader import LoadedModel, load_model
from mlx_engine.mlx_tree import flat_parameters
from mlx_engine.request import GenerationEvent, GenerationRequest
from mlx_engine.scheduler import Sequence
from mlx_engine.speculative.draft_model import check_same_tokenizer
from mlx_engine.tokenization.reply_memory import ReplyMemory

log = logging.getLogger("mlx_engine.engine")


# Engines whose worker may still run: shut down at interpreter exit (see Engine.shutdown).
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_live_engines):
        engine.shutdown()


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.config.validate()
        warn_if_slow(backend_name())  # once per process, with the fix
        if self.config.cpu_math is not None:
            set_cpu_math(self.config.cpu_math)  # the process's kernels: products built from now on
        self.tokenizer = loaded.tokenizer
        self.replies = ReplyMemory()  # generated ids behind reply text, for multi-turn prefix hits
        self.draft = self._load_draft()  # the draft model (speculative="draft"), else None
        for m in (loaded, self.draft):
            if m is not None:
                use_panel_layout(m.model)  # Q4_K, Q6_K layers in 16-row panels
                if backend_name() == "cpu":
                    # every weight onto 2 MiB pages (fewer TLB misses a decode step), moved by a thread
                    # of its own while the first request runs: the move costs the CPU ~3.6 s a GB, and
                    # a 3B model's cold start waited 1.8 s of 7.3 for it
                    use_huge_pages((v for _, v in flat_parameters(m.model)), background=True)
        self.model_name = loaded.name
        self.context_length = self._context_length(loaded)
        self._mailbox: Mailbox = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _live, _queued and _stopping
        self._live: set[str] = set()  # request ids submitted and not finished
        self._queued = 0  # submitted, not yet handed to the scheduler
        self._taken = 0  # handed to the scheduler since the last published snapshot
        self._snapshot: EngineStats | None = None  # the worker's state between two steps
        self._fixed_stats: dict[str, Any] | None = None
        self._stopping = False
        self._sources_closed = False
        self._core: EngineCore | None = None  # made on the worker (MLX streams are per thread)
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._worker, name="duet-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error
        _live_engines.add(self)

    @classmethod
    def load(cls, model: str | None = None, *, config: EngineConfig | None = None) -> Engine:
        """Load ``model`` (None: the bundled one) and start the engine. The options are checked
        first (``ConfigError``), so a bad option fails before anything is loaded."""
        config = config or EngineConfig()
        config.validate()
        return cls(load_model(model, weights=config.weights, huge_pages=False), config)

    def _context_length(self, loaded: LoadedModel) -> int:
        """``config.context_length`` when given (above the model's own only as far as its RoPE
        scaling reaches: ``context.py``), else the model's own."""
        return context_length(self.config.context_length, loaded.context_length, loaded.model, loaded.name)

    def _load_draft(self) -> LoadedModel | None:
        """The draft model of ``speculative="draft"``, loaded (or given loaded), checked to share the
        target's tokenizer (ConfigError otherwise)."""
        spec = self.config.draft_model
        if self.config.speculative != "draft" or spec is None:
            return None
        draft = (
            spec
            if isinstance(spec, LoadedModel)
            else load_model(spec, weights=self.config.weights, huge_pages=False)
        )
        check_same_tokenizer(self.loaded, draft)
        return draft

    # --- the core's parts, for inspection (read them on the worker: ``run_on_worker``) --------
    @property
    def core(self) -> EngineCore:
        assert self._core is not None, "the engine failed to build"
        return self._core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def pool(self):
        return self.core.pool

    @property
    def allocator(self):
        return self.core.allocator

    @property
    def runner(self):
        return self.core.runner

    @property
    def draft_pool(self):
        return self.core.draft_pool

    @property
    def disk(self):
        return self.core.disk

    @property
    def speculation(self):
        return self.core.speculation

    @property
    def kv_apply_budget(self) -> int:
        """KV bytes from sources applied per worker iteration (at least one frame always is)."""
        return self.core.kv.apply_budget

    @kv_apply_budget.setter
    def kv_apply_budget(self, value: int) -> None:
        self.core.kv.apply_budget = value

    # --- public API -------------------------------------------------------------
    def prepare_prompt(self, request: GenerationRequest) -> list[int]:
        """Prompt token ids for a request; raises RequestError for anything invalid. Blocking
        (template and tokenizer); hand the ids to ``submit``/``generate`` so they are not made
        twice."""
        return self.core.inputs.prompt_ids(request)

    def submit(
        self,
        request: GenerationRequest,
        events: asyncio.Queue,
        key: Hashable = NO_KEY,
        *,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """Start ``request``; its events are put into ``events`` (an ``asyncio.Queue`` of the
        running event loop), as ``(key, event)`` when a key is given (several requests may share
        one queue), until one with ``finished``. Raises at once (``RequestError``,
        ``ContextLengthError``, ``QueueFullError``, ``EngineShutDownError``) for a request that is
        refused. ``prompt_ids``: the request's prompt tokenized already (``prepare_prompt``).
        ``cancel(request.request_id)`` stops it."""
        if self._stopping:
            raise EngineShutDownError("the engine is shut down")
        prepared = self.core.inputs.prepare(request, prompt_ids)
        self._submit(request.request_id, Submit(RequestState.new(prepared, self.tokenizer, events, key)))

    async def generate(
        self, request: GenerationRequest, *, prompt_ids: list[int] | None = None
    ) -> AsyncIterator[GenerationEvent]:
        events: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.submit(request, events, prompt_ids=prompt_ids)
        finished = False
        try:
            while True:
                ev = await events.get()
                finished = ev.finished
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request.request_id)

    def _submit(self, request_id: str, message: Message) -> None:
        with self._lock:
            if self._stopping:
                raise EngineShutDownError("the engine is shut down")
            if request_id in self._live:
                raise RequestError(f"request id {request_id!r} is already running", "request_id")
            if len(self.scheduler.waiting) + self._queued >= self.config.max_queue:
                raise QueueFullError(f"the request queue is full ({self.config.max_queue} waiting)")
            self._live.add(request_id)
            self._queued += 1
            self._mailbox.put(message)

    def prefill_for_peer(
        self,
        tokens: list[int],
        start: int,
        chunk: int,
        on_layer: OnLayer,
        on_accept: Callable[[int], None] | None = None,
        on_done: Callable[[int, float], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        *,
        can_send: Callable[[], bool] | None = None,
        request_id: str | None = None,
        group: str | None = None,
    ) -> str:
        """Compute the KV of ``tokens[:N-1]`` for a decoder that holds ``tokens[:start]`` and
        hand out ``[start, N - 1)``, layer by layer, as it is computed. Returns the request id
        (``cancel`` it to stop). Thread-safe; raises ``RequestError``/``ContextLengthError``/
        ``QueueFullError``/``EngineShutDownError`` at once.

        Scheduled like any request (fair share of the token budget), on the prefill grid
        ``[k * chunk, (k + 1) * chunk)`` anchored at token 0 (the decoder's own chunk size: the
        KV is then bit-exact with the decoder's local prefill), from this engine's own prefix hit
        ``h``. The callbacks run on the worker thread and must not block: ``on_accept(h)`` once,
        when first admitted; ``on_layer(layer, t0, t1, parts)`` with evaluated arrays of their own
        in this engine's pool format, first for the tokens ``[start, h)`` already cached here, then
        for each computed chunk right after the layer's pool write (a range may come again after
        a preemption: the decoder's writes are idempotent); finally exactly one of
        ``on_done(tokens_computed, compute_s)`` or ``on_error(reason)`` (a cancel included).

        ``can_send`` (worker thread, must not block) is asked before each step: while it returns
        False (the sender's byte cap is reached) this export is not scheduled, and only it waits;
        call ``poke()`` when the sender has room again."""
        ids = self.core.inputs.peer_prefill(tokens, start, chunk)
        n = len(ids)
        rid = request_id or f"peer-{time.monotonic_ns()}-{id(on_layer)}"
        seq = Sequence(rid, ids[:-1], n - 1, n - 1, group=group, chunk=chunk, exact_grid=True, may_load=False)
        self._submit(rid, SubmitExport(Export(seq, start, on_layer, on_accept, on_done, on_error, can_send)))
        return rid

    def poke(self) -> None:
        """Wake the worker to schedule again (an export's ``can_send`` may have changed)."""
        self._mailbox.put(Wake())

    def cancel(self, request_id: str) -> None:
        self._mailbox.put(Cancel(request_id))

    def add_kv_source(self, source: KVSource) -> None:
        """Ask ``source`` (after the ones already there) for the KV of prompts admitted from now on."""
        self._mailbox.put(AddSource(source))

    def remove_kv_source(self, source: KVSource) -> None:
        self._mailbox.put(RemoveSource(source))

    def local_prefill_rate(self) -> float | None:
        """This engine's own prefill throughput, prompt tokens per second of step time (an
        exponential moving average over steps that prefilled at least 16 tokens; None before
        any): what a planner weighs a remote prefill against."""
        return self.core.prefill_rate

    def run_on_worker(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` on the worker thread between two steps (MLX state such as the KV pool is
        the worker's: inspect it from there) and return its result or raise its exception."""
        if threading.current_thread() is self._thread:
            return fn()
        call = Call(fn)
        with self._lock:
            if self._stopping:
                raise EngineShutDownError("the engine is shut down")
            self._mailbox.put(call)
        if not call.done.wait(timeout):
            raise TimeoutError("the engine's worker did not run the call in time")
        if call.error is not None:
            raise call.error
        return call.result

    def model_identity(self) -> str:
        """The hash of the model's weight files (``mlx_engine.loading.identity.model_fingerprint``)."""
        return model_fingerprint(self.loaded.path)

    def numerics_profile(self) -> dict[str, Any]:
        """What decides whether KV computed elsewhere for this model is bit-identical to this engine's."""
        return engine_numerics(self.config, self.loaded)

    def stats(self) -> EngineStats:
        """One consistent snapshot: the worker publishes its state between steps (before it hands
        out a step's outputs, so a caller that saw its request finish sees it gone here too), and
        submissions it has not yet published are counted as waiting."""
        with self._lock:
            snap, pending = self._snapshot, self._queued + self._taken
        assert snap is not None, "the engine failed to build"
        return replace(snap, waiting=snap.waiting + pending) if pending else snap

    def shutdown(self) -> None:
        """Stop taking requests, end running ones (finish_reason "error") and wait for the worker.

        Safe to call more than once. Requests submitted afterwards raise ``EngineShutDownError``."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._mailbox.put(Shutdown())
        if threading.current_thread() is not self._thread:
            self._thread.join()
        _live_engines.discard(self)
        with self._lock:
            closing = not self._sources_closed and self._core is not None
            sources = list(self._core.scheduler.sources) if closing and self._core is not None else []
            self._sources_closed = True
        for src in sources:
            try:
                src.close()  # e.g. a peer client's connection and threads
            except Exception as e:
                log.warning("KV source %s failed to close: %s", src.name, e)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- worker -----------------------------------------------------------------
    def _released(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)

    def _worker(self) -> None:
        try:
            self._serve()
        finally:
            # Free this thread's MLX state (its streams and its compile cache) while the thread
            # still holds the interpreter. Left to the C++ thread-exit destructors, the compile
            # cache releases Python objects after ``join()`` has returned; if the interpreter is
            # finalizing by then, the thread is killed inside a destructor: "terminate called
            # without an active exception" (SIGABRT) at exit. (MLX >= 0.31.2; older versions
            # keep one compile cache per process and need nothing here.)
            clear_streams = getattr(mx, "clear_streams", None)
            if clear_streams is not None:
                clear_streams()

    def _serve(self) -> None:
        try:
            self._core = core = EngineCore(
                self.loaded,
                self.config,
                context_length=self.context_length,
                draft=self.draft,
                replies=self.replies,
                sink=MailboxSink(self._mailbox),
                identity=self.model_identity,
                released=self._released,
            )
            for src in self.config.kv_sources:
                core.add_source(src, self)
        except BaseException as e:  # reported to the constructor
            self._init_error = e
            self._ready.set()
            return
        self._publish(core)
        self._ready.set()
        busy = False
        while True:
            # block only when nothing can change without a message: no step ran, no KV is queued
            if self._receive(core, block=not busy and not core.has_kv_backlog):
                core.stop(EngineShutDownError)
                self._publish(core)
                flush_outbox(core.outbox)
                return
            busy = core.step()  # runs after every receive too (an idle one), so one publish follows each
            self._publish(core)  # before the outputs: whoever sees a request end sees its stats
            flush_outbox(core.outbox)

    def _publish(self, core: EngineCore) -> None:
        if self._fixed_stats is None:
            self._fixed_stats = fixed_stats(self, core)
        snap = engine_stats(self._fixed_stats, core)
        with self._lock:
            self._snapshot, self._taken = snap, 0

    def _receive(self, core: EngineCore, block: bool) -> bool:
        """Handle what is in the mailbox (waiting for a first message when ``block``); KV
        messages are queued in order for the core. True once a shutdown was received."""
        msgs: list[Message] = [self._mailbox.get()] if block else []
        while True:
            try:
                msgs.append(self._mailbox.get_nowait())
            except queue.Empty:
                break
        stop = False
        for m in msgs:
            if isinstance(m, KVLayer | KVDone | KVFailed):
                core.kv.backlog.append(m)
            elif isinstance(m, Submit | SubmitExport):
                with self._lock:
                    self._queued -= 1
                    self._taken += 1
                if isinstance(m, Submit):
                    core.add(m.state)
                else:
                    core.add_export(m.export)
            elif isinstance(m, Cancel):
                core.cancel(m.request_id)
            elif isinstance(m, AddSource):
                try:
                    core.add_source(m.source, self)
                except Exception as e:
                    log.warning("KV source %s failed to attach: %s", m.source.name, e)
            elif isinstance(m, RemoveSource):
                core.remove_source(m.source)
            elif isinstance(m, Call):
                try:
                    m.result = m.fn()
                except BaseException as e:  # handed to the caller
                    m.error = e
                self._publish(core)  # what the call changed shows in stats() once it returns
                m.done.set()
            elif isinstance(m, Shutdown):
                stop = True
        return stop
