"""Streaming detokenizer: token ids in, final text out, a piece at a time.

Decoding one token on its own is wrong in two ways: a multi-byte character may be split
across byte-level tokens (decoding half of it gives U+FFFD), and decoders treat the first
token of what they decode specially (SentencePiece / Metaspace drop its leading space).
So each step decodes a small window: the tokens already emitted since the previous step
(the *prefix*, which absorbs the first-token effects) plus the new ones, and emits only the
text past the prefix's. While the window's text ends in U+FFFD the character may still be
incomplete, so nothing is emitted and the window grows until it is complete.

Invariant: ``"".join(add(t) for t in ids) + flush() == tokenizer.decode(ids, skip_special_tokens)``,
with one exception: SentencePiece byte-fallback runs (<0xNN> tokens) that are not valid UTF-8.
HF's decoder then turns the *whole* run into U+FFFD, complete characters before the bad byte
included; we have already emitted those, so we keep them and give U+FFFD for the bad bytes.
Cost per token: two decodes of a few tokens, independent of the length of the text.
"""

from __future__ import annotations

from mlx_engine.tokenization.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Skipped tokens never reach the decoder in a full decode either, so leaving them out
        # of the window keeps first-token effects (a dropped leading space) where they belong.
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # the window: prefix tokens, then tokens not yet emitted
        self._read = 0  # window index where the not-yet-emitted tokens start
        self._prefix_text = ""  # decode of self._ids[:self._read]
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text that became final (may be "")."""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        window = self._decode(self._ids)
        if len(window) <= len(self._prefix_text) or window.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        if window.startswith(self._prefix_text):
            new = window[len(self._prefix_text) :]
        else:  # an invalid byte-fallback run turned the prefix's characters into U+FFFD too
            new = self._decode(self._ids[self._read :])
        # the emitted tokens become the next prefix
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """The text still held back (an incomplete or invalid sequence at the end)."""
        window = self._decode(self._ids)
        new = window[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += new
        return new
