"""The asyncio-facing Engine: one worker thread owns the model and serves every caller.

    engine = Engine.load(None)                      # the bundled model
    async for ev in engine.generate(GenerationRequest(messages=[...])):
        print(ev.text, end="")

Callers submit requests from any event loop; the worker runs scheduler steps
(continuous batching, chunked prefill, paged KV, prefix cache) and pushes events back to
each caller's loop. Leaving the ``async for`` early cancels the request, and its KV
blocks are released before the next step.

``shutdown()`` (or leaving ``with Engine.load(...) as engine:``) stops the worker and waits for
it; engines still running when the interpreter exits are shut down by an ``atexit`` hook.

The worker blocks on a typed mailbox (``Submit``, ``Cancel``, ``KVLayer``, ``KVDone``,
``KVFailed``, ``Shutdown``, ...) whenever no step can run. KV that arrives from a ``KVSource``
(the disk tier, a remote prefill peer; ``kv_source.py``) is posted there by the source's own
thread and applied at the top of a worker iteration, up to ``kv_apply_budget`` bytes per
iteration (so other sequences' inter-token latency stays bounded while a load arrives), with the
touched pool arrays evaluated once. ``prefill_for_peer`` is the other direction: this engine
computes a prompt for a decoder elsewhere and hands each layer's new KV out as it is written.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.backend import backend_name, total_memory_bytes
from mlx_engine.blas import active_blas, warn_if_slow
from mlx_engine.config import EngineConfig
from mlx_engine.draft_model import DraftModelProposer, check_same_tokenizer, output_rows
from mlx_engine.errors import (
    ConfigError,
    ContextLengthError,
    DuetError,
    EngineShutDownError,
    QueueFullError,
    RequestError,
)
from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.kv_source import KVParts, KVSource
from mlx_engine.kv_cache.paged_attention import LayerExport
from mlx_engine.kv_cache.prefix_disk import PrefixDiskTier
from mlx_engine.loading.identity import model_fingerprint, numerics_profile
from mlx_engine.loading.loader import LoadedModel, load_model
from mlx_engine.model_runner import ModelRunner, Row
from mlx_engine.request import GenerationEvent, GenerationRequest, TokenLogprob, Usage
from mlx_engine.sampling.sampler import SamplerRow, SeedState, make_rng, sample
from mlx_engine.scheduler import RUNNING, Scheduler, SchedulerConfig, Sequence, StartLoad, Step
from mlx_engine.speculative import NgramProposer, SpeculationPolicy
from mlx_engine.tokenization.detokenizer import StreamingDetokenizer
from mlx_engine.tokenization.reply_memory import ReplyMemory
from mlx_engine.tokenization.stop_strings import StopMatcher

__all__ = ["Engine", "EngineConfig", "EngineStats", "QueueFullError", "RequestError"]

GiB = 2**30
log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    model: str
    backend: str
    blas: str
    weight_format: str
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_bytes: int
    kv_bits: int | None
    kv_format: str  # what a KV element is stored as: "float16", "8-bit", ...
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    loading: int = 0  # sequences whose KV is arriving from a KV source
    kv_loads: int = 0  # loads started (disk and remote)
    kv_load_failures: int = 0  # loads that ended early (their landed prefix was kept)
    kv_bytes_loaded: int = 0  # KV bytes applied from loads
    remote_prefills: int = 0  # requests that got prompt KV from a remote source
    kv_frames_dropped: int = 0  # arriving layer ranges of dead loads (cancelled, failed, finished)
    # one KV block, every layer (and a draft model's): kv_blocks_total of them is the budget
    kv_block_bytes: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(eq=False)
class _Active:
    req: GenerationRequest
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detok: StreamingDetokenizer
    stopper: StopMatcher
    rng: SeedState
    outbox: dict
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    done: bool = False
    remote: _RemoteUsage = field(default_factory=lambda: _RemoteUsage())
    text: list[str] = field(default_factory=list)  # what was emitted

    def emit(self, ev: GenerationEvent) -> None:
        self.text.append(ev.text)
        self.outbox.setdefault(self.loop, []).append((self.queue, ev))


@dataclass
class _RemoteUsage:
    """What KV loads from non-cache sources cost a request (usage's remote fields)."""

    exact: bool | None = None  # from the source's load_info(load_id)["exact"], when it has one
    bytes: int = 0
    wait_s: float = 0.0  # load start -> done or failure, summed over its loads
    compute_s: float = 0.0  # the source's own compute time (DONE)


OnLayer = Callable[[int, int, int, list[mx.array]], None]


@dataclass(eq=False)
class _Export:
    """A prompt computed for a decoder elsewhere (``Engine.prefill_for_peer``)."""

    seq: Sequence
    start: int  # tokens the decoder holds: export [start, N - 1)
    on_layer: OnLayer
    on_accept: Callable[[int], None] | None
    on_done: Callable[[int, float], None] | None
    on_error: Callable[[str], None] | None
    can_send: Callable[[], bool] | None = None  # False: the receiver's queue is full, wait
    t_start: float = field(default_factory=time.perf_counter)
    accepted: bool = False
    error: str | None = None  # an on_layer callback raised: ends the export after the step
    done: bool = False


# --- the worker's mailbox --------------------------------------------------------------------


@dataclass
class Submit:
    active: _Active


@dataclass
class SubmitExport:
    export: _Export


@dataclass
class Cancel:
    request_id: str


@dataclass
class KVLayer:
    load_id: int
    layer: int
    t0: int
    t1: int
    parts: KVParts
    release: Callable[[], None] | None
    nbytes: int


@dataclass
class KVDone:
    load_id: int
    tokens_computed: int | None = None
    compute_s: float | None = None


@dataclass
class KVFailed:
    load_id: int
    reason: str


@dataclass
class AddSource:
    source: KVSource


@dataclass
class RemoveSource:
    source: KVSource


@dataclass
class Wake:
    pass


@dataclass
class Call:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class Shutdown:
    pass


Message = (
    Submit
    | SubmitExport
    | Cancel
    | KVLayer
    | KVDone
    | KVFailed
    | AddSource
    | RemoveSource
    | Wake
    | Call
    | Shutdown
)


class _Sink:
    """The ``KVSink`` every source gets: posts to the worker's mailbox from any thread."""

    def __init__(self, mailbox: queue.SimpleQueue[Message]):
        self._mailbox = mailbox

    def layer(
        self,
        load_id: int,
        layer: int,
        t0: int,
        t1: int,
        parts: KVParts,
        release: Callable[[], None] | None = None,
    ) -> None:
        nbytes = sum(int(p.nbytes) for p in parts)
        self._mailbox.put(KVLayer(load_id, layer, t0, t1, parts, release, nbytes))

    def done(self, load_id: int, tokens_computed: int | None = None, compute_s: float | None = None) -> None:
        self._mailbox.put(KVDone(load_id, tokens_computed, compute_s))

    def failed(self, load_id: int, reason: str) -> None:
        self._mailbox.put(KVFailed(load_id, reason))


@dataclass
class _LoadMeta:
    request_id: str
    source: KVSource
    t_start: float = field(default_factory=time.perf_counter)
    bytes: int = 0


# Events produced during one worker iteration are collected per caller event loop (the engine's
# outbox) and handed over with one wake-up per loop per step instead of one per token: fewer
# self-pipe writes and GIL hand-offs while the worker and BLAS threads are busy.
Outbox = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationEvent]]]


