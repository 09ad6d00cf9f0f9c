"""Ed25519 signatures on the global states a coordinator publishes (``cryptography``).

The coordinator signs the exact bytes of each ``StateManifest`` it commits (the manifest names
the sha256 of the adapter and cache, so the signature covers them too); a device pins the
fleet's public key (32 bytes, given as hex) and verifies a manifest's signature, then the
parts' hashes, before it stores or loads anything.

Key file: PKCS#8 PEM, unencrypted, created with mode 0600 in a 0700 directory. Rotation: make a
new key file, give devices the new public key (they may pin several, comma-separated, during the
change-over), then remove the old key from the devices.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class SignatureError(ValueError):
    """A signature or key that does not verify or parse (one line)."""


def load_or_create_key(path: str | Path) -> Ed25519PrivateKey:
    """The private key at ``path``, created (0600, parent 0700) if it does not exist."""
    path = Path(path)
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise SignatureError(f"signing key {path}: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"signing key {path} is not an Ed25519 key")
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


def public_key_hex(key: Ed25519PrivateKey) -> str:
    """The raw 32-byte public key as hex (what devices pin)."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def pinned_keys(text: str) -> list[Ed25519PublicKey]:
    """Public keys from ``hex[,hex...]``; SignatureError for anything else."""
    keys = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            keys.append(Ed25519PublicKey.from_public_bytes(bytes.fromhex(part)))
        except ValueError:
            raise SignatureError(f"{part[:16]}...: not a 32-byte Ed25519 public key in hex") from None
    return keys


def verify(keys: list[Ed25519PublicKey], data: bytes, signature: bytes) -> None:
    """Raise SignatureError unless one of ``keys`` signed ``data``."""
    for key in keys:
        try:
            key.verify(signature, data)
            return
        except InvalidSignature:
            continue
    raise SignatureError("the state manifest's signature does not verify with the fleet's key")
