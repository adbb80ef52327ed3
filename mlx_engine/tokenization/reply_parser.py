"""A reply taken apart as it is generated: its reasoning, its answer and its tool calls, in the
format of the model's family. The engine's output stage runs one ``ReplyParser`` per request, so
every API and the TUI see the same parse.

``ReplyFormat`` is what a model speaks, found once from its chat template and vocabulary
(``infer_reply_format``) and overridable (``--reasoning-format``, ``--tool-format``): think markers
(``reasoning.py``), a tool-call syntax (``tool_formats.py``), or harmony (gpt-oss, ``harmony.py``),
which carries both in its channels.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_engine.tokenization import harmony
from mlx_engine.tokenization.reasoning import ReasoningSplitter, ThinkMarkers, infer_markers
from mlx_engine.tokenization.tool_calls import ParsedToolCall, ToolCallStream
from mlx_engine.tokenization.tool_formats import (
    HERMES,
    TOOL_FORMATS,
    ToolSyntax,
    infer_tool_syntax,
    syntax_named,
)

REASONING_FORMATS = ("auto", "none")
# a template's own thinking switch when it is not enable_thinking (DeepSeek V3.1: ``{% if thinking %}``)
_THINKING_VAR = re.compile(r"\bif\s+(?:not\s+)?thinking\b|\bthinking\s+is\s+(?:not\s+)?defined")


@dataclass(frozen=True)
class ReplyFormat:
    think: ThinkMarkers | None = None
    tools: ToolSyntax | None = None  # None: Hermes calls, asked for in a system prompt
    harmony: bool = False
    thinking_kwarg: str | None = None  # the template's switch for thinking ("enable_thinking")

    @property
    def family(self) -> str:
        """A short description, for logs and ``/v1/models``."""
        if self.harmony:
            return "harmony"
        think = f"{self.think.start}{self.think.end}" if self.think else "no thinking"
        return f"{think}, {self.tools.name if self.tools else 'hermes'} tool calls"

    @property
    def markers(self) -> tuple[str, ...]:
        """Control texts the parser reads, which a decode must therefore keep."""
        out: list[str] = []
        if self.harmony:
            out += harmony.MARKERS
        if self.think:
            out += [self.think.start, self.think.end]
        out += list((self.tools or HERMES).markers)
        return tuple(out)

    @property
    def closing_text(self) -> str:
        """What ends a thinking section and opens the answer (a spent thinking budget writes it)."""
        if self.harmony:
            return f"{harmony.END}{harmony.START}assistant{harmony.CHANNEL}final{harmony.MESSAGE}"
        return f"{self.think.end}\n\n" if self.think else ""

    def thinking_kwargs(self, effort: str | None) -> dict[str, Any]:
        """Template variables that carry a thinking setting: ``effort`` is none, minimal, low,
        medium or high (OpenAI's ``reasoning_effort``), on or off (``--think`` / ``--no-think``),
        or None (the template's default). Off reaches templates with a switch (Qwen3's
        ``enable_thinking``); the levels reach those that read ``reasoning_effort`` (gpt-oss, which
        always reasons: off asks it for the least, low)."""
        if effort is None:
            return {}
        if effort not in ("none", "minimal", "off", "on", "low", "medium", "high"):
            effort = "high"  # a level above high (OpenAI's xhigh, Anthropic's max)
        on = effort not in ("none", "minimal", "off")
        out: dict[str, Any] = {}
        if self.thinking_kwarg:
            out[self.thinking_kwarg] = on
        if effort in ("low", "medium", "high"):
            out["reasoning_effort"] = effort
        elif self.harmony and not on:
            out["reasoning_effort"] = "low"
        return out

    def overridden(self, reasoning: str = "auto", tools: str = "auto") -> ReplyFormat:
        """This format with ``--reasoning-format`` / ``--tool-format`` applied."""
        if reasoning not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning format {reasoning!r}: one of {', '.join(REASONING_FORMATS)}")
        if tools not in TOOL_FORMATS:
            raise ValueError(f"unknown tool format {tools!r}: one of {', '.join(TOOL_FORMATS)}")
        fmt = self
        if reasoning == "none":
            fmt = replace(fmt, think=None)
        if tools == "none":
            fmt = replace(fmt, tools=None)
        elif tools != "auto":
            fmt = replace(fmt, tools=syntax_named(tools), harmony=False)
        return fmt


def infer_reply_format(template: str | None, vocab: dict[str, int]) -> ReplyFormat:
    """What a model's replies look like, from its chat template and vocabulary."""
    t = template or ""
    kwarg = "enable_thinking" if "enable_thinking" in t else ("thinking" if _THINKING_VAR.search(t) else None)
    if harmony.harmony_template(template, vocab):
        return ReplyFormat(harmony=True, thinking_kwarg=None)
    think = infer_markers(template, lambda s: s in vocab)
    return ReplyFormat(think=think, tools=infer_tool_syntax(template, vocab), thinking_kwarg=kwarg)


@dataclass(frozen=True)
class ToolParsing:
    """A request's tools, for the parser: their names (to complete a call cut short), the OpenAI
    tools (parsers that type arguments by schema read them), and whether a grammar forces calls."""

    names: tuple[str, ...] = ()
    tools: list[dict] | None = None
    forced: bool = False
    syntax: ToolSyntax | None = None  # this request's calls' syntax, when not the model's own


@dataclass
class ReplyPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


class ReplyParser:
    """Feed a reply's text as it is generated; get back its reasoning, answer and tool calls."""

    def __init__(
        self,
        fmt: ReplyFormat,
        split_reasoning: bool = True,
        inside_thinking: bool = False,
        tool_parsing: ToolParsing | None = None,
    ):
        """``inside_thinking``: the rendered prompt opened the thinking section (``opens_thinking``);
        ``tool_parsing``: tools were offered (None: the reply's text is all answer)."""
        self._harmony = (
            harmony.HarmonyParser(tool_parsing is not None) if fmt.harmony and split_reasoning else None
        )
        self._split = (
            ReasoningSplitter(fmt.think, inside_thinking)
            if fmt.think and split_reasoning and not fmt.harmony
            else None
        )
        self._tools = None
        if tool_parsing is not None and self._harmony is None:
            tp = tool_parsing
            self._tools = ToolCallStream(tp.names, tp.forced, tp.syntax or fmt.tools or HERMES, tp.tools)

    @property
    def thinking(self) -> bool:
        if self._harmony is not None:
            return self._harmony.thinking
        return self._split is not None and self._split.thinking

    def _after_split(self, reasoning: str, content: str, end: bool, truncated: bool) -> ReplyPiece:
        if self._tools is None:
            return ReplyPiece(reasoning, content)
        items: Sequence[str | ParsedToolCall] = self._tools.feed(content)
        if end:
            items = [*items, *self._tools.finish(truncated)]
        return ReplyPiece(
            reasoning,
            "".join(x for x in items if isinstance(x, str)),
            [x for x in items if isinstance(x, ParsedToolCall)],
        )

    def feed(self, text: str) -> ReplyPiece:
        if self._harmony is not None:
            h = self._harmony.feed(text)
            return ReplyPiece(h.reasoning, h.content, h.calls)
        if self._split is None:
            return self._after_split("", text, False, False)
        return self._after_split(*self._split.feed(text), False, False)

    def finish(self, truncated: bool = False) -> ReplyPiece:
        """The end of the reply (``truncated``: cut by max_tokens): what was held back."""
        if self._harmony is not None:
            h = self._harmony.finish(truncated)
            return ReplyPiece(h.reasoning, h.content, h.calls)
        reasoning, content = self._split.finish() if self._split is not None else ("", "")
        return self._after_split(reasoning, content, True, truncated)
