"""System messages sent mid-conversation (Claude Code's agent and skill lists, an OpenAI client's
late instruction): a template that renders any role keeps them in place; one that insists on
alternating roles gets them merged into the system prompt. Nothing is dropped either way."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from mlx_engine.errors import TemplateError
from mlx_engine.tokenization import system_turns
from mlx_engine.tokenization.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

# alternating roles, a leading system prompt folded into the first user turn (Gemma's shape)
ALTERNATING = (
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<turn>{{ m['role'] }}\n{{ (first if loop.first else '') + m['content'] }}</turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<turn>assistant\n{% endif %}"
)
# renders only a leading system message and silently skips any other
FIRST_ONLY = (
    "{% for m in messages %}{% if m['role'] == 'system' and loop.first %}[SYS]{{ m['content'] }}[/SYS]"
    "{% elif m['role'] != 'system' %}[{{ m['role'] }}]{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "system", "content": "Agents available: explore, plan."},
    {"role": "user", "content": "What can you do?"},
]


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")), chat_template=template)


def test_a_template_that_renders_any_role_keeps_the_late_system_turn_in_place():
    tok = tokenizer(DEFAULT_CHAT_TEMPLATE)
    assert tok.system_turns_in_place
    text = tok.apply_chat_template(CONVERSATION)
    order = [text.index(m["content"]) for m in CONVERSATION]
    assert order == sorted(order)
    assert "<|im_start|>system\nAgents available" in text


@pytest.mark.parametrize("template", [ALTERNATING, FIRST_ONLY], ids=["alternating", "first-only"])
def test_a_template_that_cannot_gets_it_merged_into_the_system_prompt(template):
    tok = tokenizer(template)
    assert not tok.system_turns_in_place
    text = tok.apply_chat_template(CONVERSATION)
    for m in CONVERSATION:
        assert m["content"] in text  # nothing dropped
    assert text.index("Agents available") < text.index("Hi there")  # read before the conversation
    assert text.index("Be brief.") < text.index("Agents available")  # in the order sent


def test_a_late_system_message_alone_after_the_user_turn():
    """Claude Code's shape: the user's turn, then a system message, then the reply."""
    messages = [{"role": "user", "content": "say hi"}, {"role": "system", "content": "Skills: none."}]
    text = tokenizer(DEFAULT_CHAT_TEMPLATE).apply_chat_template(messages)
    assert text.index("say hi") < text.index("Skills: none.") < text.rindex("<|im_start|>assistant")
    merged = tokenizer(ALTERNATING).apply_chat_template(messages)
    assert merged.index("Skills: none.") < merged.index("say hi")


def test_leading_system_messages_are_never_moved():
    two = [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "u"},
    ]
    assert not system_turns.is_late_system(two)
    assert system_turns.place(two, in_place=False) is two
    assert system_turns.is_late_system([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])


def test_a_template_that_fails_for_other_reasons_still_fails_clearly():
    tok = tokenizer("{{ raise_exception('no chats here') }}")
    assert not tok.system_turns_in_place
    with pytest.raises(TemplateError, match="no chats here"):
        tok.apply_chat_template(CONVERSATION)
