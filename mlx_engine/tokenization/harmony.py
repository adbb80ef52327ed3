"""gpt-oss's harmony replies, parsed as they are generated: the ``analysis`` channel is the
reasoning, ``final`` (and ``commentary`` addressed to no one, a preamble) the answer, and a message
addressed ``to=functions.NAME`` a tool call whose body is its JSON arguments.

A reply, after the generation prompt ``<|start|>assistant``, is one or more messages::

    <|channel|>analysis<|message|>Let me look.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

``<|return|>`` and ``<|call|>`` end the turn (gpt-oss's end tokens; a reply that stops at one
carries no end marker at all). OpenAI's ``openai-harmony`` renders and parses this format, but only
on o200k token ids and after downloading o200k's vocabulary on first use (offline it fails:
``HarmonyError: error downloading or loading vocab file``), so Duet parses harmony's text, which the
output stage sees with the control tokens decoded as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mlx_engine.tokenization.tool_calls import ParsedToolCall, held_prefix

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_BODY_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_HEADER_MAX = 512  # a header longer than this is not one: the model is writing plain text


def harmony_template(template: str | None, vocab: dict[str, int]) -> bool:
    """Whether a model speaks harmony (gpt-oss): its template or vocabulary has the channel tokens."""
    return "<|channel|>" in (template or "") or ("<|channel|>" in vocab and "<|constrain|>" in vocab)


@dataclass
class HarmonyPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def add(self, other: HarmonyPiece) -> HarmonyPiece:
        return HarmonyPiece(
            self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls
        )


class HarmonyParser:
    """Feed a harmony reply's text; get back its reasoning, answer and calls as they complete."""

    def __init__(self, parse_calls: bool = True) -> None:
        """``parse_calls``: tools were offered (otherwise a call's text is left in the answer)."""
        self.parse_calls = parse_calls
        self._buf = ""
        self._state = "header"  # header -> body -> header ...
        self._kind = "content"  # the body's: reasoning, content or call
        self._recipient = ""
        self.calls: list[ParsedToolCall] = []

    @property
    def thinking(self) -> bool:
        return self._state == "body" and self._kind == "reasoning"

    def _open_body(self, header: str) -> None:
        m = _CHANNEL_NAME.search(header)
        channel = m.group(1) if m else ""
        r = _RECIPIENT.search(header)
        self._recipient = r.group(1) if r else ""
        if self._recipient.startswith("functions.") and self.parse_calls:
            self._kind = "call"
        elif channel == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"
        self._state = "body"

    def _emit(self, text: str, out: HarmonyPiece) -> None:
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "content":
            out.content += text

    def _close_call(self, args: str, out: HarmonyPiece, cut: bool = False) -> None:
        name = self._recipient.removeprefix("functions.")
        text = args.strip()
        try:
            text = json.dumps(json.loads(text), ensure_ascii=False) if text else "{}"
        except ValueError:
            if not cut:  # arguments that are not JSON: what the model wrote, as its answer
                out.content += text
                return
        call = ParsedToolCall(name, text)
        self.calls.append(call)
        out.calls.append(call)

    def feed(self, text: str) -> HarmonyPiece:
        out = HarmonyPiece()
        self._buf += text
        while True:
            if self._state == "header":
                i = self._buf.find(MESSAGE)
                if i < 0:
                    head = self._buf.lstrip()
                    if head and not (head.startswith(("<|", "assistant", "to=")) or "<|".startswith(head)):
                        self._kind, self._state = "content", "body"  # plain text, no header
                        continue
                    if len(self._buf) > _HEADER_MAX:
                        self._kind, self._state = "content", "body"
                        continue
                    return out
                header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE) :]
                self._open_body(header)
            else:
                ends = [(j, m) for m in _BODY_ENDS if (j := self._buf.find(m)) >= 0]
                if not ends:
                    if self._kind != "call":
                        keep = max(held_prefix(self._buf, m) for m in _BODY_ENDS)
                        self._emit(self._buf[: len(self._buf) - keep], out)
                        self._buf = self._buf[len(self._buf) - keep :]
                    return out
                j, marker = min(ends)
                body, self._buf = self._buf[:j], self._buf[j + len(marker) :]
                if self._kind == "call":
                    self._close_call(body, out)
                else:
                    self._emit(body, out)
                self._state = "header"

    def finish(self, truncated: bool = False) -> HarmonyPiece:
        """The end of the reply (at ``<|return|>`` or ``<|call|>``, which end generation, or cut)."""
        out, buf = HarmonyPiece(), self._buf
        self._buf = ""
        if self._state == "body":
            if self._kind == "call":
                self._close_call(buf, out, cut=truncated)
            else:
                self._emit(buf[: len(buf) - max(held_prefix(buf, m) for m in _BODY_ENDS)], out)
        self._state = "header"
        return out
