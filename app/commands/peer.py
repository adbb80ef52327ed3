"""``duet peer``: ``serve`` (answer decoders' PREFILL requests with this machine's KV, layer by
layer), ``plan`` (the offload planner's arithmetic on given profiles), and the pairing commands
(``app/commands/pairing.py``). The work is in ``peer/`` (server, planner, discovery, trust)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from app.peer_options import DEFAULT_PORT, LINKS
from mlx_engine.errors import ConfigError


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
        help="address to listen on: loopback (127.0.0.1, the default) serves this user's processes "
        "(authenticated by the local peer secret); any other address serves paired machines only, over mutual TLS 1.3 (docs/peers.md)",
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

    from app.commands.pairing import add_pairing_parsers

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
    from app.launch import build_engine
    from app.options import check_model_args, engine_config, use_fast_blas
    from peer.identity import local_hello
    from peer.server import EngineBackend, PeerServer, ServerLimits, listen
    from peer.trust.link_security import security_for
    from peer.trust.tls import is_loopback
    from peer.wire.handshake import check_supported
    from peer.wire.protocol import ProtocolError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    # from a network: paired decoders only, mutual TLS; from loopback: this user's local secret
    security = security_for(args.host, link=args.link)
    tls = security.tls if not is_loopback(args.host) else None
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
    check_model_args(args)
    use_fast_blas()
    from app.fd_limit import raise_fd_limit

    raise_fd_limit()  # as duet serve does: many connections meet the server's caps, not EMFILE
    sock = listen(args.host, args.port)  # a taken port fails before the model loads
    try:
        engine = build_engine(args.model, config)
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
            EngineBackend(engine), hello, args.host, limits=limits, sock=sock, security=security
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
        if tls is None:
            print(
                "duet: loopback connections are this user's processes only (the local peer secret in "
                "the config directory authenticates both sides)",
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
