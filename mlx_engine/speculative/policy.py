"""How many tokens to propose for one sequence in one step, from its measured acceptance rate and
the cost of a step's tokens as the engine measures them (docs/architecture.md, "Speculative
decoding")."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationPolicy:
    """How many tokens to propose for one sequence in one step.

    ``cost_ratio`` (r) is what one more token in a forward pass costs relative to a pass's fixed
    cost, fitted online from the engine's own steps (``observe``: the forward pass, sampling and
    verification of every position, timed together): a step of ``T`` tokens takes
    ``a + c * T`` seconds, r = c / a. A step of ``B`` decoding rows then costs ``1 + r * B`` and
    with ``k`` proposals per row ``1 + r * B * (1 + k)``, for ``(1 - p^(k+1)) / (1 - p)`` tokens
    per row instead of one, ``p`` being the measured chance that a proposal is kept. With more
    than one row, add one more pass (1): the model runner batches rows of equal length, and the
    rows with no proposals this step (the text offers none) stay in a pass of their own; at 4
    streams on a CPU that pass is most of what speculating costs. A draft model adds ``q * k``
    (``draft_cost`` q: one draft pass per proposal position, for the whole step, relative to
    ``a``; measured by ``observe_draft``).
    """

    max_k: int = 5
    cost_ratio: float = 0.1  # prior, until passes have been measured
    measure: bool = True
    min_proposals: int = 8  # proposals seen before the measured rate replaces the prior
    # a draft model's pass (one per proposal position, shared by the step's rows) relative to the
    # target pass's fixed cost; 0 for proposers that cost nothing (n-gram lookup)
    draft_cost: float = 0.0
    prior_accept: float = 0.6  # until the engine has seen min_proposals proposals verified
    decay: float = 0.98
    # proposals verified and kept over every sequence (decayed per verdict): a new sequence's prior, so
    # that text the proposer cannot predict stops costing probes at the start of every request
    _seen: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # pp, pt, tt, py, ty
    _fixed: float | None = None  # a, the fitted fixed cost of a target pass (seconds)
    _draft_pass: float | None = None  # EWMA of a draft pass's seconds
    # A lone decoding row's step seconds by the tokens it held (EWMA). The line a + c * T fits a batch;
    # a lone row's cost need not be a line in its tokens (on the CPU one or two rows of x take the
    # integer matmul kernel and from three the float one: 1.23x a plain step for 2 tokens, 1.57x for 3).
    _lone: dict[int, float] = field(default_factory=dict)

    def verdict(self, proposed: int, kept: int) -> None:
        """``proposed`` tokens of one sequence were verified, ``kept`` of them kept."""
        if proposed > 0:
            self._seen[0] = 0.99 * self._seen[0] + proposed
            self._seen[1] = 0.99 * self._seen[1] + kept

    def prior(self) -> float:
        """What a sequence with few verdicts of its own is expected to keep: the engine's recent rate
        once it has one, else ``prior_accept``."""
        seen, kept = self._seen
        return kept / seen if seen >= self.min_proposals else self.prior_accept

    def acceptance(self, proposed: int, accepted: int) -> float:
        if proposed < self.min_proposals:  # its own verdicts, the missing ones at the prior's rate
            return min((accepted + self.prior() * (self.min_proposals - proposed)) / self.min_proposals, 0.99)
        return min(accepted / proposed, 0.99)

    def observe(self, passes: int, tokens: int, seconds: float, rows: int = 0) -> None:
        """One step: ``passes`` batched passes over ``tokens`` tokens of ``rows`` rows, then sampling,
        took ``seconds``."""
        if not self.measure:
            return
        if rows == 1:
            was = self._lone.get(tokens)
            self._lone[tokens] = seconds if was is None else 0.8 * was + 0.2 * seconds
        s, d = self._sums, self.decay
        for i, v in enumerate(
            (passes * passes, passes * tokens, tokens * tokens, passes * seconds, tokens * seconds)
        ):
            s[i] = d * s[i] + v
        det = s[0] * s[2] - s[1] * s[1]
        if det <= 1e-9 * max(s[0] * s[2], 1e-30):
            return  # every pass had the same size so far: the slope is not known yet
        a = (s[3] * s[2] - s[1] * s[4]) / det
        c = (s[0] * s[4] - s[1] * s[3]) / det
        if a > 0:
            self.cost_ratio = max(c, 0.0) / a
            self._fixed = a
            self._update_draft_cost()

    def observe_draft(self, passes: int, seconds: float) -> None:
        """A draft model ran ``passes`` forward passes in ``seconds`` for one step's proposals."""
        if not self.measure or passes <= 0:
            return
        t = seconds / passes
        self._draft_pass = t if self._draft_pass is None else 0.8 * self._draft_pass + 0.2 * t
        self._update_draft_cost()

    def _update_draft_cost(self) -> None:
        if self._fixed and self._draft_pass is not None:
            self.draft_cost = self._draft_pass / self._fixed

    def choose(self, proposed: int, accepted: int, decoding_rows: int) -> int:
        k = self._best_k(self.acceptance(proposed, accepted), decoding_rows)
        if k == 0 and proposed == 0:
            # A sequence's first proposal is tried wherever the fixed prior would try it: the engine's
            # recent rate (other requests' text, other sampling) must not keep a sequence from a
            # verdict of its own. One probe costs one two-token step; if it is rejected the sequence
            # stops there.
            return min(1, self._best_k(self.prior_accept, decoding_rows))
        return k

    def _best_k(self, p: float, decoding_rows: int) -> int:
        rb = self.cost_ratio * max(decoding_rows, 1)
        passes = 2 if decoding_rows > 1 else 1  # proposing rows, and those with none
        best_k, best = 0, 1.0
        for k in range(1, self.max_k + 1):
            cost = (passes + rb * (1 + k)) / (1 + rb)  # relative to a step without proposals
            lone = self._lone_cost(k) if decoding_rows <= 1 else None
            if lone is not None:
                cost = lone
            gain = (1 - p ** (k + 1)) / (1 - p) / (cost + self.draft_cost * k / (1 + rb))
            if gain > best * 1.02:  # a clear win only
                best_k, best = k, gain
        return best_k

    def _lone_cost(self, k: int) -> float | None:
        """A lone row's step with ``k`` proposals relative to one without, as measured; None until
        both have been seen (the line's estimate stands in, and trying it measures it)."""
        plain, step = self._lone.get(1), self._lone.get(1 + k)
        return step / plain if plain and step else None
