"""POST /v1/completions (the legacy text-completion API)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_engine import defaults
from mlx_engine.request import GenerationRequest, TokenLogprob

from .common import (
    SSE_DONE,
    SSE_HEADERS,
    ChoiceState,
    ServerState,
    collect_choices,
    failure,
    max_new_tokens,
    new_id,
    prompt_ids,
    sampling_params,
    sse,
    stop_list,
    total_usage,
    wait_disconnect,
)
from .errors import bad_request
from .generation import Generation
from .protocol import CompletionRequest
from .security import effective_cache_salt

log = logging.getLogger("duet.server")


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


class _Logprobs:
    """The legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, offset: int):
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, lps: list[TokenLogprob]) -> dict:
        start = len(self.tokens)
        for lp in lps:
            self.tokens.append(lp.token)
            self.token_logprobs.append(lp.logprob)
            self.top.append({t: v for _, t, v in lp.top})
            self.text_offset.append(self.offset)
            self.offset += len(lp.token)
        return self.as_dict(start)

    def as_dict(self, start: int = 0) -> dict:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top[start:],
            "text_offset": self.text_offset[start:],
        }


class CompletionCall:
    def __init__(self, state: ServerState, body: CompletionRequest, cache_salt: str | None):
        """``cache_salt``: the request's effective prefix-cache salt (``effective_cache_salt``)."""
        self.state, self.body, self.cache_salt = state, body, cache_salt
        engine = state.engine
        state.check_model(body.model)
        self.n = body.n or 1
        if body.best_of is not None and body.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if body.suffix:
            raise bad_request("suffix (insertion) is not supported by this server", "suffix")
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")
        ignored = body.ignored_fields()
        if ignored:
            log.debug("completions request: ignoring %s", ", ".join(ignored))
        self.stream = bool(body.stream)
        if body.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self.include_usage = bool(self.stream and body.stream_options and body.stream_options.include_usage)
        self.prompts = []
        self.max_tokens = []
        # no max_tokens: until EOS, a stop, or the context is full (Duet's default, not OpenAI's 16)
        requested = defaults.MAX_TOKENS if body.max_tokens is None else body.max_tokens
        for p in _prompts(body.prompt):
            ids = prompt_ids(engine, GenerationRequest(prompt=p, max_tokens=1), "prompt")
            self.prompts.append(ids)
            self.max_tokens.append(
                max_new_tokens(requested, len(ids), engine.context_length, state.max_tokens)
            )
        self.echo = [engine.tokenizer.decode(ids) if body.echo else "" for ids in self.prompts]
        vocab = engine.tokenizer.vocab_size
        want_lp = body.logprobs is not None
        self.samplings = [sampling_params(body, vocab, want_lp, body.logprobs or 0, j) for j in range(self.n)]
        self.stop = stop_list(body.stop)
        self.id = new_id("cmpl")
        self.created = int(time.time())

    def requests(self) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                prompt=list(ids),
                max_tokens=self.max_tokens[p],
                sampling=self.samplings[j],
                stop=self.stop,
                ignore_eos=bool(self.body.ignore_eos),
                request_id=f"{self.id}-{p * self.n + j}",
                cache_salt=self.cache_salt,
                split_reasoning=False,  # a raw completion is the text as generated, markers and all
            )
            for p, ids in enumerate(self.prompts)
            for j in range(self.n)
        ]

    def prompt_ids(self) -> list[list[int]]:
        """Each request's prompt ids (the prompts, tokenized once in ``__init__``)."""
        return [ids for ids in self.prompts for _ in range(self.n)]

    def _cancelled(self, n: int) -> None:
        self.state.metrics.requests.labels("completions", "cancelled").inc(n)

    def _envelope(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_id,
            "system_fingerprint": self.state.fingerprint,
        }

    async def respond(self, request: Request) -> Response:
        gen = Generation(self.state.engine, self.requests(), self._cancelled, self.prompt_ids())
        await gen.start(self.n)
        choices = await collect_choices(gen, request, self.state.metrics, len(gen.requests))
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = []
        for i, c in enumerate(choices):
            echo = self.echo[i // self.n]
            logprobs = None
            if self.body.logprobs is not None:
                lp = _Logprobs(len(echo))
                lp.add(c.logprobs)
                logprobs = lp.as_dict()
            self.state.metrics.requests.labels("completions", c.finish_reason).inc()
            out.append(
                {
                    "index": i,
                    "text": echo + "".join(c.text),
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
        return JSONResponse({**self._envelope(), "choices": out, "usage": total_usage(choices, self.n)})

    async def stream_response(self, request: Request) -> Response:
        gen = Generation(self.state.engine, self.requests(), self._cancelled, self.prompt_ids())
        await gen.start(self.n)
        return StreamingResponse(self._sse(gen, request), media_type="text/event-stream", headers=SSE_HEADERS)

    def _chunk(self, index: int, text: str, finish_reason: str | None = None, logprobs=None) -> str:
        c = {
            **self._envelope(),
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            c["usage"] = None
        return sse(c)

    async def _sse(self, gen: Generation, request: Request) -> AsyncIterator[str]:
        t0 = time.perf_counter()
        watcher = asyncio.create_task(wait_disconnect(request))
        watcher.add_done_callback(lambda _: gen.cancel())
        choices = [ChoiceState() for _ in gen.requests]
        lps = [_Logprobs(len(self.echo[i // self.n])) for i in range(len(choices))]
        try:
            for i in range(len(choices)):
                if self.echo[i // self.n]:
                    yield self._chunk(i, self.echo[i // self.n])
            async for i, ev, err in gen.events():
                if ev is not None:
                    choices[i].add(ev, self.state.metrics, t0)
                problem = failure([choices[i]], err)
                if problem is not None:
                    yield sse(problem.body())
                    break
                assert ev is not None  # no error: an event
                logprobs = lps[i].add(ev.logprobs) if self.body.logprobs is not None and ev.logprobs else None
                if ev.text or logprobs is not None:
                    yield self._chunk(i, ev.text, logprobs=logprobs)
                if ev.finished:
                    self.state.metrics.requests.labels("completions", ev.finish_reason).inc()
                    yield self._chunk(i, "", ev.finish_reason)
            else:
                if gen.cancelled:  # the client went away
                    return
                if self.include_usage:
                    yield sse({**self._envelope(), "choices": [], "usage": total_usage(choices, self.n)})
            yield SSE_DONE
        finally:
            watcher.cancel()
            await gen.aclose()


async def completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    salt = effective_cache_salt(request.scope, body.cache_salt)
    call = await asyncio.to_thread(CompletionCall, state, body, salt)  # tokenizer: off the event loop
    if call.stream:
        return await call.stream_response(request)
    return await call.respond(request)
