"""Speculative decoding: who proposes tokens (``ngram``, ``draft_model``), how many
(``policy``), and how proposals are verified against the target's samples (``verify``).

Greedy output is token-identical to plain decoding and sampled output has the target's
distribution (docs/architecture.md, "Speculative decoding").
"""

from mlx_engine.speculative.ngram import NgramProposer
from mlx_engine.speculative.policy import SpeculationPolicy

__all__ = ["NgramProposer", "SpeculationPolicy"]
