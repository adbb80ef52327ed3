"""What mutual TLS 1.3 (peer/tls.py) costs on a link: bulk throughput over loopback TCP, plain vs
TLS, one direction, like a peer streaming KV to its decoder.

    .venv/bin/python bench/tls_link.py [--mib 512] [--chunk-kib 1024] [--repeat 3]

Prints one line per mode (best of --repeat) and the cipher TLS negotiated. Loopback has no wire
limit, so this is the CPU cost of each side; compare with the link (10 GbE = 1.25 GB/s).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path

from peer.trust.keys import PairedPeers, load_identity
from peer.trust.tls import accept_tls, client_context, connect_tls, server_context


def run(total: int, chunk: int, use_tls: bool, cfg: tuple) -> tuple[float, str]:
    server_id, server_peers, client_id, client_peers = cfg
    listener = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def sink() -> None:
        conn, _ = listener.accept()
        s = accept_tls(conn, server_context(server_id, server_peers), server_peers)[0] if use_tls else conn
        buf = bytearray(chunk)
        with s:
            while n := s.recv_into(buf):
                received[0] += n

    t = threading.Thread(target=sink)
    t.start()
    sock = socket.create_connection(listener.getsockname())
    cipher = "none"
    if use_tls:
        tls, _ = connect_tls(sock, client_context(client_id, client_peers), client_peers)
        cipher = f"{tls.version()} {tls.cipher()[0]}"  # type: ignore[index]
        sock = tls
    payload = memoryview(bytes(chunk))
    t0 = time.perf_counter()
    sent = 0
    with sock:
        while sent < total:
            sock.sendall(payload)
            sent += chunk
        sock.shutdown(socket.SHUT_WR)
        t.join()
    dt = time.perf_counter() - t0
    listener.close()
    assert received[0] == sent
    return sent / dt / 1e9, cipher


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per run, MiB")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="bytes per send, KiB")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        srv, cli = Path(d) / "gpu", Path(d) / "mac"
        sid, cid = load_identity(srv, "gpu"), load_identity(cli, "mac")
        sp, cp = PairedPeers(srv), PairedPeers(cli)
        sp.add("mac", cid.cert_pem)
        cp.add("gpu", sid.cert_pem)
        cfg = (sid, sp, cid, cp)
        for use_tls in (False, True):
            results = [run(a.mib << 20, a.chunk_kib << 10, use_tls, cfg) for _ in range(a.repeat)]
            best = max(r[0] for r in results)
            print(
                f"{'tls' if use_tls else 'plain':5s} {best:6.2f} GB/s  ({results[0][1]}, {a.mib} MiB, best of {a.repeat})"
            )


if __name__ == "__main__":
    main()
