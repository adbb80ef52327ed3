"""Discovery: the TXT record stays within DNS-SD limits and holds nothing secret; and over a real
network, two network namespaces joined by a veth pair (made here, unique names, deleted with every
process in them even on failure): a peer advertised with mDNS bound to its veth address only is
found by ``duet peers`` in the other namespace, after pairing with a code over the same link."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_engine.errors import ConfigError
from peer.discovery import MAX_ENTRY_BYTES, SERVICE_TYPE, TXT_KEYS, check_txt, txt_record
from peer.trust.keys import load_identity

ROOT = Path(__file__).resolve().parent.parent
WAIT = 30


def good_txt(**over):
    kw = dict(
        version=1,
        backend="cuda",
        device="NVIDIA H200",
        memory_gb=141,
        models=["xxh3-128:" + "ab" * 16, "xxh3-128:" + "cd" * 16],
        prefill_tps=15234.7,
        short_id="0123456789abcdef",
    )
    kw.update(over)
    return txt_record(**kw)


def test_txt_record_within_dns_sd_limits_and_public_only(tmp_path):
    ident = load_identity(tmp_path, "gpu")
    txt = good_txt(short_id=ident.short_id)
    assert set(txt) == set(TXT_KEYS)
    assert (
        txt["models"] == "abababababab,cdcdcdcdcdcd" and txt["tps"] == "15235" and txt["id"] == ident.short_id
    )
    encoded = b"".join(f"{k}={v}".encode() for k, v in txt.items())
    assert all(len(f"{k}={v}".encode()) <= MAX_ENTRY_BYTES for k, v in txt.items())
    key_pem = ident.key_path.read_bytes()
    secret_lines = [line for line in key_pem.splitlines() if b"-----" not in line]
    assert secret_lines and not any(line[:16] in encoded for line in secret_lines)
    assert ident.fingerprint not in encoded.decode()  # only the 16-digit prefix
    from zeroconf import ServiceInfo

    info = ServiceInfo(
        SERVICE_TYPE, f"gpu.{SERVICE_TYPE}", port=7611, properties=txt, addresses=[b"\n\0\0\1"]
    )
    assert len(info.text) <= 400

    with pytest.raises(ConfigError, match="255"):
        good_txt(device="x" * 260)
    with pytest.raises(ConfigError, match="at most"):
        good_txt(device="x" * 200, models=[f"xxh3-128:{i:032x}" for i in range(18)])
    with pytest.raises(ConfigError, match="not one of the public keys"):
        check_txt({**txt, "code": "1234-5678"})
    with pytest.raises(ConfigError, match="fingerprint prefix"):
        good_txt(short_id=ident.fingerprint)


# --- two namespaces ---------------------------------------------------------------------------
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=WAIT)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"duetprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` is unavailable here: {e}"
    _ip("netns", "del", probe)
    return None


def _kill_all_in(ns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=WAIT).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap_orphaned_namespaces() -> None:
    """Delete namespaces this suite made in a process that is gone (killed before its finally ran)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=WAIT).stdout
    for line in out.splitlines():
        m = re.fullmatch(r"(duet-(\d+)-[0-9a-f]{6}-[ab])(?: \(id: \d+\))?", line.strip())
        if m and not Path(f"/proc/{m.group(2)}").exists():
            _kill_all_in(m.group(1))
            subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True, timeout=WAIT)


