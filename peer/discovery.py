"""Finding prefill peers on the local network: DNS-SD over mDNS (python-zeroconf), service type
``_duet._tcp.local.``.

``Advertiser`` registers this machine's peer on **explicit interface addresses only** (never every
interface of the machine): zeroconf is bound to those addresses and the service record lists only
them. ``Browser`` collects the peers seen on the given interfaces. ``txt_record`` builds the TXT
record from an allowlist of public keys and checks every ``key=value`` against DNS-SD's 255-byte
limit (python-zeroconf raises a bare ``ValueError`` past it) and the whole record against
``MAX_TXT_BYTES``:

| key | value |
|---|---|
| ``v`` | peer protocol version |
| ``role`` | ``prefill`` |
| ``backend`` | metal / cuda / cpu |
| ``dev`` | device name (e.g. the GPU's) |
| ``mem`` | device memory, GB |
| ``models`` | short model fingerprints (12 hex digits each), comma-separated |
| ``tps`` | measured prefill tokens/s |
| ``id`` | short id: the first 16 hex digits of the peer's certificate fingerprint |

Nothing secret goes in: the certificate fingerprint is public (it is what pairing pins), and no
key, code or prompt is ever passed to this module.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from mlx_engine.errors import ConfigError

SERVICE_TYPE = "_duet._tcp.local."
TXT_KEYS = ("v", "role", "backend", "dev", "mem", "models", "tps", "id")
MAX_ENTRY_BYTES = 255
MAX_TXT_BYTES = 400  # well inside one mDNS packet with the other records
SHORT_MODEL_CHARS = 12
_HEX_RE = re.compile(r"^[0-9a-f]+$")


def short_model(fp: str) -> str:
    """``xxh3-128:<hex>`` -> its first 12 hex digits."""
    return fp.rpartition(":")[2][:SHORT_MODEL_CHARS]


def txt_record(
    *,
    version: int,
    backend: str,
    device: str,
    memory_gb: float,
    models: list[str],
    prefill_tps: float | None,
    short_id: str,
    role: str = "prefill",
) -> dict[str, str]:
    """The TXT record's key/values, checked: every entry ``key=value`` ≤ 255 bytes, the whole record
    ≤ ``MAX_TXT_BYTES``, only public values (``ConfigError`` otherwise)."""
    if not (_HEX_RE.match(short_id) and len(short_id) <= 16):
        raise ConfigError(f"short id {short_id!r} is not a certificate fingerprint prefix", "id")
    shorts = [short_model(m) for m in models]
    for s in shorts:
        if not _HEX_RE.match(s):
            raise ConfigError(f"model fingerprint {s!r} is not hex", "models")
    txt = {
        "v": str(int(version)),
        "role": role,
        "backend": backend,
        "dev": device,
        "mem": f"{memory_gb:.0f}",
        "models": ",".join(shorts),
        "tps": "" if prefill_tps is None else f"{prefill_tps:.0f}",
        "id": short_id,
    }
    check_txt(txt)
    return txt


def txt_for(hello: Any, *, short_id: str, prefill_tps: float | None) -> dict[str, str]:
    """The TXT record of a prefill peer serving ``hello`` (its ``peer.wire.protocol.Hello``), with this
    machine's device name and memory from MLX (``mx.device_info()``; memory 0 when unknown)."""
    device, memory_gb = device_description()
    return txt_record(
        version=hello.protocol_max,
        backend=hello.backend,
        device=device,
        memory_gb=memory_gb,
        models=[hello.model_fingerprint],
        prefill_tps=prefill_tps,
        short_id=short_id,
    )


def device_description() -> tuple[str, float]:
    """(device name, memory in GB) as MLX reports them; at most 64 characters of name."""
    try:
        import mlx.core as mx

        info = dict(mx.device_info())
    except Exception:  # an MLX without device_info, or no device: still advertise
        info = {}
    name = str(info.get("device_name") or info.get("architecture") or "unknown")[:64]
    mem = info.get("memory_size") or info.get("total_memory") or 0
    return name, float(mem) / 1e9 if isinstance(mem, int | float) else 0.0


def check_txt(txt: dict[str, str]) -> None:
    total = 0
    for k, v in txt.items():
        if k not in TXT_KEYS:
            raise ConfigError(f"TXT key {k!r} is not one of the public keys {TXT_KEYS}", "txt")
        n = len(f"{k}={v}".encode())
        if n > MAX_ENTRY_BYTES:
            raise ConfigError(f"TXT entry {k!r} is {n} bytes (DNS-SD allows {MAX_ENTRY_BYTES})", "txt")
        total += n + 1  # each entry carries a length byte
    if total > MAX_TXT_BYTES:
        raise ConfigError(f"TXT record is {total} bytes (at most {MAX_TXT_BYTES})", "txt")


