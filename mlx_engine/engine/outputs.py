"""What a request's sampled tokens become: text through the streaming detokenizer and the stop
matcher, logprobs, the finish reason, usage, and the events its caller receives.

Events are collected per caller event loop (the ``Outbox``) and handed over with one wake-up per
loop per worker iteration instead of one per token: fewer self-pipe writes and GIL hand-offs
while the worker and BLAS threads are busy. Each event goes straight into the caller's own
``asyncio.Queue`` (one queue between the worker thread and the event loop), tagged with the
caller's key when it gave one. The model family's reply parser (``ReplyParser``: reasoning, answer,
tool calls) runs here, so every API and the TUI share it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from mlx_engine.engine.inputs import Prepared
from mlx_engine.errors import DuetError
from mlx_engine.request import GenerationEvent, GenerationRequest, TokenLogprob, Usage
from mlx_engine.sampling.sampler import SampleResult, SeedState, make_rng
from mlx_engine.scheduler import Sequence
from mlx_engine.tokenization.detokenizer import StreamingDetokenizer
from mlx_engine.tokenization.reasoning import opens_thinking
from mlx_engine.tokenization.reply_memory import ReplyMemory
from mlx_engine.tokenization.reply_parser import ReplyParser
from mlx_engine.tokenization.stop_strings import StopMatcher
from mlx_engine.tokenization.tokenizer import Tokenizer

NO_KEY = object()  # events go into the queue as they are (``Engine.generate``)

Outbox = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]]


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def flush_outbox(outbox: Outbox) -> None:
    """Hand each caller loop the events of this iteration (one ``call_soon_threadsafe`` per loop)."""
    for loop, items in outbox.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass
    outbox.clear()


@dataclass
class RemoteUsage:
    """What KV loads from non-cache sources cost a request (usage's remote fields)."""

    exact: bool | None = None  # from the source's load_info(load_id)["exact"], when it has one
    bytes: int = 0
    wait_s: float = 0.0  # load start -> done or failure, summed over its loads
    compute_s: float = 0.0  # the source's own compute time (DONE)


@dataclass(eq=False)
class RequestState:
    """One generation request on the worker: its sequence and everything that turns its tokens
    into events."""

    req: GenerationRequest
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    key: Hashable
    detok: StreamingDetokenizer
    stopper: StopMatcher
    rng: SeedState
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    done: bool = False
    remote: RemoteUsage = field(default_factory=RemoteUsage)
    text: list[str] = field(default_factory=list)  # what was emitted (thinking and answer, as generated)
    parser: ReplyParser | None = None  # reasoning, answer and tool calls apart (the model's format)
    reasoning_tokens: int = 0
    forced: list[int] = field(
        default_factory=list
    )  # the next tokens, whatever the model says (a spent budget)

    @classmethod
    def new(
        cls, prepared: Prepared, tokenizer: Tokenizer, queue: asyncio.Queue, key: Hashable = NO_KEY
    ) -> RequestState:
        r = prepared.request
        fmt = tokenizer.reply_format
        parser = None
        if (r.split_reasoning and (fmt.think or fmt.harmony)) or r.tool_parsing is not None:
            inside = False
            if fmt.think is not None:  # the rendered prompt says whether the reply starts inside thinking
                tail = tokenizer.decode(prepared.ids[-16:], skip_special_tokens=False)
                inside = opens_thinking(tail, fmt.think)
            parser = ReplyParser(fmt, r.split_reasoning, inside, r.tool_parsing)
        return cls(
            req=r,
            seq=prepared.sequence(),
            loop=asyncio.get_running_loop(),
            queue=queue,
            key=key,
            detok=StreamingDetokenizer(tokenizer),
            stopper=StopMatcher(list(r.stop)),
            rng=make_rng(r.sampling.seed),
            parser=parser,
        )


@dataclass(frozen=True)
class Finish:
    """How a request ends: its finish reason and what its last event says."""

    reason: str  # "stop", "length", "cancelled" or "error"
    stop_reason: Any = None  # the stop token id or stop string
    flush: bool = True  # emit the detokenizer's held-back text first (not after a stop string)
    error: str | None = None  # what went wrong ("error")
    error_type: type[DuetError] | None = None  # the DuetError kind a caller may raise for it


class OutputProcessor:
    """Turns sampled tokens into events; runs on the worker thread."""

    def __init__(
        self, tokenizer: Tokenizer, replies: ReplyMemory, outbox: Outbox, reasoning_budget: int | None = None
    ):
        """``reasoning_budget``: the thinking budget of requests that give none (--reasoning-budget)."""
        self.tokenizer = tokenizer
        self.replies = replies
        self.outbox = outbox
        self.reasoning_budget = reasoning_budget

    def emit(self, st: RequestState, ev: GenerationEvent) -> None:
        st.text.append(ev.reasoning + ev.text)
        item = ev if st.key is NO_KEY else (st.key, ev)
        self.outbox.setdefault(st.loop, []).append((st.queue, item))

    def _event(self, st: RequestState, text: str, final: bool = False, **kw: Any) -> GenerationEvent:
        """An event for ``text`` as generated: its reasoning, answer and tool calls apart
        (``RequestState.parser``); the ``final`` one also takes what the parser held back."""
        if st.parser is None:
            return GenerationEvent(st.req.request_id, text, **kw)
        p = st.parser.feed(text)
        reasoning, content, calls = p.reasoning, p.content, p.calls
        if final:
            q = st.parser.finish(kw.get("finish_reason") == "length")
            reasoning, content, calls = reasoning + q.reasoning, content + q.content, calls + q.calls
        return GenerationEvent(st.req.request_id, content, reasoning=reasoning, tool_calls=calls, **kw)

    def token(self, st: RequestState, r: SampleResult, now: float) -> Finish | None:
        """Append a sampled token to the request and emit its event; what ends the request, if it
        does."""
        seq, req, tok = st.seq, st.req, int(r.token_id)
        if st.t_first is None:
            st.t_first = now
        st.t_last = now
        seq.tokens.append(tok)
        if req.constraint is not None:
            req.constraint.accept(tok)
        if st.forced and st.forced[0] == tok:
            st.forced.pop(0)
        lp = []
        if req.sampling.logprobs:
            assert r.logprob is not None  # the sampler sets it when logprobs are asked for
            piece = self.tokenizer.piece
            lp = [
                TokenLogprob(
                    tok, piece(tok), float(r.logprob), tuple((t, piece(t), float(v)) for t, v in r.top)
                )
            ]
        if (tok in self.tokenizer.eos_token_ids and not req.ignore_eos) or tok in req.stop_token_ids:
            self.emit(st, GenerationEvent(req.request_id, "", [tok], lp))
            return Finish("stop", tok)
        thinking = st.parser is not None and st.parser.thinking
        marker = self.tokenizer.special_markers.get(tok)
        raw = st.detok.add(tok) if marker is None else st.detok.flush() + marker  # a full decode skips it
        text, hit = st.stopper.feed(raw)
        self.emit(st, self._event(st, text, token_ids=[tok], logprobs=lp))
        if thinking or (st.parser is not None and st.parser.thinking):
            st.reasoning_tokens += 1  # inside the thinking section, its markers included
            self._check_budget(st)
        if hit is not None:
            return Finish("stop", hit, flush=False)
        if req.constraint is not None and req.constraint.is_finished():
            return Finish("stop")
        if len(seq.tokens) >= seq.max_total:
            return Finish("length")
        return None

    def _check_budget(self, st: RequestState) -> None:
        """A thinking section that has spent its budget is closed: the family's end marker (and,
        for harmony, the start of the final message) becomes the next tokens."""
        budget = st.req.thinking_budget if st.req.thinking_budget is not None else self.reasoning_budget
        if budget is None or st.reasoning_tokens < budget or st.forced or st.parser is None:
            return
        if not st.parser.thinking:
            return
        st.forced = self.tokenizer.encode(self.tokenizer.reply_format.closing_text, add_special_tokens=False)

    @staticmethod
    def usage(st: RequestState, speculative: bool) -> tuple[Usage, bool]:
        """The request's usage, and whether its prompt was prefilled remotely (in part)."""
        seq = st.seq
        n_out = seq.num_generated
        usage = Usage(prompt_tokens=seq.num_prompt, completion_tokens=n_out, cached_tokens=seq.num_cached)
        usage.prompt_tokens_computed = seq.prompt_computed
        caches = {name for name, cache, _, _ in seq.load_ranges if cache}
        remote = {name: n for name, n in seq.loaded.items() if n and name not in caches}
        if remote:
            usage.prefill_location = "remote:" + ",".join(remote)
            usage.remote_tokens = sum(remote.values())
            usage.prefill_exact = st.remote.exact
        usage.remote_bytes = st.remote.bytes
        usage.remote_wait_s = st.remote.wait_s
        usage.remote_compute_s = st.remote.compute_s
        if seq.load_failures:
            usage.fallback_reason = "; ".join(seq.load_failures)
        if speculative:
            usage.speculative = {"proposed": seq.spec_proposed, "accepted": seq.spec_accepted}
        if st.t_first is not None:
            usage.ttft_s = st.t_first - st.t_submit
            usage.prefill_tps = (seq.num_prompt - seq.num_cached) / max(usage.ttft_s, 1e-9)
            if n_out > 1 and st.t_last is not None and st.t_last > st.t_first:
                usage.decode_tps = (n_out - 1) / (st.t_last - st.t_first)
        return usage, bool(remote)

    def finish(self, st: RequestState, usage: Usage, end: Finish) -> None:
        """Emit the request's last event; a reply that ended normally is remembered with the ids
        it was generated as (a multi-turn chat's next prompt then hits the prefix cache)."""
        text, reason = "", end.reason
        if end.flush and reason in ("stop", "length"):
            tail, hit = st.stopper.feed(st.detok.flush())
            text = tail if hit is not None else tail + st.stopper.flush()
        usage.reasoning_tokens = st.reasoning_tokens
        self.emit(
            st,
            self._event(
                st,
                text,
                final=True,
                finish_reason=reason,
                usage=usage,
                error=end.error,
                stop_reason=end.stop_reason,
                error_type=end.error_type,
            ),
        )
        seq = st.seq
        if reason in ("stop", "length") and st.req.messages is not None:
            self.replies.remember(
                "".join(st.text),
                seq.tokens[seq.num_prompt :],
                lambda ids: self.tokenizer.decode(ids, False),
                st.req.cache_salt,
            )
