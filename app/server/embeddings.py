"""POST /v1/embeddings: vectors from the embedding model served beside the chat model
(``duet serve --embedding-model PATH``; ``mlx_engine.embeddings``).

``input`` is a string, a list of strings, a list of token ids or a list of token id lists
(used as given); ``encoding_format`` float (default) or base64 (little-endian float32, as
OpenAI sends it); ``dimensions`` cuts a Matryoshka model's vectors short (normalized again) and
is a 400 for models not trained for it. Vectors are L2-normalized.

Batching: every input of every waiting request goes into one queue; one batcher task takes
whatever is queued and runs it in forward passes of at most ``max_batch_tokens`` on the
engine's worker thread (between two generation steps, where MLX work belongs: a big batch
stalls the streams for one pass at a time), so requests that arrive while a batch runs share
the next one instead of running one at a time.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlx_engine.embeddings import EmbeddingModel
from mlx_engine.errors import EngineShutDownError

from .errors import APIError, bad_request, shutting_down
from .metrics import Metrics
from .protocol import check_body
from .registry import ModelRegistry

MAX_INPUTS = 2048  # as at OpenAI


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_INPUTS),
        ]
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # accepted and ignored

    @model_validator(mode="before")
    @classmethod
    def _valid_body(cls, data: Any) -> Any:
        return check_body(data)


@dataclass
class _Job:
    inputs: list[list[int]]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EmbeddingBatcher:
    """Runs queued inputs in batches on the engine's worker thread (see the module doc): ``run``
    is that engine's ``run_on_worker``; None (several models, loaded and unloaded as used): a
    thread of the embedding model's own."""

    def __init__(self, model: EmbeddingModel, run: Callable[[Callable[[], Any]], Any] | None = None):
        self.model = model
        self._pool: ThreadPoolExecutor | None = None
        if run is None:
            pool = self._pool = ThreadPoolExecutor(1, thread_name_prefix="duet-embed")
            run = functools.partial(_run_in, pool)
        self.run = run
        self._queue: list[_Job] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.rounds = 0  # times the queue was taken (each is one or more forward passes)
        self.running = 0  # inputs in the batch being computed

    @property
    def queued(self) -> int:
        return sum(len(j.inputs) for j in self._queue)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()  # bound to the running loop
            self._task = asyncio.create_task(self._run())
        job = _Job(inputs)
        self._queue.append(job)
        self._wake.set()
        return await job.done

    async def _forward(self, inputs: list[list[int]]) -> np.ndarray:
        """One worker call per forward pass, so generation steps run between them."""
        out = np.zeros((len(inputs), self.model.dim), dtype=np.float32)
        for batch in self.model.batches(inputs):
            part = [inputs[i] for i in batch]
            run = functools.partial(self.model.embed_batch, part)
            out[batch] = await asyncio.to_thread(self.run, run)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            jobs, self._queue = self._queue, []
            jobs = [j for j in jobs if not j.done.cancelled()]  # their clients left
            if not jobs:
                continue
            flat = [x for j in jobs for x in j.inputs]
            self.rounds += 1
            self.running = len(flat)
            try:
                vectors = await self._forward(flat)
            except Exception as e:  # every waiting request gets the failure
                for j in jobs:
                    if not j.done.done():
                        j.done.set_exception(e)
                continue
            finally:
                self.running = 0
            at = 0
            for j in jobs:
                if not j.done.done():
                    j.done.set_result(vectors[at : at + len(j.inputs)])
                at += len(j.inputs)


def _run_in(pool: ThreadPoolExecutor, fn: Callable[[], Any]) -> Any:
    return pool.submit(fn).result()


def _token_lists(model: EmbeddingModel, body: EmbeddingRequest) -> list[list[int]]:
    raw = body.input
    if isinstance(raw, str):
        lists = model.tokenize([raw])
    elif raw and isinstance(raw[0], str):
        lists = model.tokenize([str(x) for x in raw])
    elif raw and isinstance(raw[0], int):
        lists = [[int(x) for x in raw]]
    else:
        lists = [list(x) for x in raw]  # type: ignore[arg-type]
    for i, ids in enumerate(lists):
        model.check(ids, "input" if len(lists) == 1 else f"input[{i}]")  # RequestError: a 400
    return lists


def _encode(v: np.ndarray, fmt: str | None) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode()
    return v.astype(np.float32).tolist()


async def embeddings(
    models: ModelRegistry,
    batcher: EmbeddingBatcher | None,
    metrics: Metrics | None,
    embedding_ids: tuple[str, ...],
    body: EmbeddingRequest,
) -> JSONResponse:
    """``embedding_ids``: the names of the embedding model (none without --embedding-model);
    a chat model's name is a 400, any other a 404 naming what is served."""
    if batcher is None or body.model not in embedding_ids:
        if models.lookup(body.model) is not None:
            hint = (
                f" This server serves embeddings with `{embedding_ids[0]}`."
                if embedding_ids
                else " Start duet serve with --embedding-model to serve embeddings."
            )
            raise bad_request(
                f"The model `{body.model}` is a chat model: it does not make embeddings.{hint}",
                "model",
                "model_not_embedding",
            )
        if embedding_ids:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist. This server makes embeddings with "
                f"`{embedding_ids[0]}`.",
                param="model",
                code="model_not_found",
            )
        models.require(body.model)  # a 404 naming what is served
    assert batcher is not None
    model = batcher.model
    if body.dimensions is not None and body.dimensions != model.dim:
        if not model.matryoshka:
            raise bad_request(
                f"This model makes {model.dim}-dimensional vectors and was not trained to be cut short: "
                "leave dimensions out",
                "dimensions",
            )
        if body.dimensions > model.dim:
            raise bad_request(f"dimensions must be at most {model.dim} for this model", "dimensions")
    lists = await asyncio.to_thread(_token_lists, model, body)
    try:
        vectors = await batcher.embed(lists)
    except EngineShutDownError:
        raise shutting_down() from None
    if body.dimensions is not None and body.dimensions < model.dim:
        vectors = vectors[:, : body.dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    tokens = sum(len(x) for x in lists)
    if metrics is not None:
        metrics.requests.labels("embeddings", "stop").inc()
        metrics.embedding_tokens.inc(tokens)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
