"""System messages after the conversation has begun (Claude Code sends them; so may any OpenAI client).

A chat template either renders a system turn wherever one comes (ChatML, Qwen, Llama 3, Mistral v7,
Phi: the turn's text lands between the turns around it) or cannot (Gemma's raise "roles must
alternate", others drop it or fold only the first into the user turn). ``takes_system_turns``
finds out once per template by rendering a probe conversation; where a template cannot, ``place``
merges every later system message into the leading system prompt, in order, so the model still
reads all of it, only earlier than it was sent. Nothing is dropped either way.
"""

from __future__ import annotations

from collections.abc import Callable

# a system prompt, a user and an assistant turn, a late system message, a user turn: templates that
# insist on alternating roles (Gemma's) refuse it, those that render any role in place keep its order
_PROBE = [
    ("system", "\ue010probe-system-0\ue011"),
    ("user", "\ue010probe-user-1\ue011"),
    ("assistant", "\ue010probe-assistant-2\ue011"),
    ("system", "\ue010probe-system-3\ue011"),
    ("user", "\ue010probe-user-4\ue011"),
]


def takes_system_turns(render: Callable[[list[dict]], str]) -> bool:
    """Whether ``render`` (messages -> text) puts a system message after the first user turn where
    it was sent: between the turns around it, every other message still rendered, in order."""
    try:
        text = render([{"role": role, "content": text} for role, text in _PROBE])
    except Exception:  # the template refuses the conversation (raise_exception, a Jinja error)
        return False
    at = [text.find(content) for _, content in _PROBE]
    return all(i >= 0 for i in at) and at == sorted(at)


def is_late_system(messages: list[dict]) -> bool:
    """Whether any system message follows a message of another role."""
    seen_other = False
    for m in messages:
        if m.get("role") == "system":
            if seen_other:
                return True
        else:
            seen_other = True
    return False


def merge_into_first(messages: list[dict]) -> list[dict]:
    """The conversation with every system message merged, in order, into one leading system
    message (blank lines between their texts)."""
    system = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    first = next(m for m in messages if m.get("role") == "system")
    merged = {**first, "content": "\n\n".join(t for t in system if t)}
    return [merged, *rest]


def place(messages: list[dict], in_place: bool) -> list[dict]:
    """``messages`` as the template can take them: unchanged where system turns render in place
    (or none comes late), else with the late ones merged into the system prompt."""
    if in_place or not is_late_system(messages):
        return messages
    return merge_into_first(messages)