@pytest.fixture
def netns_pair() -> Iterator[tuple[str, str, str, str, str, str]]:
    """(ns_a, ip_a, ns_b, ip_b, veth_a, veth_b): two namespaces joined by a veth pair. Their names
    carry this process's pid, so a later run deletes them if this one is killed before cleaning up."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    _reap_orphaned_namespaces()
    tag = secrets.token_hex(3)
    a, b = f"duet-{os.getpid()}-{tag}-a", f"duet-{os.getpid()}-{tag}-b"
    octet = int(tag[:2], 16) % 250 + 1
    ip_a, ip_b = f"10.213.{octet}.1", f"10.213.{octet}.2"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", f"dv{tag}a", "netns", a, "type", "veth", "peer", "name", f"dv{tag}b", "netns", b)
        for ns, ifname, ip in ((a, f"dv{tag}a", ip_a), (b, f"dv{tag}b", ip_b)):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, ip_a, b, ip_b, f"dv{tag}a", f"dv{tag}b"
    finally:
        for ns in made:
            _kill_all_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=WAIT)


def _in_ns(ns: str, config: Path, *argv: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "DUET_CONFIG_DIR": str(config), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


DUET = [sys.executable, "-m", "app.cli"]
CAPTURE = """
import signal, socket, sys
# SIGTERM ends the loop and closes (flushes) the file: set here, since a process started in the
# background inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))  # every frame (ETH_P_ALL)
s.bind((sys.argv[1], 0))
s.settimeout(0.2)
print("ready", flush=True)
with open(sys.argv[2], "ab") as out:
    while True:
        try:
            out.write(s.recv(65536))
        except TimeoutError:
            out.flush()
"""


class VethCapture:
    """Every frame seen on one interface of a namespace (an AF_PACKET socket in a process run there,
    appending the raw frames to a file): ``stop()`` returns the bytes."""

    def __init__(self, ns: str, ifname: str, path: Path):
        self.path = path
        path.write_bytes(b"")
        self.proc = _in_ns(ns, path.parent, sys.executable, "-c", CAPTURE, ifname, str(path))
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> bytes:
        self.proc.send_signal(signal.SIGTERM)  # ends the loop; the file is closed, so flushed
        self.proc.wait(WAIT)
        return self.path.read_bytes()


TLS_CLIENT_HELLO = b"\x16\x03\x01"  # handshake record, legacy version 3.1: the TLS ClientHello
ADVERTISE = """
import sys
from peer.discovery import Advertiser, txt_record
from peer.trust.keys import load_identity
ident = load_identity()
txt = txt_record(version=1, backend="cuda", device="NVIDIA H200", memory_gb=141,
                 models=["xxh3-128:" + "ab" * 16], prefill_tps=15000.0, short_id=ident.short_id)
with Advertiser("gpu", 7611, txt, [sys.argv[1]]):
    print("ready", flush=True)
    sys.stdin.read()
