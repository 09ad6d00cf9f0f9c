"""Atomic file writes (state on disk is either the old file or the new one, never half of it) and
the advisory lock that serialises processes sharing a directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def file_lock(
    path: str | os.PathLike[str], *, exclusive: bool = True, on_wait: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold an advisory lock (``flock``) on ``path`` (created if missing) for the ``with`` block:
    exclusive for writers, shared for readers. It serialises processes that share a state
    directory (``device serve`` and a SuperNode's ClientApp) around multi-file writes and reads.
    ``on_wait`` is called once, before blocking, when another process holds the lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
