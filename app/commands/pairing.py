"""The pairing and discovery commands: ``duet peer pair``, ``duet peer unpair NAME`` and
``duet peers``. ``app/commands/peer.py`` and ``app/cli.py`` add their parsers; the work is in
``peer/trust/pairing.py``, ``peer/trust/keys.py`` and ``peer/discovery.py``."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

from mlx_engine.errors import ConfigError
from peer.ports import PAIR_PORT


def add_pairing_parsers(psub: Any) -> None:
    """``pair`` and ``unpair`` under ``duet peer``."""
    p = psub.add_parser(
        "pair",
        help="pair this machine with another one using a one-time code",
        description="On the GPU box run `duet peer pair`: it prints `pairing code: NNNN-NNNN` and waits "
        "(single use, 5 minutes, 3 attempts). On the Mac run `duet peer pair --code NNNN-NNNN HOST`. "
        "The code never crosses the network (SPAKE2); the two machines then know each other's certificate.",
    )
    p.add_argument(
        "target", nargs="?", metavar="HOST[:PORT]", help="the machine showing the code (with --code)"
    )
    p.add_argument("--code", default=None, metavar="NNNN-NNNN", help="the code the other machine printed")
    p.add_argument(
        "--host", default="0.0.0.0", help="address to wait on for the other machine (default: all)"
    )
    p.add_argument("--port", type=int, default=PAIR_PORT, help=f"port to wait on (default {PAIR_PORT})")
    p.add_argument("--name", default=None, help="this machine's name, when its certificate is first made")
    p.set_defaults(func=cmd_pair)
    u = psub.add_parser("unpair", help="forget a paired machine", description="Forget a paired machine.")
    u.add_argument("name", help="the paired machine's name (as `duet peers` shows)")
    u.set_defaults(func=cmd_unpair)


def add_peers_parser(sub: Any) -> None:
    """``duet peers``."""
    p = sub.add_parser(
        "peers",
        help="list prefill peers on the local network and paired machines",
        description="Browse mDNS (_duet._tcp) for prefill peers: name, address, backend, device, model "
        "fingerprints, measured prefill tok/s, and whether this machine is paired with each.",
    )
    p.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="IP",
        help="browse on this interface address only (repeatable; default: every interface)",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to listen (default 3)")
    p.add_argument("--wait-for", default=None, metavar="NAME", help="stop as soon as this peer is seen")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_peers)


def cmd_pair(args: argparse.Namespace) -> int:
    from peer.trust.keys import PairedPeers, load_identity
    from peer.trust.pairing import PairingCode, PairingError, pair_with_code, serve_pairing

    if args.code is not None:
        peer, identity = pair_with_code(args.code, args.target, args.name)
        print(
            f"paired with {peer.name} (id {peer.short_id}); this machine is {identity.name} (id {identity.short_id})"
        )
        return 0
    if args.target:
        raise ConfigError("HOST is for the machine typing the code: add --code NNNN-NNNN", "target")
    identity = load_identity(name=args.name)
    peers = PairedPeers()
    pcode = PairingCode()
    try:
        listener = socket.create_server((args.host, args.port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port} for pairing: {e}", "port") from None
    with listener:
        print(f"pairing code: {pcode.code}", flush=True)
        print(
            f"duet: waiting on {args.host}:{listener.getsockname()[1]} for `duet peer pair --code "
            f"NNNN-NNNN THIS_HOST` (single use, expires in {pcode.ttl_s / 60:.0f} minutes, "
            f"{pcode.max_attempts} attempts); this machine is {identity.name} (id {identity.short_id})",
            file=sys.stderr,
            flush=True,
        )

        def failed(e: PairingError) -> None:
            print(f"duet: {e}", file=sys.stderr, flush=True)

        peer = serve_pairing(listener, pcode, identity, peers, on_attempt_failed=failed)
    print(f"paired with {peer.name} (id {peer.short_id})")
    return 0


def cmd_unpair(args: argparse.Namespace) -> int:
    from peer.trust.keys import PairedPeers

    gone = PairedPeers().remove(args.name)
    print(f"unpaired {gone.name} (id {gone.short_id})")
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from peer.discovery import Browser, format_table, local_ip_for
    from peer.trust.keys import PairedPeers

    interfaces = [local_ip_for(i) for i in args.interface]
    paired = PairedPeers().load()
    paired_ids = {p.short_id: p.name for p in paired.values()}
    with Browser(interfaces or None) as browser:
        seen = (
            browser.wait_for(args.wait_for, args.timeout) if args.wait_for else browser.collect(args.timeout)
        )
    rows = [p.as_dict(p.short_id in paired_ids) for p in sorted(seen, key=lambda p: p.name)]
    seen_ids = {r["id"] for r in rows}
    offline = [{"name": p.name, "id": p.short_id} for p in paired.values() if p.short_id not in seen_ids]
    if args.json:
        print(json.dumps({"peers": rows, "paired_not_seen": offline}))
        return 0
    print(format_table(rows) if rows else "no peers found (is `duet peer serve` running on this network?)")
    for p in offline:
        print(f"paired, not seen: {p['name']} (id {p['id']})")
    return 0
