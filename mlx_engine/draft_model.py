"""The draft-model proposer for speculative decoding (``speculative="draft"``, ``--draft-model``).

A second, smaller model that shares the target's tokenizer proposes ``k`` tokens greedily after a
decoding sequence's last one; the engine verifies them in the target's batched step exactly as it
verifies prompt-lookup proposals (speculative.py): a greedy proposal is a fixed token, so the
output is token-identical to plain decoding for greedy requests and has the target's distribution
(and, for a seed, the same tokens) when sampling. The draft only changes how many proposals are
kept, never what is emitted.

**Its KV.** A second ``KVPool`` with the draft's geometry (its layers, heads, head size, dtype) is
indexed by the *same block ids* as the target's pool: token ``t`` of a sequence has its draft KV
at ``table[t // block_size]`` of the draft pool, in the sequence's own block table. So the draft
allocates nothing: admission, preemption, copy-on-write (the engine copies a block in both pools)
and the memory budget (each block pays for both, ``Engine._build``) stay the scheduler's, and
a sequence's draft KV is freed with its blocks. (Separate blocks per draft sequence were the
alternative: every id has storage in both pools, so an id held for the draft alone would leave its
target storage unused, and the draft's memory would cost as much per token as the target's.)

**What is valid.** Per sequence the proposer keeps how many of its tokens have draft KV (``valid``)
and the proposals whose KV it wrote last step; after verification the kept proposals' KV stays
valid and the rest is simply overwritten next time: no copies on rollback. A preemption (or a
first admission with a prefix hit) gives the sequence blocks whose draft KV this proposer did not
write, so ``valid`` restarts at 0 and the draft recomputes the context: its own prefill, one
``chunk``-token piece per step while the sequence decodes plainly, proposing again once it is at
most a piece behind (no step waits for a whole draft prefill). Draft writes below the target's
``num_computed`` may land in blocks shared with another sequence; those hold the same tokens
there, so the values written are the same.

**Batching.** ``propose`` only reserves: it returns ``k`` placeholders, so the scheduler sizes the
step and gives the sequence blocks for all ``1 + k`` positions (copy-on-write included). Once the
step's block copies are made, ``fill`` computes every reserved sequence's proposals together: one
draft pass over each sequence's new tokens (rows of equal length batched), then ``k - 1``
single-token passes over all sequences still proposing, and writes the proposals over the
placeholders before the target's pass is built.
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


class DraftModelProposer:
    """Greedy proposals from a draft model with its KV in a pool sharing the target's block ids."""

    def __init__(self, draft: LoadedModel, pool: KVPool, vocab_limit: int, chunk: int = 256):
        self.draft = draft
        self.pool = pool
        self.runner = ModelRunner(draft.model, pool)
        self.vocab_limit = vocab_limit  # proposals are ids the target scores (and embeds)
        self.chunk = max(chunk, 1)
        self.states: dict[str, _State] = {}  # request id -> its draft KV's state
        self.passes = 0  # draft forward calls (for tests and the bench)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Reserve ``k`` proposals (placeholders; ``fill`` computes them in the step's batch)."""
        return [PLACEHOLDER] * max(k, 0)

    def forget(self, request_id: str) -> None:
        """The sequence finished: drop its state (its draft KV goes with its blocks)."""
        self.states.pop(request_id, None)

    def _valid(self, seq: Sequence) -> int:
        st = self.states.get(seq.request_id)
        if st is None or st.preemptions != seq.preemptions:
            st = self.states[seq.request_id] = _State(seq.preemptions)
        n = st.valid
        for tok in st.proposed:  # proposals kept by verification: their KV is still right
            if n >= seq.num_verified or seq.tokens[n] != tok:
                break
            n += 1
        return min(n, seq.num_verified - 1)  # the last real token is never in the draft yet

    def fill(self, seqs: list[Sequence]) -> list[Sequence]:
        """Write the proposals of sequences whose ``num_draft`` placeholders ``propose`` reserved.
        A sequence whose draft is more than ``chunk`` tokens behind (a new or re-admitted one)
        catches up by one ``chunk`` in this step and gets no proposals: it is returned, for the
        caller to withdraw its placeholders (so no step waits for a whole draft prefill)."""
        seqs = [s for s in seqs if s.num_draft]
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
        logits = self.runner.forward(rows)  # rows of equal length share a pass
        self.passes += 1
        for i in behind:
            self.states[seqs[i].request_id] = _State(seqs[i].preemptions, starts[i] + self.chunk)
        if not ready:
            return [seqs[i] for i in behind]
        nxt = self._greedy(logits[len(behind) :])
        proposals: dict[int, list[int]] = {i: [t] for i, t in zip(ready, nxt, strict=True)}
        live = ready
        for j in range(1, max(seqs[i].num_draft for i in ready)):
            live = [i for i in live if seqs[i].num_draft > j]
            rows = [Row([proposals[i][-1]], ends[i] - 1 + j, seqs[i].blocks) for i in live]
            for i, t in zip(live, self._greedy(self.runner.forward(rows)), strict=True):
                proposals[i].append(t)
            self.passes += 1
        for i in ready:
            s = seqs[i]
            drafts = proposals[i][: s.num_draft]
            s.tokens[s.num_verified :] = drafts
            # KV written: the sequence's tokens, and every proposal but the last
            self.states[s.request_id] = _State(s.preemptions, ends[i], drafts[:-1])
        return [seqs[i] for i in behind]

    def _greedy(self, logits: mx.array) -> list[int]:
        ids = np.asarray(mx.argmax(logits[:, : self.vocab_limit], axis=-1))
        return [int(t) for t in ids]
