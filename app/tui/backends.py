"""Where replies come from: an in-process Engine, or an OpenAI-compatible server.

Both speak the Engine API's vocabulary (GenerationEvent, Usage), so the chat app
does not care which one it has. ``load``/``connect`` block (run them in a thread);
``stream`` is async and runs on the app's event loop. Closing ``stream`` early
(``aclose``, which ``contextlib.aclosing`` does on break or task cancel) stops the
generation; ``stop`` cancels every reply in flight at once, from the UI's key handler.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mlx_engine.errors import DuetError
from mlx_engine.request import GenerationEvent, GenerationRequest, RequestError, Usage

from .settings import Sampling

if TYPE_CHECKING:
    from mlx_engine.engine import Engine, EngineConfig
    from peer.attach import PeerSpec


class BackendError(RuntimeError):
    """A model or server the chat cannot use; the message is shown to the user as is."""


@dataclass
class Resources:
    """What the status bar shows besides per-reply timings (None: the backend cannot tell)."""

    kv_used_bytes: int | None = None
    kv_total_bytes: int | None = None
    prefix_hit_rate: float | None = None
    detail: str = ""  # backend, BLAS, weight format


class LocalBackend:
    kind = "local"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name: str = engine.model_name
        self.context_length: int | None = engine.context_length
        self._live: set[str] = set()  # request ids of the replies streaming now

    @classmethod
    def load(
        cls, spec: str | None, config: EngineConfig | None = None, peers: PeerSpec | None = None
    ) -> LocalBackend:
        """``peers``: the engine's prefill peers (``--peers``), attached before the first request;
        if attaching them fails, the engine is shut down again."""
        from app.launch import build_engine
        from mlx_engine.config import EngineConfig

        try:
            return cls(build_engine(spec, config or EngineConfig(), peers))
        except (DuetError, OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
            # ModelNotFoundError, ModelLoadError, GGUF errors, bad configs, out of memory
            raise BackendError(f"could not load model {spec or 'bundled'!r}: {e}") from e

    def count_tokens(self, messages: list[dict]) -> int | None:
        try:
            return len(self.engine.prepare_prompt(GenerationRequest(messages=messages, max_tokens=1)))
        except RequestError:
            return None

    async def stream(
        self, messages: list[dict], sampling: Sampling, think: str | None = None
    ) -> AsyncGenerator[GenerationEvent, None]:
        """``think``: on, off, low, medium or high (``/think``), None for the template's default."""
        # max_tokens auto: the context length, which the engine caps at what the context and KV cache hold
        max_tokens = sampling.max_tokens or self.engine.context_length
        kwargs = self.engine.tokenizer.reply_format.thinking_kwargs(think)
        req = GenerationRequest(
            messages=messages, max_tokens=max_tokens, sampling=sampling.params(), template_kwargs=kwargs
        )
        self._live.add(req.request_id)
        try:
            # closed now, not when collected (engine.generate is an async generator)
            gen = cast(AsyncGenerator[GenerationEvent, None], self.engine.generate(req))
            async with aclosing(gen) as events:
                async for ev in events:
                    yield ev
        finally:
            self._live.discard(req.request_id)

    def stop(self) -> None:
        """Cancel the replies in flight now; the engine drops them before its next step."""
        for rid in list(self._live):
            self.engine.cancel(rid)

    def peer_sources(self) -> list[Any]:
        """The engine's prefill peers (``--peers``): ``RemotePrefillSource`` objects."""
        from peer.attach import sources_of

        return sources_of(self.engine)

    def prefill_report(self, usage: Usage, request_id: str) -> dict[str, Any]:
        """Where a finished request's prefill ran and how long its parts took: the remote-prefill
        block of ``duet generate --json``'s usage (remote loads with their wait and transfer times,
        the fallback reason, the offload planner's prediction when it made one); empty without peers."""
        if not self.peer_sources():
            return {}
        from peer.attach import peer_usage

        return peer_usage(usage, self.engine, request_id)

    def resources(self) -> Resources:
        s = self.engine.stats()
        return Resources(  # blocks held by requests, of the budget (the pool grows toward it as used)
            kv_used_bytes=s.kv_blocks_used * s.kv_block_bytes,
            kv_total_bytes=s.kv_blocks_total * s.kv_block_bytes,
            prefix_hit_rate=s.prefix_hit_rate if s.prefix_query_tokens else None,
            detail=f"{s.backend} · {s.weight_format} · BLAS {s.blas} · KV {s.kv_format}",
        )

    def close(self) -> None:
        self.engine.shutdown()


