"""What the peer link's protection costs: bulk throughput over loopback TCP, one direction, like a
prefill peer streaming KV to its decoder.

    .venv/bin/python bench/tls_link.py [--mib 256] [--chunk-kib 1024] [--repeat 5] [--macs]

Modes (median of --repeat runs each, interleaved):
- ``plain``: bare TCP, ``sendall`` of --chunk-kib buffers;
- ``frames``: bare TCP through the peer framing (``send_frame`` / ``FrameReader``, xxh3 checksums),
  the loopback link;
- ``tls``: mutual TLS 1.3 (peer/trust/tls.py), ``sendall`` of the same buffers;
- ``trusted``: the trusted link (``--link trusted``): the pinned TLS handshake, then the peer
  framing with a GMAC tag per header and payload (peer/wire/frame_mac.py), verified on receipt;
- ``aead``: not a Duet link, a sketch of one: bare TCP, each --chunk-kib message AES-256-GCM
  encrypted by the application (``encrypt_into`` a reused buffer, ``sendall``) and decrypted on
  receipt (``recv_into`` a reused buffer, ``decrypt_into`` another): what encrypting frames
  without ``ssl`` would cost.

``--macs`` also times the MAC and AEAD candidates on one --chunk-kib buffer (one thread, no I/O).
Loopback has no wire limit, so this is the CPU cost of both ends on one machine; compare with the
link (10 GbE = 1.25 GB/s).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from peer.trust.keys import PairedPeers, load_identity
from peer.trust.tls import accept_tls, client_context, connect_tls, server_context
from peer.wire.framing import BufferPool, FrameReader, encode_prefill, send_frame
from peer.wire.protocol import Prefill

MODES = ("plain", "frames", "tls", "trusted", "aead")


def run(total: int, chunk: int, mode: str, cfg: tuple) -> tuple[float, str]:
    """GB/s of one run of ``total`` bytes in ``mode``, and what protected it."""
    server_id, server_peers, client_id, client_peers = cfg
    listener = socket.create_server(("127.0.0.1", 0))
    received = [0]
    link = {"tls": "tls", "trusted": "trusted"}.get(mode)
    framed = mode in ("frames", "trusted")
    tokens = chunk // 4
    aead = AESGCM(bytes(32)) if mode == "aead" else None  # a fixed key: timing only

    def sink() -> None:
        conn, _ = listener.accept()
        s = conn
        if link:
            s = accept_tls(conn, server_context(server_id, server_peers), server_peers, link=link)[0]
        with s:
            if framed:
                reader = FrameReader(s, BufferPool(4 * chunk + 4096), max_prompt_tokens=tokens)
                while (frame := reader.read()) is not None:
                    with frame:
                        received[0] += frame.payload.nbytes if frame.payload else 0
            elif aead is not None:
                sealed, plain = bytearray(chunk + 16), bytearray(chunk)
                view, seq = memoryview(sealed), 0
                while True:
                    got = 0
                    while got < len(sealed) and (n := s.recv_into(view[got:])):
                        got += n
                    if got < len(sealed):
                        break
                    aead.decrypt_into(seq.to_bytes(12, "big"), sealed, b"", plain)
                    received[0] += chunk
                    seq += 1
            else:
                buf = bytearray(chunk)
                while n := s.recv_into(buf):
                    received[0] += n

    t = threading.Thread(target=sink)
    t.start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    what = "none"
    conn = sock
    if link:
        conn = connect_tls(sock, client_context(client_id, client_peers), client_peers, link=link)[0]
        what = "TLS 1.3 handshake, then GMAC tags" if link == "trusted" else "TLS 1.3"
        if link == "tls":
            what = f"{conn.version()} {conn.cipher()[0]}"  # type: ignore[union-attr]
    ids = np.zeros(tokens, "<u4")
    payload = memoryview(bytes(chunk))
    sealed = bytearray(chunk + 16)
    if aead is not None:
        what = "AES-256-GCM by the application, no TLS"
    t0 = time.perf_counter()
    sent = 0
    with conn:
        while sent < total:
            if framed:
                send_frame(conn, encode_prefill(Prefill("bench", 1, tokens, 0, 16), ids))
            elif aead is not None:
                aead.encrypt_into((sent // chunk).to_bytes(12, "big"), payload, b"", sealed)
                conn.sendall(sealed)  # type: ignore[union-attr]
            else:
                conn.sendall(payload)  # type: ignore[union-attr]
            sent += chunk
        conn.shutdown(socket.SHUT_WR)
        t.join()
    dt = time.perf_counter() - t0
    listener.close()
    assert received[0] == sent
    return sent / dt / 1e9, what


def time_macs(nbytes: int, repeat: int) -> dict[str, float]:
    """GB/s of each MAC / AEAD candidate over one ``nbytes`` buffer (median of ``repeat`` runs)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from peer.wire.frame_mac import FrameMAC

    data = memoryview(bytearray(os.urandom(nbytes)))
    key = os.urandom(32)
    out = bytearray(nbytes + 16)
    gmac = FrameMAC(key, b"s->c")
    aes, chacha = AESGCM(key), ChaCha20Poly1305(key)

    def hmac_sha256() -> None:
        h = hmac.new(key, digestmod="sha256")
        h.update(data)
        h.digest()

    def blake2b() -> None:
        h = hashlib.blake2b(key=key, digest_size=16)
        h.update(data)
        h.digest()

    def poly1305() -> None:  # a one-time key per frame from ChaCha20, as in ChaCha20-Poly1305
        one_time = Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor().update(bytes(32))
        p = Poly1305(one_time)
        p.update(data)
        p.finalize()

    candidates: dict[str, Callable[[], object]] = {
        "GMAC (AES-256-GCM, AAD only; the trusted link's)": lambda: gmac.sign([data]),
        "Poly1305 (one-time key from ChaCha20)": poly1305,
        "HMAC-SHA256 (OpenSSL)": hmac_sha256,
        "keyed BLAKE2b": blake2b,
        "AES-256-GCM encrypt_into (encrypts too)": lambda: aes.encrypt_into(bytes(12), data, b"", out),
        "ChaCha20-Poly1305 encrypt_into (encrypts too)": lambda: chacha.encrypt_into(
            bytes(12), data, b"", out
        ),
    }
    result = {}
    reps = max(1, (256 << 20) // nbytes)
    for name, fn in candidates.items():
        fn()
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            runs.append(reps * nbytes / (time.perf_counter() - t0) / 1e9)
        result[name] = statistics.median(runs)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per run, MiB")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="bytes per send (and per frame), KiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--macs", action="store_true", help="also time the MAC / AEAD candidates")
    a = ap.parse_args()
    chunk = a.chunk_kib << 10
    with tempfile.TemporaryDirectory() as d:
        srv, cli = Path(d) / "gpu", Path(d) / "mac"
        sid, cid = load_identity(srv, "gpu"), load_identity(cli, "mac")
        sp, cp = PairedPeers(srv), PairedPeers(cli)
        sp.add("mac", cid.cert_pem)
        cp.add("gpu", sid.cert_pem)
        cfg = (sid, sp, cid, cp)
        results: dict[str, list[float]] = {m: [] for m in MODES}
        what: dict[str, str] = {}
        for _ in range(a.repeat):  # interleaved, so a load spike hits every mode alike
            for mode in MODES:
                gbps, what[mode] = run(a.mib << 20, chunk, mode, cfg)
                results[mode].append(gbps)
        plain = statistics.median(results["plain"])
        for mode in MODES:
            med = statistics.median(results[mode])
            print(
                f"{mode:8s} {med:6.2f} GB/s  x{med / plain:4.2f} of plain  ({what[mode]}; {a.mib} MiB, "
                f"{a.chunk_kib} KiB sends, median of {a.repeat})"
            )
    if a.macs:
        for name, gbps in time_macs(chunk, a.repeat).items():
            print(f"  {name:48s} {gbps:6.2f} GB/s")


if __name__ == "__main__":
    main()
