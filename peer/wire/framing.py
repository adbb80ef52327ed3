"""Frames on a byte stream: encode/send without copies, read with ``recv_into`` into pooled buffers.

``u32 length`` (big-endian) + msgpack header + raw payload of exactly ``header["nbytes"]`` bytes,
whose xxh3-64 is ``header["checksum"]``. A reader trusts no length field: the header length is
capped (``MAX_HEADER_BYTES``), and a payload must have exactly the size its message implies (a
PREFILL's token count, a LAYER_KV's shapes under the receiver's ``KVFormat``) and fit the
receive pool, all checked before a byte of it is allocated or read.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from peer.wire.frame_mac import TAG_BYTES, MacSocket
from peer.wire.protocol import (
    MAX_HEADER_BYTES,
    U64,
    ErrorCode,
    LayerKV,
    Message,
    Prefill,
    ProtocolError,
    bad_frame,
    decode_message,
    pack_header,
    unpack_header,
)

if TYPE_CHECKING:
    from peer.wire.kv_wire import KVFormat

LEN_BYTES = 4
TOKEN_DTYPE = np.dtype("<u4")


def checksum(buffers) -> int:
    """xxh3-64 of the concatenated buffers (~20 GB/s: far above any link it guards)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def _byte_view(b) -> memoryview:
    if isinstance(b, np.ndarray):
        b = np.ascontiguousarray(b)
    return memoryview(b).cast("B")


def encode_frame(header: dict[str, Any], payload=()) -> list[memoryview | bytes]:
    """Buffers for one frame: the length prefix and header, then each payload buffer as is (a
    numpy array must be C-contiguous; it is sent from its own memory, not copied)."""
    views = [v for v in (_byte_view(b) for b in payload) if v.nbytes]
    header = dict(header, nbytes=sum(v.nbytes for v in views))
    header.pop("checksum", None)
    if views:
        header["checksum"] = checksum(views)
    raw = pack_header(header)
    return [len(raw).to_bytes(LEN_BYTES, "big") + raw, *views]


def encode_message(msg: Message, payload=()) -> list[memoryview | bytes]:
    return encode_frame(msg.to_header(), payload)


def encode_prefill(msg: Prefill, tokens) -> list[memoryview | bytes]:
    """A PREFILL frame: the header and the prompt's token ids as little-endian uint32."""
    ids = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    if ids.shape != (msg.n_tokens,):
        raise ValueError(f"PREFILL says {msg.n_tokens} tokens, got {ids.shape}")
    return encode_message(msg, [ids])


def send_frame(sock: socket.socket | MacSocket, buffers) -> None:
    """Write every buffer, in order, with as few system calls as the kernel allows."""
    views = [_byte_view(b) for b in buffers]
    views = [v for v in views if v.nbytes]
    if isinstance(sock, MacSocket):  # the trusted link: the frame's MAC follows it
        sock.send_frame(views)
        return
    if not hasattr(sock, "sendmsg") or isinstance(sock, ssl.SSLSocket):  # TLS refuses sendmsg
        for v in views:
            sock.sendall(v)
        return
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


# --- receive buffers ---------------------------------------------------------------------------


