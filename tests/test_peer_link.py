"""The trusted link (``duet peer serve --link trusted`` / ``--peer-link trusted``): the pinned mutual
TLS handshake as always, then frames unencrypted but each authenticated with a MAC keyed from
secrets exchanged inside TLS (peer/wire/frame_mac.py, peer/trust/tls.py).

- frames: a corrupted, forged (valid checksum, no key), replayed, reordered or dropped frame fails
  its MAC (``ErrorCode.MAC``), before anything of it is used;
- the link exchange: both sides trusted gives a MAC'd socket, both tls a TLS socket; one side
  trusted and the other not is refused on both sides with a clear message (no silent downgrade);
  an unpaired decoder is refused exactly as under TLS;
- the prefill stream through a recording proxy: exact KV, the capture starts with a TLS handshake
  and holds neither the link keys nor the link message, then plaintext frames; a proxy that flips a
  bit trips the MAC, the load fails (``mac``) and only exact KV landed;
- two engines over a trusted link: pool bytes, first-token logits and greedy tokens equal local
  prefill's.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from peer.trust.tls import LinkMismatchError, PeerAuthError, PeerTLS
from peer.wire.frame_mac import TO_CLIENT, TO_SERVER, FrameMAC, MacSocket, derive_keys
from peer.wire.framing import BufferPool, FrameReader, encode_message, encode_prefill, send_frame
from peer.wire.protocol import Cancel, ErrorCode, Prefill, ProtocolError
from tests.test_peer_tls import CHUNK, TOKENS, WAIT, N, Tap, _kv_bytes, _token_bytes, machine, pair

# --- frames -------------------------------------------------------------------------------------

SECRETS = (os.urandom(32), os.urandom(32))


def signed_frames(n: int) -> list[bytes]:
    """The bytes a decoder's MacSocket puts on the wire for ``n`` frames: CANCELs, and a PREFILL (a
    payload of 4 token ids) as the last one."""
    a, b = socket.socketpair()
    out = []
    with a, b:
        sender = MacSocket.client(a, *SECRETS)
        for i in range(n):
            last = i == n - 1
            send_frame(
                sender,
                encode_prefill(Prefill(f"r{i}", i, 4, 0, 16), [1, 2, 3, 4])
                if last
                else encode_message(Cancel(f"r{i}", i)),
            )
            data = b""
            while True:
                try:
                    data += b.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
            out.append(data)
    return out


def deliver(wire: bytes) -> list[object]:
    """What a peer's reader makes of ``wire``: the messages read, then the error that stopped it."""
    a, b = socket.socketpair()
    got: list[object] = []
    with a, b:
        a.sendall(wire)
        a.shutdown(socket.SHUT_WR)
        reader = FrameReader(MacSocket.server(b, *SECRETS), BufferPool(1 << 20), stall_timeout=WAIT)
        try:
            while (frame := reader.read(idle_timeout=WAIT)) is not None:
                got.append(frame.msg.request_id)  # type: ignore[attr-defined]
        except ProtocolError as e:
            got.append(e.code)
    return got


def test_a_mac_socket_pair_exchanges_frames_and_the_tag_spans_buffer_splits():
    a, b = socket.socketpair()
    client, server = MacSocket.client(a, *SECRETS), MacSocket.server(b, *SECRETS)
    with client, server:
        send_frame(client, encode_message(Cancel("r", 1)))
        send_frame(server, encode_message(Cancel("s", 2)))
        assert FrameReader(server, BufferPool(1 << 20)).read(WAIT).msg == Cancel("r", 1)
        assert FrameReader(client, BufferPool(1 << 20)).read(WAIT).msg == Cancel("s", 2)
    one = FrameMAC(b"k" * 32, TO_SERVER)
    assert one.sign([b"abc", b"defgh"]) == FrameMAC(b"k" * 32, TO_SERVER).sign([b"abcd", b"", b"efgh"])
    assert FrameMAC(b"k" * 32, TO_CLIENT).sign([b"abc"]) != FrameMAC(b"k" * 32, TO_SERVER).sign([b"abc"])