def _deliver(items: list[tuple[asyncio.Queue, GenerationEvent]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


def _flush_outbox(outbox: Outbox) -> None:
    for loop, items in outbox.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass
    outbox.clear()


# Engines whose worker may still run: shut down at interpreter exit (see Engine.shutdown).
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_live_engines):
        engine.shutdown()


class Engine:
    # KV bytes from sources applied per worker iteration (at least one frame always is): bounds the
    # time a step waits while a remote load arrives
    kv_apply_budget = 64 * 2**20

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.config.validate()
        warn_if_slow(backend_name())  # once per process, with the fix
        self.tokenizer = loaded.tokenizer
        self.replies = ReplyMemory()  # generated ids behind reply text, for multi-turn prefix hits
        self.speculation = SpeculationPolicy()  # how many tokens to propose (config.speculative)
        self.draft = self._load_draft()  # the draft model (speculative="draft"), else None
        self._proposer: NgramProposer | DraftModelProposer | None = None
        self.model_name = loaded.name
        self.context_length = self._context_length(loaded)
        self._mailbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._sink = _Sink(self._mailbox)
        self._lock = threading.Lock()  # guards _live, _queued and _stopping
        self._live: set[str] = set()  # request ids submitted and not finished
        self._queued = 0  # submitted, not yet handed to the scheduler
        self._active: dict[str, _Active] = {}  # worker thread only, as everything below
        self._exports: dict[str, _Export] = {}
        self._backlog: deque[KVLayer | KVDone | KVFailed] = deque()
        self._load_meta: dict[int, _LoadMeta] = {}
        self._outbox: Outbox = {}
        self._stopping = False
        self._steps = 0
        self._kv_bytes_loaded = 0
        self._remote_prefills = 0
        self._frames_dropped = 0
        self._sources_closed = False
        self._prefill_rate: float | None = None  # EWMA of local prefill tokens per second
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
        return cls(load_model(model, weights=config.weights), config)

    def _context_length(self, loaded: LoadedModel) -> int:
        """``config.context_length`` when given (a warning above the model's trained context, as
        llama.cpp gives), else the model's own."""
        asked = self.config.context_length
        if asked is None:
            return loaded.context_length
        if asked > loaded.context_length:
            log.warning(
                "context length %d is above the %d tokens %s was trained for: replies past that may degrade",
                asked,
                loaded.context_length,
                loaded.name,
            )
        return asked

    def _load_draft(self) -> LoadedModel | None:
        """The draft model of ``speculative="draft"``, loaded (or given loaded), checked to share the
        target's tokenizer (ConfigError otherwise)."""
        spec = self.config.draft_model
        if self.config.speculative != "draft" or spec is None:
            return None
        draft = spec if isinstance(spec, LoadedModel) else load_model(spec, weights=self.config.weights)
        check_same_tokenizer(self.loaded, draft)
        return draft

    def _kv_dtype(self, m: LoadedModel) -> mx.Dtype:
        """What the KV pool of model ``m`` stores (``KVPool.store_dtype``)."""
        return KVPool.store_dtype(self.config.kv_dtype, m.dtype, self.config.kv_bits, backend_name())

    def _kv_bytes_per_token(self, m: LoadedModel) -> int:
        c = self.config
        return m.num_layers * KVPool.bytes_per_token_per_layer(
            m.n_kv_heads, m.head_dim, self._kv_dtype(m), c.kv_bits, c.kv_group_size
        )

    # --- set-up on the worker thread (MLX streams are per thread) -----------------
    def _build(self) -> None:
        c, m = self.config, self.loaded
        kv_dtype = self._kv_dtype(m)
        memory = total_memory_bytes()
        budget = c.kv_budget_bytes(memory)
        if self.draft is not None:  # each block holds the draft's KV too (draft_model.py): split the budget
            target = self._kv_bytes_per_token(m)
            budget *= target / (target + self._kv_bytes_per_token(self.draft))
        num_blocks = KVPool.blocks_for_budget(
            budget,
            m.num_layers,
            m.n_kv_heads,
            m.head_dim,
            kv_dtype,
            c.kv_bits,
            c.kv_group_size,
            c.block_size,
        )
        # never more than the running sequences could fill at full context
        num_blocks = min(num_blocks, c.max_running * -(-self.context_length // c.block_size) + 1)
        per_block = c.block_size * self._kv_bytes_per_token(m)
        if self.draft is not None:
            per_block += c.block_size * self._kv_bytes_per_token(self.draft)
        self._kv_block_bytes = per_block
        kv_bytes, weight_bytes = num_blocks * per_block, m.weight_bytes  # the budget, taken as used
        if kv_bytes + weight_bytes > memory:
            raise ConfigError(
                f"the KV cache ({kv_bytes / GiB:.1f} GiB) and the model's weights ({weight_bytes / GiB:.1f} GiB) "
                f"need more than this machine's {memory / GiB:.1f} GiB of memory; lower cache_gb or cache_fraction",
                "cache_gb" if c.cache_gb is not None else "cache_fraction",
            )
        self.pool = KVPool(
            m.num_layers,
            num_blocks,
            c.block_size,
            m.n_kv_heads,
            m.head_dim,
            kv_dtype,
            c.kv_bits,
            c.kv_group_size,
            capacity=(first := c.kv_first_blocks()),
            act_dtype=m.dtype,
        )
        self.allocator = BlockAllocator(
            num_blocks, c.block_size, enable_prefix_cache=c.prefix_cache, initial_blocks=first
        )
        self.allocator.on_grow = self.pool.grow
        self.draft_pool: KVPool | None = None
        if self.draft is not None:  # the draft's KV, at the same block ids (draft_model.py)
            d = self.draft
            self.draft_pool = draft_pool = KVPool(
                d.num_layers,
                num_blocks,
                c.block_size,
                d.n_kv_heads,
                d.head_dim,
                self._kv_dtype(d),
                c.kv_bits,
                c.kv_group_size,
                capacity=first,
                act_dtype=d.dtype,
            )
            pool = self.pool

            def grow(capacity: int) -> None:
                pool.grow(capacity)
                draft_pool.grow(capacity)

            self.allocator.on_grow = grow
        self.scheduler = Scheduler(
            self.allocator,
            SchedulerConfig(
                c.max_batch_tokens, min(c.prefill_chunk, c.max_batch_tokens), c.max_running, c.max_queue
            ),
            num_layers=m.num_layers,
        )
        self.runner = ModelRunner(m.model, self.pool)
        if c.speculative == "ngram":
            self._proposer = NgramProposer()
            self.scheduler.drafter = self._draft
        elif self.draft is not None and self.draft_pool is not None:
            vocab = min(output_rows(m.model), output_rows(self.draft.model))
            self._proposer = DraftModelProposer(self.draft, self.draft_pool, vocab, c.prefill_chunk)
            self.scheduler.drafter = self._draft
        self.disk: PrefixDiskTier | None = None
        if c.disk_cache_dir and c.prefix_cache:
            # the model's identity (a hash of its weights) and the numerics that shape its KV: a cache
            # written by another model, version or KV format is never read back
            fingerprint = {
                "model": self.model_identity(),
                "block_size": c.block_size,
                **self.numerics_profile(),
            }
            disk = self.disk = PrefixDiskTier(
                c.disk_cache_dir,
                fingerprint,
                int(c.disk_cache_gb * 2**30),
                block_size=c.block_size,
                num_layers=m.num_layers,
            )
            self.allocator.on_evict = lambda b, toks: disk.save(toks, self.pool.read_block(b))
            self.scheduler.sources.append(disk)
        for src in c.kv_sources:
            self._add_source(src)

    def _add_source(self, source: KVSource) -> None:
        """On the worker: ask ``source`` too from now on (after the ones already there)."""
        self.scheduler.sources.append(source)
        if not getattr(source, "is_cache", False):
            # local prefill then ends as a remote one does: exact first-token logits
            self.scheduler.cfg.last_token_alone = True
        attach = getattr(source, "attach", None)
        if attach is not None:
            attach(self)  # e.g. a peer client builds its HELLO from the pool and starts connecting

    def _flush_prefix_cache(self) -> None:
        if self.disk is None or self.allocator.index is None:
            return
        index = self.allocator.index
        for b in index.blocks(salted=False, tails=False):  # no salted prefix, and whole blocks only
            self.disk.save(index.path_tokens(b), self.pool.read_block(b))

    # --- public API -------------------------------------------------------------
    def prepare_prompt(self, request: GenerationRequest) -> list[int]:
        """Prompt token ids for a request; raises RequestError for anything invalid."""
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("give exactly one of prompt or messages", "messages")
        if request.max_tokens is not None and (
            isinstance(request.max_tokens, bool)
            or not isinstance(request.max_tokens, int)
            or request.max_tokens <= 0
        ):
            raise RequestError(
                "max_tokens must be a positive integer (or None: until the context is full)", "max_tokens"
            )
        request.sampling.validate(self.tokenizer.vocab_size)
        for name in ("group", "cache_salt"):
            if not isinstance(getattr(request, name), str | None):
                raise RequestError(f"{name} must be a string", name)
        if request.messages is not None:
            if not request.messages:
                raise RequestError("messages must not be empty", "messages")
            # control tokens come only from the template, never from message text (TemplateError)
            # a reply the model wrote keeps the ids it was generated as (ReplyMemory)
            salt = request.cache_salt
            ids = self.tokenizer.encode_chat(
                request.messages, True, request.tools, replies=lambda t: self.replies.recall(t, salt)
            )
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise RequestError("prompt must not be empty", "prompt")
            # a text prompt is text (as at OpenAI): control tokens only as token ids
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=True, parse_special=False)
        else:
            assert request.prompt is not None  # exactly one of prompt and messages, checked above
            ids = [int(t) for t in request.prompt]
            if not ids:
                raise RequestError("prompt must not be empty", "prompt")
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise RequestError("prompt token ids must be inside the vocabulary", "prompt")
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the model's context is {self.context_length} tokens",
                "messages" if request.messages is not None else "prompt",
            )
        if not self.scheduler.can_ever_fit(len(ids) + 1):
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens, more than the KV cache holds "
                f"({(self.allocator.num_blocks - 1) * self.allocator.block_size} tokens); raise cache_gb",
                "prompt",
            )
        return ids

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

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        if self._stopping:
            raise EngineShutDownError("the engine is shut down")
        ids = self.prepare_prompt(request)
        # max_tokens None: until EOS, a stop, or the context (or the whole KV cache) is full
        cap = min(self.context_length, (self.allocator.num_blocks - 1) * self.allocator.block_size)
        limit = cap if request.max_tokens is None else min(len(ids) + request.max_tokens, cap)
        seq = Sequence(
            request.request_id,
            list(ids),
            len(ids),
            limit,
            group=request.group or request.fork_of,  # n > 1 choices: their first choice's group
            cache_salt=request.cache_salt,
        )
        active = _Active(
            req=request,
            seq=seq,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            detok=StreamingDetokenizer(self.tokenizer),
            stopper=StopMatcher(list(request.stop)),
            rng=make_rng(request.sampling.seed),
            outbox=self._outbox,
        )
        self._submit(request.request_id, Submit(active))
        finished = False
        try:
            while True:
                ev = await active.queue.get()
                finished = ev.finished
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request.request_id)

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
        ids = [int(t) for t in tokens]
        n = len(ids)
        if n < 2 or any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise RequestError("a peer prefill needs at least 2 token ids inside the vocabulary", "prompt")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < n - 1:
            raise RequestError(f"start must be in [0, {n - 1}), not {start!r}", "start")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise RequestError(f"chunk must be a positive integer, not {chunk!r}", "chunk")
        if n >= self.context_length or not self.scheduler.can_ever_fit(n):
            raise ContextLengthError(f"the prompt has {n} tokens, more than this engine holds", "prompt")
        rid = request_id or f"peer-{time.monotonic_ns()}-{id(on_layer)}"
        seq = Sequence(rid, ids[:-1], n - 1, n - 1, group=group, chunk=chunk, exact_grid=True, may_load=False)
        self._submit(rid, SubmitExport(_Export(seq, start, on_layer, on_accept, on_done, on_error, can_send)))
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
        return self._prefill_rate

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
        c = self.config
        return numerics_profile(
            backend=backend_name(),
            weight_format=self.loaded.weight_format,
            dtype=str(self.loaded.dtype),
            kv_dtype=str(self._kv_dtype(self.loaded)),
            kv_bits=c.kv_bits,
            kv_group_size=c.kv_group_size,
            prefill_chunk=min(c.prefill_chunk, c.max_batch_tokens),
        )

    def stats(self) -> EngineStats:
        a, s = self.allocator, self.scheduler
        return EngineStats(
            model=self.model_name,
            backend=backend_name(),
            blas=active_blas(),
            weight_format=self.loaded.weight_format,
            running=len(s.running),
            waiting=len(s.waiting) + self._queued,
            kv_blocks_total=a.num_blocks - 1,
            kv_blocks_used=a.num_used,
            kv_blocks_cached=a.num_cached,
            kv_bytes=self.pool.nbytes,
            kv_block_bytes=self._kv_block_bytes,
            kv_bits=self.config.kv_bits,
            kv_format=f"{self.pool.kv_bits}-bit"
            if self.pool.kv_bits
            else str(self.pool.dtype).rsplit(".", 1)[-1],
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            preemptions=s.preemptions,
            steps=self._steps,
            loading=len(s.loading),
            kv_loads=s.loads_started,
            kv_load_failures=s.loads_failed,
            kv_bytes_loaded=self._kv_bytes_loaded,
            remote_prefills=self._remote_prefills,
            kv_frames_dropped=self._frames_dropped,
        )

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
            sources, self._sources_closed = ([] if self._sources_closed else self._all_sources()), True
        for src in sources:
            close = getattr(src, "close", None)
            if close is not None:
                try:
                    close()  # e.g. a peer client's connection and threads
                except Exception as e:
                    log.warning("KV source %s failed to close: %s", getattr(src, "name", "?"), e)

    def _all_sources(self) -> list[KVSource]:
        scheduler = getattr(self, "scheduler", None)  # absent when the engine failed to build
        return list(scheduler.sources) if scheduler is not None else []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- worker -----------------------------------------------------------------
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
            self._build()
        except BaseException as e:  # reported to the constructor
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        busy = False
        while True:
            # block only when nothing can change without a message: no step ran, no KV is queued
            if self._receive(block=not busy and not self._backlog):
                self._stop()
                return
            try:
                self._apply_kv()
                busy = self._step()
            except Exception as e:  # a failed step fails its requests, never the engine
                traceback.print_exc()
                busy = True
                for a in list(self._active.values()):
                    if a.seq.status == RUNNING:
                        self._finish(a, "error", f"generation failed: {e}")
                for x in list(self._exports.values()):
                    if x.seq.status == RUNNING:
                        self._finish_export(x, f"generation failed: {e}")
            _flush_outbox(self._outbox)

    def _receive(self, block: bool) -> bool:
        """Handle what is in the mailbox (waiting for a first message when ``block``); KV
        messages are queued in order for ``_apply_kv``. True once a shutdown was received."""
        msgs: list[Message] = [self._mailbox.get()] if block else []
        while True:
            try:
                msgs.append(self._mailbox.get_nowait())
            except queue.Empty:
                break
        stop = False
        for m in msgs:
            if isinstance(m, KVLayer | KVDone | KVFailed):
                self._backlog.append(m)
            elif isinstance(m, Submit):
                self._admit(m.active)
            elif isinstance(m, SubmitExport):
                self._admit_export(m.export)
            elif isinstance(m, Cancel):
                if m.request_id in self._active:
                    self._finish(self._active[m.request_id], "cancelled")
                elif m.request_id in self._exports:
                    self._finish_export(self._exports[m.request_id], "cancelled")
            elif isinstance(m, AddSource):
                try:
                    self._add_source(m.source)
                except Exception as e:
                    log.warning("KV source %s failed to attach: %s", getattr(m.source, "name", "?"), e)
            elif isinstance(m, RemoveSource):
                if m.source in self.scheduler.sources:
                    self.scheduler.sources.remove(m.source)
            elif isinstance(m, Call):
                try:
                    m.result = m.fn()
                except BaseException as e:  # handed to the caller
                    m.error = e
                m.done.set()
            elif isinstance(m, Shutdown):
                stop = True
        return stop

    def _admit(self, a: _Active) -> None:
        with self._lock:
            self._queued -= 1
        self._active[a.req.request_id] = a
        lead = self._active.get(a.req.fork_of) if a.req.fork_of else None
        if (
            lead is not None
            and lead.seq.tokens[: lead.seq.num_prompt] == a.seq.tokens
            and lead.req.cache_salt == a.req.cache_salt
        ):
            a.seq.leader = lead.seq
        try:
            self.scheduler.add(a.seq)
        except QueueFullError as e:  # preempted sequences filled the queue since the submit
            self._finish(a, "error", str(e), error_type=QueueFullError)

    def _admit_export(self, x: _Export) -> None:
        with self._lock:
            self._queued -= 1
        self._exports[x.seq.request_id] = x
        try:
            self.scheduler.add(x.seq)
        except QueueFullError as e:
            self._finish_export(x, str(e))

    def _stop(self) -> None:
        for a in list(self._active.values()):
            self._finish(a, "error", "the engine shut down", error_type=EngineShutDownError)
        for x in list(self._exports.values()):
            self._finish_export(x, "the engine shut down")
        for m in self._backlog:
            if isinstance(m, KVLayer) and m.release is not None:
                m.release()
        self._backlog.clear()
        _flush_outbox(self._outbox)
        self._flush_prefix_cache()

    # --- KV from sources -----------------------------------------------------------
    def _start_load(self, sl: StartLoad) -> None:
        load = sl.load
        self._load_meta[load.load_id] = _LoadMeta(load.request_id, sl.source)
        try:
            sl.source.start_load(load, self._sink)
        except Exception as e:  # a broken source costs the load, never the engine
            log.warning("KV source %s failed to start load %d: %s", sl.source.name, load.load_id, e)
            self._load_ended(load.load_id, f"start_load failed: {e}")

    def _apply_kv(self) -> None:
        """Apply queued KV messages in order, up to ``kv_apply_budget`` bytes of layers (at least
        one), then evaluate every touched pool array once."""
        budget, touched = self.kv_apply_budget, set()
        while self._backlog:
            m = self._backlog[0]
            if isinstance(m, KVLayer) and budget <= 0:
                break
            self._backlog.popleft()
            if isinstance(m, KVLayer):
                budget -= max(m.nbytes, 1)
                try:
                    if self._apply_layer(m):
                        touched.add(m.layer)
                finally:
                    if m.release is not None:
                        m.release()
            elif isinstance(m, KVDone):
                meta = self._load_meta.get(m.load_id)
                if meta is not None and m.compute_s is not None and meta.request_id in self._active:
                    self._active[meta.request_id].remote.compute_s += m.compute_s
                self._load_ended(m.load_id, None)
            else:
                self._load_ended(m.load_id, m.reason)
        if touched:
            mx.eval([a for layer in sorted(touched) for a in self.pool.layer_arrays(layer)])

    def _apply_layer(self, m: KVLayer) -> bool:
        """Write one arriving layer range into the pool; False when it was dropped."""
        try:
            target = self.scheduler.kv_target(m.load_id, m.layer, m.t0, m.t1)
            if target is None:  # a dead load (cancelled, failed, finished), or complete already
                self._frames_dropped += self.scheduler.source_of(m.load_id) is None
                return False
            pool = self.pool.layer_arrays(m.layer)
            if len(m.parts) != len(pool):
                raise ValueError(f"{len(m.parts)} KV parts for a pool layer of {len(pool)} arrays")
            if any(p.shape[0] != m.t1 - m.t0 for p in m.parts):
                raise ValueError(f"KV parts of {[p.shape[0] for p in m.parts]} tokens for [{m.t0}, {m.t1})")
            lo, hi = target.t0 - m.t0, target.t1 - m.t0
            parts = [self._to_pool(p[lo:hi], ref) for p, ref in zip(m.parts, pool, strict=True)]
            self.pool.write_tokens(m.layer, target.blocks, target.t0, parts)
        except (ValueError, TypeError) as e:  # a frame that does not fit: the load fails
            src = self.scheduler.source_of(m.load_id)
            self._load_ended(m.load_id, f"bad KV frame: {e}")
            if src is not None:
                self._cancel_at_source(src, m.load_id)
            return False
        self.scheduler.kv_landed(m.load_id, m.layer, m.t0, m.t1)
        self._kv_bytes_loaded += m.nbytes
        meta = self._load_meta.get(m.load_id)
        if meta is not None:
            meta.bytes += m.nbytes
        return True

    @staticmethod
    def _to_pool(part: Any, ref: mx.array) -> mx.array:
        """An arriving part as an mx array of the pool array ``ref``'s dtype (bf16 from uint16 bits)."""
        if isinstance(part, mx.array):
            a = part
        else:
            a = mx.array(np.ascontiguousarray(part))
            if ref.dtype == mx.bfloat16 and a.dtype == mx.uint16:
                a = a.view(mx.bfloat16)
        if a.dtype != ref.dtype:
            raise ValueError(f"a KV part of dtype {a.dtype} for a pool of {ref.dtype}")
        return a

    def _load_ended(self, load_id: int, reason: str | None) -> None:
        meta = self._load_meta.pop(load_id, None)
        seq = self.scheduler.load_finished(load_id, reason)
        if seq is None or meta is None:
            return  # a load that was cancelled (its late DONE or failure is dropped)
        if reason is not None:  # logged once: by the source itself when it logs its own failures
            log.log(
                logging.DEBUG if getattr(meta.source, "logs_failures", False) else logging.WARNING,
                "KV load %d from %s for %s ended early: %s",
                load_id,
                meta.source.name,
                meta.request_id,
                reason,
            )
        a = self._active.get(meta.request_id)
        if a is not None and not getattr(meta.source, "is_cache", False):
            a.remote.bytes += meta.bytes
            a.remote.wait_s += time.perf_counter() - meta.t_start
            load_info = getattr(meta.source, "load_info", None)
            info = load_info(load_id) if load_info is not None else None
            if isinstance(info, dict) and info.get("exact") is not None:
                a.remote.exact = bool(info["exact"]) and a.remote.exact is not False

    def _cancel_at_source(self, source: KVSource, load_id: int) -> None:
        self._load_meta.pop(load_id, None)
        try:
            source.cancel(load_id)
        except Exception as e:
            log.warning("KV source %s failed to cancel load %d: %s", source.name, load_id, e)

    # --- one step -------------------------------------------------------------------
    def _step(self) -> bool:
        """Schedule and run one step; False when there was nothing to do."""
        for x in list(self._exports.values()):
            if x.can_send is not None:
                try:
                    x.seq.paused = not x.can_send()
                except Exception as e:
                    self._finish_export(x, f"can_send failed: {e}")
        step = self.scheduler.schedule()
        # copy-on-write of blocks shared (n > 1 choices) or cached part-full, before a load or the
        # forward pass writes on
        for src, dst in step.copies:
            self.pool.copy_block(src, dst)
            if self.draft_pool is not None and isinstance(self._proposer, DraftModelProposer):
                self.draft_pool.copy_block(src, dst)
                self._proposer.copied(src, dst)
        for sl in step.loads:
            self._start_load(sl)
        for rid in step.admitted:
            if rid in self._exports:
                self._accept_export(self._exports[rid])
        for rid in [r for r, seq in step.seqs.items() if seq.status != RUNNING]:
            del step.tokens[rid], step.seqs[rid]  # an export that ended as it was accepted
        if not step.tokens:
            return bool(step.loads)
        self._steps += 1
        if isinstance(self._proposer, DraftModelProposer):  # the step's proposals, in one batch
            passes, t_draft = self._proposer.passes, time.perf_counter()
            for seq in self._proposer.fill(list(step.seqs.values())):
                self.scheduler.withdraw_draft(seq, step)  # its draft is still catching up
            self.speculation.observe_draft(self._proposer.passes - passes, time.perf_counter() - t_draft)
        rows = [self._row(step, rid, n) for rid, n in step.tokens.items()]
        prefill = sum(
            max(min(seq.num_computed + n, seq.num_prompt) - seq.num_computed, 0)
            for seq, n in ((step.seqs[rid], n) for rid, n in step.tokens.items())
        )
        t0 = time.perf_counter()
        logits = self.runner.forward(rows)
        if prefill >= 16:
            rate = prefill / max(time.perf_counter() - t0, 1e-9)
            self._prefill_rate = (
                rate if self._prefill_rate is None else 0.75 * self._prefill_rate + 0.25 * rate
            )
        rids = list(step.tokens)
        done = set(self.scheduler.advance(step))
        for x in [self._exports[r] for r in rids if r in self._exports]:
            if x.error is not None:
                self._finish_export(x, x.error)
            elif x.seq.request_id in done:
                self._finish_export(x)
        sampled = [i for i, rid in enumerate(rids) if rid in done and rid in self._active]
        drafted = [i for i in sampled if step.seqs[rids[i]].num_draft]
        for seq in (step.seqs[r] for r in rids):
            if seq.num_draft and seq.request_id not in self._active:
                self.scheduler.end_draft(seq, 0)
        if drafted:
            sampled = [i for i in sampled if i not in drafted]
            self._verify([(self._active[rids[i]], self.runner.position_logits[i]) for i in drafted])
        if sampled:
            self._sample(step, rids, sampled, logits)
        # what the step cost, sampling and verification included, against the tokens it held: the
        # speculation policy's cost model (a pass's fixed cost and the cost of one more token). Only
        # steps of decoding rows, the steps speculation changes: a prompt's tokens cost less each
        # (many rows of x take a different matmul path on the CPU), and fitted together with decoding
        # tokens they made one more proposed token look nearly free in a busy batch.
        if not prefill:
            self.speculation.observe(
                len({len(r.tokens) for r in rows}),
                sum(len(r.tokens) for r in rows),
                time.perf_counter() - t0,
                rows=len(rows),
            )
        return True

    def _verify(self, drafted: list[tuple[_Active, mx.array]]) -> None:
        """Sample each position of the rows with proposed tokens, as plain decoding would, keeping
        proposals while they equal the sampled token (speculative.py); the first that differs
        emits the sampled token instead, and the rest are rolled back. Rows that draw no random
        numbers (greedy) have every position sampled in one batched call; a row that draws samples
        position by position, so that its random stream advances once per emitted token."""
        batched = [(a, lg) for a, lg in drafted if a.req.sampling.greedy]
        if batched:
            rows = [r for a, lg in batched for r in self._position_rows(a, lg.shape[0])]
            flat = mx.concatenate([lg for _, lg in batched], axis=0) if len(batched) > 1 else batched[0][1]
            results, at = sample(flat, rows), 0
            for a, lg in batched:
                n = lg.shape[0]
                self._keep_verified(a, results[at : at + n])
                at += n
        for a, lg in drafted:
            if a.req.sampling.greedy:
                continue
            results = []
            for i, row in enumerate(self._position_rows(a, lg.shape[0])):
                results.append(sample(lg[i : i + 1], [row])[0])
                if i == lg.shape[0] - 1 or results[-1].token_id != a.seq.tokens[a.seq.num_verified + i]:
                    break
            self._keep_verified(a, results)

    @staticmethod
    def _position_rows(a: _Active, n: int) -> list[SamplerRow]:
        """Sampler rows for the ``n`` positions of ``a``'s drafted row: position ``i`` sees the
        output as it is if the proposals before it are kept."""
        seq, p = a.seq, a.req.sampling
        base = seq.num_verified
        penalised = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
        return [
            SamplerRow(
                params=p,
                rng=a.rng,
                prompt_ids=seq.tokens[: seq.num_prompt] if penalised else (),
                output_ids=seq.tokens[seq.num_prompt : base + i] if penalised else (),
            )
            for i in range(n)
        ]

    def _keep_verified(self, a: _Active, results: list) -> None:
        """Emit sampled ``results`` up to and including the first that differs from its proposal
        (all of them when every proposal matched), and roll the rest of the row back."""
        seq = a.seq
        drafts = seq.tokens[seq.num_verified :]
        n = 1
        while n <= len(drafts) and n < len(results) and results[n - 1].token_id == drafts[n - 1]:
            n += 1
        results = results[:n]
        self.scheduler.end_draft(seq, len(results) - 1)
        now = time.perf_counter()
        for i, r in enumerate(results):
            self._on_token(a, r, now)
            if a.done:
                return
            if i < len(results) - 1:
                self.scheduler.draft_kept(seq)

    def _draft(self, seq: Sequence, max_k: int, decoding_rows: int) -> list[int]:
        """The scheduler's drafter: tokens to propose after ``seq``'s last (speculative.py)."""
        a = self._active.get(seq.request_id)
        if a is None or a.req.constraint is not None:  # a grammar must see each token first
            return []
        k = self.speculation.choose(seq.spec_proposed, seq.spec_accepted, decoding_rows)
        if k == 0 and seq.num_generated % 16 == 0 and decoding_rows <= 2:
            k = 1  # probe now and then: what the text does may have changed
        k = min(k, max_k)
        if self.draft is not None and len(seq.tokens) + k > self.draft.context_length:
            return []  # past the draft model's context: its guesses would be noise
        assert self._proposer is not None
        return self._proposer.propose(seq.tokens, k)

    def _row(self, step: Step, rid: str, n: int) -> Row:
        seq = step.seqs[rid]
        row = Row(seq.tokens[seq.num_computed : seq.num_computed + n], seq.num_computed, seq.blocks)
        row.all_logits = seq.num_draft > 0
        x = self._exports.get(rid)
        if x is not None:
            t0, t1 = max(x.start, seq.num_computed), seq.num_computed + n
            if t1 > t0:
                row.export = LayerExport(seq.blocks, t0, t1, self._export_hook(x))
        return row

    def _sample(self, step: Step, rids: list[str], sampled: list[int], logits: mx.array) -> None:
        actives, srows, keep = [], [], []
        for i in sampled:
            a = self._active[rids[i]]
            allowed = a.req.constraint.allowed_tokens() if a.req.constraint is not None else None
            if allowed is not None and not allowed.any():
                self._finish(a, "error", "the output constraint allows no further token")
                continue
            p = a.req.sampling
            penalised = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
            seq = a.seq
            actives.append(a)
            keep.append(i)
            srows.append(
                SamplerRow(
                    params=p,
                    rng=a.rng,
                    prompt_ids=seq.tokens[: seq.num_prompt] if penalised else (),
                    output_ids=seq.tokens[seq.num_prompt :] if penalised else (),
                    allowed=allowed,
                )
            )
        if not keep:
            return
        idx = mx.array(keep) if len(keep) != len(rids) else None
        results = sample(logits if idx is None else logits[idx], srows)
        now = time.perf_counter()
        for a, r in zip(actives, results, strict=True):
            self._on_token(a, r, now)

    # --- exports (this engine as a prefill peer) --------------------------------------
    def _export_hook(self, x: _Export) -> OnLayer:
        def on_layer(layer: int, t0: int, t1: int, parts: list[mx.array]) -> None:
            if x.error is None:
                try:
                    x.on_layer(layer, t0, t1, parts)
                except Exception as e:  # the receiver's side broke: end this export after the step
                    x.error = f"on_layer failed: {e}"

        return on_layer

    def _accept_export(self, x: _Export) -> None:
        """On (re)admission: report the prefix hit once, then hand out ``[start, h)`` from the
        pool, chunk by chunk on the grid, layer by layer within a chunk."""
        seq, h = x.seq, x.seq.num_computed
        if not x.accepted:
            x.accepted = True
            if x.on_accept is not None:
                try:
                    x.on_accept(h)
                except Exception as e:
                    x.error = f"on_accept failed: {e}"
        chunk = seq.chunk or 1
        t = x.start
        hook = self._export_hook(x)
        while t < h and x.error is None:
            t1 = min(h, (t // chunk + 1) * chunk)
            for layer in range(self.pool.num_layers):
                hook(layer, t, t1, self.pool.read_tokens(layer, seq.blocks, t, t1))
            t = t1
        if x.error is not None:
            self._finish_export(x, x.error)

    def _finish_export(self, x: _Export, error: str | None = None) -> None:
        if x.done:
            return
        x.done = True
        for src, load_id in self.scheduler.finish(x.seq):
            self._cancel_at_source(src, load_id)
        del self._exports[x.seq.request_id]
        with self._lock:
            self._live.discard(x.seq.request_id)
        try:
            if error is None:
                if x.on_done is not None:
                    x.on_done(x.seq.prompt_computed, time.perf_counter() - x.t_start)
            elif x.on_error is not None:
                x.on_error(error)
        except Exception as e:
            log.warning("peer prefill %s: a callback failed: %s", x.seq.request_id, e)

    # --- tokens and the end of a request ------------------------------------------------
    def _on_token(self, a: _Active, r, now: float) -> None:
        seq, req, tok = a.seq, a.req, int(r.token_id)
        if a.t_first is None:
            a.t_first = now
        a.t_last = now
        seq.tokens.append(tok)
        if req.constraint is not None:
            req.constraint.accept(tok)
        lp = []
        if req.sampling.logprobs:
            piece = self.tokenizer.piece
            lp = [
                TokenLogprob(
                    tok, piece(tok), float(r.logprob), tuple((t, piece(t), float(v)) for t, v in r.top)
                )
            ]
        if (tok in self.tokenizer.eos_token_ids and not req.ignore_eos) or tok in req.stop_token_ids:
            a.emit(GenerationEvent(req.request_id, "", [tok], lp))
            self._finish(a, "stop", stop_reason=tok)
            return
        text, hit = a.stopper.feed(a.detok.add(tok))
        a.emit(GenerationEvent(req.request_id, text, [tok], lp))
        if hit is not None:
            self._finish(a, "stop", stop_reason=hit, flush=False)
        elif req.constraint is not None and req.constraint.is_finished():
            self._finish(a, "stop")
        elif len(seq.tokens) >= seq.max_total:
            self._finish(a, "length")

    def _finish(
        self,
        a: _Active,
        reason: str,
        error: str | None = None,
        stop_reason=None,
        flush: bool = True,
        error_type: type[DuetError] | None = None,
    ) -> None:
        if a.done:
            return
        a.done = True
        for src, load_id in self.scheduler.finish(a.seq):
            self._cancel_at_source(src, load_id)
        if isinstance(self._proposer, DraftModelProposer):
            self._proposer.forget(a.req.request_id)
        del self._active[a.req.request_id]
        with self._lock:
            self._live.discard(a.req.request_id)
        text = ""
        if flush and reason in ("stop", "length"):
            tail, hit = a.stopper.feed(a.detok.flush())
            text = tail if hit is not None else tail + a.stopper.flush()
        seq = a.seq
        n_out = seq.num_generated
        usage = Usage(prompt_tokens=seq.num_prompt, completion_tokens=n_out, cached_tokens=seq.num_cached)
        usage.prompt_tokens_computed = seq.prompt_computed
        caches = {name for name, cache, _, _ in seq.load_ranges if cache}
        remote = {name: n for name, n in seq.loaded.items() if n and name not in caches}
        if remote:
            usage.prefill_location = "remote:" + ",".join(remote)
            usage.remote_tokens = sum(remote.values())
            self._remote_prefills += 1
        usage.remote_bytes = a.remote.bytes
        usage.remote_wait_s = a.remote.wait_s
        usage.remote_compute_s = a.remote.compute_s
        if remote:
            usage.prefill_exact = a.remote.exact
        if seq.load_failures:
            usage.fallback_reason = "; ".join(seq.load_failures)
        if self.config.speculative != "off":
            usage.speculative = {"proposed": seq.spec_proposed, "accepted": seq.spec_accepted}
        if a.t_first is not None:
            usage.ttft_s = a.t_first - a.t_submit
            usage.prefill_tps = (seq.num_prompt - seq.num_cached) / max(usage.ttft_s, 1e-9)
            if n_out > 1 and a.t_last is not None and a.t_last > a.t_first:
                usage.decode_tps = (n_out - 1) / (a.t_last - a.t_first)
        for src in self.scheduler.sources:  # e.g. a peer's offload planner records the measured TTFT
            finished = getattr(src, "request_finished", None)
            if finished is not None:
                try:
                    finished(a.req.request_id, seq.tokens, usage)
                except Exception as e:
                    log.warning("KV source %s: request_finished failed: %s", src.name, e)
        a.emit(GenerationEvent(a.req.request_id, text, [], [], reason, usage, error, stop_reason, error_type))
        if reason in ("stop", "length") and a.req.messages is not None:
            self.replies.remember(
                "".join(a.text),
                seq.tokens[seq.num_prompt :],
                lambda ids: self.tokenizer.decode(ids, False),
                a.req.cache_salt,
            )
