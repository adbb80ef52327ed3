"""Preparing a request, once, before it reaches the worker: validation, the prompt's token ids
and the sequence the scheduler will run. The result (``Prepared``) travels with the request.

A caller that tokenized the prompt already (the server does, off its event loop, to size the
reply) hands the ids in and the template is not rendered again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_engine import heap
from mlx_engine.errors import ContextLengthError, RequestError
from mlx_engine.request import GenerationRequest
from mlx_engine.scheduler import Sequence
from mlx_engine.tokenization.reply_memory import ReplyMemory
from mlx_engine.tokenization.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prepared:
    request: GenerationRequest
    ids: list[int]  # the prompt's token ids
    max_total: int  # prompt + reply tokens at most: the request's max_tokens, the context, the KV cache

    def sequence(self) -> Sequence:
        r = self.request
        return Sequence(
            r.request_id,
            list(self.ids),
            len(self.ids),
            self.max_total,
            group=r.group or r.fork_of,  # n > 1 choices: their first choice's group
            cache_salt=r.cache_salt,
        )


class InputProcessor:
    """Checks requests and tokenizes prompts for one engine (thread-safe: it holds no state of
    its own beyond the tokenizer and the reply memory, both safe to read from any thread)."""

    def __init__(self, tokenizer: Tokenizer, replies: ReplyMemory, context_length: int, kv_tokens: int):
        self.tokenizer = tokenizer
        self.replies = replies
        self.context_length = context_length
        self.kv_tokens = kv_tokens  # tokens the whole KV cache holds (a sequence can never exceed it)

    def check(self, request: GenerationRequest) -> None:
        """RequestError for a request that cannot run, whatever its prompt."""
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("give exactly one of prompt or messages", "messages")
        if request.max_tokens is not None and (
            isinstance(request.max_tokens, bool)
            or not isinstance(request.max_tokens, int)
            or request.max_tokens <= 0
        ):
            raise RequestError(
                "max_tokens must be a positive integer (or None: until the context is full)", "max_tokens"
            )
        request.sampling.validate(self.tokenizer.vocab_size)
        for name in ("group", "cache_salt"):
            if not isinstance(getattr(request, name), str | None):
                raise RequestError(f"{name} must be a string", name)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids; RequestError (ContextLengthError) for anything invalid."""
        self.check(request)
        if request.messages is not None:
            if not request.messages:
                raise RequestError("messages must not be empty", "messages")
            # control tokens come only from the template, never from message text (TemplateError)
            # a reply the model wrote keeps the ids it was generated as (ReplyMemory)
            salt = request.cache_salt
            ids = self.tokenizer.encode_chat(
                request.messages,
                True,
                request.tools,
                replies=lambda t: self.replies.recall(t, salt),
                template_kwargs=request.template_kwargs,
            )
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise RequestError("prompt must not be empty", "prompt")
            # a text prompt is text (as at OpenAI): control tokens only as token ids
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=True, parse_special=False)
        else:
            assert request.prompt is not None  # exactly one of prompt and messages, checked above
            ids = self._token_ids(request.prompt, "prompt")
        if len(ids) >= heap.RELEASE_AFTER_TOKENS:  # the tokenizer's transient heap, freed: give it back
            heap.release_free()
        self._check_fits(ids, "messages" if request.messages is not None else "prompt")
        return ids

    def prepare(self, request: GenerationRequest, ids: list[int] | None = None) -> Prepared:
        """The request, checked, with its prompt ids (``ids``: tokenized already by the caller,
        from this request's prompt or messages; only checked, not rendered again)."""
        if ids is None:
            ids = self.prompt_ids(request)
        else:
            self.check(request)
            ids = self._token_ids(ids, "prompt")
            self._check_fits(ids, "messages" if request.messages is not None else "prompt")
        # max_tokens None: until EOS, a stop, or the context (or the whole KV cache) is full
        cap = min(self.context_length, self.kv_tokens)
        limit = cap if request.max_tokens is None else min(len(ids) + request.max_tokens, cap)
        return Prepared(request, ids, limit)

    def peer_prefill(self, tokens: list[int], start: int, chunk: int) -> list[int]:
        """The token ids of a peer's prefill (``Engine.prefill_for_peer``), checked."""
        ids = [int(t) for t in tokens]
        n = len(ids)
        if n < 2 or any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise RequestError("a peer prefill needs at least 2 token ids inside the vocabulary", "prompt")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < n - 1:
            raise RequestError(f"start must be in [0, {n - 1}), not {start!r}", "start")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise RequestError(f"chunk must be a positive integer, not {chunk!r}", "chunk")
        if n >= self.context_length or n > self.kv_tokens:
            raise ContextLengthError(f"the prompt has {n} tokens, more than this engine holds", "prompt")
        return ids

    def _token_ids(self, tokens, param: str) -> list[int]:
        ids = [int(t) for t in tokens]
        if not ids:
            raise RequestError(f"{param} must not be empty", param)
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise RequestError(f"{param} token ids must be inside the vocabulary", param)
        return ids

    def _check_fits(self, ids: list[int], param: str) -> None:
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the model's context is {self.context_length} tokens",
                param,
            )
        if len(ids) + 1 > self.kv_tokens:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens, more than the KV cache holds ({self.kv_tokens} tokens); "
                "raise cache_gb",
                "prompt",
            )
