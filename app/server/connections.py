"""Connection hygiene for `duet serve`: file descriptors, a connection cap, header and drain
timeouts, and a log that a flood of errors cannot fill.

uvicorn (h11) has no timeout for a request's headers: a socket that connects and sends nothing,
or a few bytes a minute, holds a file descriptor for ever, and a few thousand of them used to
exhaust the descriptor limit, after which every ``accept()`` failed (and asyncio logged each
failure with a traceback). Here:

- ``raise_fd_limit`` (app/fd_limit.py) lifts the soft descriptor limit to the hard one at start;
- ``protocol_class`` gives uvicorn an h11 protocol that closes a connection whose request headers
  are not complete ``header_timeout`` seconds after its first byte (or after it connected), and
  one that keeps sending a body after its response was sent (a refused body) for longer than
  that; and caps open connections at ``max_connections``: beyond it a new connection evicts the
  connection that has been idle (waiting for a request) longest, or is closed itself when every
  connection is busy, so idle sockets can never lock out a real request;
- ``RateLimitFilter`` lets one log line of a kind through per interval, with a count of the
  ones it held back.
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("duet.server.connections")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
_FD_RESERVE = 256  # descriptors kept for the model files, the engine, logs and the listener


def connection_cap(fd_limit: int, wanted: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """Open connections allowed under a descriptor limit (room kept for everything else)."""
    return max(16, min(wanted, fd_limit - _FD_RESERVE))


def protocol_class(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS
) -> type[H11Protocol]:
    """An H11Protocol subclass with these limits; its idle-connection registry is its own."""
    idle: dict[H11Protocol, None] = {}  # connections waiting for a request, oldest first

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None  # "headers", "drain" or None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            idle[self] = None
            self._set_phase("headers")
            if len(self.connections) > max_connections:
                victim = next((p for p in idle if p is not self and not p.transport.is_closing()), None)
                if victim is None:
                    log.warning("more than %d connections, all busy: closing a new one", max_connections)
                    self.transport.close()
                else:
                    victim.transport.close()

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            self._set_phase(None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._update()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:
                # waiting for the next request: uvicorn's keep-alive timeout governs the silence,
                # the header timeout starts again with the next request's first byte
                idle[self] = None
                self._set_phase(None)
            else:
                self._update()

        def _update(self) -> None:
            them, us = self.conn.their_state, self.conn.our_state
            if them is h11.IDLE:
                idle.setdefault(self, None)
                self._set_phase("headers")
            else:
                idle.pop(self, None)
                done = us in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
                self._set_phase("drain" if done and them is h11.SEND_BODY else None)

        def _set_phase(self, phase: str | None) -> None:
            if phase == self._phase:
                return  # a deadline runs from when its phase began
            self._phase = phase
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if phase is not None and not self.transport.is_closing():
                self._timer = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class RateLimitFilter(logging.Filter):
    """Lets through one record per ``interval`` seconds for each kind (logger, first line of the
    message, exception type); the next one that passes says how many were held back."""

    def __init__(self, interval: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._last: dict[tuple, float] = {}
        self._held: dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        first = str(record.msg).split("\n", 1)[0][:200]
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        key = (record.name, record.levelno, first, exc)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} [{held} more like this in the last {self.interval:g} s not logged]"
        if len(self._last) > 1000:  # forget old kinds
            self._last = {k: t for k, t in self._last.items() if now - t < self.interval}
        return True


def rate_limit_logs(
    interval: float = 10.0, loggers=("asyncio", "uvicorn.error", "duet.server.connections")
) -> RateLimitFilter:
    """Install one RateLimitFilter on the loggers a connection flood writes to."""
    f = RateLimitFilter(interval)
    for name in loggers:
        logging.getLogger(name).addFilter(f)
    return f