def _addresses(interfaces: list[str]) -> list[str]:
    if not interfaces:
        raise ConfigError(
            "advertising needs at least one --interface IP (never every interface)", "interface"
        )
    out = []
    for ip in interfaces:
        try:
            addr = ipaddress.ip_address(ip.split("%")[0])
        except ValueError:
            raise ConfigError(f"--interface {ip!r} is not an IP address", "interface") from None
        if addr.is_unspecified:
            raise ConfigError(f"--interface {ip!r}: name one interface's address, not all", "interface")
        out.append(ip)
    return out


def _ip_version(addrs: list[str]) -> IPVersion:
    v6 = [":" in a for a in addrs]
    return IPVersion.V6Only if all(v6) else IPVersion.V4Only if not any(v6) else IPVersion.All


def _scope_index(address: str) -> int | None:
    """The interface index of a scoped IPv6 address (``fe80::1%eth0`` or ``fe80::1%3``)."""
    _, sep, scope = address.partition("%")
    if not sep:
        return None
    if scope.isdigit():
        return int(scope)
    try:
        return socket.if_nametoindex(scope)
    except OSError:
        raise ConfigError(f"--interface {address!r}: no interface {scope!r} here", "interface") from None


def _zeroconf(interfaces: list[str]) -> Zeroconf:
    addrs = _addresses(interfaces)
    # IPv6 multicast joins by interface index: a scoped address (link-local) names its interface by
    # its scope, which zeroconf would drop (it looks the bare address up on every interface)
    choice: list[str | int] = [i if (i := _scope_index(a)) is not None else a for a in addrs]
    return Zeroconf(interfaces=choice, ip_version=_ip_version(addrs))


class Advertiser:
    """Registers ``<name>._duet._tcp.local.`` on the given interface addresses only."""

    def __init__(self, name: str, port: int, txt: dict[str, str], interfaces: list[str]):
        check_txt(txt)
        self.addresses = _addresses(interfaces)
        self.zc = _zeroconf(self.addresses)
        host = f"{name}-{txt.get('id', '')[:6]}".strip("-")
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            port=port,
            properties=txt,
            server=f"{host}.local.",
            parsed_addresses=[a.split("%")[0] for a in self.addresses],
        )
        self.zc.register_service(self.info, allow_name_change=True)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()

    def __enter__(self) -> Advertiser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class DiscoveredPeer:
    name: str
    addresses: list[str]
    port: int
    txt: dict[str, str] = field(default_factory=dict)

    @property
    def short_id(self) -> str:
        return self.txt.get("id", "")

    def best_address(self, nics: list[Any] | None = None) -> str | None:
        """The address to connect to (never a loopback, unspecified or multicast one: any local user
        can advertise a copy of a peer's public record pointing at a port it listens on): IPv4 first, then global IPv6, then IPv6 link-local with its
        scope id kept (``fe80::1%eth0``: without it the address is ambiguous). With ``nics`` (this
        machine's, ``peer.interfaces.list_nics()``) an address reached through the fastest
        interface comes first (``peer.interfaces.rank_addresses``)."""

        def rank(a: str) -> int:
            ip = ipaddress.ip_address(a.split("%")[0])
            return 0 if ip.version == 4 else 2 if ip.is_link_local else 1

        def scoped_or_routable(a: str) -> bool:
            ip = ipaddress.ip_address(a.split("%")[0])
            return "%" in a or not (ip.version == 6 and ip.is_link_local)

        usable = [a for a in self.addresses if remote_address(a) and scoped_or_routable(a)]
        if usable and nics:
            from peer.interfaces import rank_addresses

            return rank_addresses(usable, nics)[0]
        return min(usable, key=rank) if usable else None

    def as_dict(self, paired: bool) -> dict[str, Any]:
        t = self.txt
        return {
            "name": self.name,
            "addresses": self.addresses,
            "port": self.port,
            "backend": t.get("backend", ""),
            "device": t.get("dev", ""),
            "memory_gb": t.get("mem", ""),
            "models": [m for m in t.get("models", "").split(",") if m],
            "prefill_tps": t.get("tps", ""),
            "id": self.short_id,
            "protocol": t.get("v", ""),
            "paired": paired,
        }


