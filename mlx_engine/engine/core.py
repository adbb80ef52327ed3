"""The engine core: one ``step()`` schedules, applies arriving KV, runs the model and samples, on
whatever thread calls it. No threads, locks or event loops here (``api.py`` owns those), so a test
can drive the core directly: ``add``, then ``step()`` until it returns False.

A step: exports' send windows are asked, proposals are made for decoding sequences (speculative
decoding: data the scheduler sizes into the step), the scheduler's ``Step`` is made (and never
changed after), copy-on-write copies and KV loads start, the model runs the step's rows, the
scheduler ``advance``s over what was computed, and the sampled rows' tokens go to the output
processor; drafted rows are verified first (``speculative/verify.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.config import EngineConfig
from mlx_engine.engine.build import build_kv
from mlx_engine.engine.inputs import InputProcessor
from mlx_engine.engine.kv_transfer import Export, KVTransfer
from mlx_engine.engine.messages import MailboxSink
from mlx_engine.engine.outputs import Finish, Outbox, OutputProcessor, RequestState
from mlx_engine.errors import DuetError, QueueFullError
from mlx_engine.kv_cache.kv_source import KVSource
from mlx_engine.kv_cache.paged_attention import LayerExport
from mlx_engine.loading.loader import LoadedModel
from mlx_engine.model_runner import ModelRunner, Row
from mlx_engine.sampling.sampler import SampleResult, sample
from mlx_engine.scheduler import RUNNING, Scheduler, SchedulerConfig, Sequence
from mlx_engine.speculative.draft_model import DraftModelProposer, output_rows
from mlx_engine.speculative.ngram import NgramProposer
from mlx_engine.speculative.policy import SpeculationPolicy
from mlx_engine.speculative.verify import sampler_row, verify
from mlx_engine.tokenization.reply_memory import ReplyMemory

log = logging.getLogger("mlx_engine.engine")

# KV bytes from sources applied per iteration (at least one frame always is): bounds the time a
# step waits while a remote load arrives
KV_APPLY_BUDGET = 64 * 2**20


class EngineCore:
    """The model, its KV store and the scheduler, stepped by one thread (``api.Engine``'s worker)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        context_length: int,
        draft: LoadedModel | None,
        replies: ReplyMemory,
        sink: MailboxSink,
        identity: Callable[[], str],
        released: Callable[[str], None] = lambda rid: None,
    ):
        self.loaded, self.config = loaded, config
        self.tokenizer = loaded.tokenizer
        if (config.reasoning_format, config.tool_format, config.chat_template) != ("auto", "auto", None):
            template = Path(config.chat_template).read_text() if config.chat_template else None
            self.tokenizer.configure_replies(config.reasoning_format, config.tool_format, template)
        self.draft = draft
        self.released = released  # told (on this thread) each request id the core lets go of
        c, m = config, loaded
        kv = build_kv(c, m, draft, context_length, identity)
        self.pool, self.allocator, self.draft_pool, self.disk = kv.pool, kv.allocator, kv.draft_pool, kv.disk
        self.block_bytes = kv.block_bytes
        self.scheduler = Scheduler(self.allocator, SchedulerConfig.of(c), num_layers=m.num_layers)
        self.runner = ModelRunner(m.model, self.pool)
        self.speculation = SpeculationPolicy()  # how many tokens to propose (config.speculative)
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if c.speculative == "ngram":
            self.proposer = NgramProposer()
        elif draft is not None and self.draft_pool is not None:
            vocab = min(output_rows(m.model), output_rows(draft.model))
            self.proposer = DraftModelProposer(draft, self.draft_pool, vocab, c.prefill_chunk)
        self.outbox: Outbox = {}
        self.inputs = InputProcessor(
            self.tokenizer,
            replies,
            context_length,
            (self.allocator.num_blocks - 1) * self.allocator.block_size,
        )
        self.outputs = OutputProcessor(self.tokenizer, replies, self.outbox, config.reasoning_budget)
        self.kv = KVTransfer(self.scheduler, self.pool, sink, KV_APPLY_BUDGET)
        self.requests: dict[str, RequestState] = {}
        self.exports: dict[str, Export] = {}
        self.steps = 0
        self.remote_prefills = 0  # requests that got prompt KV from a remote source
        self.prefill_rate: float | None = None  # EWMA of local prefill tokens per second
        if self.disk is not None:
            self.scheduler.sources.append(self.disk)

    # --- requests in ------------------------------------------------------------------
    def add(self, st: RequestState) -> None:
        self.requests[st.req.request_id] = st
        lead = self.requests.get(st.req.fork_of) if st.req.fork_of else None
        if (
            lead is not None
            and lead.seq.tokens[: lead.seq.num_prompt] == st.seq.tokens
            and lead.req.cache_salt == st.req.cache_salt
        ):
            st.seq.leader = lead.seq
        try:
            self.scheduler.add(st.seq)
        except QueueFullError as e:  # preempted sequences filled the queue since the submit
            self.finish(st, Finish("error", error=str(e), error_type=QueueFullError))

    def add_export(self, x: Export) -> None:
        self.exports[x.seq.request_id] = x
        try:
            self.scheduler.add(x.seq)
        except QueueFullError as e:
            self.finish_export(x, str(e))

    def cancel(self, request_id: str) -> None:
        if request_id in self.requests:
            self.finish(self.requests[request_id], Finish("cancelled"))
        elif request_id in self.exports:
            self.finish_export(self.exports[request_id], "cancelled")

    def add_source(self, source: KVSource, engine: Any) -> None:
        """Ask ``source`` too from now on (after the ones already there); ``engine`` is what the
        source's ``attach`` hook is given."""
        self.scheduler.sources.append(source)
        if not source.is_cache:
            # local prefill then ends as a remote one does: exact first-token logits
            self.scheduler.cfg.last_token_alone = True
        source.attach(engine)  # e.g. a peer client builds its HELLO from the pool and starts connecting

    def remove_source(self, source: KVSource) -> None:
        if source in self.scheduler.sources:
            self.scheduler.sources.remove(source)

    # --- one step -----------------------------------------------------------------------
    def step(self) -> bool:
        """Apply arriving KV, then schedule and run one step; False when there was nothing to
        do. A step that fails fails the requests it ran, never the core."""
        try:
            self.kv.apply(self.requests)
            return self._step()
        except Exception as e:
            log.exception("a step failed")
            for st in list(self.requests.values()):
                if st.seq.status == RUNNING:
                    self.finish(st, Finish("error", error=f"generation failed: {e}"))
            for x in list(self.exports.values()):
                if x.seq.status == RUNNING:
                    self.finish_export(x, f"generation failed: {e}")
            return True

    @property
    def has_kv_backlog(self) -> bool:
        return bool(self.kv.backlog)

    def _step(self) -> bool:
        for x in list(self.exports.values()):
            if x.can_send is not None:
                try:
                    x.seq.paused = not x.can_send()
                except Exception as e:
                    self.finish_export(x, f"can_send failed: {e}")
        step = self.scheduler.schedule(self._proposals())
        # copy-on-write of blocks shared (n > 1 choices) or cached part-full, before a load or the
        # forward pass writes on
        for src, dst in step.copies:
            self.pool.copy_block(src, dst)
            if self.draft_pool is not None and isinstance(self.proposer, DraftModelProposer):
                self.draft_pool.copy_block(src, dst)
                self.proposer.copied(src, dst)
        for sl in step.loads:
            self.kv.start(sl, self.requests)
        for rid in step.admitted:
            if rid in self.exports:
                x = self.exports[rid]
                x.accept(self.pool)
                if x.error is not None:
                    self.finish_export(x, x.error)
        # what the rows compute: the step's tokens, less the exports that ended as they were accepted
        run = {rid: n for rid, n in step.tokens.items() if step.seqs[rid].status == RUNNING}
        if not run:
            return bool(step.loads)
        self.steps += 1
        if isinstance(self.proposer, DraftModelProposer):  # the step's proposals, in one batch
            passes, t_draft = self.proposer.passes, time.perf_counter()
            for seq in self.proposer.fill([step.seqs[rid] for rid in run]):
                self.scheduler.withdraw_proposals(seq)  # its draft is still catching up
                run[seq.request_id] = 1
            self.speculation.observe_draft(self.proposer.passes - passes, time.perf_counter() - t_draft)
        rows = [self._row(step.seqs[rid], n) for rid, n in run.items()]
        prefill = sum(
            max(min(seq.num_computed + n, seq.num_prompt) - seq.num_computed, 0)
            for seq, n in ((step.seqs[rid], n) for rid, n in run.items())
        )
        t0 = time.perf_counter()
        logits = self.runner.forward(rows)
        if prefill >= 16:
            rate = prefill / max(time.perf_counter() - t0, 1e-9)
            self.prefill_rate = rate if self.prefill_rate is None else 0.75 * self.prefill_rate + 0.25 * rate
        rids = list(run)
        done = set(self.scheduler.advance(step, run))
        for x in [self.exports[r] for r in rids if r in self.exports]:
            if x.error is not None:
                self.finish_export(x, x.error)
            elif x.seq.request_id in done:
                self.finish_export(x)
        sampled = [i for i, rid in enumerate(rids) if rid in done and rid in self.requests]
        drafted = [i for i in sampled if step.seqs[rids[i]].num_unverified]
        for seq in (step.seqs[r] for r in rids):
            if seq.num_unverified and seq.request_id not in self.requests:
                self.scheduler.end_proposals(seq, 0)
        if drafted:
            sampled = [i for i in sampled if i not in drafted]
            self._verify(
                [self.requests[rids[i]] for i in drafted], [self.runner.position_logits[i] for i in drafted]
            )
        if sampled:
            self._sample([self.requests[rids[i]] for i in sampled], sampled, len(rids), logits)
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

    def _proposals(self) -> dict[str, list[int]]:
        """Tokens to propose after each decoding sequence's last one (speculative decoding)."""
        if self.proposer is None:
            return {}
        decoding = [s for s in self.scheduler.running if s.num_pending == 1 and not s.paused]
        out = {}
        for seq in decoding:
            st = self.requests.get(seq.request_id)
            if st is None or st.req.constraint is not None or st.forced or seq.num_generated < 1:
                continue  # an export, or a grammar that must see each token first
            k = self.speculation.choose(seq.spec_proposed, seq.spec_accepted, len(decoding))
            if k == 0 and seq.num_generated % 16 == 0 and len(decoding) <= 2:
                k = 1  # probe now and then: what the text does may have changed
            k = min(k, seq.max_total - len(seq.tokens) - 1)
            if k < 1 or (self.draft is not None and len(seq.tokens) + k > self.draft.context_length):
                continue  # past the draft model's context: its guesses would be noise
            proposed = self.proposer.propose(seq.tokens, k)
            if proposed:
                out[seq.request_id] = proposed
        return out

    def _row(self, seq: Sequence, n: int) -> Row:
        row = Row(seq.tokens[seq.num_computed : seq.num_computed + n], seq.num_computed, seq.blocks)
        row.all_logits = seq.num_unverified > 0
        x = self.exports.get(seq.request_id)
        if x is not None:
            t0, t1 = max(x.start, seq.num_computed), seq.num_computed + n
            if t1 > t0:
                row.export = LayerExport(seq.blocks, t0, t1, x.hook())
        return row

    def _sample(self, states: list[RequestState], at: list[int], num_rows: int, logits: mx.array) -> None:
        """Sample the next token of each request (``at``: their rows in ``logits``)."""
        keep, srows, live = [], [], []
        for st, i in zip(states, at, strict=True):
            allowed = st.req.constraint.allowed_tokens() if st.req.constraint is not None else None
            if st.forced:  # a spent thinking budget: the end marker, token by token
                allowed = np.zeros(self.tokenizer.vocab_size, dtype=bool)
                allowed[st.forced[0]] = True
            if allowed is not None and not allowed.any():
                self.finish(st, Finish("error", error="the output constraint allows no further token"))
                continue
            live.append(st)
            keep.append(i)
            srows.append(sampler_row(st.req.sampling, st.rng, st.seq, len(st.seq.tokens), allowed))
        if not keep:
            return
        idx = mx.array(keep) if len(keep) != num_rows else None
        results = sample(self._tokens_only(logits if idx is None else logits[idx]), srows)
        now = time.perf_counter()
        for st, r in zip(live, results, strict=True):
            self._emit(st, r, now)

    def _verify(self, states: list[RequestState], logits: list[mx.array]) -> None:
        """Verify the proposals of drafted rows; emit what was kept and roll the rest back."""
        rows = [
            (st.seq, st.req.sampling, st.rng, self._tokens_only(lg))
            for st, lg in zip(states, logits, strict=True)
        ]
        for st, results in zip(states, verify(rows), strict=True):
            seq = st.seq
            proposed = self.scheduler.end_proposals(seq, len(results) - 1)
            self.speculation.verdict(len(proposed), len(results) - 1)
            now = time.perf_counter()
            for i, r in enumerate(results):
                self._emit(st, r, now)
                if st.done:
                    break
                if i < len(results) - 1:
                    self.scheduler.proposal_kept(seq)

    def _tokens_only(self, logits: mx.array) -> mx.array:
        """Logits of the tokenizer's ids only: a model whose output layer is padded past its
        vocabulary (rows kept for alignment, as vLLM's LogitsProcessor drops them) never emits an
        id that is no token."""
        vocab = self.tokenizer.vocab_size
        return logits[:, :vocab] if logits.shape[-1] > vocab else logits

    def _emit(self, st: RequestState, r: SampleResult, now: float) -> None:
        end = self.outputs.token(st, r, now)
        if end is not None:
            self.finish(st, end)

    # --- the end of a request -------------------------------------------------------------
    def finish(self, st: RequestState, end: Finish) -> None:
        if st.done:
            return
        st.done = True
        for src, load_id in self.scheduler.finish(st.seq):
            self.kv.cancel_at_source(src, load_id)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.forget(st.req.request_id)
        del self.requests[st.req.request_id]
        self.released(st.req.request_id)
        usage, remote = self.outputs.usage(st, self.config.speculative != "off")
        self.remote_prefills += remote
        for src in self.scheduler.sources:  # e.g. a peer's offload planner records the measured TTFT
            try:
                src.request_finished(st.req.request_id, st.seq.tokens, usage)
            except Exception as e:
                log.warning("KV source %s: request_finished failed: %s", src.name, e)
        self.outputs.finish(st, usage, end)

    def finish_export(self, x: Export, error: str | None = None) -> None:
        if x.done:
            return
        x.done = True
        for src, load_id in self.scheduler.finish(x.seq):
            self.kv.cancel_at_source(src, load_id)
        del self.exports[x.seq.request_id]
        self.released(x.seq.request_id)
        x.report(error)

    def stop(self, error_type: type[DuetError]) -> None:
        """End everything (the engine shuts down) and write the prefix cache to the disk tier."""
        for st in list(self.requests.values()):
            self.finish(st, Finish("error", error="the engine shut down", error_type=error_type))
        for x in list(self.exports.values()):
            self.finish_export(x, "the engine shut down")
        self.kv.drop_backlog()
        self._flush_prefix_cache()

    def _flush_prefix_cache(self) -> None:
        if self.disk is None or self.allocator.index is None:
            return
        index = self.allocator.index
        for b in index.blocks(salted=False, tails=False):  # no salted prefix, and whole blocks only
            self.disk.save(index.path_tokens(b), self.pool.read_block(b))
