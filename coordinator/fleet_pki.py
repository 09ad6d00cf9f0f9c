"""TLS and SuperNode-authentication material for a real deployment (``omnidraft fleet init``).

Flower's own executables run the federation: ``flower-superlink`` serves TLS with a server
certificate signed by the fleet's CA, and with ``--enable-supernode-auth`` it only lets in
SuperNodes whose public key was registered (``flwr supernode register KEY.pub``); each
``flower-supernode`` trusts the CA (``--root-certificates``) and signs in with its private key
(``--auth-supernode-private-key``, an EC key in OpenSSH format).

Layout of the directory (0700; every private key 0600)::

    ca.crt  ca.key                the fleet's certificate authority (keep ca.key offline)
    superlink.crt  superlink.key  the SuperLink's server certificate, SANs from ``hosts``
    nodes/<name>  nodes/<name>.pub  one key pair per device (the private key goes to the
                                    device, the public one is registered on the SuperLink)

``init`` is idempotent: an existing CA and certificate are kept, missing node keys are added.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from omnidraft.shared.node_keys import checked_public_key, write_node_key
from omnidraft.shared.util.atomic_io import write_bytes_atomic

CA_DAYS = 3650
SERVER_DAYS = 825  # the longest server-certificate life browsers and most TLS stacks accept
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class PkiError(ValueError):
    """A bad name or an unusable existing file (one line)."""


@dataclass(frozen=True)
class FleetPki:
    """Paths of the material in one directory (see the module docstring)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "superlink.crt"

    @property
    def server_key(self) -> Path:
        return self.root / "superlink.key"

    def node_key(self, name: str) -> Path:
        return self.root / "nodes" / name

    def node_public_key(self, name: str) -> Path:
        return self.root / "nodes" / f"{name}.pub"

    def nodes(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "nodes").glob("*.pub"))


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "OmniDraft Fleet"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _load_ca(pki: FleetPki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise PkiError(f"{pki.root}: the existing CA cannot be read ({exc})") from None
    return cert, key


def _make_ca(pki: FleetPki, now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = _name("OmniDraft Fleet CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    write_bytes_atomic(pki.ca_key, _pem_key(key))  # atomic writes create files 0600
    write_bytes_atomic(pki.ca_cert, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _make_server_cert(pki: FleetPki, ca: x509.Certificate, ca_key, hosts: list[str], now: dt.datetime) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    write_bytes_atomic(pki.server_key, _pem_key(key))
    write_bytes_atomic(pki.server_cert, cert.public_bytes(serialization.Encoding.PEM))


def _checked_name(name: str) -> None:
    if not _NODE_NAME.match(name):
        raise PkiError(f"node name {name!r}: use 1-64 letters, digits, '.', '_', '-'")


def _nodes_dir(pki: FleetPki) -> None:
    """``nodes/``, created if missing, readable by the owner only."""
    folder = pki.root / "nodes"
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def add_node(pki: FleetPki, name: str) -> bool:
    """Create the key pair of SuperNode ``name`` unless it exists (the operator's own test
    devices; a real device makes its own: ``add_public_key``); True when created."""
    _checked_name(name)
    if pki.node_key(name).exists() and pki.node_public_key(name).exists():
        return False
    _nodes_dir(pki)
    write_node_key(pki.node_key(name), name)
    return True


def add_public_key(pki: FleetPki, name: str, public: bytes, source: str) -> None:
    """Keep device ``name``'s own public key (made on the device: ``omnidraft device keygen``)
    as ``nodes/<name>.pub``; no private key is stored. PkiError for a bad name, a key that is
    not an OpenSSH P-384 public key, or a name already holding another key."""
    _checked_name(name)
    try:
        line = checked_public_key(public, source)
    except ValueError as exc:
        raise PkiError(str(exc)) from None
    path = pki.node_public_key(name)
    if path.exists() and path.read_bytes().split()[:2] != line.split()[:2]:
        raise PkiError(f"node {name!r} already has another key ({path}); pick another name")
    _nodes_dir(pki)
    write_bytes_atomic(path, line)


def init(root: str | os.PathLike[str], nodes: list[str], hosts: list[str] | None = None) -> tuple[FleetPki, list[str]]:
    """Create (or complete) the directory at ``root``: CA, SuperLink certificate valid for
    ``hosts`` (default ``127.0.0.1`` and ``localhost``), and a key pair per name in ``nodes``.
    Returns the material and the list of files created."""
    pki = FleetPki(Path(root))
    hosts = list(dict.fromkeys(hosts or ["127.0.0.1", "localhost"]))
    if pki.root.exists() and not pki.root.is_dir():
        raise PkiError(f"{pki.root} is not a directory")
    pki.root.mkdir(parents=True, exist_ok=True)
    os.chmod(pki.root, 0o700)
    created: list[str] = []
    now = dt.datetime.now(dt.UTC)
    if pki.ca_cert.exists() or pki.ca_key.exists():
        ca, ca_key = _load_ca(pki)
    else:
        ca, ca_key = _make_ca(pki, now)
        created += [pki.ca_cert.name, pki.ca_key.name]
    if not (pki.server_cert.exists() and pki.server_key.exists()):
        _make_server_cert(pki, ca, ca_key, hosts, now)
        created += [pki.server_cert.name, pki.server_key.name]
    for name in nodes:
        if add_node(pki, name):
            created += [f"nodes/{name}", f"nodes/{name}.pub"]
    return pki, created
