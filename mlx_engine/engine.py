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
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import mlx.core as mx

from .backend import backend_name, total_memory_bytes
from .blas import active_blas, warn_if_slow
from .block_allocator import BlockAllocator
from .config import EngineConfig
from .detokenizer import StreamingDetokenizer
from .errors import (
    ConfigError,
    ContextLengthError,
    DuetError,
    EngineShutDownError,
    QueueFullError,
    RequestError,
)
from .kv_pool import KVPool
from .loader import LoadedModel, load_model
from .model_runner import ModelRunner, Row
from .prefix_disk import PrefixDiskTier
from .request import GenerationEvent, GenerationRequest, TokenLogprob, Usage
from .sampler import SamplerRow, SeedState, make_rng, sample
from .scheduler import Scheduler, SchedulerConfig, Sequence
from .stop_strings import StopMatcher

__all__ = ["Engine", "EngineConfig", "EngineStats", "QueueFullError", "RequestError"]

GiB = 2**30


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
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int

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

    def emit(self, ev: GenerationEvent) -> None:
        self.outbox.setdefault(self.loop, []).append((self.queue, ev))


# Events produced during one worker iteration are collected per caller event loop (the engine's
# outbox) and handed over with one wake-up per loop per step instead of one per token: fewer
# self-pipe writes and GIL hand-offs while the worker and BLAS threads are busy.
Outbox = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationEvent]]]


