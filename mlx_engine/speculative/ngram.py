"""Prompt lookup (n-gram) proposals for speculative decoding: what followed the context's last
few tokens the last time they occurred (in the prompt or the output) is proposed next."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last ``n`` tokens
    (longest ``n`` first) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_ngram + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            tail = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # excludes the tail itself
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # what followed the most recent occurrence
                return [int(t) for t in arr[start : start + k]]
        return []
