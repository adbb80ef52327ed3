"""An engine's prefill peers: ``attach_peers`` connects an engine to them as KV sources, and the
engine's own source list is where they are found again (``sources_of``, ``peer_usage``).

A library call, no command line: ``PeerSpec`` says where the peers are (addresses, and whether to
look for paired machines over mDNS), when to offload (``mode``) and over which link; the CLI turns
its ``--peers`` / ``--remote-prefill`` / ``--peer-link`` / ``--interface`` options into one
(``app/peer_options.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client imports MLX: only once peers are attached
    from peer.client import RemotePrefillSource

MODES = ("auto", "always", "never")
AUTO_BROWSE_S = 5.0  # auto: the longest wait for a paired machine's mDNS answer
log = logging.getLogger("duet.peer")


@dataclass(frozen=True)
class PeerSpec:
    """Where an engine's prefill peers are and how it uses them."""

    addresses: tuple[tuple[str, int], ...] = ()  # (host, port) of each peer
    auto: bool = False  # also the paired machines advertised over mDNS
    mode: str = "never"  # auto: when the planner predicts an earlier first token; always; never
    link: str = "tls"  # to network peers: tls, or trusted (frames authenticated, not encrypted)
    interfaces: tuple[str, ...] = ()  # with auto: browse on these interface addresses only


def attach_peers(engine: Any, spec: PeerSpec, *, wait_s: float | None = None) -> list[RemotePrefillSource]:
    """Connect ``engine`` to its peers as KV sources; waits for each HELLO exchange (up to the
    connect and HELLO deadlines). A peer that cannot be used logs one line (the reason); requests
    prefill locally meanwhile and it is retried in the background after a backoff."""
    if spec.mode == "never":
        return []
    from peer.client import PeerTimeouts, RemotePrefillSource
    from peer.identity import model_fingerprint
    from peer.trust.link_security import PeerSecurity, security_for
    from peer.trust.tls import PeerTLS

    model_fingerprint(engine.loaded.path)  # hashed here, not on the worker (attach finds it memoised)
    timeouts = PeerTimeouts()
    sources = []
    targets: list[tuple[str, int, str | None, str | None]] = [(h, p, None, None) for h, p in spec.addresses]
    if spec.auto:
        targets += discovered(spec.interfaces)
    for host, port, name, pin in targets:
        if pin is None:  # TLS with a paired machine over a network, the local secret on loopback
            security = security_for(host, "--peers", link=spec.link)
        else:  # found over mDNS: TLS always, with the paired machine the advert claims to be
            security = PeerSecurity(tls=PeerTLS.load(link=spec.link), expect=pin)
        src = RemotePrefillSource(
            host, port, policy=spec.mode, timeouts=timeouts, security=security, name=name
        )
        sources.append(src)
        engine.add_kv_source(src)  # the worker attaches it: HELLO from the pool, connecting
    engine.run_on_worker(lambda: None, 300)  # every source is attached
    wait = timeouts.connect_s + timeouts.hello_s if wait_s is None else wait_s
    for src in sources:
        src.connect(wait_s=wait)
    return sources


def discovered(
    interfaces: tuple[str, ...] = (), timeout: float = AUTO_BROWSE_S
) -> list[tuple[str, int, str | None, str | None]]:
    """Paired machines advertised on ``interfaces`` (every interface without): (address, port,
    name, fingerprint of the paired machine the advert claims to be, which TLS then requires).
    Loopback addresses in an advert are never used (``DiscoveredPeer.best_address``)."""
    from peer.discovery import discover_paired
    from peer.interfaces import list_nics
    from peer.trust.keys import PairedPeers

    paired = {p.short_id: p for p in PairedPeers().load().values()}
    found = discover_paired(list(interfaces) or None, set(paired), timeout)
    if not found:
        log.warning(
            "peer: --peers auto found no paired machine advertising within %g s; prefilling here", timeout
        )
    nics = list_nics()  # with several interfaces, a peer's address through the fastest one first
    return [
        (addr, p.port, paired[p.short_id].name, paired[p.short_id].fingerprint)
        for p in found
        if (addr := p.best_address(nics))
    ]


def sources_of(engine: Any) -> list[RemotePrefillSource]:
    """The peer sources among ``engine``'s KV sources (for /metrics and --json)."""
    scheduler = getattr(engine, "scheduler", None)
    sources = getattr(scheduler, "sources", None) or []
    if not sources:
        return []
    from peer.client import RemotePrefillSource

    return [s for s in sources if isinstance(s, RemotePrefillSource)]


_LOAD_FIELDS = (
    "peer",
    "start",
    "end",
    "hit",
    "frames",
    "bytes",
    "tokens_computed",
    "compute_s",
    "wait_s",
    "transfer_s",
    "total_s",
    "accept_s",
    "link_s",
    "predicted_s",
    "outcome",
    "exact",
)


def peer_usage(usage: Any, engine: Any, request_id: str) -> dict[str, Any]:
    """The remote-prefill part of a request's usage (``duet generate --json``)."""
    out: dict[str, Any] = {
        "prefill_location": usage.prefill_location,
        "prompt_tokens_computed": usage.prompt_tokens_computed,
        "remote_tokens": usage.remote_tokens,
        "remote_bytes": usage.remote_bytes,
        "remote_wait_s": round(usage.remote_wait_s, 4),
        "remote_compute_s": round(usage.remote_compute_s, 4),
        "fallback_reason": usage.fallback_reason,
    }
    sources = sources_of(engine)
    loads = [info for src in sources for info in src.loads_of(request_id)]
    if loads:
        out["remote_loads"] = [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items() if k in _LOAD_FIELDS}
            for info in loads
        ]
    plans = [d.as_dict() for src in sources if (d := src.planner.decision(request_id)) is not None]
    if plans:  # the offload planner's decision(s): offloaded or not, predicted and measured TTFT
        out["plan"] = plans[0] if len(plans) == 1 else plans
    if usage.prefill_location.startswith("remote:"):
        used = [s for s in sources if s.name in usage.prefill_location]
        exact = getattr(usage, "prefill_exact", None)
        out["exact"] = all(s.exact for s in used) if exact is None else exact
        inexact = [r for s in used for r in s.inexact]
        if inexact:
            out["inexact_reasons"] = inexact
    elif sources and usage.fallback_reason is None:
        down = [f"{s.name}: {s.last_error[0]}" for s in sources if not s.healthy and s.last_error is not None]
        if down:  # never offered: the peer was unavailable
            out["fallback_reason"] = "; ".join(down)
    return out
