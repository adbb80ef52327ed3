"""Run the ``n`` engine requests of one API call and merge their events into one stream.

Submission is separated from waiting so that refusals (bad request, full queue, engine shut
down) become HTTP errors before any response header is sent. With ``n > 1`` the other choices
of a prompt name its first choice in ``fork_of``: the engine computes the prompt once and the
choices share its KV blocks copy-on-write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from mlx_engine.engine import Engine
from mlx_engine.request import GenerationEvent, GenerationRequest

from .errors import bad_request, from_duet_error

log = logging.getLogger("duet.server")


def max_fanout(engine: Engine) -> int:
    """Most sequences (prompts x n) one API call may ask for: no more than the engine runs at
    once, and no more than its queue can ever hold (a bigger call could never be admitted)."""
    return min(engine.config.max_running, engine.config.max_queue)


def check_fanout(engine: Engine, count: int, n: int) -> None:
    limit = max_fanout(engine)
    if count > limit:
        prompts = count // max(n, 1)
        raise bad_request(
            f"This request asks for {count} sequences ({prompts} prompt{'s' if prompts != 1 else ''} x n={n}); "
            f"this server generates at most {limit} for one request. Please reduce n or the number of prompts.",
            "n",
            "too_many_sequences",
        )


class Generation:
    def __init__(self, engine: Engine, requests: list[GenerationRequest], on_cancel=None):
        """``on_cancel(n)`` is told how many requests were cancelled before they finished."""
        self.engine = engine
        self.requests = requests
        self.on_cancel = on_cancel
        self.finished: set[int] = set()
        self.cancelled = False
        self._queue: asyncio.Queue[tuple[int, GenerationEvent | None, BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._refused: dict[int, BaseException] = {}

    async def _pump(self, i: int) -> None:
        try:
            async for ev in self.engine.generate(self.requests[i]):
                self._queue.put_nowait((i, ev, None))
        except Exception as e:  # refusals and engine failures; CancelledError passes through
            self._refused[i] = e
            self._queue.put_nowait((i, None, e))

    async def _submit(self, i: int) -> None:
        self._tasks.append(asyncio.create_task(self._pump(i)))
        # One loop turn runs generate() up to its first wait: validation and the queue check.
        await asyncio.sleep(0)
        if i in self._refused:
            raise from_duet_error(self._refused[i])

    async def start(self, n: int = 1) -> None:
        """Submit every request; raises APIError (and cancels the rest) if any is refused.

        ``requests`` come in groups of ``n`` choices sharing one prompt; the other choices of a
        group fork the first one's prompt KV in the engine (copy-on-write) instead of computing
        the prompt again.
        """
        check_fanout(self.engine, len(self.requests), n)
        try:
            for i, req in enumerate(self.requests):
                req.group = self.requests[0].request_id  # the engine serves calls round-robin
                if i % n:
                    req.fork_of = self.requests[i - i % n].request_id
                await self._submit(i)
        except BaseException:
            self.on_cancel = None  # refused, not cancelled
            await self.aclose()
            raise

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent | None, BaseException | None]]:
        """(choice index, event, error) until every request has finished or failed."""
        open_ = set(range(len(self.requests)))
        while open_:
            item = await self._queue.get()
            i, ev, err = item
            if i < 0:  # cancelled
                return
            if err is not None or (ev is not None and ev.finished):
                open_.discard(i)
                self.finished.add(i)
            yield item

    def cancel(self) -> None:
        """Cancel every request (the engine frees their KV blocks); ``events()`` then ends."""
        if self.cancelled:
            return
        self.cancelled = True
        for t in self._tasks:
            t.cancel()
        self._queue.put_nowait((-1, None, None))
        unfinished = len(set(range(len(self._tasks))) - self.finished)
        if unfinished and self.on_cancel is not None:
            self.on_cancel(unfinished)

    async def aclose(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
