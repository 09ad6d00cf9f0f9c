"""Device state at rest, encrypted: AES-256-GCM (``cryptography``) with a key kept outside the
state directory.

The key is 32 random bytes in a file of mode 0600 (created on first use; its path is the
device owner's choice, e.g. ``/etc/omnidraft/state.key`` or a mounted secret). Each state file
is stored as ``ODS1 | nonce (12 bytes) | ciphertext+tag``, with the file's name as associated
data, so a file cannot be swapped for another one. A wrong key is a configuration error and is
reported as such (``StateKeyError``); the files are left untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"ODS1"
NONCE_BYTES = 12


class StateKeyError(ValueError):
    """The state cannot be read with the key given (or without one); one line."""


class StateCipher:
    """Encrypts and decrypts state files with the key at ``path`` (see the module docstring)."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        self.created = False  # whether this object created the key file (only then is plaintext state migrated)
        if self.path.exists():
            if self.path.is_dir():
                raise StateKeyError(f"state key {self.path} is a directory")
            key = self.path.read_bytes()
            if len(key) != 32:
                raise StateKeyError(f"state key {self.path} is not a 32-byte key ({len(key)} bytes)")
            if self.path.stat().st_mode & 0o077:
                raise StateKeyError(f"state key {self.path} is readable by other users (chmod 600 it)")
        elif create:
            key = AESGCM.generate_key(bit_length=256)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
                f.flush()
                os.fsync(f.fileno())
            self.created = True
        else:
            raise StateKeyError(f"state key {self.path} does not exist")
        self._aead = AESGCM(key)

    def encrypt(self, name: str, data: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, name.encode())

    def decrypt(self, name: str, blob: bytes) -> bytes:
        if not is_encrypted(blob):
            raise StateKeyError(f"{name} is not encrypted")
        nonce = blob[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES :], name.encode())
        except InvalidTag:
            raise StateKeyError(
                f"the device state cannot be decrypted with the key {self.path} (wrong key, or the file was altered)"
            ) from None


def is_encrypted(blob: bytes) -> bool:
    return blob.startswith(MAGIC)