def remote_address(address: str) -> bool:
    """Whether an advertised address can be another machine's: not loopback, unspecified or multicast."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified or ip.is_multicast)


def _decode_txt(props: dict[bytes, bytes | None]) -> dict[str, str]:
    out = {}
    for k, v in props.items():
        key = k.decode("utf-8", "replace")
        if key in TXT_KEYS:
            out[key] = (v or b"").decode("utf-8", "replace")[:MAX_ENTRY_BYTES]
    return out


class Browser:
    """Collects ``_duet._tcp`` peers seen on ``interfaces`` (addresses; None: every interface, for
    the ``duet peers`` command only)."""

    def __init__(self, interfaces: list[str] | None = None):
        self.zc = _zeroconf(interfaces) if interfaces else Zeroconf()
        self.peers: dict[str, DiscoveredPeer] = {}
        self._cond = threading.Condition()
        self._browser = ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            with self._cond:
                self.peers.pop(name, None)
                self._cond.notify_all()
            return
        threading.Thread(target=self._resolve, args=(service_type, name), daemon=True).start()

    def _resolve(self, service_type: str, name: str) -> None:
        info = self.zc.get_service_info(service_type, name, timeout=3000)
        if info is None or info.port is None:
            return
        short = name.removesuffix("." + SERVICE_TYPE)
        peer = DiscoveredPeer(short, info.parsed_scoped_addresses(), info.port, _decode_txt(info.properties))
        with self._cond:
            self.peers[name] = peer
            self._cond.notify_all()

    def wait_for(self, name: str | None, timeout: float) -> list[DiscoveredPeer]:
        """Wait until a peer called ``name`` is seen (or any peer, ``name`` None), at most ``timeout``
        seconds; returns the peers seen so far."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [p for p in self.peers.values() if name is None or p.name == name]
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return list(self.peers.values())
                self._cond.wait(left)

    def wait_until(
        self, done: Callable[[list[DiscoveredPeer]], bool], timeout: float
    ) -> list[DiscoveredPeer]:
        """Wait until ``done(peers seen)`` holds, at most ``timeout`` seconds; the peers seen."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(list(self.peers.values())) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return list(self.peers.values())

    def collect(self, seconds: float) -> list[DiscoveredPeer]:
        """Every peer seen within ``seconds``."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return list(self.peers.values())

    def close(self) -> None:
        self._browser.cancel()
        self.zc.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_port(peer: DiscoveredPeer) -> str:
    addr = peer.addresses[0] if peer.addresses else "?"
    return f"[{addr}]:{peer.port}" if ":" in addr else f"{addr}:{peer.port}"


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = ("name", "address", "backend", "device", "models", "prefill tok/s", "id", "paired")
    lines = [cols]
    for r in rows:
        addr = r["addresses"][0] if r["addresses"] else "?"
        lines.append(
            (
                r["name"],
                f"[{addr}]:{r['port']}" if ":" in addr else f"{addr}:{r['port']}",
                r["backend"],
                r["device"],
                ",".join(r["models"]) or "-",
                r["prefill_tps"] or "-",
                r["id"],
                "yes" if r["paired"] else "no",
            )
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(cols))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def local_ip_for(interface: str) -> str:
    """``interface`` as given (an address), checked to be one of this machine's."""
    addr = interface.split("%")[0]
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        raise ConfigError(f"--interface {interface!r} is not an IP address", "interface") from None
    if ip.version == 6 and ip.is_link_local and "%" not in interface:
        raise ConfigError(
            f"--interface {interface!r} is link-local: give its interface too (e.g. {addr}%eth0)", "interface"
        )
    try:  # getaddrinfo keeps a scope id (fe80::1%eth0), which binding a link-local address needs
        family, _, _, _, sockaddr = socket.getaddrinfo(interface, 0, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind(sockaddr)
    except OSError:
        raise ConfigError(
            f"--interface {interface!r} is not an address of this machine", "interface"
        ) from None
    return interface


def discover_paired(
    interfaces: list[str] | None, paired_ids: set[str], timeout: float
) -> list[DiscoveredPeer]:
    """The advertised peers whose short id is a paired machine's, seen on ``interfaces`` (None: every
    interface) within ``timeout`` seconds (returns as soon as one is seen). A TXT id or an address
    can be forged: the caller connects over TLS pinned to the certificate of the paired machine
    whose id the advert claims (``peer.attach.discovered``), never to a loopback address, so a
    forger is refused before any byte of a prompt."""

    def paired(peers: list[DiscoveredPeer]) -> bool:
        return any(p.short_id in paired_ids and p.best_address() for p in peers)

    with Browser(interfaces) as browser:
        seen = browser.wait_until(paired, timeout)
    return [p for p in seen if p.short_id in paired_ids and p.best_address()]
