"""Choosing among several network interfaces (peer/interfaces.py): link speeds from a sysfs tree
made here, addresses from ifaddr-shaped adapters; the fastest interface that is up is advertised,
a decoder connects through its fastest interface that reaches the peer, and IPv6 link-local
addresses keep their scope."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mlx_engine.errors import ConfigError
from peer.discovery import DiscoveredPeer, local_ip_for
from peer.interfaces import Nic, fastest_nic, list_nics, nic_of, rank_addresses


@dataclass
class IP:
    ip: object
    network_prefix: int


@dataclass
class Adapter:
    name: str
    ips: list[IP] = field(default_factory=list)
    index: int | None = None


def sysfs(tmp_path, **links):
    """``name=(speed, operstate)``; a speed of None leaves the file unreadable (EINVAL: no carrier)."""
    root = tmp_path / "net"
    for name, (speed, state) in links.items():
        d = root / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(f"{state}\n")
        if speed is not None:
            (d / "speed").write_text(f"{speed}\n")
    return root


ADAPTERS = [
    Adapter("lo", [IP("127.0.0.1", 8), IP(("::1", 0, 0), 128)]),
    Adapter("wlan0", [IP("192.168.1.10", 24), IP(("fe80::aa", 0, 3), 64)]),
    Adapter("eth0", [IP("192.168.1.11", 24)]),
    Adapter("enp1s0", [IP("10.0.0.5", 24), IP(("2001:db8::5", 0, 0), 64), IP(("fe80::5", 0, 4), 64)], 4),
    Adapter("eth1", [IP("172.16.0.5", 16)]),
    Adapter("tun0", [IP("10.8.0.2", 24)]),
    Adapter("noaddr", []),
]


def test_nics_list_addresses_speeds_and_keep_link_local_scopes(tmp_path):
    root = sysfs(
        tmp_path,
        lo=(None, "unknown"),
        wlan0=(None, "up"),  # Wi-Fi reports no speed
        eth0=(1000, "up"),
        enp1s0=(10000, "up"),
        eth1=(25000, "down"),  # fastest, but down
        tun0=(-1, "unknown"),  # a tunnel: no speed, state unknown (usable)
    )
    nics = {n.name: n for n in list_nics(ADAPTERS, root)}
    assert set(nics) == {"wlan0", "eth0", "enp1s0", "eth1", "tun0"}  # no loopback, none without address
    assert nics["enp1s0"].addresses == ("10.0.0.5", "2001:db8::5", "fe80::5%enp1s0")
    assert nics["wlan0"].addresses == ("192.168.1.10", "fe80::aa%wlan0")
    assert (nics["enp1s0"].speed_mbps, nics["wlan0"].speed_mbps, nics["tun0"].speed_mbps) == (
        10000,
        None,
        None,
    )
    assert not nics["eth1"].up and nics["tun0"].up
    assert fastest_nic(nics.values()) == nics["enp1s0"]  # 25 GbE is down; 10 GbE beats 1 GbE and Wi-Fi
    assert fastest_nic([nics["wlan0"], nics["tun0"]]) == nics["tun0"]  # unknown speeds: by name
    assert fastest_nic([nics["eth1"]]) is None
    assert nic_of("fe80::5%enp1s0", nics.values()) == nics["enp1s0"]
    assert nic_of("fe80::5%wlan0", nics.values()) is None  # another interface's scope
    assert nic_of("fe80::5%4", nics.values()) == nics["enp1s0"]  # a numeric scope: the index
    assert nics["enp1s0"].describe() == "enp1s0 (10000 Mb/s)" and "unknown" in nics["wlan0"].describe()


def test_a_decoder_reaches_a_peer_through_its_fastest_interface(tmp_path):
    root = sysfs(tmp_path, wlan0=(None, "up"), eth0=(1000, "up"), enp1s0=(10000, "up"))
    nics = list_nics(ADAPTERS[:4], root)
    # the peer is on the Wi-Fi/1 GbE LAN and on the 10 GbE cable
    peer = ["192.168.1.20", "10.0.0.7", "fe80::7%enp1s0", "203.0.113.9"]
    assert rank_addresses(peer, nics) == ["10.0.0.7", "fe80::7%enp1s0", "192.168.1.20", "203.0.113.9"]
    assert DiscoveredPeer("gpu", peer, 7611).best_address(nics) == "10.0.0.7"
    assert DiscoveredPeer("gpu", peer, 7611).best_address() == "192.168.1.20"  # no interfaces: first IPv4
    slow = list_nics(
        ADAPTERS[:4], sysfs(tmp_path / "x", wlan0=(None, "up"), eth0=(1000, "up"), enp1s0=(10, "up"))
    )
    assert DiscoveredPeer("gpu", peer, 7611).best_address(slow) == "192.168.1.20"  # now the LAN is faster
    # an unscoped link-local address is never chosen; a scoped one on the fast link is
    assert DiscoveredPeer("gpu", ["fe80::7", "fe80::7%enp1s0"], 7611).best_address(nics) == "fe80::7%enp1s0"
    assert rank_addresses(["192.168.1.20", "fe80::7%4"], nics) == ["fe80::7%4", "192.168.1.20"]


def test_interface_addresses_are_checked_with_their_scope():
    assert local_ip_for("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match="link-local: give its interface too"):
        local_ip_for("fe80::1")
    with pytest.raises(ConfigError, match="not an address of this machine"):
        local_ip_for("192.0.2.99")
    with pytest.raises(ConfigError, match="not an IP address"):
        local_ip_for("gpu.local")


def test_nic_reaches_its_networks_only():
    n = Nic("eth0", ("10.0.0.5", "fe80::5%eth0"), ("10.0.0.5/24", "fe80::5/64"), 1000, True)
    assert n.reaches("10.0.0.200") and not n.reaches("10.0.1.1")
    assert n.reaches("fe80::9%eth0") and not n.reaches("fe80::9%eth1") and not n.reaches("fe80::9")
