"""Two engines joined by the real peer network layer over a loopback socket, for the peer tests.

``Pair`` runs a prefill peer (an ``Engine`` behind ``PeerServer`` + ``EngineBackend``) and a decoder
(an ``Engine`` with a ``RemotePrefillSource`` connected to it), plus a reference engine configured
like the decoder that prefills locally (with a source that never offers, so it computes the last
prompt token on its own as the decoder does after a remote load). The peer loads its own copy of
the model: it computes while the decoder decodes."""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.loader import LoadedModel, load_model
from peer.client import Backoff, PeerTimeouts, RemotePrefillSource
from peer.export_connection import Connection
from peer.identity import local_hello
from peer.server import EngineBackend, PeerServer, ServerLimits
from tests.test_engine_tiny import assert_no_leaks
from tests.test_remote_prefill_engine import NoPeer

WAIT = 120.0  # a deadline for hangs only


def tiny_cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"cache_gb": 0.02, "prefill_chunk": 64, "max_batch_tokens": 128, **kw})


class Pair:
    def __init__(
        self,
        decoder_model: LoadedModel,
        peer_model: LoadedModel,
        dec_cfg: EngineConfig,
        peer_cfg: EngineConfig | None = None,
        *,
        backend_class: type[EngineBackend] = EngineBackend,
        connection_class: type[Connection] = Connection,
        limits: ServerLimits | None = None,
        hello_change: dict[str, Any] | None = None,
        timeouts: PeerTimeouts | None = None,
        backoff: Backoff | None = None,
        buffer_cap_bytes: int = 64 << 20,
        policy: str = "always",
        server_tls: Any = None,  # peer.trust.tls.PeerTLS: the connection over pinned TLS / a trusted link
        client_tls: Any = None,
    ):
        self.ref = Engine(decoder_model, dec_cfg)
        self.ref.add_kv_source(NoPeer())
        self.dec = Engine(decoder_model, dec_cfg)
        self.peer = Engine(peer_model, peer_cfg or dec_cfg)
        self.backend = backend_class(self.peer)
        hello = self.peer.run_on_worker(lambda: local_hello(self.peer), WAIT)
        if hello_change:
            hello = dataclasses.replace(hello, **hello_change)
        self.server = PeerServer(
            self.backend, hello, limits=limits, connection_class=connection_class, tls=server_tls
        ).start()
        self.src = RemotePrefillSource(
            "127.0.0.1",
            self.server.port,
            timeouts=timeouts or PeerTimeouts(),
            backoff=backoff or Backoff(initial_s=300),  # no retry inside a test unless it says so
            buffer_cap_bytes=buffer_cap_bytes,
            policy=policy,
            tls=client_tls,
        )
        self.dec.add_kv_source(self.src)  # attached on the decoder's worker
        self.dec.run_on_worker(lambda: None, WAIT)
        self.src.connect(wait_s=WAIT)
        self.chunk = min(dec_cfg.prefill_chunk, dec_cfg.max_batch_tokens)

    @property
    def peer_name(self) -> str:
        return self.src.name

    def peer_settled(self) -> None:
        """Wait until the peer ended every export and its worker handled the cancels."""
        with self.server.idle:
            assert self.server.idle.wait_for(lambda: self.server.active_exports == 0, WAIT)
        self.peer.run_on_worker(lambda: None, WAIT)

    def assert_no_leaks(self) -> None:
        self.dec.run_on_worker(lambda: None, WAIT)
        assert_no_leaks(self.dec)
        self.peer_settled()
        assert_no_leaks(self.peer)

    def close(self) -> None:
        self.src.close()
        self.server.close()
        for e in (self.ref, self.dec, self.peer):
            e.shutdown()


def two_models(path) -> tuple[LoadedModel, LoadedModel]:
    return load_model(str(path)), load_model(str(path))
