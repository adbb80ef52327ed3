"""Stop strings matched across token boundaries, never emitted.

The decode loop feeds each new piece of detokenized text to a ``StopMatcher``. It
returns the text that is safe to show now and, once a stop string has appeared, which
one. Text that might be the start of a stop string is held back until the next piece
decides it; text at and after a stop is dropped.

Which stop wins: the one whose occurrence *ends* first when reading left to right (the
first one a reader would see completed); among those ending at the same place, the one
that starts earliest (the longest). This makes the result independent of how the text
is split into pieces: feeding "xbc" at once or one character at a time gives the same
answer. In the common case (stops that are not substrings of each other) it is simply
the stop that occurs earliest in the text.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, the matched stop string or None).

        After a stop has matched, everything fed is dropped: ("", None).
        """
        if self.matched is not None:
            return "", None
        if not self.stops:
            return text, None
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:  # longest first, so ties on the end go to the longest
            start = buf.find(stop)
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return buf[: best[1]], best[2]
        hold = self._held_suffix_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The held-back text, when generation ends without (further) stop."""
        held, self._held = self._held, ""
        return held

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-n:]
            if any(stop.startswith(tail) for stop in self.stops if len(stop) > n):
                return n
        return 0
