"""One tokenizer type for every model source: a `tokenizers.Tokenizer` plus what the
model's metadata says about special tokens and its chat template.

GGUF files (see ``gguf_tokenizer.py``) and HF directories (``from_hf_dir``) both end up
here, so the engine, the detokenizer and the server never care where a model came from.
"""

from __future__ import annotations

import datetime
import json
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from .errors import TemplateError

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
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        ids = {self.backend.token_to_id(t) for t in eos_tokens if t}
        ids.update(extra_eos_ids)
        ids.discard(None)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.eos_token = next(iter(eos_tokens), None) if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self._template = _compile_template(chat_template or DEFAULT_CHAT_TEMPLATE)

    # --- basic ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to ids. ``add_special_tokens`` adds BOS when the model wants it and the
        text does not already start with it (chat templates usually write it)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
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

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    def piece(self, token_id: int) -> str:
        """A single token's text as it would appear in isolation (for logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    # --- chat ---------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
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
        try:
            return self._template.render(
                messages=norm,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e

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
