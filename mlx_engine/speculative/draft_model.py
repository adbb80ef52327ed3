"""The draft-model proposer (``speculative="draft"``, ``--draft-model``): a smaller model with the
target's tokenizer proposes tokens greedily, verified like any proposal (``verify.py``), so it
changes how many proposals are kept, never what is emitted.

Its KV lives in a second ``KVPool`` indexed by the *same block ids* as the target's (the draft
allocates nothing; admission, preemption, copy-on-write and the budget stay the scheduler's).
Invariants: a block is *marked* (a hash of every token up to its end) only while its draft KV is
complete for those tokens, and any draft write into it clears the mark first; ``propose`` only
reserves placeholders, and ``fill`` writes the real proposals before the target's pass is built.
How and why: docs/architecture.md ("Speculative decoding", "Draft model").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_engine.errors import ConfigError
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.loading.loader import LoadedModel
from mlx_engine.model_runner import ModelRunner, Row
from mlx_engine.scheduler import Sequence

PLACEHOLDER = 0  # a reserved proposal's token until ``fill`` writes the real one


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """ConfigError unless ``draft`` reads and writes token ids exactly as ``target`` does."""
    t, d = target.tokenizer, draft.tokenizer
    why = None
    if t.vocab_size != d.vocab_size:
        why = f"its vocabulary has {d.vocab_size} tokens, the model's {t.vocab_size}"
    elif t.backend.get_vocab(with_added_tokens=True) != d.backend.get_vocab(with_added_tokens=True):
        why = "its tokens have other ids"
    elif t.eos_token_ids != d.eos_token_ids or t.bos_token_id != d.bos_token_id:
        why = "its end or start tokens differ"
    if why is not None:
        raise ConfigError(
            f"the draft model {draft.name} does not share {target.name}'s tokenizer ({why}); "
            "a draft model must use the same tokenizer",
            "draft_model",
        )


def output_rows(model: nn.Module) -> int:
    """How many token ids a model's output layer scores (its vocabulary, padding included)."""
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    return int(head.weight.shape[0])


@dataclass
class _State:
    preemptions: int  # the sequence's count when ``valid`` was measured (a preemption resets it)
    valid: int = 0  # leading tokens of the sequence whose draft KV is in its blocks
    proposed: list[int] = field(default_factory=list)  # proposals written after ``valid`` last step
    chain: list[int] = field(default_factory=list)  # per full block: a hash of every token up to its end
    marked: int = 0  # leading blocks of the sequence this state has marked in ``marks``