def test_tampered_forged_replayed_reordered_and_dropped_frames_fail_the_mac():
    f0, f1, f2 = signed_frames(3)
    assert f2[-32:-16] == np.asarray([1, 2, 3, 4], "<u4").tobytes()  # PREFILL: payload, then its tag
    assert deliver(f0 + f1 + f2) == ["r0", "r1", "r2"]
    for at in (3, 6, len(f1) - 1):  # length prefix (within the header cap), header, header tag
        flipped = bytearray(f1)
        flipped[at] ^= 0x01
        assert deliver(f0 + bytes(flipped) + f2) == ["r0", ErrorCode.MAC]
    flipped = bytearray(f2)
    flipped[-20] ^= 0x01  # the token ids: the MAC fails before the checksum is looked at
    assert deliver(f0 + f1 + bytes(flipped)) == ["r0", "r1", ErrorCode.MAC]
    forged = b"".join(bytes(b) for b in encode_message(Cancel("r1", 1)))
    assert deliver(f0 + forged + os.urandom(16)) == ["r0", ErrorCode.MAC]  # well-formed, wrong key
    assert deliver(f0 + f0) == ["r0", ErrorCode.MAC]  # replayed
    assert deliver(f1 + f0) == [ErrorCode.MAC]  # reordered
    assert deliver(f0 + f2) == ["r0", ErrorCode.MAC]  # one dropped
    up, _ = derive_keys(os.urandom(32), SECRETS[1])  # another connection's key
    bufs = encode_message(Cancel("r0", 0))
    assert deliver(b"".join(bytes(b) for b in bufs) + FrameMAC(up, TO_SERVER).sign(bufs)) == [ErrorCode.MAC]


# --- the link exchange ------------------------------------------------------------------------


def link_up(server: PeerTLS, client: PeerTLS) -> tuple[object, object]:
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def srv() -> None:
        try:
            out["s"] = server.wrap_server(b)[0]
        except PeerAuthError as e:
            out["s"] = e

    t = threading.Thread(target=srv)
    t.start()
    try:
        out["c"] = client.wrap_client(a, "gpu")[0]
    except PeerAuthError as e:
        out["c"] = e
    t.join(WAIT)
    assert not t.is_alive()
    return out["s"], out["c"]


def test_both_sides_choose_the_link_and_one_sided_trust_is_refused_on_both(tmp_path):
    import ssl

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    s, c = link_up(PeerTLS(*gpu, link="trusted"), PeerTLS(*mac, link="trusted"))
    assert isinstance(s, MacSocket) and isinstance(c, MacSocket)
    send_frame(c, encode_message(Cancel("over", 1)))
    assert FrameReader(s, BufferPool(1 << 20)).read(WAIT).msg == Cancel("over", 1)
    s, c = link_up(PeerTLS(*gpu), PeerTLS(*mac))
    assert isinstance(s, ssl.SSLSocket) and isinstance(c, ssl.SSLSocket) and c.version() == "TLSv1.3"

    s, c = link_up(PeerTLS(*gpu, link="trusted"), PeerTLS(*mac, link="tls"))
    assert isinstance(s, LinkMismatchError) and isinstance(c, LinkMismatchError)
    assert "refused mac: it asked for a tls link (encrypted)" in str(s)
    assert "this peer serves a trusted link (authenticated, not encrypted)" in str(s)
    assert "gpu refused this machine: it serves a trusted link" in str(c)
    assert "choose the same link on both sides" in str(c)
    s, c = link_up(PeerTLS(*gpu, link="tls"), PeerTLS(*mac, link="trusted"))
    assert isinstance(s, LinkMismatchError) and "it asked for a trusted link" in str(s)
    assert isinstance(c, LinkMismatchError) and "it serves a tls link (encrypted)" in str(c)

    stranger = machine(tmp_path, "stranger")
    stranger[1].add("gpu", gpu[0].cert_pem)
    s, c = link_up(PeerTLS(*gpu, link="trusted"), PeerTLS(*stranger, link="trusted"))
    assert type(s) is PeerAuthError and "not one this machine has paired with" in str(s)
    assert type(c) is PeerAuthError and "gpu refused this machine" in str(c)
    with pytest.raises(ValueError, match="link must be one of"):
        PeerTLS(*gpu, link="plain")


