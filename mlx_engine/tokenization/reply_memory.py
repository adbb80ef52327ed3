"""The token ids the model generated, kept next to the text they produced.

Chat clients send history back as text. A reply's text does not always re-tokenize to the ids
that were generated (``"he" + "llo"`` was sampled, ``"hello"`` is what the tokenizer makes), and
then the prefix cache match stops at that reply. ``ReplyMemory`` remembers, per finished
generation, the ids behind its text, so that ``Tokenizer.encode_chat`` can use them again when a
later prompt holds that text where the reply was.

Entries are keyed by the request's cache salt as well as the text: a tenant must not learn, from
how its prompt tokenizes, that another tenant was sent some text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class ReplyMemory:
    """A bounded LRU map (salt, reply text) -> generated token ids. Thread safe."""

    def __init__(self, max_entries: int = 1024, max_tokens: int = 1 << 20):
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str | None, str], tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(
        self, text: str, ids: list[int], decode: Callable[[list[int]], str], salt: str | None = None
    ) -> bool:
        """Keep ``ids`` for ``text`` if they decode to it, or a prefix of them does (a stop string
        cut the text short, or an end-of-turn token followed it). Returns whether it was kept."""
        if not text.strip() or "\ufffd" in text or not ids or len(ids) > self.max_tokens:
            return False  # a broken character's bytes cannot be told apart from the text's own U+FFFD
        for n in range(len(ids), max(0, len(ids) - 8), -1):
            if decode(ids[:n]) == text:
                break
        else:
            return False
        key = (salt, text)
        with self._lock:
            if key in self._entries:
                self._tokens -= len(self._entries.pop(key))
            self._entries[key] = tuple(ids[:n])
            self._tokens += n
            while self._entries and (len(self._entries) > self.max_entries or self._tokens > self.max_tokens):
                _, old = self._entries.popitem(last=False)
                self._tokens -= len(old)
        return True

    def recall(self, text: str, salt: str | None = None) -> list[int] | None:
        with self._lock:
            ids = self._entries.get((salt, text))
            if ids is None:
                return None
            self._entries.move_to_end((salt, text))
            return list(ids)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0
