"""Who may teach a device: the owner's token for its generation service.

A device learns from the requests it serves (the online learner, and the request log its
federated rounds train on), so whoever can send it requests can steer what it learns. The
service therefore knows one secret, the owner's token (32 random bytes as hex, in a 0600 file,
by default ``<state-dir>/owner.token``, created on first use). A request that carries it
(gRPC metadata ``authorization: Bearer <token>``; ``omnidraft device ask --owner-token FILE``)
is the owner's: served, learned from and logged. Any other request on a loopback listener is
served without teaching the device anything; on any other address it is refused
(``UNAUTHENTICATED``), and such an address needs TLS as well (``client.service.serve``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

from omnidraft.shared.util.atomic_io import write_bytes_atomic

TOKEN_FILE = "owner.token"
METADATA_KEY = "authorization"
SCHEME = "Bearer "


def load_or_create(path: str | os.PathLike[str]) -> str:
    """The token in ``path``, created (0600) when the file does not exist."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, (secrets.token_hex(32) + "\n").encode())  # atomic writes create files 0600
    return read(path)


def read(path: str | os.PathLike[str]) -> str:
    """The token in ``path``; ValueError (one line) when it is missing or not a token."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"owner token {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(token) < 32 or not all(c in "0123456789abcdef" for c in token):
        raise ValueError(f"owner token {path} is not a token (64 hex digits)")
    return token


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata that presents ``token``."""
    return ((METADATA_KEY, SCHEME + token),)


def presented_by(invocation_metadata, token: str) -> bool:
    """Whether a call's metadata carries ``token`` (compared in constant time)."""
    for key, value in invocation_metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith(SCHEME):
            return hmac.compare_digest(value[len(SCHEME) :].encode(), token.encode())
    return False


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` listens on a loopback interface only."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