"""


def _pair(ns_a: str, ip_a: str, ns_b: str, gpu_dir: Path, mac_dir: Path) -> None:
    """`duet peer pair` in ns_a (the GPU box) and `duet peer pair --code` in ns_b, over the veth."""
    shower = _in_ns(ns_a, gpu_dir, *DUET, "peer", "pair", "--host", ip_a, "--name", "gpu")
    try:
        assert shower.stdout is not None
        line = shower.stdout.readline()
        assert line.startswith("pairing code: "), shower.stderr.read() if shower.stderr else line
        code = line.split(": ")[1].strip()
        joiner = _in_ns(ns_b, mac_dir, *DUET, "peer", "pair", "--name", "mac", "--code", code, ip_a)
        out, err = joiner.communicate(timeout=WAIT)
        assert joiner.returncode == 0, err
        assert out.startswith("paired with gpu")
        rest, err = shower.communicate(timeout=WAIT)
        assert shower.returncode == 0, err
        assert rest.startswith("paired with mac")
    finally:
        shower.kill()
        shower.wait(WAIT)


@pytest.mark.slow
def test_pair_and_discover_over_a_veth_between_two_namespaces(netns_pair, tmp_path):
    ns_a, ip_a, ns_b, ip_b, veth_a, veth_b = netns_pair
    gpu_dir, mac_dir = tmp_path / "gpu", tmp_path / "mac"
    _pair(ns_a, ip_a, ns_b, gpu_dir, mac_dir)

    advertiser = _in_ns(ns_a, gpu_dir, sys.executable, "-c", ADVERTISE, ip_a, stdin=subprocess.PIPE)
    try:
        assert advertiser.stdout is not None and advertiser.stdout.readline().strip() == "ready"
        browse = _in_ns(
            ns_b,
            mac_dir,
            *DUET,
            "peers",
            "--interface",
            ip_b,
            "--wait-for",
            "gpu",
            "--timeout",
            str(WAIT),
            "--json",
        )
        out, err = browse.communicate(timeout=WAIT + 10)
        assert browse.returncode == 0, err
        peers = json.loads(out)["peers"]
        assert [p["name"] for p in peers] == ["gpu"]
        p = peers[0]
        assert p["addresses"] == [ip_a] and p["port"] == 7611
        assert (p["backend"], p["device"], p["models"], p["prefill_tps"]) == (
            "cuda",
            "NVIDIA H200",
            ["abababababab"],
            "15000",
        )
        assert p["paired"] is True and p["id"] == load_identity(gpu_dir).short_id
    finally:
        advertiser.kill()
        advertiser.wait(WAIT)


def test_txt_for_a_serving_peer(tmp_path):
    from peer.discovery import txt_for
    from tests.peer_fakes import fake_hello

    hello = fake_hello()
    ident = load_identity(tmp_path, "gpu")
    txt = txt_for(hello, short_id=ident.short_id, prefill_tps=None)
    assert txt["v"] == str(hello.protocol_max) and txt["backend"] == hello.backend
    assert txt["models"] == hello.model_fingerprint.rpartition(":")[2][:12] and txt["tps"] == ""
    assert txt["dev"] and txt["id"] == ident.short_id
    check_txt(txt)


@pytest.mark.slow
def test_remote_prefill_over_tls_between_two_namespaces(netns_pair, tmp_path, tiny_dirs):
    """The GPU box serves on its veth address (mutual TLS, paired machines only); the paired decoder
    in the other namespace prefills there with the greedy tokens of local prefill; a machine not
    paired with it is refused on both sides and answers locally."""
    import re

    ns_a, ip_a, ns_b, ip_b, veth_a, veth_b = netns_pair
    gpu_dir, mac_dir, stranger_dir = tmp_path / "gpu", tmp_path / "mac", tmp_path / "stranger"
    _pair(ns_a, ip_a, ns_b, gpu_dir, mac_dir)
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed: cannot shape the link")
    for ns, dev in ((ns_a, veth_a), (ns_b, veth_b)):  # a 1 Gbit/s link (netem is not available)
        subprocess.run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                "1gbit",
                "burst",
                "256kb",
                "latency",
                "50ms",
            ],
            check=True,
            capture_output=True,
            timeout=WAIT,
        )
    load_identity(stranger_dir, "stranger")
    from peer.identity import model_fingerprint
    from peer.trust.keys import PairedPeers

    PairedPeers(stranger_dir).add("gpu", load_identity(gpu_dir).cert_pem)  # it trusts the box, not vice versa
    model = str(tiny_dirs("llama"))
    serve = _in_ns(
        ns_a,
        gpu_dir,
        *DUET,
        "peer",
        "serve",
        "--model",
        model,
        "--cache-gb",
        "0.05",
        "--host",
        ip_a,
        "--port",
        "0",
    )
    try:
        assert serve.stderr is not None
        port = None
        for line in serve.stderr:
            if m := re.search(r"prefill peer serving .* at [0-9.]+:(\d+), mutual TLS", line):
                port = int(m.group(1))
                break
        assert port is not None, "duet peer serve did not come up"
        where = f"{ip_a}:{port}"
        common = ["generate", "--model", model, "--cache-gb", "0.05", "--raw", "--json", "--temperature", "0"]
        common += ["--prompt", "The quick brown fox jumps over the lazy dog. " * 8, "--max-tokens", "6"]

        def generate(config: Path, mode: str, *peers: str) -> tuple[dict, str]:
            p = _in_ns(ns_b, config, *DUET, *common, *(peers or ("--peers", where)), "--remote-prefill", mode)
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            return json.loads(out), err

        browse = _in_ns(ns_b, mac_dir, *DUET, "peers", "--interface", ip_b, "--wait-for", "gpu", "--json")
        seen = json.loads(browse.communicate(timeout=WAIT + 10)[0])["peers"]
        capture = VethCapture(ns_b, veth_b, tmp_path / "veth.cap")  # the decoder's side of the link
        try:
            remote, _ = generate(mac_dir, "always", "--peers", "auto", "--interface", ip_b)  # found over mDNS
        finally:
            wire = capture.stop()
        local, _ = generate(mac_dir, "never")
        refused, err = generate(stranger_dir, "always")
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            _, serve_err = serve.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            _, serve_err = serve.communicate()
    (adv,) = seen  # duet peer serve advertised itself on its --host address, with its model
    assert (adv["name"], adv["addresses"], adv["port"], adv["paired"]) == ("gpu", [ip_a], port, True)
    assert adv["models"] == [model_fingerprint(model).rpartition(":")[2][:12]] and adv["backend"] == "cpu"
    assert float(adv["prefill_tps"]) > 0  # measured at start, cached in the box's config dir
    assert (gpu_dir / "prefill_rates.json").is_file()
    assert remote["usage"]["prefill_location"] == "remote:gpu" and remote["usage"]["remote_bytes"] > 0
    assert local["usage"]["prefill_location"] == "local"
    assert remote["token_ids"] == local["token_ids"]
    assert refused["usage"]["prefill_location"] == "local" and refused["token_ids"] == local["token_ids"]
    assert f"{where} refused this machine: it has not paired with this machine's certificate" in err
    # on the veth itself: the TLS handshake, and none of the peer protocol (HELLO, KV frame headers)
    assert TLS_CLIENT_HELLO in wire and len(wire) > remote["usage"]["remote_bytes"]
    assert b"model_fingerprint" not in wire and b"layer_kv" not in wire
    assert "refused a client: its certificate is not one this machine has paired with" in serve_err
    assert "paired decoder mac" in serve_err


def test_network_peer_options_are_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    from app import cli
    from mlx_engine.engine import Engine
    from peer.trust.keys import PairedPeers

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

    assert "--peers auto uses paired machines only" in error("generate", "--prompt", "hi", "--peers", "auto")
    assert "--peers 192.0.2.7 is not a loopback address" in error(
        "generate", "-p", "hi", "--peers", "192.0.2.7:7611"
    )
    assert "--host 192.0.2.7 is not a loopback address" in error("peer", "serve", "--host", "192.0.2.7")
    assert not (tmp_path / "mac").exists()  # refusing made no key
    PairedPeers(tmp_path / "mac").add("gpu", load_identity(tmp_path / "gpu", "gpu").cert_pem)
    assert "not an address of this machine" in error(
        "generate", "-p", "hi", "--peers", "auto", "--interface", "192.0.2.99"
    )


def test_prefill_rate_is_measured_once_then_cached_per_model_and_device(tmp_path):
    from peer.rate import prefill_rate

    class Engine:
        context_length = 4096

        def __init__(self, rate):
            self.rate, self.prompts = rate, []

        async def generate(self, req):
            self.prompts.append(req.prompt)
            yield None

        def local_prefill_rate(self):
            return self.rate

    e = Engine(1234.5)
    assert prefill_rate(e, "xxh3-128:aa", "cuda", "H200", directory=tmp_path) == 1234.5
    assert len(e.prompts) == 1 and len(e.prompts[0]) == 512
    again = Engine(9.0)
    assert (
        prefill_rate(again, "xxh3-128:aa", "cuda", "H200", directory=tmp_path) == 1234.5 and not again.prompts
    )
    other = Engine(777.0)  # another device: measured again
    assert prefill_rate(other, "xxh3-128:aa", "cuda", "A100", directory=tmp_path) == 777.0 and other.prompts
    assert oct((tmp_path / "prefill_rates.json").stat().st_mode & 0o777) == "0o600"


def test_best_address_prefers_ipv4_and_keeps_a_link_local_scope():
    from peer.discovery import DiscoveredPeer

    def best(*addrs: str) -> str | None:
        return DiscoveredPeer("gpu", list(addrs), 7611).best_address()

    assert best("fe80::1%eth0", "2001:db8::5", "10.0.0.5") == "10.0.0.5"
    assert best("fe80::1%eth0", "2001:db8::5") == "2001:db8::5"
    assert best("fe80::1%eth0") == "fe80::1%eth0"
    assert best("fe80::1") is None  # link-local without a scope: ambiguous, not used


@pytest.mark.slow
def test_serve_on_every_address_advertises_its_fastest_interface_with_link_local_scope(
    netns_pair, tmp_path, tiny_dirs
):
    """`duet peer serve --host ::` names no interface: it advertises the addresses of its fastest
    interface that is up (the veth: loopback never), IPv6 link-local included; the decoder browsing
    over its own link-local address sees the peer's link-local address with a scope and prefills
    there."""
    ns_a, ip_a, ns_b, ip_b, veth_a, veth_b = netns_pair
    gpu_dir, mac_dir = tmp_path / "gpu", tmp_path / "mac"
    _pair(ns_a, ip_a, ns_b, gpu_dir, mac_dir)
    ll_a, ll_b = "fe80::d:a", "fe80::d:b"
    for ns, dev, ll in ((ns_a, veth_a, ll_a), (ns_b, veth_b, ll_b)):
        _ip("-n", ns, "addr", "add", f"{ll}/64", "dev", dev, "nodad")
    model = str(tiny_dirs("llama"))
    serve = _in_ns(
        ns_a, gpu_dir, *DUET, "peer", "serve", "--model", model, "--cache-gb", "0.05", "--host", "::",
        "--port", "0",
    )  # fmt: skip
    try:
        assert serve.stderr is not None
        advertised = ""
        for line in serve.stderr:
            if line.startswith("duet: advertised as gpu on "):
                advertised = line
                break
        assert advertised, "duet peer serve --host :: did not advertise"
        browse = _in_ns(
            ns_b, mac_dir, *DUET, "peers", "--interface", f"{ll_b}%{veth_b}", "--wait-for", "gpu", "--json"
        )
        out, err = browse.communicate(timeout=WAIT + 10)
        assert browse.returncode == 0, err
        (peer,) = json.loads(out)["peers"]
        gen = _in_ns(
            ns_b, mac_dir, *DUET, "generate", "--model", model, "--cache-gb", "0.05", "--raw", "--json",
            "--temperature", "0", "--prompt", "The quick brown fox " * 10, "--max-tokens", "4",
            "--peers", "auto", "--interface", f"{ll_b}%{veth_b}", "--remote-prefill", "always",
        )  # fmt: skip
        gen_out, gen_err = gen.communicate(timeout=120)
        assert gen.returncode == 0, gen_err
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.communicate()
    listed = advertised.removeprefix("duet: advertised as gpu on ").split(" (interface ")[0].split(", ")
    assert ip_a in listed and f"{ll_a}%{veth_a}" in listed and f"interface {veth_a} (" in advertised, (
        advertised
    )
    assert not [a for a in listed if ipaddress.ip_address(a.split("%")[0]).is_loopback], listed
    scoped = [a for a in peer["addresses"] if a.split("%")[0] == ll_a]
    assert ip_a in peer["addresses"] and scoped and all("%" in a for a in scoped), peer["addresses"]
    assert json.loads(gen_out)["usage"]["prefill_location"] == "remote:gpu"
