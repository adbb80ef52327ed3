"""This machine's peer identity and the peers it has paired with.

Each machine has one self-signed certificate and its private key (ECDSA P-256, made with
``cryptography``), stored 0600 in the config directory (``DUET_CONFIG_DIR``, else platformdirs' user
config dir for ``duet``; the directory itself is 0700). A certificate's **fingerprint** is the SHA-256
of its DER bytes; its first 16 hex digits are the machine's short id (in mDNS TXT records and
messages).

Paired peers live in ``peers.json`` (0600): ``{name: {"fingerprint": hex, "certificate": PEM}}``.
The certificate is kept next to its fingerprint so TLS can load it as the only trust anchor for that
peer (``peer/trust/tls.py``); on load every certificate must hash to its recorded fingerprint.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mlx_engine.errors import ConfigError
from mlx_engine.private_files import private_dir, write_private

CERT_FILE = "peer-cert.pem"
KEY_FILE = "peer-key.pem"
PEERS_FILE = "peers.json"
SHORT_ID_CHARS = 16
CERT_DAYS = 3650
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_lock = threading.Lock()


def config_dir() -> Path:
    """Where keys and peer state live: ``DUET_CONFIG_DIR``, else platformdirs' user config dir."""
    env = os.environ.get("DUET_CONFIG_DIR")
    if env:
        return Path(env)
    from platformdirs import user_config_dir

    return Path(user_config_dir("duet", appauthor=False))


def fingerprint(cert_der: bytes) -> str:
    """SHA-256 of a certificate's DER bytes, lowercase hex."""
    return hashlib.sha256(cert_der).hexdigest()


def short_id(fp: str) -> str:
    return fp[:SHORT_ID_CHARS]


def device_name() -> str:
    """A default name for this machine: its host name up to the first dot, made name-safe."""
    host = socket.gethostname().split(".")[0] or "duet"
    name = re.sub(r"[^A-Za-z0-9._-]", "-", host)[:63].strip("-.") or "duet"
    return name if _NAME_RE.match(name) else "duet"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(
            f"peer name {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
            "name",
        )
    return name


@contextlib.contextmanager
def dir_lock(d: Path) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``d/.lock`` across processes."""
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@dataclass(frozen=True)
class Identity:
    """This machine's certificate and key (paths, for ``ssl``) and what others know it by."""

    name: str
    cert_path: Path
    key_path: Path
    cert_der: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_der)

    @property
    def short_id(self) -> str:
        return short_id(self.fingerprint)

    @property
    def cert_pem(self) -> str:
        return x509.load_der_x509_certificate(self.cert_der).public_bytes(serialization.Encoding.PEM).decode()


def _make_certificate(name: str) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"duet peer {name}")])
    now = datetime.datetime.now(datetime.UTC)
    pub = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(pub), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def load_identity(directory: Path | None = None, name: str | None = None) -> Identity:
    """This machine's identity, made on first use (certificate and key 0600 in ``directory``)."""
    d = private_dir(directory or config_dir())
    cert_path, key_path = d / CERT_FILE, d / KEY_FILE
    with _lock, dir_lock(d):  # two processes starting at once make one key pair, not a mix
        if not (cert_path.is_file() and key_path.is_file()):
            cert_pem, key_pem = _make_certificate(check_name(name or device_name()))
            write_private(key_path, key_pem, durable=True)
            write_private(cert_path, cert_pem, durable=True)
        for p in (cert_path, key_path):
            if p.stat().st_mode & 0o077:
                os.chmod(p, 0o600)  # never leave a key readable by others
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError as e:
            raise ConfigError(f"peer certificate {cert_path} is unreadable: {e}", "config_dir") from None
    stored = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = str(stored[0].value) if stored else ""
    own = name or (cn.removeprefix("duet peer ") if cn.startswith("duet peer ") else device_name())
    return Identity(check_name(own), cert_path, key_path, cert.public_bytes(serialization.Encoding.DER))


@dataclass(frozen=True)
class PairedPeer:
    name: str
    fingerprint: str
    cert_pem: str

    @property
    def short_id(self) -> str:
        return short_id(self.fingerprint)


class PairedPeers:
    """The peers this machine has paired with, in ``peers.json`` (0600) in the config directory."""

    def __init__(self, directory: Path | None = None):
        self.path = (directory or config_dir()) / PEERS_FILE

    def load(self) -> dict[str, PairedPeer]:
        with _lock:
            if not self.path.is_file():
                return {}
            try:
                raw = json.loads(self.path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"paired peers file {self.path} is unreadable: {e}", "config_dir") from None
        out = {}
        for name, entry in dict(raw).items():
            fp, pem = str(entry["fingerprint"]), str(entry["certificate"])
            der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(serialization.Encoding.DER)
            if fingerprint(der) != fp:
                raise ConfigError(
                    f"paired peer {name!r} in {self.path}: its certificate does not match its fingerprint",
                    "config_dir",
                )
            out[name] = PairedPeer(name, fp, pem)
        return out

    def _save(self, peers: dict[str, PairedPeer]) -> None:
        data = {p.name: {"fingerprint": p.fingerprint, "certificate": p.cert_pem} for p in peers.values()}
        private_dir(self.path.parent)
        write_private(self.path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), durable=True)

    def add(self, name: str, cert_pem: str) -> PairedPeer:
        """Pair with the holder of ``cert_pem`` under ``name`` (another name for the same
        certificate is replaced; a name taken by another certificate gets a ``-2``, ``-3`` ... suffix)."""
        check_name(name)
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        fp = fingerprint(cert.public_bytes(serialization.Encoding.DER))
        pem = cert.public_bytes(serialization.Encoding.PEM).decode()
        with dir_lock(private_dir(self.path.parent)):
            peers = {n: p for n, p in self.load().items() if p.fingerprint != fp}
            final, i = name, 1
            while final in peers:
                i += 1
                final = f"{name[:58]}-{i}"
            peers[final] = PairedPeer(final, fp, pem)
            self._save(peers)
        return peers[final]

    def remove(self, name: str) -> PairedPeer:
        with dir_lock(private_dir(self.path.parent)):
            peers = self.load()
            if name not in peers:
                known = ", ".join(sorted(peers)) or "none"
                raise ConfigError(f"no paired peer named {name!r} (paired: {known})", "name")
            gone = peers.pop(name)
            self._save(peers)
        return gone

    def by_fingerprint(self, fp: str) -> PairedPeer | None:
        return next((p for p in self.load().values() if p.fingerprint == fp), None)