class DraftModelProposer:
    """Greedy proposals from a draft model with its KV in a pool sharing the target's block ids."""

    def __init__(self, draft: LoadedModel, pool: KVPool, vocab_limit: int, chunk: int = 256):
        self.draft = draft
        self.pool = pool
        self.runner = ModelRunner(draft.model, pool)
        self.vocab_limit = vocab_limit  # proposals are ids the target scores (and embeds)
        self.chunk = max(chunk, 1)
        self.states: dict[str, _State] = {}  # request id -> its draft KV's state
        # block id -> chain hash of the tokens its draft KV was computed for (complete blocks only):
        # a prefix hit on such a block reuses the draft's KV too
        self.marks: dict[int, int] = {}
        self.passes = 0  # draft forward calls (for tests and the bench)
        self.tokens_computed = 0  # tokens the draft processed (for tests and the bench)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Reserve ``k`` proposals (placeholders; ``fill`` computes them in the step's batch)."""
        return [PLACEHOLDER] * max(k, 0)

    def forget(self, request_id: str) -> None:
        """The sequence finished: drop its state (its draft KV goes with its blocks)."""
        self.states.pop(request_id, None)

    def copied(self, src: int, dst: int) -> None:
        """Block ``src`` was copied to ``dst`` in both pools (copy-on-write)."""
        if src in self.marks:
            self.marks[dst] = self.marks[src]
        else:
            self.marks.pop(dst, None)

    def _chain(self, st: _State, tokens: list[int], n_blocks: int) -> list[int]:
        bs = self.pool.block_size
        while len(st.chain) < n_blocks:
            i = len(st.chain)
            st.chain.append(hash((st.chain[-1] if i else 0, tuple(tokens[i * bs : (i + 1) * bs]))))
        return st.chain

    def _valid(self, seq: Sequence) -> int:
        st = self.states.get(seq.request_id)
        if st is None or st.preemptions != seq.preemptions:
            # new blocks: those whose draft KV was computed for the same tokens (a prefix hit on
            # blocks another sequence, or this one before a preemption, drafted) are reused
            st = self.states[seq.request_id] = _State(seq.preemptions)
            limit = min((seq.num_verified - 1) // self.pool.block_size, len(seq.blocks))
            chain = self._chain(st, seq.tokens, limit)
            while st.marked < limit and self.marks.get(seq.blocks[st.marked]) == chain[st.marked]:
                st.marked += 1
            st.valid = st.marked * self.pool.block_size
        n = st.valid
        for tok in st.proposed:  # proposals kept by verification: their KV is still right
            if n >= seq.num_verified or seq.tokens[n] != tok:
                break
            n += 1
        return min(n, seq.num_verified - 1)  # the last real token is never in the draft yet

    def fill(self, seqs: list[Sequence]) -> list[Sequence]:
        """Write the proposals of sequences whose ``num_unverified`` placeholders ``propose`` reserved.
        A sequence whose draft is more than ``chunk`` tokens behind (a new or re-admitted one)
        catches up by one ``chunk`` in this step and gets no proposals: it is returned, for the
        caller to withdraw its placeholders (so no step waits for a whole draft prefill)."""
        seqs = [s for s in seqs if s.num_unverified]
        if not seqs:
            return []
        starts = [self._valid(s) for s in seqs]
        ends = [s.num_verified for s in seqs]
        behind = [i for i, s in enumerate(seqs) if ends[i] - starts[i] > self.chunk]
        ready = [i for i in range(len(seqs)) if ends[i] - starts[i] <= self.chunk]
        rows = [
            Row(seqs[i].tokens[starts[i] : starts[i] + self.chunk], starts[i], seqs[i].blocks) for i in behind
        ]
        rows += [Row(seqs[i].tokens[starts[i] : ends[i]], starts[i], seqs[i].blocks) for i in ready]
        logits = self._forward(rows)
        for i in behind:
            self._written(seqs[i], starts[i] + self.chunk, [])
        if not ready:
            return [seqs[i] for i in behind]
        nxt = self._greedy(logits[len(behind) :])
        proposals: dict[int, list[int]] = {i: [t] for i, t in zip(ready, nxt, strict=True)}
        live = ready
        for j in range(1, max(seqs[i].num_unverified for i in ready)):
            live = [i for i in live if seqs[i].num_unverified > j]
            rows = [Row([proposals[i][-1]], ends[i] - 1 + j, seqs[i].blocks) for i in live]
            for i, t in zip(live, self._greedy(self._forward(rows)), strict=True):
                proposals[i].append(t)
        for i in ready:
            s = seqs[i]
            drafts = proposals[i][: s.num_unverified]
            s.tokens[s.num_verified :] = drafts
            # KV written: the sequence's tokens, and every proposal but the last
            self._written(s, ends[i], drafts[:-1])
        return [seqs[i] for i in behind]

    def _forward(self, rows: list[Row]) -> mx.array:
        bs = self.pool.block_size
        for r in rows:  # blocks written now no longer hold what their mark says
            for b in r.blocks[r.start // bs : (r.start + len(r.tokens) - 1) // bs + 1]:
                self.marks.pop(b, None)
        self.passes += 1
        self.tokens_computed += sum(len(r.tokens) for r in rows)
        return self.runner.forward(rows)  # rows of equal length share a pass

    def _written(self, seq: Sequence, valid: int, proposed: list[int]) -> None:
        """After a fill: ``seq``'s first ``valid`` tokens and then ``proposed`` have draft KV; the
        blocks that now hold complete draft KV are marked for prefix hits."""
        st = self.states[seq.request_id]
        st.valid, st.proposed = valid, proposed
        full = min(valid // self.pool.block_size, len(seq.blocks))
        chain = self._chain(st, seq.tokens, full)
        for i in range(st.marked, full):
            self.marks[seq.blocks[i]] = chain[i]
        st.marked = max(st.marked, full)

    def _greedy(self, logits: mx.array) -> list[int]:
        ids = np.asarray(mx.argmax(logits[:, : self.vocab_limit], axis=-1))
        return [int(t) for t in ids]
