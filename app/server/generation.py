"""Run the ``n`` engine requests of one API call and merge their events into one stream.

Submission is separated from waiting so that refusals (bad request, full queue, engine shut
down) become HTTP errors before any response header is sent. Every request's events arrive in one
``asyncio.Queue``, put there by the engine's worker (``Engine.submit``). With ``n > 1`` the other choices
of a prompt name its first choice in ``fork_of``: the engine computes the prompt once and the
choices share its KV blocks copy-on-write.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mlx_engine.engine import Engine
from mlx_engine.request import GenerationEvent, GenerationRequest

from .errors import bad_request, from_duet_error


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
    def __init__(
        self,
        engine: Engine,
        requests: list[GenerationRequest],
        on_cancel=None,
        prompt_ids: list[list[int]] | None = None,
    ):
        """``on_cancel(n)`` is told how many requests were cancelled before they finished;
        ``prompt_ids``: each request's prompt, tokenized already (the engine does not render
        its template again)."""
        self.engine = engine
        self.requests = requests
        self.prompt_ids = prompt_ids
        self.on_cancel = on_cancel
        self.finished: set[int] = set()
        self.cancelled = False
        # the one queue between the engine's worker and this event loop: (choice index, event)
        self._queue: asyncio.Queue[tuple[int, GenerationEvent | None]] = asyncio.Queue()
        self._submitted: list[str] = []

    async def start(self, n: int = 1) -> None:
        """Submit every request; raises APIError (and cancels the rest) if any is refused
        (bad request, full queue, engine shut down), before any response header is sent.

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
                ids = self.prompt_ids[i] if self.prompt_ids is not None else None
                self.engine.submit(req, self._queue, i, prompt_ids=ids)
                self._submitted.append(req.request_id)
        except Exception as e:
            self.on_cancel = None  # refused, not cancelled
            self.cancel()
            raise from_duet_error(e) from None

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent | None, BaseException | None]]:
        """(choice index, event, None) until every request has finished."""
        open_ = set(range(len(self._submitted)))
        while open_:
            i, ev = await self._queue.get()
            if i < 0:  # cancelled
                return
            if ev is not None and ev.finished:
                open_.discard(i)
                self.finished.add(i)
            yield i, ev, None

    def cancel(self) -> None:
        """Cancel every request (the engine frees their KV blocks); ``events()`` then ends."""
        if self.cancelled:
            return
        self.cancelled = True
        unfinished = [i for i in range(len(self._submitted)) if i not in self.finished]
        for i in unfinished:
            self.engine.cancel(self._submitted[i])
        self._queue.put_nowait((-1, None))
        if unfinished and self.on_cancel is not None:
            self.on_cancel(len(unfinished))

    async def aclose(self) -> None:
        self.cancel()