class PooledBuffer:
    """A payload buffer on loan from a ``BufferPool``; ``release()`` (or ``with``) returns it."""

    def __init__(self, pool: BufferPool, array: np.ndarray):
        self.pool, self.array = pool, array
        self._released = False

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool._release(self.array)

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class BufferPool:
    """Payload buffers under a byte cap. ``acquire`` blocks while the cap is reached, so a reader
    stops reading its socket (TCP pushes back on the sender) until the consumer releases frames.
    Released buffers are kept for reuse (frames of one layer shape repeat) within the same cap."""

    def __init__(self, cap_bytes: int):
        if cap_bytes < 1:
            raise ValueError("buffer pool cap must be positive")
        self.cap = cap_bytes
        self._cv = threading.Condition()
        self._free: dict[int, list[np.ndarray]] = {}
        self._in_use = self._cached = self.peak = 0
        self._closed = False

    @property
    def in_use(self) -> int:
        return self._in_use

    def acquire(self, nbytes: int, timeout: float | None = None) -> PooledBuffer:
        if nbytes > self.cap:
            raise bad_frame(f"a {nbytes}-byte payload exceeds the {self.cap}-byte receive buffer")
        deadline = None if timeout is None else time.monotonic() + timeout
        array = None
        with self._cv:
            while True:
                if self._closed:
                    raise ProtocolError(ErrorCode.CANCELLED, "receive buffer pool closed")
                if self._free.get(nbytes):
                    array = self._free[nbytes].pop()
                    self._cached -= nbytes
                    break
                while self._in_use + self._cached + nbytes > self.cap and self._cached:
                    self._drop_one()
                if self._in_use + nbytes <= self.cap:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ProtocolError(ErrorCode.TIMEOUT, "no receive buffer freed in time")
                self._cv.wait(left)
            self._in_use += nbytes
            self.peak = max(self.peak, self._in_use)
        if array is None:  # allocated outside the lock, already counted against the cap
            array = np.empty(nbytes, np.uint8)
        return PooledBuffer(self, array)

    def _drop_one(self) -> None:
        size = next(s for s, lst in self._free.items() if lst)
        self._free[size].pop()
        self._cached -= size

    def _release(self, array: np.ndarray) -> None:
        with self._cv:
            self._in_use -= array.nbytes
            if not self._closed:
                self._free.setdefault(array.nbytes, []).append(array)
                self._cached += array.nbytes
            self._cv.notify_all()

    def close(self) -> None:
        """Wake every waiter with ``ProtocolError(CANCELLED)`` and keep no buffers."""
        with self._cv:
            self._closed = True
            self._free.clear()
            self._cached = 0
            self._cv.notify_all()


# --- reading -------------------------------------------------------------------------------------


@dataclass
class Frame:
    msg: Message
    header: dict[str, Any]
    payload: PooledBuffer | None = None
    received_at: float = field(default_factory=time.monotonic)

    def token_ids(self) -> np.ndarray:
        """A PREFILL's prompt (a copy, so the frame can be released)."""
        assert isinstance(self.msg, Prefill) and self.payload is not None
        return self.payload.array.view(TOKEN_DTYPE).copy()

    def release(self) -> None:
        if self.payload is not None:
            self.payload.release()

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class IdleTimeout(ProtocolError):
    """No frame began within ``read``'s idle timeout: the stream is still usable."""

    def __init__(self, seconds: float):
        super().__init__(ErrorCode.TIMEOUT, f"no frame from the peer in {seconds:g} s")