def _deliver(items: list[tuple[asyncio.Queue, GenerationEvent]]) -> None:
    for queue, ev in items:
        queue.put_nowait(ev)


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
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.config.validate()
        warn_if_slow(backend_name())  # once per process, with the fix
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.context_length = loaded.context_length
        self._cv = threading.Condition()
        self._inbox: list[_Active] = []
        self._cancels: set[str] = set()
        self._active: dict[str, _Active] = {}
        self._outbox: Outbox = {}
        self._stopping = False
        self._steps = 0
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

    # --- set-up on the worker thread (MLX streams are per thread) -----------------
    def _build(self) -> None:
        c, m = self.config, self.loaded
        memory = total_memory_bytes()
        num_blocks = KVPool.blocks_for_budget(
            c.kv_budget_bytes(memory),
            m.num_layers,
            m.n_kv_heads,
            m.head_dim,
            m.dtype,
            c.kv_bits,
            c.kv_group_size,
            c.block_size,
        )
        # never more than the running sequences could fill at full context
        num_blocks = min(num_blocks, c.max_running * -(-m.context_length // c.block_size) + 1)
        per_block = c.block_size * m.num_layers
        per_block *= KVPool.bytes_per_token_per_layer(
            m.n_kv_heads, m.head_dim, m.dtype, c.kv_bits, c.kv_group_size
        )
        kv_bytes, weight_bytes = num_blocks * per_block, m.weight_bytes
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
            m.dtype,
            c.kv_bits,
            c.kv_group_size,
        )
        self.allocator = BlockAllocator(num_blocks, c.block_size, enable_prefix_cache=c.prefix_cache)
        self.scheduler = Scheduler(
            self.allocator,
            SchedulerConfig(
                c.max_batch_tokens, min(c.prefill_chunk, c.max_batch_tokens), c.max_running, c.max_queue
            ),
        )
        self.runner = ModelRunner(m.model, self.pool)
        self.disk: PrefixDiskTier | None = None
        if c.disk_cache_dir and c.prefix_cache:
            fingerprint = {
                "model": str(m.path),
                "size": m.path.stat().st_size if m.path.is_file() else 0,
                "weights": m.weight_format,
                "kv_bits": c.kv_bits,
                "group": c.kv_group_size,
                "block_size": c.block_size,
                "dtype": str(m.dtype),
            }
            disk = self.disk = PrefixDiskTier(c.disk_cache_dir, fingerprint, int(c.disk_cache_gb * 2**30))
            self.allocator.on_evict = lambda b, toks: disk.save(toks, self.pool.read_block(b))
            self.scheduler.disk_lookup = self._load_prefix_from_disk

    def _load_prefix_from_disk(self, tokens: list[int], num_blocks: int, max_tokens: int) -> list[int]:
        """Continue a memory prefix hit with blocks from the disk tier; returns the blocks loaded."""
        bs, out, disk = self.allocator.block_size, [], self.disk
        assert disk is not None  # only installed with a disk tier
        for k in range(num_blocks + 1, max_tokens // bs + 1):
            key = tokens[: k * bs]
            if self.allocator.num_free < 2 or not disk.has(key):
                break
            parts = disk.load(key)
            if parts is None:
                break
            (b,) = self.allocator.allocate(1)
            self.pool.write_block(b, parts)
            out.append(b)
        return out

    def _flush_prefix_cache(self) -> None:
        if self.disk is None or self.allocator.index is None:
            return
        index = self.allocator.index
        for b in index.blocks(salted=False):  # salted prefixes never go to disk
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
            ids = self.tokenizer.encode_chat(request.messages, True, request.tools)
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
        with self._cv:
            if self._stopping:
                raise EngineShutDownError("the engine is shut down")
            if request.request_id in self._active or any(
                a.req.request_id == request.request_id for a in self._inbox
            ):
                raise RequestError(f"request id {request.request_id!r} is already running", "request_id")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.config.max_queue:
                raise QueueFullError(f"the request queue is full ({self.config.max_queue} waiting)")
            self._inbox.append(active)
            self._cv.notify()
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

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancels.add(request_id)
            self._cv.notify()

    def stats(self) -> EngineStats:
        a, s = self.allocator, self.scheduler
        return EngineStats(
            model=self.model_name,
            backend=backend_name(),
            blas=active_blas(),
            weight_format=self.loaded.weight_format,
            running=len(s.running),
            waiting=len(s.waiting) + len(self._inbox),
            kv_blocks_total=a.num_blocks - 1,
            kv_blocks_used=a.num_used,
            kv_blocks_cached=a.num_cached,
            kv_bytes=self.pool.nbytes,
            kv_bits=self.config.kv_bits,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            preemptions=s.preemptions,
            steps=self._steps,
        )

    def shutdown(self) -> None:
        """Stop taking requests, end running ones (finish_reason "error") and wait for the worker.

        Safe to call more than once. Requests submitted afterwards raise ``EngineShutDownError``."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        _live_engines.discard(self)

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
        while True:
            with self._cv:
                while not (self._inbox or self._cancels or self._stopping or self.scheduler.has_work()):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
                stopping = self._stopping
            for a in inbox:
                self._active[a.req.request_id] = a
                lead = self._active.get(a.req.fork_of) if a.req.fork_of else None
                if (
                    lead is not None
                    and lead.seq.tokens[: lead.seq.num_prompt] == a.seq.tokens
                    and lead.req.cache_salt == a.req.cache_salt
                ):
                    a.seq.leader = lead.seq
                self.scheduler.waiting.append(a.seq)
            for rid in cancels:
                if rid in self._active:
                    self._finish(self._active[rid], "cancelled")
            if stopping:
                for a in list(self._active.values()):
                    self._finish(a, "error", "the engine shut down", error_type=EngineShutDownError)
                _flush_outbox(self._outbox)
                self._flush_prefix_cache()
                return
            try:
                self._step()
            except Exception as e:  # a failed step fails its requests, never the engine
                traceback.print_exc()
                for a in list(self._active.values()):
                    if a.seq.status == "running":
                        self._finish(a, "error", f"generation failed: {e}")
            _flush_outbox(self._outbox)

    def _step(self) -> None:
        step = self.scheduler.schedule()
        if not step:
            if self.scheduler.has_work():
                time.sleep(0.001)  # waiting on blocks that nothing running will free: wait for cancels
            return
        self._steps += 1
        for src, dst in self.scheduler.copies:  # copy-on-write of blocks shared by n > 1 choices
            self.pool.copy_block(src, dst)
        rows, sampled = [], []
        for rid, n in step.items():
            seq = self._active[rid].seq
            rows.append(
                Row(seq.tokens[seq.num_computed : seq.num_computed + n], seq.num_computed, seq.blocks)
            )
        logits = self.runner.forward(rows)
        for i, (rid, n) in enumerate(step.items()):
            seq = self._active[rid].seq
            seq.num_computed += n
            full = seq.num_computed // self.allocator.block_size
            if full > seq.num_registered:  # a block filled up: make it matchable by later requests
                self.allocator.register(seq.tokens, seq.blocks, full, seq.cache_salt)
                seq.num_registered = full
            if seq.num_computed == len(seq.tokens):
                sampled.append(i)
        if not sampled:
            return
        rids = list(step)
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
        sampled = keep
        idx = mx.array(sampled) if len(sampled) != len(rows) else None
        results = sample(logits if idx is None else logits[idx], srows)
        now = time.perf_counter()
        for a, r in zip(actives, results, strict=True):
            self._on_token(a, r, now)

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
        self.scheduler.finish(a.seq)
        del self._active[a.req.request_id]
        text = ""
        if flush and reason in ("stop", "length"):
            tail, hit = a.stopper.feed(a.detok.flush())
            text = tail if hit is not None else tail + a.stopper.flush()
        seq = a.seq
        n_out = seq.num_generated
        usage = Usage(prompt_tokens=seq.num_prompt, completion_tokens=n_out, cached_tokens=seq.num_cached)
        if a.t_first is not None:
            usage.ttft_s = a.t_first - a.t_submit
            usage.prefill_tps = (seq.num_prompt - seq.num_cached) / max(usage.ttft_s, 1e-9)
            if n_out > 1 and a.t_last is not None and a.t_last > a.t_first:
                usage.decode_tps = (n_out - 1) / (a.t_last - a.t_first)
        a.emit(GenerationEvent(a.req.request_id, text, [], [], reason, usage, error, stop_reason, error_type))
