"""The trusted link's frames: plain TCP, every frame authenticated with a MAC (``--link trusted``).

After the pinned mutual TLS handshake (``peer/trust/tls.py``) both sides exchange fresh random
secrets inside TLS, derive one key per direction (``derive_keys``), close TLS and continue on the
bare TCP socket wrapped in ``MacSocket``. Each frame (``u32 length`` + header + payload, exactly as
on the other links) carries 16-byte tags: one right after the header, one after the payload (when
there is one):

    u32 length | header | tag(length | header) | payload | tag(header tag | payload)
    tag(m) = GMAC(key[direction], nonce = direction label (4 bytes) || n (u64 BE),
                  AAD = direction label || n || m),  n = this direction's tag counter

so nothing of a header is used, not even to size the payload, before it is authenticated, and a
payload is authenticated before it is handed on.

GMAC is AES-256-GCM with an empty plaintext (NIST SP 800-38D): a real MAC as long as a nonce never
repeats under a key, which holds here: a fresh key per connection and direction, and the nonce is
that direction's tag counter. It was the fastest MAC measured (bench/tls_link.py
``--macs``: GMAC, Poly1305, HMAC-SHA256, keyed BLAKE2b). The counters are never sent: each side
counts the tags it sends and receives, so a replayed, reordered, dropped or injected frame fails
the MAC like a corrupted one (``ProtocolError(MAC)``), and the connection is dropped (its
loads fall back to local prefill, keeping only KV that landed verified).

Nothing is encrypted: anyone on the path can read prompts' token ids and KV. It is for a link the
user trusts (a cable between two machines, a private switch), chosen explicitly on both sides.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from peer.wire.protocol import ErrorCode, ProtocolError

TAG_BYTES = 16
KEY_BYTES = 32
SECRET_BYTES = 32  # each side's random contribution to the link keys
TO_SERVER, TO_CLIENT = b"c->s", b"s->c"  # direction labels (4 bytes: the nonce's first part)
KDF_LABEL = b"duet trusted link v1"


def derive_keys(client_secret: bytes, server_secret: bytes) -> tuple[bytes, bytes]:
    """(client->server key, server->client key) from both sides' fresh secrets (exchanged inside
    TLS, so only the two endpoints know them)."""
    if len(client_secret) != SECRET_BYTES or len(server_secret) != SECRET_BYTES:
        raise ValueError("link secrets must be 32 bytes each")
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=KDF_LABEL, info=b"keys").derive(
        client_secret + server_secret
    )
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


class FrameMAC:
    """Tags for one direction of a connection: ``key``, its direction label and a frame counter."""

    def __init__(self, key: bytes, direction: bytes):
        if len(key) != KEY_BYTES or len(direction) != 4:
            raise ValueError("a frame MAC needs a 32-byte key and a 4-byte direction label")
        self._aes = algorithms.AES(key)
        self.direction = direction
        self.seq = 0

    def _tag(self, buffers: Any) -> bytes:
        head = self.direction + self.seq.to_bytes(8, "big")
        gmac = Cipher(self._aes, modes.GCM(head)).encryptor()
        gmac.authenticate_additional_data(head)
        for b in buffers:
            if memoryview(b).nbytes:
                gmac.authenticate_additional_data(b)
        gmac.finalize()
        self.seq += 1
        return gmac.tag

    def sign(self, buffers: Any) -> bytes:
        """The next tag sent, over ``buffers`` in order."""
        return self._tag(buffers)

    def verify(self, buffers: Any, tag: bytes | bytearray | memoryview) -> None:
        """Check the next tag received; ``ProtocolError(MAC)`` when ``buffers`` are not what the other
        side sent there (corrupted, replayed, reordered, injected)."""
        import hmac

        expected = self._tag(buffers)
        if not hmac.compare_digest(expected, bytes(tag)):
            raise ProtocolError(
                ErrorCode.MAC,
                f"tag {self.seq - 1} of the link failed its MAC: a frame was corrupted, replayed, "
                "reordered or injected",
            )


class MacSocket:
    """A connected TCP socket carrying MAC-tagged frames (``peer/wire/framing.py`` sends through
    ``send_frame`` and reads the tag after each frame). Only what the peer code uses of a socket."""

    def __init__(self, sock: socket.socket, send_mac: FrameMAC, recv_mac: FrameMAC):
        self.sock = sock
        self.send_mac, self.recv_mac = send_mac, recv_mac
        self._send_lock = threading.Lock()  # a frame's tag and its bytes go out together, in order

    @classmethod
    def client(cls, sock: socket.socket, client_secret: bytes, server_secret: bytes) -> MacSocket:
        up, down = derive_keys(client_secret, server_secret)
        return cls(sock, FrameMAC(up, TO_SERVER), FrameMAC(down, TO_CLIENT))

    @classmethod
    def server(cls, sock: socket.socket, client_secret: bytes, server_secret: bytes) -> MacSocket:
        up, down = derive_keys(client_secret, server_secret)
        return cls(sock, FrameMAC(down, TO_CLIENT), FrameMAC(up, TO_SERVER))

    def send_frame(self, views: list[memoryview]) -> None:
        """Write one frame (``views[0]``: length prefix + header; the rest: its payload) with its
        tags (sendmsg of memoryviews: no copy)."""
        with self._send_lock:
            head_tag = memoryview(self.send_mac.sign(views[:1]))
            out = [views[0], head_tag]
            if len(views) > 1:
                out += [*views[1:], memoryview(self.send_mac.sign([head_tag, *views[1:]]))]
            while out:
                sent = self.sock.sendmsg(out)
                while out and sent >= out[0].nbytes:
                    sent -= out[0].nbytes
                    out.pop(0)
                if sent:
                    out[0] = out[0][sent:]

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        return self.sock.recv_into(buffer, nbytes)

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, value: float | None) -> None:
        self.sock.settimeout(value)

    def setsockopt(self, *args: Any) -> None:
        self.sock.setsockopt(*args)

    def getpeername(self) -> Any:
        return self.sock.getpeername()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> MacSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
