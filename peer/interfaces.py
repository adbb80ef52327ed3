"""This machine's network interfaces, and which one a peer should use when it has several.

``list_nics()`` lists the interfaces that have an address (``ifaddr``, which python-zeroconf uses
too), loopback left out, each with its link speed as the kernel reports it
(``/sys/class/net/NAME/speed``, Mb/s; Linux only, and only with a carrier: unknown elsewhere) and
whether it is up (``operstate``). IPv6 link-local addresses carry their scope (``fe80::1%eth0``):
without it such an address names no interface.

A serving peer advertises on the interfaces named with ``--interface``; when none is named and
``--host`` names no single address, on the **fastest** interface that is up (``fastest_nic``: the
highest reported link speed; interfaces whose speed is unknown come after those with a known
speed, then by name, so the choice is stable). A decoder that finds a peer at several addresses
connects through its own fastest interface that reaches one (``rank_addresses``). The speed is
the negotiated link rate, not a measurement of the path: name the interface when that matters
(e.g. a Thunderbolt or 10 GbE cable beside Wi-Fi on a Mac, where the kernel reports no speed).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True)
class Nic:
    name: str
    addresses: tuple[str, ...]  # IPv4 first, then IPv6; link-local IPv6 as fe80::...%name
    networks: tuple[str, ...]  # the addresses' networks (CIDR), in the same order
    speed_mbps: int | None  # link speed the kernel reports; None when unknown
    up: bool
    index: int | None = None  # the interface index (a numeric scope id names it)

    def has_scope(self, scope: str) -> bool:
        return scope == self.name or (scope.isdigit() and int(scope) == self.index)

    def describe(self) -> str:
        speed = f"{self.speed_mbps} Mb/s" if self.speed_mbps else "speed unknown"
        return f"{self.name} ({speed})"

    def reaches(self, address: str) -> bool:
        """Whether ``address`` is on one of this interface's networks (a scoped link-local address:
        whether its scope is this interface)."""
        bare, _, scope = address.partition("%")
        ip = ipaddress.ip_address(bare)
        if ip.version == 6 and ip.is_link_local:
            return self.has_scope(scope)
        return any(ip in ipaddress.ip_network(n, strict=False) for n in self.networks)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # no such interface, no sysfs (macOS), or no carrier (EINVAL)
        return None


def link_speed(name: str, sys_net: Path = SYS_NET) -> int | None:
    value = _read(sys_net / name / "speed")
    try:
        speed = int(value) if value is not None else None
    except ValueError:
        return None
    return speed if speed and speed > 0 else None  # -1: unknown


def is_up(name: str, sys_net: Path = SYS_NET) -> bool:
    """``operstate`` up (or unknown, as tunnels report); True where there is no sysfs."""
    state = _read(sys_net / name / "operstate")
    return state is None or state in ("up", "unknown")


def list_nics(adapters: Iterable[Any] | None = None, sys_net: Path = SYS_NET) -> list[Nic]:
    """The interfaces with an address, loopback left out (``adapters``: ``ifaddr.get_adapters()``)."""
    if adapters is None:
        import ifaddr

        adapters = ifaddr.get_adapters()
    nics = []
    for a in adapters:
        v4: list[tuple[str, str]] = []
        v6: list[tuple[str, str]] = []
        for ip in a.ips:
            if isinstance(ip.ip, tuple):  # IPv6: (address, flowinfo, scope_id)
                addr = ipaddress.ip_address(ip.ip[0].split("%")[0])
                text = f"{addr}%{a.name}" if addr.is_link_local else str(addr)
                v6.append((text, f"{addr}/{ip.network_prefix}"))
            else:
                addr = ipaddress.ip_address(ip.ip)
                v4.append((str(addr), f"{addr}/{ip.network_prefix}"))
        pairs = [p for p in v4 + v6 if not ipaddress.ip_address(p[0].split("%")[0]).is_loopback]
        if not pairs:
            continue
        nics.append(
            Nic(
                a.name,
                tuple(p[0] for p in pairs),
                tuple(p[1] for p in pairs),
                link_speed(a.name, sys_net),
                is_up(a.name, sys_net),
                getattr(a, "index", None),
            )
        )
    return nics


def _speed_key(nic: Nic) -> tuple[int, int, str]:
    return (0 if nic.speed_mbps else 1, -(nic.speed_mbps or 0), nic.name)


def fastest_nic(nics: Iterable[Nic]) -> Nic | None:
    """The interface that is up with the highest known link speed (unknown speeds last, then by
    name); None when none is up."""
    up = [n for n in nics if n.up]
    return min(up, key=_speed_key) if up else None


def nic_of(address: str, nics: Iterable[Nic]) -> Nic | None:
    """The interface holding ``address`` (the scope of a link-local one must match)."""
    bare, _, scope = address.partition("%")
    ip = ipaddress.ip_address(bare)
    for n in nics:
        for a in n.addresses:
            if ipaddress.ip_address(a.partition("%")[0]) == ip and (not scope or n.has_scope(scope)):
                return n
    return None


def rank_addresses(addresses: Iterable[str], nics: Iterable[Nic]) -> list[str]:
    """A peer's addresses, best first: through this machine's fastest interface (up) that reaches
    one, and on the same interface IPv4, then global IPv6, then link-local IPv6 (with its scope).
    Addresses no interface here reaches come last, in that family order."""
    up = sorted((n for n in nics if n.up), key=_speed_key)

    def family(a: str) -> int:
        ip = ipaddress.ip_address(a.split("%")[0])
        return 0 if ip.version == 4 else 2 if ip.is_link_local else 1

    def key(a: str) -> tuple[int, int]:
        via = next((i for i, n in enumerate(up) if n.reaches(a)), len(up))
        return via, family(a)

    return sorted(addresses, key=key)
