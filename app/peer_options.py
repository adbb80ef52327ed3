"""The prefill-peer options of ``duet generate``, ``duet serve`` and ``duet chat`` (``--peers``,
``--interface``, ``--peer-link``, ``--remote-prefill``): added to a parser, checked before anything
loads, and turned into the ``peer.attach.PeerSpec`` the engine's peers are attached from.
Importable without MLX: every ``duet`` command builds its parser on start."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from mlx_engine.errors import ConfigError
from peer.ports import PREFILL_PORT

if TYPE_CHECKING:
    from peer.attach import PeerSpec

MODES = ("auto", "always", "never")  # peer.attach.MODES (not imported here: argparse only)
LINKS = ("tls", "trusted")  # peer.trust.tls.LINKS
DEFAULT_PORT = PREFILL_PORT


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
                "--peer-link trusted applies to peers on a network address (a loopback peer is authenticated "
                "by this user's local peer secret, not TLS)",
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


def peer_spec(args: argparse.Namespace) -> PeerSpec:
    """The peers the options name, for ``peer.attach.attach_peers``."""
    from peer.attach import PeerSpec

    return PeerSpec(
        addresses=tuple(parse_peers(getattr(args, "peers", None))),
        auto=peers_auto(args),
        mode=remote_prefill_mode(args),
        link=getattr(args, "peer_link", "tls"),
        interfaces=tuple(getattr(args, "interface", None) or ()),
    )
