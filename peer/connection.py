"""One connection to a prefill peer: the socket (TCP, then mutual TLS when paired), the HELLO
exchange and its checks (``open_connection``), and the live connection's reader, sender queue
and wake-up pipe (``Conn``). What travels over it is ``peer/client.py``'s business."""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peer.wire.frame_mac import MacSocket
from peer.wire.framing import BufferPool, FrameReader, encode_message, send_frame
from peer.wire.handshake import check_peer
from peer.wire.kv_wire import KVFormat
from peer.wire.protocol import Error, ErrorCode, Hello, ProtocolError

if TYPE_CHECKING:
    from peer.trust.keys import PairedPeer
    from peer.trust.link_security import PeerSecurity


@dataclass
class PeerTimeouts:
    connect_s: float = 5.0  # TCP connect
    hello_s: float = 10.0  # the peer's HELLO after ours
    first_byte_s: float = 30.0  # PREFILL sent -> ACCEPT, and ACCEPT -> first LAYER_KV (plus the peer's ETA)
    stall_s: float = 10.0  # between two frames of one load, and inside a frame
    # a whole load, PREFILL sent -> DONE, whatever its frames do (ACCEPTs, re-sent layers): load_s plus
    # the load's tokens at min_rate_tps (a peer slower than that is no use for prefill anyway)
    load_s: float = 120.0
    min_rate_tps: float = 50.0

    def load_deadline_s(self, tokens: int) -> float:
        return self.load_s + max(tokens, 0) / self.min_rate_tps


@dataclass
class Backoff:
    initial_s: float = 1.0
    max_s: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.initial_s * 2 ** max(failures - 1, 0), self.max_s)


class Conn:
    """One live connection: its socket, reader (recv_into a byte-capped pool) and sender thread."""

    def __init__(
        self,
        sock: socket.socket | MacSocket,
        reader: FrameReader,
        remote: Hello,
        peer: PairedPeer | None = None,
    ):
        self.sock, self.reader, self.remote = sock, reader, remote
        self.peer = peer  # who authenticated (None on a plain link)
        self.out: queue.Queue[list | None] = queue.Queue()
        self.closed = threading.Event()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.threads: list[threading.Thread] = []

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self.wake_w.send(b"\0")

    def drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self.wake_r.recv(4096):
                pass

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.out.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.wake()
        self.reader.buffers.close()


def open_connection(
    host: str,
    port: int,
    local: Hello,
    fmt: KVFormat,
    *,
    timeouts: PeerTimeouts,
    buffer_cap: int,
    security: PeerSecurity | None,
    name: str,
) -> Conn:
    """Connect to ``host:port``, authenticate the peer as ``security`` says for the address actually
    reached (mutual TLS, pinned, over a network; this user's local secret on loopback), send our
    HELLO, read and check the peer's. Raises ``ProtocolError`` for any failure, the socket closed;
    nothing of the model or a prompt is sent before the peer is authenticated."""
    sock: socket.socket | MacSocket | None = None
    peer: PairedPeer | None = None
    try:
        try:
            sock = socket.create_connection((host, port), timeout=timeouts.connect_s)
        except OSError as e:
            raise ProtocolError(ErrorCode.DISCONNECTED, f"cannot connect: {e.strerror or e}") from None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if security is not None:
            from peer.trust.tls import PeerAuthError, PeerTLS

            try:
                guard = security.guard_for(sock.getpeername()[0] if sock.family != socket.AF_UNIX else None)
                if guard is not None:
                    sock, peer = guard.wrap_client(sock, who=name)
                    if isinstance(guard, PeerTLS):
                        security.check_pin(peer, name)
            except PeerAuthError as e:  # nothing of the model or prompt was sent
                sock.close()
                sock = None
                raise ProtocolError(ErrorCode.DISCONNECTED, str(e)) from None
        try:
            send_frame(sock, encode_message(local))
        except OSError as e:
            raise ProtocolError(ErrorCode.DISCONNECTED, f"connection lost: {e}") from None
        reader = FrameReader(
            sock,
            BufferPool(buffer_cap),
            kv_format=fmt,
            max_prompt_tokens=1,
            stall_timeout=timeouts.stall_s,
        )
        frame = reader.read(idle_timeout=timeouts.hello_s)
        if frame is None:
            raise ProtocolError(ErrorCode.DISCONNECTED, "the peer closed the connection during HELLO")
        frame.release()
        remote = frame.msg
        if isinstance(remote, Error):
            raise ProtocolError(remote.code, f"the peer refused: {remote.message}")
        if not isinstance(remote, Hello):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"expected HELLO, got {remote.TYPE.value}")
        check_peer(local, remote)
        return Conn(sock, reader, remote, peer)
    except ProtocolError:
        if sock is not None:
            sock.close()
        raise
