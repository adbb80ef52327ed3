"""Tool calls parsed out of a reply as it is generated, in the syntax of the model's family.

A family writes each call (or each group of calls) between an open and a close marker
(``tool_formats.ToolSyntax``): Hermes/Qwen ``<tool_call>{json}</tool_call>``, Qwen3-Coder
``<tool_call><function=NAME><parameter=...>``, Mistral ``[TOOL_CALLS]...`` (no close marker: the
block runs to the next ``[TOOL_CALLS]`` or the end of the reply), and so on. ``ToolCallStream``
finds the blocks in streamed text and hands each block's body to the family's parser; everything
else is content. Text that might be the start of an open marker is held back until it is clear
what it is. A block whose body does not parse stays in the content, verbatim.

A reply cut by ``max_tokens`` inside a Hermes call still comes back as a call, as OpenAI's does:
the name (completed from the known tool names when the cut fell inside it) and whatever arguments
text was generated, for the client to see with ``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_engine.tokenization.tool_formats import ToolSyntax


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_from_json(obj: object) -> ParsedToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments already encoded
        try:
            json.loads(args)
        except ValueError:
            return None
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_call_body(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return call_from_json(obj)


# the start of a call as models (and the forced-call grammar) write it: the name, then the arguments
_CALL_START = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?'
    r'(?P<args>\s*,\s*"(?:arguments|parameters)"\s*:\s*)?',
    re.S,
)


def cut_call_body(body: str, names: Sequence[str]) -> ParsedToolCall | None:
    """The JSON call a block cut short by ``max_tokens`` was writing, or None if that is not clear.

    ``names`` are the tools offered: a name cut short is completed when only one of them fits.
    """
    m = _CALL_START.match(body)
    if m is None:  # cut before the name began: clear only when there is one tool to call
        started = body.strip()
        if len(names) == 1 and '{"name": "'.startswith(re.sub(r"\s+", " ", started)):
            return ParsedToolCall(names[0], "")
        return None
    try:
        name = json.loads(f'"{m["name"]}"')
    except ValueError:  # cut inside an escape
        return None
    if not m["closed"]:
        fits = [n for n in names if n.startswith(name)]
        if len(fits) != 1:
            return None
        name = fits[0]
    arguments = body[m.end() :].rstrip() if m["args"] else ""
    return ParsedToolCall(name, arguments)


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


StreamItem = str | ParsedToolCall  # content text, or a call


def _default_syntax() -> ToolSyntax:
    from mlx_engine.tokenization.tool_formats import HERMES

    return HERMES


class ToolCallStream:
    """Feed text deltas; get back content (``str``) and ``ParsedToolCall`` items, in order."""

    def __init__(
        self,
        names: Sequence[str] = (),
        forced: bool = False,
        syntax: ToolSyntax | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        """``names``: the tools offered (to complete a name cut short by ``max_tokens``);
        ``forced``: a grammar makes the reply tool calls only; ``syntax``: the family's (Hermes
        when not given); ``tools``: the OpenAI tools offered (parsers that type arguments by their
        schema read them)."""
        self.names = tuple(names)
        self.forced = forced
        self.syntax = syntax or _default_syntax()
        self.tools = tools
        self._buf = ""
        self._inside = False
        self._opener = ""  # the marker that opened the block we are in
        self._text_last = False  # the last item out was text (not a call)
        self._started = False  # content has begun (for syntaxes whose calls only open a reply)
        self._ws = ""  # whitespace held back: dropped if it only separates tool calls
        self.calls: list[ParsedToolCall] = []

    def _content(self, text: str, out: list[StreamItem]) -> None:
        if not text:
            return
        if not text.strip():
            self._ws += text
            return
        self._started = self._text_last = True
        out.append(self._ws + text)
        self._ws = ""

    def _add_calls(self, calls: list[ParsedToolCall], out: list[StreamItem]) -> None:
        """Calls found: whitespace held since the text before them is that text's (the same
        however the text was split); whitespace between calls is dropped."""
        if self._ws and self._text_last:
            out.append(self._ws)
        self._ws, self._text_last = "", False
        self.calls += calls
        out += calls

    def _close_block(
        self, body: str, calls: list[ParsedToolCall], out: list[StreamItem], opener: str
    ) -> None:
        if not calls:
            self._content(opener + body + self.syntax.close, out)
            return
        self._add_calls(calls, out)

    def _find_open(self) -> tuple[int, str]:
        """Where the next block opens in the buffer, and its marker (-1 if none yet)."""
        best, marker = -1, ""
        for m in self.syntax.opens:
            if m in self.syntax.start_opens:
                if self._started or self.calls:
                    continue
                head = len(self._buf) - len(self._buf.lstrip())
                i = head if self._buf[head:].startswith(m) else -1
            else:
                i = self._buf.find(m)
            if i >= 0 and (best < 0 or i < best):
                best, marker = i, m
        return best, marker

    def _keep(self) -> int:
        """How much of the buffer's end may still become an open marker."""
        keep = 0
        for m in self.syntax.opens:
            if m in self.syntax.start_opens:
                if self._started or self.calls:
                    continue
                if m.startswith(self._buf.lstrip()):
                    keep = max(keep, len(self._buf))
                continue
            keep = max(keep, held_prefix(self._buf, m))
        return keep

    def _block_end(self) -> tuple[int, int, list[ParsedToolCall]]:
        """Where the open block's body ends and the rest begins, and its calls (-1: not yet).

        With a close marker, the first one after which the body parses ends the block: a close
        marker inside a string of the arguments is the arguments' own text."""
        close = self.syntax.close
        if close:
            j = self._buf.find(close)
            while j >= 0:
                calls = self.syntax.parse_body(self._buf[:j], self.tools)
                if calls:
                    return j, j + len(close), calls
                j = self._buf.find(close, j + 1)
            return -1, -1, []
        # no close marker: the block runs to the next open marker (which starts a new block)
        marks = [m for m in self.syntax.opens if m not in self.syntax.start_opens]
        j = min((k for m in marks if (k := self._buf.find(m)) >= 0), default=-1)
        return (j, j, self.syntax.parse_body(self._buf[:j], self.tools)) if j >= 0 else (-1, -1, [])

    def feed(self, text: str) -> list[StreamItem]:
        out: list[StreamItem] = []
        self._buf += text
        while True:
            if not self._inside:
                i, marker = self._find_open()
                if i < 0:
                    keep = self._keep()
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(self._buf[:i], out)
                skip = 0 if marker in self.syntax.start_opens else len(marker)
                self._buf = self._buf[i + skip :]
                self._opener = marker
                self._inside = True
            else:
                j, rest, calls = self._block_end()
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[rest:]
                self._inside = False
                self._close_block(
                    body, calls, out, "" if self._opener in self.syntax.start_opens else self._opener
                )

    def finish(self, truncated: bool = False) -> list[StreamItem]:
        """End of generation: an unclosed block still counts when its body parses (EOS right
        after the call, or a syntax with no close marker), or, when ``truncated`` (cut by
        max_tokens), when it began a call; anything else left over is content."""
        out: list[StreamItem] = []
        syntax = self.syntax
        if self._inside:
            opener = "" if self._opener in syntax.start_opens else self._opener
            body = self._buf.rstrip()
            if syntax.close:
                body = body[: len(body) - held_prefix(body, syntax.close)]  # a close marker cut short
            calls = syntax.parse_body(body, self.tools)
            if not calls and truncated and syntax.json_body:
                cut = cut_call_body(body, self.names)
                calls = [cut] if cut is not None else []
            first = self._buf.find(syntax.close) if syntax.close else -1
            if calls:
                self._add_calls(calls, out)
            elif first >= 0 and not truncated:
                # no close marker ended a call: the block up to the first one is text, and what
                # follows is read again (it may hold calls)
                rest = self._buf[first + len(syntax.close) :]
                self._content(opener + self._buf[: first + len(syntax.close)], out)
                self._buf, self._inside = "", False
                return out + self.feed(rest) + self.finish(truncated)
            else:
                self._content(opener + self._buf, out)
        elif (
            truncated
            and syntax.json_body
            and syntax.opens[0].startswith(self._buf)
            and len(self._buf) >= (1 if self.forced else 6)
        ):
            # cut inside the opening tag ("<tool_" at least, any of it when the grammar forces a
            # call): markup, not content; a call if it can only be one
            call = cut_call_body("", self.names)
            if call is not None:
                self._add_calls([call], out)
        else:
            self._content(self._buf, out)
        if self._ws and not self.calls:
            out.append(self._ws)
        self._buf, self._ws, self._inside = "", "", False
        return out


def parse_tool_calls(
    text: str,
    truncated: bool = False,
    names: Sequence[str] = (),
    forced: bool = False,
    syntax: ToolSyntax | None = None,
    tools: list[dict] | None = None,
) -> tuple[str | None, list[ParsedToolCall]]:
    """Whole text -> (content or None, tool calls). ``truncated``: cut by max_tokens."""
    s = ToolCallStream(names, forced, syntax, tools)
    items = s.feed(text) + s.finish(truncated)
    content = "".join(x for x in items if isinstance(x, str))
    if s.calls and not content.strip():
        return None, s.calls
    return content, s.calls
