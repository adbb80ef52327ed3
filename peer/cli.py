"""The peer commands and options: ``duet peer serve``, and ``--peers`` / ``--remote-prefill`` for
``duet generate``, ``duet serve`` and ``duet chat``.

``app/cli.py`` calls ``add_peer_parser`` (the ``peer`` command), ``add_peer_args`` (the options of
the other commands), ``check_peer_args`` (before anything loads) and ``attach_peers`` (once the
engine is up: one ``RemotePrefillSource`` per peer, connected before the first request, so the
HELLO exchange is not part of a request's time to first token).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlx_engine.errors import ConfigError

if TYPE_CHECKING:  # the client imports MLX: only once peers are attached
    from peer.client import RemotePrefillSource

MODES = ("auto", "always", "never")
LINKS = ("tls", "trusted")  # peer.trust.tls.LINKS (not imported here: argparse only)
DEFAULT_PORT = 7611
AUTO_BROWSE_S = 5.0  # --peers auto: the longest wait for a paired machine's mDNS answer

_sources: weakref.WeakKeyDictionary[Any, list[RemotePrefillSource]] = weakref.WeakKeyDictionary()


# --- options of generate / serve / chat --------------------------------------------------------
def add_peer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peers",
        action="append",
        default=[],
        metavar="auto|off|HOST:PORT[,HOST:PORT...]",
        help="prefill peers (`duet peer serve`) to compute prompts on, then stream their KV here: "
        "auto finds paired machines over mDNS; a network address needs pairing (mutual TLS); "
        "repeatable",
    )
    p.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="IP",
        help="with --peers auto: look for peers on this interface address only (repeatable; "
        "default: every interface)",
    )
    p.add_argument(
        "--peer-link",
        choices=LINKS,
        default="tls",
        help="link to network peers: tls (the default) encrypts everything; trusted (the peer must "
        "serve --link trusted too) authenticates every frame but does not encrypt, for a trusted link",
    )
    p.add_argument(
        "--remote-prefill",
        choices=MODES,
        default=None,
        help="auto (the default with --peers): offload a prompt when the rates measured so far say "
        "the peer finishes first; always: whenever a peer is connected and healthy; never: prefill here",
    )


def parse_peers(values: list[str] | None) -> list[tuple[str, int]]:
    """``--peers`` values -> (host, port) pairs; ConfigError (one line) for a bad one."""
    out = []
    for value in values or ():
        for item in (x.strip() for x in value.split(",")):
            if not item or item in ("auto", "off"):
                continue
            host, sep, port = item.rpartition(":")
            host = host.strip("[]")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"--peers {item!r} is not HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})", "peers"
                )
            out.append((host, int(port)))
    return out


def peers_auto(args: argparse.Namespace) -> bool:
    """Whether ``--peers auto`` asks for the paired machines advertised on the network."""
    return any(x.strip() == "auto" for v in getattr(args, "peers", None) or () for x in v.split(","))


def remote_prefill_mode(args: argparse.Namespace) -> str:
    mode = getattr(args, "remote_prefill", None)
    peers = parse_peers(getattr(args, "peers", None)) or peers_auto(args)
    if mode is None:
        return "auto" if peers else "never"
    if mode != "never" and not peers:
        raise ConfigError(f"--remote-prefill {mode} needs --peers HOST:PORT", "remote_prefill")
    return mode


def check_peer_args(args: argparse.Namespace) -> None:
    """The peer options, checked before anything loads."""
    if remote_prefill_mode(args) != "never":
        from peer.trust.tls import tls_for_address

        link = getattr(args, "peer_link", "tls")
        network = [h for h, _ in parse_peers(getattr(args, "peers", None)) if tls_for_address(h, "--peers")]
        if link == "trusted" and not network and not peers_auto(args):
            raise ConfigError(
                "--peer-link trusted applies to peers on a network address (a loopback peer is plain TCP)",
                "peer_link",
            )
        if peers_auto(args):
            from peer.discovery import local_ip_for
            from peer.trust.keys import PairedPeers

            for ip in getattr(args, "interface", None) or ():
                local_ip_for(ip)
            if not PairedPeers().load():
                raise ConfigError(
                    "--peers auto uses paired machines only, and none is paired yet "
                    "(duet peer pair --code NNNN-NNNN HOST)",
                    "peers",
                )


def attach_peers(
    engine: Any, args: argparse.Namespace, *, wait_s: float | None = None
) -> list[RemotePrefillSource]:
    """Connect ``engine`` to its ``--peers`` as KV sources; waits for each HELLO exchange (up to the
    connect and HELLO deadlines). A peer that cannot be used logs one line (the reason); requests
    prefill locally meanwhile and it is retried in the background after a backoff."""
    mode = remote_prefill_mode(args)
    if mode == "never":
        return []
    from peer.client import PeerTimeouts, RemotePrefillSource
    from peer.identity import model_fingerprint
    from peer.trust.tls import tls_for_address

    model_fingerprint(engine.loaded.path)  # hashed here, not on the worker (attach finds it memoised)
    timeouts = PeerTimeouts()
    sources = []
    targets: list[tuple[str, int, str | None]] = [(h, p, None) for h, p in parse_peers(args.peers)]
    if peers_auto(args):
        targets += _discovered(args)
    for host, port, name in targets:
        # a peer on a network: mutual TLS, paired only (then a trusted link if asked for)
        tls = tls_for_address(host, "--peers", link=getattr(args, "peer_link", "tls"))
        src = RemotePrefillSource(host, port, policy=mode, timeouts=timeouts, tls=tls, name=name)
        sources.append(src)
        engine.add_kv_source(src)  # the worker attaches it: HELLO from the pool, connecting
    _sources[engine] = sources
    engine.run_on_worker(lambda: None, 300)  # every source is attached
    wait = timeouts.connect_s + timeouts.hello_s if wait_s is None else wait_s
    for src in sources:
        src.connect(wait_s=wait)
    return sources


def _discovered(
    args: argparse.Namespace, timeout: float = AUTO_BROWSE_S
) -> list[tuple[str, int, str | None]]:
    """``--peers auto``: paired machines advertised on ``--interface`` (every interface without)."""
    from peer.discovery import discover_paired
    from peer.trust.keys import PairedPeers

    paired = {p.short_id: p.name for p in PairedPeers().load().values()}
    found = discover_paired(list(getattr(args, "interface", None) or ()) or None, set(paired), timeout)
    if not found:
        logging.getLogger("duet.peer").warning(
            "peer: --peers auto found no paired machine advertising within %g s; prefilling here", timeout
        )
    from peer.interfaces import list_nics

    nics = list_nics()  # with several interfaces, a peer's address through the fastest one first
    return [(addr, p.port, paired[p.short_id]) for p in found if (addr := p.best_address(nics))]


def sources_of(engine: Any) -> list[RemotePrefillSource]:
    """The peer sources ``attach_peers`` gave ``engine`` (for /metrics and --json)."""
    try:
        return list(_sources.get(engine, ()))
    except TypeError:  # an object that cannot be weakly referenced never got peers
        return []


def peer_usage(usage: Any, engine: Any, request_id: str) -> dict[str, Any]:
    """The remote-prefill part of ``duet generate --json``'s usage."""
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
            {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in info.items()
                if k
                in (
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
            }
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


# --- duet peer serve ----------------------------------------------------------------------------
def add_peer_parser(sub: Any, add_model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``peer`` command (``add_model_args``: the CLI's shared model and cache options)."""
    p = sub.add_parser(
        "peer",
        help="run a prefill peer for other Duet instances, pair machines",
        description="Prefill peers compute prompts for another Duet (the decoder) and stream the KV "
        "cache to it, layer by layer: on loopback for this machine, on a network address for paired "
        "machines over mutual TLS (docs/peers.md).",
    )
    psub = p.add_subparsers(dest="peer_command", metavar="{serve,pair,unpair,plan}", help="what to do")
    psub.required = True
    s = psub.add_parser(
        "serve",
        help="serve remote prefill to decoders (this machine, or paired machines on a network)",
        description="Load a model and answer decoders' PREFILL requests (`duet generate --peers ...`) "
        "with its KV cache, streamed layer by layer (docs/peer-protocol.md).",
    )
    add_model_args(s)
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: loopback (127.0.0.1, the default) serves this machine over plain "
        "TCP; any other address serves paired machines only, over mutual TLS 1.3 (docs/peers.md)",
    )
    s.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port to listen on (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    s.add_argument(
        "--max-exports",
        type=int,
        default=None,
        help="most remote prefills computed at once; more get BUSY and prefill locally (default 8)",
    )
    s.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="IP",
        help="advertise over mDNS (_duet._tcp) on this interface address only (repeatable; default: "
        "the --host address when it is a network one; never every interface)",
    )
    s.add_argument("--no-advertise", action="store_true", help="do not advertise over mDNS")
    s.add_argument(
        "--link",
        choices=LINKS,
        default="tls",
        help="on a network address: tls (the default) encrypts everything; trusted runs the same pinned "
        "TLS handshake, then sends frames unencrypted but authenticated (a MAC per frame), for a link "
        "you trust where TLS would cap the speed; decoders must ask for it too (--peer-link trusted)",
    )
    s.set_defaults(func=cmd_peer_serve)

    from peer.commands import add_pairing_parsers

    add_pairing_parsers(psub)
    add_plan_parser(psub)


# --- duet peer plan ---------------------------------------------------------------------------------
def add_plan_parser(psub: Any) -> None:
    p = psub.add_parser(
        "plan",
        help="predict time to first token, local prefill against a prefill peer",
        description="The offload planner's arithmetic (peer/planner.py) on given profiles: for each "
        "prompt length, local prefill against remote prefill with the KV streamed layer by layer "
        "(and, for comparison, sent only after the whole prefill).",
    )
    p.add_argument(
        "--prompt-tokens",
        default="512,2048,8192",
        metavar="N[,N...]",
        help="prompt lengths (default 512,2048,8192)",
    )
    p.add_argument("--local-tps", type=float, required=True, help="local prefill tokens/s")
    p.add_argument("--remote-tps", type=float, required=True, help="the peer's prefill tokens/s")
    p.add_argument("--link-gbps", type=float, required=True, help="link speed, Gbit/s")
    p.add_argument(
        "--model-kv-bytes-per-token",
        type=int,
        required=True,
        metavar="B",
        help="KV bytes per token over all layers (Llama-3.1-8B fp16: 131072)",
    )
    p.add_argument("--layers", type=int, default=32, help="layers (frames per chunk; default 32)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens (default 512)")
    p.add_argument("--rtt-ms", type=float, default=1.0, help="round trip and set-up, ms (default 1)")
    p.add_argument(
        "--tail-ms",
        type=float,
        default=None,
        help="the decoder's last-token step, ms (default: one token at --local-tps)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_peer_plan)


def cmd_peer_plan(args: argparse.Namespace) -> int:
    import json

    from peer.planner import Planner, format_plan, plan_table

    try:
        lengths = [int(x) for x in args.prompt_tokens.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or any(n < 2 for n in lengths):
        raise ConfigError(
            f"--prompt-tokens must be lengths of at least 2, not {args.prompt_tokens!r}", "prompt_tokens"
        )
    for name in ("local_tps", "remote_tps", "link_gbps", "model_kv_bytes_per_token", "layers", "chunk"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive", name)
    if args.rtt_ms < 0 or (args.tail_ms is not None and args.tail_ms < 0):
        raise ConfigError("--rtt-ms and --tail-ms must not be negative", "rtt_ms")
    planner = Planner(
        kv_bytes_per_token=args.model_kv_bytes_per_token, num_layers=args.layers, chunk=args.chunk
    )
    tail = 1 / args.local_tps if args.tail_ms is None else args.tail_ms / 1000
    planner.seed(
        local_tps=args.local_tps,
        remote_tps=args.remote_tps,
        bandwidth_Bps=args.link_gbps * 1e9 / 8,
        setup_s=args.rtt_ms / 1000,
        tail_s=tail,
    )
    rows = plan_table(planner, lengths)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_plan(rows))
    return 0


def cmd_peer_serve(args: argparse.Namespace) -> int:
    from app.cli import _check_model, _use_fast_blas, engine_config
    from mlx_engine.engine import Engine
    from peer.identity import local_hello
    from peer.server import EngineBackend, PeerServer, ServerLimits, _listen
    from peer.trust.tls import tls_for_address
    from peer.wire.handshake import check_supported
    from peer.wire.protocol import ProtocolError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    tls = tls_for_address(args.host, link=args.link)  # not loopback: paired decoders only, mutual TLS
    if tls is None and args.link != "tls":
        raise ConfigError(
            f"--link {args.link} applies to a network --host (loopback {args.host} is plain TCP to this "
            "machine only)",
            "link",
        )
    if args.interface:
        from peer.discovery import local_ip_for

        for ip in args.interface:
            local_ip_for(ip)  # one of this machine's addresses, checked before the model loads
    limits = ServerLimits()
    if args.max_exports is not None:
        if args.max_exports < 1:
            raise ConfigError(f"--max-exports must be at least 1, got {args.max_exports}", "max_exports")
        limits.max_exports = args.max_exports
    config = engine_config(args)
    _check_model(args)
    _use_fast_blas()
    sock = _listen(args.host, args.port)  # a taken port fails before the model loads
    try:
        engine = Engine.load(args.model, config=config)
    except BaseException:
        sock.close()
        raise
    stop = threading.Event()
    try:
        hello = engine.run_on_worker(lambda: local_hello(engine), 300)
        try:
            check_supported(hello)
        except ProtocolError as e:
            raise ConfigError(f"{engine.model_name} cannot serve remote prefill: {e}", "model") from None
        server = PeerServer(
            EngineBackend(engine), hello, args.host, limits=limits, sock=sock, tls=tls
        ).start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        s = engine.stats()
        host = f"[{args.host.strip('[]')}]" if ":" in args.host else args.host
        print(
            f"duet: prefill peer serving {engine.model_name} ({s.backend}, {s.weight_format} weights, "
            f"model {hello.model_fingerprint[:24]}) at {host}:{server.port}"
            + (f", mutual TLS with paired machines only (this one is {tls.identity.name})" if tls else "")
            + (
                ", then a trusted link: frames authenticated, NOT encrypted"
                if tls and tls.link == "trusted"
                else ""
            ),
            file=sys.stderr,
            flush=True,
        )
        advertiser = _advertise(args, tls, hello, server.port, engine) if tls else None
        try:
            stop.wait()
        finally:
            if advertiser is not None:
                advertiser.close()
            server.close()
    finally:
        sock.close()
        engine.shutdown()
    return 0


def _advertise(args: argparse.Namespace, tls: Any, hello: Any, port: int, engine: Any) -> Any:
    """Advertise this peer on ``--interface`` addresses, else on ``--host`` when it names one
    address, else (``--host`` 0.0.0.0 or ::) on the addresses of the fastest interface that is up
    (``peer.interfaces.fastest_nic``), with its public TXT record; None with ``--no-advertise``."""
    import ipaddress

    from peer.discovery import Advertiser, txt_for

    if args.no_advertise:
        return None
    interfaces = list(args.interface)
    unspecified = False
    if not interfaces:
        try:
            unspecified = ipaddress.ip_address(args.host.strip("[]").split("%")[0]).is_unspecified
            if not unspecified:
                interfaces = [args.host.strip("[]")]
        except ValueError:  # a host name: the user names the interfaces
            pass
    chosen = ""
    if unspecified:  # every address: advertise the fastest interface that is up
        from peer.interfaces import fastest_nic, list_nics

        nic = fastest_nic(list_nics())
        if nic is not None:  # 0.0.0.0 listens on IPv4 only; :: on both (dual-stack)
            v4_only = ":" not in args.host
            interfaces = [a for a in nic.addresses if not (v4_only and ":" in a)]
            chosen = f" (interface {nic.describe()}: the fastest link this machine reports)"
    if not interfaces:
        logging.getLogger("duet.peer").warning(
            "peer: not advertised over mDNS (give --interface IP to advertise on one interface)"
        )
        return None
    from peer.discovery import device_description
    from peer.rate import prefill_rate

    rate = prefill_rate(engine, hello.model_fingerprint, hello.backend, device_description()[0])
    txt = txt_for(hello, short_id=tls.identity.short_id, prefill_tps=rate)
    adv = Advertiser(tls.identity.name, port, txt, interfaces)
    tps = f", prefill {rate:.0f} tok/s" if rate else ""
    print(
        f"duet: advertised as {tls.identity.name} on {', '.join(interfaces)}{chosen}{tps}",
        file=sys.stderr,
        flush=True,
    )
    return adv
