"""Pieces shared by the chat and completions endpoints: request mapping, usage, SSE framing,
and running a non-streamed generation that stops when its client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from fastapi import Request

from mlx_engine import __version__, defaults
from mlx_engine.engine import Engine
from mlx_engine.errors import ContextLengthError, DuetError, EngineShutDownError
from mlx_engine.loading.identity import short_hash
from mlx_engine.request import GenerationEvent, RequestError, SamplingParams, TokenLogprob, Usage
from mlx_engine.sampling.constraints import GrammarFactory
from mlx_engine.tokenization.tool_calls import ParsedToolCall

from .errors import APIError, bad_request, internal_error
from .metrics import Metrics
from .protocol import _Sampling

log = logging.getLogger("duet.server")
T = TypeVar("T")


@dataclass
class ServerState:
    engine: Engine
    metrics: Metrics
    grammars: GrammarFactory
    model_ids: tuple[str, ...]  # the served id first, then accepted aliases
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    embedding_ids: tuple[str, ...] = ()  # the embedding model's id and aliases (--embedding-model)
    max_tokens: int | None = None  # the most tokens any reply may have (`duet serve --max-tokens`)

    @property
    def model_id(self) -> str:
        return self.model_ids[0]

    @cached_property
    def fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: changes when the model's weights or the numerics do."""
        e = self.engine
        return "fp_" + short_hash(__version__, e.model_identity(), e.numerics_profile())[:10]

    def check_model(self, model: str) -> None:
        if model in self.embedding_ids and model not in self.model_ids:
            raise APIError(
                400,
                f"The model `{model}` is an embedding model: it serves /v1/embeddings only. "
                f"Chat with `{self.model_id}`.",
                param="model",
                code="model_not_chat",
            )
        if model not in self.model_ids:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_id}`.",
                param="model",
                code="model_not_found",
            )


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sampling_params(
    body: _Sampling, vocab_size: int, logprobs: bool, top_logprobs: int, index: int
) -> SamplingParams:
    bias = None
    if body.logit_bias:
        bias = {}
        for k, v in body.logit_bias.items():
            try:
                tok = int(k)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
            if not 0 <= tok < vocab_size:
                raise bad_request(
                    f"logit_bias token id {tok} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias"
                )
            bias[tok] = float(v)
    p = SamplingParams(
        # what the client leaves out takes Duet's defaults (mlx_engine.defaults, Ollama's set)
        temperature=defaults.TEMPERATURE if body.temperature is None else body.temperature,
        top_p=defaults.TOP_P if body.top_p is None else body.top_p,
        top_k=defaults.TOP_K if body.top_k is None else body.top_k,
        min_p=defaults.MIN_P if body.min_p is None else body.min_p,
        repetition_penalty=(
            defaults.REPETITION_PENALTY if body.repetition_penalty is None else body.repetition_penalty
        ),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        # n choices with one seed still differ; any integer is a seed, as at OpenAI
        seed=None if body.seed is None else (body.seed + index) % 2**63,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    p.validate(vocab_size)  # a RequestError is the route's 400 (errors.from_duet_error)
    return p


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in stops if s]


def max_new_tokens(
    requested: int | None, prompt_len: int, context: int, server_cap: int | None = None
) -> int | None:
    """``requested`` as a cap: at most what the context leaves after the prompt, as llama.cpp's
    server and Ollama do (agents send ``max_tokens`` far above a local model's context; a reply
    that reaches the cap ends with ``finish_reason: "length"``). The prompt fits already
    (``prompt_ids``: a prompt that fills the context is a 400 there). None stays None: until EOS, a
    stop, or the context (or the KV cache) is full, which the engine enforces. ``server_cap``
    (`duet serve --max-tokens`) caps every reply, asked or not."""
    limit = fewest(requested, server_cap)
    return None if limit is None else min(limit, context - prompt_len)


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """``message`` as a warning the first time ``key`` is seen, at debug level after (clients send
    the same request shape, unsupported tools included, every time)."""
    log.log(logging.DEBUG if key in _warned else logging.WARNING, "%s", message)
    _warned.add(key)


def fewest(*limits: int | None) -> int | None:
    """The smallest of the limits given (None: no limit)."""
    given = [x for x in limits if x is not None]
    return min(given) if given else None


# Unicode normalization (NFC/NFKC composition) turns at most 4 characters of text into one.
_NORMALIZATION_SLACK = 4
_longest_token: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_prompt_chars(engine: Engine) -> int:
    """Characters of prompt text beyond which a prompt cannot fit the context, however it
    tokenizes: a token covers at most as many characters of text as its vocabulary entry has
    (entries are spelled in byte-level or metaspace alphabets, at least one character per
    character of text), so text longer than context x longest entry x normalization slack needs
    more tokens than the context holds. Computed from the vocabulary (fixed guesses fail: the
    bundled SmolLM2 has an 81-character token of spaces)."""
    tok = engine.tokenizer
    longest = _longest_token.get(tok)
    if longest is None:
        longest = max((len(t) for t in tok.backend.get_vocab(with_added_tokens=True)), default=1)
        _longest_token[tok] = longest
    return engine.context_length * max(longest, 1) * _NORMALIZATION_SLACK


def prompt_chars(request) -> int:
    """Characters of client text in a request's prompt or message contents."""
    if isinstance(request.prompt, str):
        return len(request.prompt)
    n = 0
    for m in request.messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return n


def prompt_ids(engine: Engine, request, param: str) -> list[int]:
    """Token ids of a request's prompt. Blocking (template and tokenizer): call it off the event
    loop. Text too long to fit the context is refused before it is tokenized."""
    chars, limit = prompt_chars(request), max_prompt_chars(engine)
    if chars > limit:
        raise bad_request(
            f"The prompt has {chars} characters, more than can fit this model's maximum context "
            f"length of {engine.context_length} tokens. Please reduce the prompt.",
            param,
            "context_length_exceeded",
        )
    try:
        return engine.prepare_prompt(request)
    except RequestError as e:
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        raise bad_request(str(e), param if e.param in ("prompt", "messages") else e.param, code) from None


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int = 0
) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def chat_logprob(lp: TokenLogprob) -> dict:
    def entry(tok: str, logprob: float) -> dict:
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8", "replace"))}

    return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for _, t, v in lp.top]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(
    request: Request, work: Awaitable[T], on_disconnect: Callable[[], Awaitable[object]]
) -> T | None:
    """Run ``work``; if the client hangs up first, cancel it, run ``on_disconnect`` and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await on_disconnect()
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # the thinking, apart from the answer
    tool_calls: list[ParsedToolCall] = field(default_factory=list)  # parsed by the engine
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_type: type[DuetError] | None = None
    t_last: float | None = None

    def add(self, ev: GenerationEvent, metrics: Metrics, t0: float) -> None:
        now = time.perf_counter()
        if ev.token_ids:
            if self.t_last is None:
                metrics.ttft.observe(now - t0)
            else:
                metrics.itl.observe(now - self.t_last)
            self.t_last = now
        self.text.append(ev.text)
        if ev.reasoning:
            self.reasoning.append(ev.reasoning)
        self.tool_calls.extend(ev.tool_calls)
        self.token_ids.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        if ev.finished:
            self.finish_reason, self.usage, self.error = ev.finish_reason, ev.usage, ev.error
            self.error_type = ev.error_type
            if ev.usage is not None:
                metrics.observe_usage(ev.usage)
            metrics.e2e.observe(now - t0)


def failure(choices: list[ChoiceState], err: BaseException | None) -> APIError | None:
    """The error to report when a choice failed (engine shut down or a failed step)."""
    if err is not None:
        from .errors import from_duet_error

        return from_duet_error(err)
    for c in choices:
        if c.finish_reason == "error":
            if c.error_type is not None and issubclass(c.error_type, EngineShutDownError):
                return APIError(
                    503, "the server is shutting down", type="server_error", code="service_unavailable"
                )
            log.error("a generation failed: %s", c.error)  # the engine logged the traceback
            return internal_error()
    return None


def total_usage(choices: list[ChoiceState], n: int) -> dict:
    """Prompt tokens count once per prompt (choices of one prompt share it, as OpenAI bills);
    cached tokens are the first choice's of each prompt."""
    prompt = cached = completion = reasoning = 0
    for i, c in enumerate(choices):
        u = c.usage or Usage()
        completion += u.completion_tokens
        reasoning += u.reasoning_tokens
        if i % n == 0:
            prompt += u.prompt_tokens
            cached += u.cached_tokens
    return usage_dict(prompt, completion, cached, reasoning)


async def collect_choices(gen, request: Request, metrics: Metrics, count: int) -> list[ChoiceState] | None:
    """Run a non-streamed call's ``count`` choices to the end. Returns None when the client left
    first (its requests are cancelled); raises the APIError that fits a failed choice."""
    t0 = time.perf_counter()
    choices = [ChoiceState() for _ in range(count)]

    async def drain() -> BaseException | None:
        async for i, ev, err in gen.events():
            if err is not None:
                return err
            choices[i].add(ev, metrics, t0)
        return None

    done, err = False, None
    try:
        err = await unless_disconnected(request, drain(), gen.aclose)
        done = True
    finally:
        if not done:
            await gen.aclose()
    if err is None and any(c.finish_reason is None for c in choices):
        return None
    problem = failure(choices, err)
    if problem is not None:
        raise problem
    return choices
