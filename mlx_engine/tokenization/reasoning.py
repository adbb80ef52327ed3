"""A reply's thinking kept apart from its answer: the think markers of a model family, found from
its vocabulary and chat template, and an incremental splitter the engine's output stage runs on
every reply (so every API and the TUI see the same split).

Families mark thinking with a pair of markers, usually single special tokens: ``<think>`` /
``</think>`` (Qwen3, DeepSeek-R1 and its distills, QwQ, GLM, MiniMax, Kimi), ``[THINK]`` /
``[/THINK]`` (Magistral), and a few others mlx-lm also knows (``mlx_lm.tokenizer_utils
._infer_thinking``). A pair counts when both markers are single tokens of the vocabulary, or when
the chat template writes both (a GGUF's tokenizer may list ``<think>`` as plain text).

Where a reply starts: several templates open the thinking section themselves (DeepSeek-R1
distills, Qwen3 thinking-2507 models end the generation prompt with ``<think>\\n``), so the reply
carries only the end marker. ``opens_thinking`` reads that from the rendered prompt, not the reply.

Only a thinking section at the start of a reply is reasoning (what llama.cpp and vLLM parse):
once the answer has begun, marker text in it is the answer's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# (start, end), the most common first
KNOWN_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("[THINK]", "[/THINK]"),
    ("<seed:think>", "</seed:think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str


def infer_markers(template: str | None, single_token: Callable[[str], bool]) -> ThinkMarkers | None:
    """The think markers of a model: a known pair whose two markers are single tokens
    (``single_token(text)``) or both appear in its chat template."""
    for start, end in KNOWN_MARKERS:
        if (single_token(start) and single_token(end)) or (
            template and start in template and end in template
        ):
            return ThinkMarkers(start, end)
    return None


def opens_thinking(prompt_tail: str, markers: ThinkMarkers) -> bool:
    """Whether a rendered prompt ends inside an open thinking section (its generation prompt
    wrote the start marker, and nothing but whitespace after it)."""
    i, j = prompt_tail.rfind(markers.start), prompt_tail.rfind(markers.end)
    return i >= 0 and i > j and not prompt_tail[i + len(markers.start) :].strip()


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Feed a reply's text as it is generated; get back (reasoning, content) pieces. Text that may
    be the start of a marker is held back until it is clear what it is."""

    def __init__(self, markers: ThinkMarkers, inside: bool = False):
        self.markers = markers
        self.state = "reasoning" if inside else "start"  # start -> reasoning -> content, or start -> content
        self._buf = ""
        self._after_end = False  # whitespace right after the end marker is not the answer's

    @property
    def thinking(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.markers.start):
                self._buf = head[len(self.markers.start) :]
                self.state = "reasoning"
            elif self.markers.start.startswith(head):
                return "", ""  # whitespace, or a marker still arriving
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self._buf.find(self.markers.end)
            if i < 0:
                keep = _held(self._buf, self.markers.end)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(self.markers.end) :]
            self.state, self._after_end = "content", True
        if self._after_end:
            rest = self._buf.lstrip()
            if not rest:
                self._buf = ""
                return reasoning, ""
            self._buf, self._after_end = rest, False
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what was held back. A reply cut inside its thinking keeps its
        reasoning (less a marker cut short); one that never began thinking keeps its whitespace."""
        buf, self._buf = self._buf, ""
        if self.state == "reasoning":
            return buf[: len(buf) - _held(buf, self.markers.end)], ""
        if self.state == "start":
            return "", buf
        return "", "" if self._after_end else buf
