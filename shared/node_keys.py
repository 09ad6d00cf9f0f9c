"""A SuperNode's authentication key pair, made where it is used (``cryptography``).

Flower's SuperNode authentication takes an EC key in OpenSSH format
(``flower-supernode --auth-supernode-private-key``); the SuperLink knows only the public half
(``flwr supernode register``). A device makes its own pair (``omnidraft device keygen``) and
hands the operator the public line; the private key never leaves the device. The coordinator's
``fleet init --node`` still makes pairs for the operator's own test devices.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from omnidraft.shared.util.atomic_io import write_bytes_atomic

KEY_TYPE = b"ecdsa-sha2-nistp384"
MAX_PUBLIC_BYTES = 4096


def public_key_path(private: str | os.PathLike[str]) -> Path:
    return Path(f"{private}.pub")


def write_node_key(private: str | os.PathLike[str], comment: str) -> bytes:
    """Create an EC P-384 key pair: ``private`` (OpenSSH, 0600, its folder 0700 when created)
    and ``private.pub`` (``ecdsa-sha2-nistp384 <base64> <comment>``); returns the public line."""
    path = Path(private)
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
        os.chmod(path.parent, 0o700)
    key = ec.generate_private_key(ec.SECP384R1())
    write_bytes_atomic(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )  # atomic writes create files 0600
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    line = public + f" {comment}\n".encode()
    write_bytes_atomic(public_key_path(path), line)
    return line


def checked_public_key(data: bytes, source: str) -> bytes:
    """``data`` as one OpenSSH EC P-384 public key line (the form ``write_node_key`` writes);
    ValueError (one line, naming ``source``) for anything else, a private key included."""
    if len(data) > MAX_PUBLIC_BYTES or b"PRIVATE KEY" in data:
        raise ValueError(f"{source} is not a public key (give the device's .pub file, never its private key)")
    line = data.strip()
    try:
        key = serialization.load_ssh_public_key(b" ".join(line.split()[:2]))
    except (ValueError, TypeError, IndexError):
        raise ValueError(f"{source} is not an OpenSSH public key") from None
    if not line.startswith(KEY_TYPE + b" ") or not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(
            f"{source}: Flower's SuperNode authentication takes an {KEY_TYPE.decode()} key "
            f"(omnidraft device keygen makes one)"
        )
    return line + b"\n"