def _context_of(model) -> int | None:
    extra = getattr(model, "model_extra", None) or {}
    for key in ("context_length", "max_context_length", "max_model_len"):
        if isinstance(extra.get(key), int):
            return extra[key]
    return None


class RemoteBackend:
    """An OpenAI-compatible server (`duet serve`, or any other) through the `openai` client."""

    kind = "remote"

    def __init__(self, url: str, name: str, context_length: int | None, api_key: str, models: list[str]):
        from openai import AsyncOpenAI

        self.url = url
        self.name = name
        self.models = models
        self.context_length = context_length
        self.client = AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0)

    @classmethod
    def connect(cls, url: str, model: str | None = None, api_key: str | None = None) -> RemoteBackend:
        try:
            import openai
        except ImportError as e:
            raise BackendError("--server needs the `openai` package: pip install openai") from e
        url = url.rstrip("/")
        if not url.endswith("/v1"):
            url += "/v1"
        key = api_key or "not-needed"
        try:
            with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=10) as client:
                models = list(client.models.list())
        except openai.APIError as e:
            raise BackendError(f"cannot reach the server at {url}: {e}") from e
        if not models:
            raise BackendError(f"the server at {url} lists no models")
        chosen = next((m for m in models if m.id == model), None) if model else models[0]
        if chosen is None:
            raise BackendError(
                f"the server at {url} has no model {model!r}; it has: {', '.join(m.id for m in models)}"
            )
        return cls(url, chosen.id, _context_of(chosen), key, [m.id for m in models])

    def count_tokens(self, messages: list[dict]) -> int | None:
        return None

    async def stream(
        self, messages: list[dict], sampling: Sampling, think: str | None = None
    ) -> AsyncGenerator[GenerationEvent, None]:
        import openai

        effort = {"on": "medium", "off": "none"}.get(think or "", think)
        extra: dict[str, Any] = {"top_k": sampling.top_k, "min_p": sampling.min_p}
        if effort is not None:
            extra["reasoning_effort"] = effort

        t0 = time.perf_counter()
        t_first = t_last = None
        n_chunks = 0
        finish, usage = None, Usage(prefill_location="server")
        try:
            stream = await self.client.chat.completions.create(
                model=self.name,
                messages=cast(Any, messages),  # OpenAI's message dicts, as the app builds them
                stream=True,
                stream_options={"include_usage": True},
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,  # None (auto): null, the server's own default
                seed=sampling.seed,
                extra_body=extra,
            )
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        text = choice.delta.content or ""
                        # the server's thinking (llama.cpp's and vLLM's name; OpenRouter's reasoning)
                        more = choice.delta.model_extra or {}
                        thought = more.get("reasoning_content") or more.get("reasoning") or ""
                        if text or thought:
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last = now
                            n_chunks += 1
                            yield GenerationEvent(chunk.id, text, reasoning=thought)
                        finish = choice.finish_reason or finish
                    if chunk.usage is not None:
                        details = chunk.usage.prompt_tokens_details
                        usage.prompt_tokens = chunk.usage.prompt_tokens
                        usage.completion_tokens = chunk.usage.completion_tokens
                        usage.cached_tokens = (details.cached_tokens or 0) if details else 0
                        out = chunk.usage.completion_tokens_details
                        usage.reasoning_tokens = (out.reasoning_tokens or 0) if out else 0
        except openai.APIError as e:
            yield GenerationEvent("", "", finish_reason="error", error=f"server error: {e}", usage=usage)
            return
        n_out = usage.completion_tokens or n_chunks
        if t_first is not None and t_last is not None:
            usage.ttft_s = t_first - t0
            if n_out > 1 and t_last > t_first:
                usage.decode_tps = (n_out - 1) / (t_last - t_first)
        yield GenerationEvent("", "", finish_reason=finish or "stop", usage=usage)

    def resources(self) -> Resources:
        return Resources(detail=f"server {self.url}")

    def peer_sources(self) -> list[Any]:
        return []  # the server's own peers are its business (its /metrics shows them)

    def prefill_report(self, usage: Usage, request_id: str) -> dict[str, Any]:
        return {}

    def stop(self) -> None:
        """Nothing to do at once: closing ``stream`` (the app cancels its task) closes the HTTP
        response, and the server cancels the request when its client goes away."""

    def close(self) -> None:
        pass


Backend = LocalBackend | RemoteBackend