# --- the prefill stream over a trusted link ------------------------------------------------------


def prefill_over(server_tls, client_tls, corrupt_at=None):
    from peer.client import RemotePrefillSource
    from peer.server import PeerServer
    from tests.peer_fakes import FakeBackend, KVLoad, RecordingSink, fake_hello

    backend = FakeBackend()
    server = PeerServer(backend, fake_hello(), "127.0.0.1", 0, tls=server_tls).start()
    tap = Tap(server.port, corrupt_at)
    src = RemotePrefillSource("127.0.0.1", tap.port, tls=client_tls, name="gpu")
    src.configure(fake_hello(), CHUNK)
    keys: list[bytes] = []
    try:
        ok = src.connect(wait_s=WAIT)
        sink = RecordingSink(N)
        if ok:
            sock = src.link.conn.sock  # type: ignore[union-attr]
            if isinstance(sock, MacSocket):
                keys = [sock.send_mac._aes.key, sock.recv_mac._aes.key]
            src.start_load(KVLoad(1, "req-1", list(TOKENS), 0, N - 1), sink)
            sink.wait_end(1)
        return ok, backend, server, src, sink, bytes(tap.seen), keys
    finally:
        src.close()
        server.close()
        tap.close()


def test_prefill_over_a_trusted_link_is_exact_after_a_tls_handshake(tmp_path):
    from tests.peer_fakes import LAYERS, expected_kv

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    ok, backend, server, src, sink, wire, keys = prefill_over(
        PeerTLS(*gpu, link="trusted"), PeerTLS(*mac, link="trusted")
    )
    assert ok and sink.loads[1].done and src.remote_prefills == 1 and src.fallbacks == {}
    for layer in range(LAYERS):
        for got, want in zip(sink.loads[1].kv[layer], expected_kv(TOKENS, layer, 0, N - 1), strict=True):
            np.testing.assert_array_equal(got[: N - 1], want)
    assert wire[:3] == b"\x16\x03\x01"  # a TLS ClientHello opens the connection
    hello_at = wire.index(b"hello")  # then the peer protocol in plaintext, as documented
    assert hello_at > 1000 and _token_bytes() in wire and _kv_bytes() in wire
    assert b"DUETLINK" not in wire  # the link exchange (its secrets) went inside TLS
    assert len(keys) == 2 and all(len(k) == 32 and k not in wire for k in keys)
    assert server.stats.counts.get("connections") == 1


