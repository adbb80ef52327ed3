"""One tokenizer type for every model source: a `tokenizers.Tokenizer` plus what the
model's metadata says about special tokens and its chat template.

GGUF files (see ``gguf_tokenizer.py``) and HF directories (``from_hf_dir``) both end up
here, so the engine, the detokenizer and the server never care where a model came from.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from mlx_engine.errors import TemplateError
from mlx_engine.tokenization import system_turns
from mlx_engine.tokenization.reply_parser import ReplyFormat, infer_reply_format

# Used when a model ships no chat template: ChatML, what most small instruct models speak.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass(frozen=True)
class _ControlText:
    """What control-token text looks like: whole tokens, and the pieces that could complete one
    next to other text (a string that ends in ``<|im_`` or starts with ``start|>``)."""

    whole: re.Pattern
    prefixes: frozenset[str]  # proper prefixes of a control token's text
    suffixes: frozenset[str]  # proper suffixes
    longest: int

    @classmethod
    def of(cls, texts: set[str]) -> _ControlText | None:
        if not texts:
            return None
        return cls(
            whole=re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))),
            prefixes=frozenset(t[:k] for t in texts for k in range(1, len(t))),
            suffixes=frozenset(t[k:] for t in texts for k in range(1, len(t))),
            longest=max(map(len, texts)),
        )

    def spans(self, s: str) -> list[tuple[int, int]]:
        """Where ``s`` holds control-token text, or a piece of one at either end."""
        spans = [m.span() for m in self.whole.finditer(s)]
        first = spans[0][0] if spans else len(s)
        head = next((k for k in range(min(first, self.longest), 0, -1) if s[:k] in self.suffixes), 0)
        rest = max(spans[-1][1] if spans else 0, head, len(s) - self.longest)
        tail = next((k for k in range(len(s) - rest, 0, -1) if s[-k:] in self.prefixes), 0)
        return ([(0, head)] if head else []) + spans + ([(len(s) - tail, len(s))] if tail else [])


class _Sentinels:
    """Stand-ins for control-token text in caller-supplied strings: private-use characters around
    a random per-call number, which templates pass through unchanged and callers cannot guess."""

    def __init__(self, control: _ControlText | None):
        self.control = control
        self.originals: dict[str, str] = {}  # sentinel -> the text it stands for
        self._by_text: dict[str, str] = {}
        self._nonce = f"{secrets.randbelow(10**12):012d}"
        self._pattern = re.compile(f"\ue000{self._nonce}_\\d+\ue001")

    def _sentinel(self, text: str) -> str:
        if text not in self._by_text:
            key = f"\ue000{self._nonce}_{len(self._by_text)}\ue001"
            self._by_text[text] = key
            self.originals[key] = text
        return self._by_text[text]

    def swap(self, value):
        """``value`` (strings, lists and dicts, nested; keys too) with control-token text replaced."""
        if self.control is None:
            return value
        if isinstance(value, str):
            out, at = [], 0
            for lo, hi in self.control.spans(value):
                out += [value[at:lo], self._sentinel(value[lo:hi])]
                at = hi
            return "".join([*out, value[at:]]) if out else value
        if isinstance(value, list | tuple):
            return [self.swap(v) for v in value]
        if isinstance(value, dict):
            return {self.swap(k): self.swap(v) for k, v in value.items()}
        return value

    def found_in(self, text: str) -> bool:
        return self._pattern.search(text) is not None

    def restore(self, text: str) -> str:
        return self._pattern.sub(lambda m: self.originals.get(m.group(), m.group()), text)


def _encode(backend: HFTokenizer, text: str) -> Encoding:
    """``backend.encode(text, add_special_tokens=False)``, letting other threads run meanwhile:
    ``encode`` holds the GIL throughout (about a second per megabyte of text), so a server
    tokenizing a long prompt on a worker thread froze its event loop, and /health and every stream
    with it; ``encode_batch`` releases it while it works."""
    return backend.encode_batch([text], add_special_tokens=False)[0]


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: list[str] | tuple[str, ...] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        extra_eos_ids: list[int] | tuple[int, ...] = (),
        add_eos_token: bool = False,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.add_bos_token = add_bos_token
        # Append EOS to a raw-text ``encode`` (a GGUF's tokenizer.ggml.add_eos_token, as llama.cpp
        # does); chat prompts never get it: the model is to continue them, not see them ended.
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        ids = set(extra_eos_ids)
        for t in eos_tokens:
            if t and (eos_id := self.backend.token_to_id(t)) is not None:  # None: not in the vocabulary
                ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.eos_token = next(iter(eos_tokens), None) if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self._template = _compile_template(chat_template or DEFAULT_CHAT_TEMPLATE)

    # --- basic ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Text to ids. ``add_special_tokens`` adds BOS when the model wants it and the
        text does not already start with it (chat templates usually write it).

        ``parse_special=False`` reads control-token text (``<|im_start|>``, ``<s>``...) as plain
        text, the way untrusted text must be read; model-specific non-control added tokens
        (``<think>``...) are still matched whole, as llama.cpp and transformers do."""
        backend = self.backend if parse_special else self._text_backend
        ids = self._with_bos(_encode(backend, text).ids, add_special_tokens)
        eos_id = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        if add_special_tokens and self.add_eos_token and eos_id is not None and ids[-1:] != [eos_id]:
            ids.append(eos_id)
        return ids

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prepare(self) -> None:
        """Build now what the first prompts with client text would build: the copy of the backend
        that reads control-token text as text holds the GIL while it is made (~0.2 s for a 49k
        vocabulary), and the reply format's inference (~0.1 s since it no longer imports
        ``transformers``, ~1 s before: ``mlx_lm_functions``); in a server's first request they
        stalled its event loop (/health took 1.2-1.5 s at the start of bench/soak.py's load), so
        a server calls this before it serves."""
        self._text_backend  # noqa: B018
        self._control_text  # noqa: B018
        self.special_ids  # noqa: B018
        self.reply_format  # noqa: B018
        self.special_markers  # noqa: B018

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def _text_backend(self) -> HFTokenizer:
        """A copy of the backend that does not match control tokens (the flag is per tokenizer
        object, and the original keeps serving other threads)."""
        backend = HFTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _control_text(self) -> _ControlText | None:
        return _ControlText.of(
            {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special and t.content}
        )

    @cached_property
    def reply_format(self) -> ReplyFormat:
        """What this model's replies look like: think markers, tool-call syntax or harmony
        (``reply_parser.infer_reply_format``); ``configure_replies`` overrides it."""
        return infer_reply_format(self.chat_template, self._vocab())

    def _vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def configure_replies(
        self, reasoning: str = "auto", tools: str = "auto", template: str | None = None
    ) -> None:
        """Apply ``--reasoning-format``, ``--tool-format`` and ``--chat-template`` (the template's
        text): the reply format is inferred again from the new template, then overridden."""
        if template is not None:
            self.chat_template = template
            self._template = _compile_template(template)
            self.__dict__.pop("system_turns_in_place", None)
        fmt = infer_reply_format(self.chat_template, self._vocab())
        self.reply_format = fmt.overridden(reasoning, tools)
        self.__dict__.pop("special_markers", None)

    @cached_property
    def special_markers(self) -> dict[int, str]:
        """Markers the reply parser reads that are special tokens (a full decode skips them):
        id -> marker text."""
        ids = {t: self.backend.token_to_id(t) for t in self.reply_format.markers}
        return {i: t for t, i in ids.items() if i is not None and i in self.special_ids}

    def added_id(self, text: str) -> int | None:
        """The id of the added token (special or not: ``<think>``, ``[TOOL_CALLS]``) whose text is
        ``text``, or None."""
        i = self.backend.token_to_id(text)
        return i if i is not None and i in self._added_ids else None

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def piece(self, token_id: int) -> str:
        """A single token's text as it would appear in isolation (for logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    # --- chat ---------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """``template_kwargs``: extra variables for the template (``enable_thinking``,
        ``reasoning_effort``, a client's ``chat_template_kwargs``); the ones the renderer sets
        itself win."""
        if not messages:
            raise TemplateError("messages must not be empty")
        norm = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise TemplateError("each message needs a 'role'")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                )
            norm.append({**m, "content": content if content is not None else ""})
        norm = system_turns.place(norm, self.system_turns_in_place)
        try:
            return self._render(norm, add_generation_prompt, tools, template_kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e

    @cached_property
    def system_turns_in_place(self) -> bool:
        """Whether the chat template renders a system message sent mid-conversation where it was
        sent; if not, such messages are merged into the system prompt (``system_turns``)."""

        return system_turns.takes_system_turns(lambda messages: self._render(messages, True, None))

    def _render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        own = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        return self._template.render({**(extra or {}), **own})

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        replies: Callable[[str], list[int] | None] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render a chat and tokenize it so that control tokens come only from the template.

        Control-token text inside anything the caller supplied (message content and names, tool
        calls and results, tool definitions, system text) is read as plain text: it is swapped for
        a sentinel before rendering, and each stretch of rendered text between two of the
        template's control tokens that holds a sentinel is re-encoded, sentinels restored, with
        control-token matching off. Every other stretch keeps the ids of a plain ``encode`` of the
        rendered text, so chats without control-token text tokenize exactly as before.

        ``replies`` (text -> the ids the model generated for it, see ``ReplyMemory``): an
        assistant message whose text the model produced, found verbatim where the template put
        it, keeps the generated ids, so the prefix cache still matches past it. The result is
        used only if it decodes to exactly what the plain tokenization decodes to.
        """
        sentinels = _Sentinels(self._control_text)
        messages = sentinels.swap(messages)
        tools = sentinels.swap(tools)
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        plain = self._encode_rendered(text, sentinels)
        spans = self._reply_spans(text, messages, sentinels, replies) if replies is not None else []
        if not spans:
            return self._with_bos(plain, True)
        ids: list[int] = []
        at = 0
        for lo, hi, reply_ids in spans:
            ids += self._encode_rendered(text[at:lo], sentinels) + reply_ids
            at = hi
        ids += self._encode_rendered(text[at:], sentinels)
        if ids != plain and self.decode(ids, False) != self.decode(plain, False):
            ids = plain
        return self._with_bos(ids, True)

    @staticmethod
    def _reply_spans(
        text: str, messages: list[dict], sentinels: _Sentinels, replies: Callable[[str], list[int] | None]
    ) -> list[tuple[int, int, list[int]]]:
        """Where, in order, the rendered ``text`` holds assistant replies whose ids are known."""
        spans = []
        at = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) and m.get("role") == "assistant" else None
            if not isinstance(content, str) or not content or sentinels.found_in(content):
                continue
            ids = replies(content)
            if ids is None:
                continue
            lo = text.find(content, at)
            if lo < 0:  # the template changed it (trimmed, dropped a thinking section): plain ids
                continue
            spans.append((lo, lo + len(content), ids))
            at = lo + len(content)
        return spans

    def _encode_rendered(self, text: str, sentinels: _Sentinels) -> list[int]:
        """Ids of rendered template text (no BOS added), sentinel stretches read as plain text."""
        if not sentinels.originals:
            return _encode(self.backend, text).ids
        enc = _encode(self.backend, text)
        ids: list[int] = []
        run: list[int] = []  # ids since the last control token
        start = 0  # where the text of that run begins

        def close_run(end: int) -> None:
            piece = text[start:end]
            if sentinels.found_in(piece):
                ids.extend(_encode(self._text_backend, sentinels.restore(piece)).ids)
            else:
                ids.extend(run)
            run.clear()

        special = self.special_ids
        for tok, (lo, hi) in zip(enc.ids, enc.offsets, strict=True):
            if tok in special:
                close_run(lo)
                ids.append(tok)
                start = hi
            else:
                run.append(tok)
        close_run(len(text))
        return ids

    # --- construction -------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a HF/MLX model directory: tokenizer.json + tokenizer_config.json.

        Falls back to transformers (converting a slow tokenizer) when there is no tokenizer.json.
        """
        path = Path(path)
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        if (path / "tokenizer.json").exists():
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer  # heavy; only for models without tokenizer.json

            backend = AutoTokenizer.from_pretrained(str(path)).backend_tokenizer

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates; take the default
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if template is None and (path / "chat_template.json").exists():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")

        eos = tok_str(cfg.get("eos_token"))
        extra_eos: list[int] = []
        gen_cfg = path / "generation_config.json"
        if gen_cfg.exists():
            e = json.loads(gen_cfg.read_text()).get("eos_token_id")
            extra_eos = [e] if isinstance(e, int) else list(e or [])
        if (path / "config.json").exists():
            e = json.loads((path / "config.json").read_text()).get("eos_token_id")
            extra_eos += [e] if isinstance(e, int) else list(e or [])
        bos = tok_str(cfg.get("bos_token"))
        add_bos = bool(cfg.get("add_bos_token", False))
        if not add_bos and bos and backend.token_to_id(bos) is not None:
            # a tokenizer.json post-processor that prepends BOS is what "add_bos_token" means there
            add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [backend.token_to_id(bos)]
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=[eos] if eos else [],
            chat_template=template,
            add_bos_token=add_bos,
            extra_eos_ids=extra_eos,
        )