class FrameReader:
    """Reads frames from a socket (anything with ``recv_into``) into ``buffers``.

    ``kv_format`` is this side's pool format (set once HELLOs are exchanged): LAYER_KV frames are
    refused before it is known. ``stall_timeout`` bounds every wait for bytes inside a frame; the
    wait for a frame's first byte is ``read(idle_timeout)``. Any error inside a frame leaves the
    stream unusable, so the reader raises it again on every later ``read`` (drop the connection);
    an idle timeout between frames does not.
    """

    def __init__(
        self,
        sock,
        buffers: BufferPool,
        *,
        kv_format: KVFormat | None = None,
        max_prompt_tokens: int = 1 << 20,
        stall_timeout: float | None = None,
    ):
        self.sock, self.buffers = sock, buffers
        self.kv_format, self.max_prompt_tokens = kv_format, max_prompt_tokens
        self.stall_timeout = stall_timeout
        self._header = bytearray(MAX_HEADER_BYTES)
        self._len = bytearray(LEN_BYTES)
        self._selector: selectors.BaseSelector | None = None
        self._error: ProtocolError | None = None
        self.mac = sock.recv_mac if isinstance(sock, MacSocket) else None  # trusted link: tags follow frames
        self._head_tag, self._tag = bytearray(TAG_BYTES), bytearray(TAG_BYTES)

    def read(self, idle_timeout: float | None = None) -> Frame | None:
        """The next frame, or None when the peer closed the connection between frames."""
        if self._error is not None:
            raise self._error
        if not self._wait(idle_timeout):
            assert idle_timeout is not None
            raise IdleTimeout(idle_timeout)
        try:
            return self._read()
        except ProtocolError as e:
            self._error = e
            raise

    def _read(self) -> Frame | None:
        if self._recv_exact(memoryview(self._len), at_boundary=True) == 0:
            return None
        n = int.from_bytes(self._len, "big")
        if not 0 < n <= MAX_HEADER_BYTES:
            raise bad_frame(f"header length {n} is outside 1..{MAX_HEADER_BYTES}")
        view = memoryview(self._header)[:n]
        self._recv_exact(view)
        if self.mac is not None:  # trusted link: the header is authenticated before it is parsed
            self._check_mac([self._len, view], self._head_tag)
        header = unpack_header(view)
        msg = decode_message(header)
        nbytes, digest = header.get("nbytes", 0), header.get("checksum")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise bad_frame("frame nbytes is not a non-negative integer")
        expected = self._payload_size(msg)
        if nbytes != expected:
            raise bad_frame(f"{msg.TYPE.value} payload of {nbytes} bytes, its fields imply {expected}")
        if not nbytes:
            return Frame(msg, header)
        if not isinstance(digest, int) or isinstance(digest, bool) or not 0 <= digest < U64:
            raise bad_frame("a frame with a payload needs an integer checksum")
        buf = self.buffers.acquire(nbytes)
        try:
            self._recv_exact(memoryview(buf.array.data))
            if self.mac is not None:  # and the payload before it is checked or used
                self._check_mac([self._head_tag, buf.array.data], self._tag)
            if checksum([buf.array]) != digest:
                raise ProtocolError(ErrorCode.CHECKSUM, f"{msg.TYPE.value} payload checksum mismatch")
        except BaseException:
            buf.release()
            raise
        return Frame(msg, header, buf)

    def _check_mac(self, parts: list[Any], tag: bytearray) -> None:
        """Read the next tag into ``tag`` and check it over ``parts`` (trusted link)."""
        assert self.mac is not None
        self._recv_exact(memoryview(tag))
        self.mac.verify(parts, tag)

    def _payload_size(self, msg: Message) -> int:
        if isinstance(msg, Prefill):
            if msg.n_tokens > self.max_prompt_tokens:
                raise bad_frame(f"PREFILL of {msg.n_tokens} tokens exceeds {self.max_prompt_tokens}")
            return msg.n_tokens * TOKEN_DTYPE.itemsize
        if isinstance(msg, LayerKV):
            if self.kv_format is None:
                raise bad_frame("LAYER_KV before the HELLO exchange")
            return self.kv_format.check_frame(msg)
        return 0

    def _wait(self, timeout: float | None) -> bool:
        """Whether bytes are ready within ``timeout`` (None: wait in ``recv_into`` itself)."""
        if timeout is None or not hasattr(self.sock, "fileno"):
            return True
        pending = getattr(self.sock, "pending", None)  # TLS may hold decrypted bytes already
        if pending is not None and pending():
            return True
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
            self._selector.register(self.sock, selectors.EVENT_READ)
        return bool(self._selector.select(max(timeout, 0)))

    def _recv_exact(self, view: memoryview, at_boundary: bool = False) -> int:
        got = 0
        while got < view.nbytes:
            if (got or not at_boundary) and not self._wait(self.stall_timeout):
                raise ProtocolError(ErrorCode.TIMEOUT, f"peer stalled for {self.stall_timeout:g} s mid-frame")
            try:
                n = self.sock.recv_into(view[got:])
            except (TimeoutError, BlockingIOError):
                raise ProtocolError(ErrorCode.TIMEOUT, "peer stalled mid-frame") from None
            except OSError as e:
                raise ProtocolError(ErrorCode.DISCONNECTED, f"peer connection lost: {e}") from None
            if n == 0:
                if at_boundary and got == 0:
                    return 0
                raise ProtocolError(ErrorCode.TRUNCATED, "peer closed the connection inside a frame")
            got += n
        return got