def test_a_flipped_bit_on_a_trusted_link_trips_the_mac_and_only_exact_kv_landed(tmp_path):
    from tests.peer_fakes import LAYERS, expected_kv

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    ok, backend, server, src, sink, wire, _ = prefill_over(
        PeerTLS(*gpu, link="trusted"), PeerTLS(*mac, link="trusted"), corrupt_at=12000
    )
    load = sink.loads[1]
    assert ok and not load.done and load.failed == ErrorCode.MAC.value and src.remote_prefills == 0
    assert src.fallbacks == {"mac": 1} and src.last_error is not None and src.last_error[0] == "mac"
    assert 0 < load.frames < LAYERS * -(-(N - 1) // CHUNK)
    for layer, end in load.landed.items():  # every frame that landed is exact
        for got, want in zip(load.kv[layer], expected_kv(TOKENS, layer, 0, end), strict=True):
            np.testing.assert_array_equal(got[:end], want)


def test_a_decoder_asking_for_another_link_gets_nothing_and_both_sides_say_why(tmp_path):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    for served, asked in (("trusted", "tls"), ("tls", "trusted")):
        ok, backend, server, src, sink, wire, _ = prefill_over(
            PeerTLS(*gpu, link=served), PeerTLS(*mac, link=asked)
        )
        assert not ok and backend.started == [] and server.stats.counts.get("connections", 0) == 0
        with server.idle:  # the server counts the refusal after sending its reason
            assert server.idle.wait_for(
                lambda s=server: s.stats.counts.get("connections_link_mismatch") == 1, WAIT
            )
        assert (
            src.last_error is not None
            and f"gpu refused this machine: it serves a {served} link" in (src.last_error[1])
        )
        assert _token_bytes() not in wire and b"hello" not in wire


# --- two engines -----------------------------------------------------------------------------------


def test_engines_over_a_trusted_link_match_local_prefill(tiny_dirs, tmp_path):
    from tests.peer_pair import Pair, tiny_cfg, two_models
    from tests.test_engine_tiny import prompts
    from tests.test_peer_loopback import assert_exact_remote

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    models = two_models(tiny_dirs("llama"))
    (p,) = prompts(models[0].tokenizer.vocab_size, [150], seed=13)
    pr = Pair(
        *models,
        tiny_cfg(),
        server_tls=PeerTLS(*gpu, link="trusted"),
        client_tls=PeerTLS(*mac, link="trusted"),
    )
    try:
        assert isinstance(pr.src.link.conn.sock, MacSocket)  # type: ignore[union-attr]
        assert_exact_remote(pr, p)
    finally:
        pr.close()


def test_link_options_are_checked_before_anything_loads(tmp_path, monkeypatch, capsys):
    from app import cli
    from mlx_engine.engine import Engine

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(Engine, "load", refuse)
    import app.options

    monkeypatch.setattr(app.options, "check_model_args", lambda args: None)
    monkeypatch.setenv("DUET_CONFIG_DIR", str(tmp_path / "mac"))

    def error(*argv: str) -> str:
        assert cli.main(list(argv)) == cli.EXIT_ERROR
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("duet: error: ")
        return err

    assert "--link trusted applies to a network --host" in error("peer", "serve", "--link", "trusted")
    assert "--peer-link trusted applies to peers on a network address" in error(
        "generate", "-p", "hi", "--peers", "127.0.0.1:7611", "--peer-link", "trusted"
    )
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cli.main(["peer", "serve", "--link", "plain"])
    assert "invalid choice: 'plain'" in capsys.readouterr().err


def test_a_partner_silent_after_the_handshake_is_refused_within_the_deadline(tmp_path):
    """A client that completes TLS but never sends its link message (or a server that never
    answers it) ends in PeerAuthError at the handshake deadline, never a bare socket error that
    would leave the connecting thread dead."""
    from peer.trust.tls import accept_tls, client_context, connect_tls, server_context

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    for server_link, client_link in (("tls", None), (None, "tls")):
        a, b = socket.socketpair()
        out: dict[str, object] = {}

        def srv(link=server_link, sock=b, out=out) -> None:
            try:
                out["s"] = accept_tls(sock, server_context(*gpu), gpu[1], timeout=1.0, link=link)[0]
            except PeerAuthError as e:
                out["s"] = e

        t = threading.Thread(target=srv)
        t.start()
        try:
            out["c"] = connect_tls(a, client_context(*mac), mac[1], who="gpu", timeout=1.0, link=client_link)[
                0
            ]
        except PeerAuthError as e:
            out["c"] = e
        t.join(WAIT)
        silent = out["s"] if server_link else out["c"]
        assert isinstance(silent, PeerAuthError) and "setting up the link with" in str(silent)
        assert "timed out" in str(silent)
        for x in (a, b, out["s"], out["c"]):
            if hasattr(x, "close"):
                x.close()
