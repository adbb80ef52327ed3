"""Parse Hermes/Qwen-style tool calls out of generated text.

Models trained on the Hermes format (Qwen2/2.5/3, Hermes, SmolLM2's tool tune, many others)
write each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The parser
turns those blocks into OpenAI tool calls and leaves everything else as content. A block
whose body is not a JSON object with a ``name`` stays in the content, verbatim.

``ToolCallStream`` does the same incrementally for streamed responses: text that might be
the start of a ``<tool_call>`` tag is held back until it is clear what it is.

A reply cut by ``max_tokens`` inside a call still comes back as a call, as OpenAI's does: the
name (completed from the known tool names when the cut fell inside it) and whatever arguments
text was generated, for the client to see with ``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlx_engine.sampling.constraints import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


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


def parse_call_body(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
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


# the start of a call as models (and the forced-call grammar) write it: the name, then the arguments
_CALL_START = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?'
    r'(?P<args>\s*,\s*"(?:arguments|parameters)"\s*:\s*)?',
    re.S,
)


def cut_call_body(body: str, names: Sequence[str]) -> ParsedToolCall | None:
    """The call a block cut short by ``max_tokens`` was writing, or None if that is not clear.

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


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


StreamItem = str | ParsedToolCall  # content text, or a call


class ToolCallStream:
    """Feed text deltas; get back content (``str``) and ``ParsedToolCall`` items, in order."""

    def __init__(self, names: Sequence[str] = (), forced: bool = False) -> None:
        """``names``: the tools offered (to complete a name cut short by ``max_tokens``);
        ``forced``: a grammar makes the reply tool calls only."""
        self.names = tuple(names)
        self.forced = forced
        self._buf = ""
        self._inside = False
        self._ws = ""  # whitespace held back: dropped if it only separates tool calls
        self.calls: list[ParsedToolCall] = []

    def _content(self, text: str, out: list[StreamItem]) -> None:
        if not text:
            return
        if not text.strip():
            self._ws += text
            return
        out.append(self._ws + text)
        self._ws = ""

    def _close_block(self, body: str, out: list[StreamItem]) -> None:
        call = parse_call_body(body.strip())
        if call is None:
            self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, out)
            return
        self._ws = ""
        self.calls.append(call)
        out.append(call)

    def feed(self, text: str) -> list[StreamItem]:
        out: list[StreamItem] = []
        self._buf += text
        while True:
            if not self._inside:
                i = self._buf.find(TOOL_CALL_OPEN)
                if i < 0:
                    keep = _held_prefix(self._buf, TOOL_CALL_OPEN)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(self._buf[:i], out)
                self._buf = self._buf[i + len(TOOL_CALL_OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(TOOL_CALL_CLOSE)
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(TOOL_CALL_CLOSE) :]
                self._inside = False
                self._close_block(body, out)

    def finish(self, truncated: bool = False) -> list[StreamItem]:
        """End of generation: an unclosed block still counts when its body parses (EOS right
        after the JSON), or, when ``truncated`` (cut by max_tokens), when it began a call;
        anything else left over is content."""
        out: list[StreamItem] = []
        if self._inside:
            body = self._buf.rstrip()
            body = body[: len(body) - _held_prefix(body, TOOL_CALL_CLOSE)]  # a close tag cut short
            call = parse_call_body(body.strip())
            if call is None and truncated:
                call = cut_call_body(body, self.names)
            if call is not None:
                self.calls.append(call)
                out.append(call)
            else:
                self._content(TOOL_CALL_OPEN + self._buf, out)
        elif (
            truncated and TOOL_CALL_OPEN.startswith(self._buf) and len(self._buf) >= (1 if self.forced else 6)
        ):
            # cut inside the opening tag ("<tool_" at least, any of it when the grammar forces a
            # call): markup, not content; a call if it can only be one
            call = cut_call_body("", self.names)
            if call is not None:
                self.calls.append(call)
                out.append(call)
        else:
            self._content(self._buf, out)
        if self._ws and not self.calls:
            out.append(self._ws)
        self._buf, self._ws, self._inside = "", "", False
        return out


def parse_tool_calls(
    text: str, truncated: bool = False, names: Sequence[str] = (), forced: bool = False
) -> tuple[str | None, list[ParsedToolCall]]:
    """Whole text -> (content or None, tool calls). ``truncated``: cut by max_tokens."""
    s = ToolCallStream(names, forced)
    items = s.feed(text) + s.finish(truncated)
    content = "".join(x for x in items if isinstance(x, str))
    if s.calls and not content.strip():
        return None, s.calls
    return content, s.calls
