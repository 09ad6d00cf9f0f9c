"""The prompts a device served, kept on the device for its federated rounds.

``device serve`` appends every request's prompt; the device's ClientApp (``device join``) trains
a federated round on the prompts that came in since its previous round — the same online
setting as the paper, on the user's own traffic. The log never leaves the device: a round
sends only the adapter and the ids of the target tokens learned as n-grams.

``<state_dir>/requests.log`` is one JSON document ``{"next": N, "entries": [[seq, prompt], ...]}``
holding the newest ``keep`` prompts, rewritten atomically under a lock (both processes use it),
and encrypted with the device's state key when one is given.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnidraft.shared.util.atomic_io import file_lock, write_bytes_atomic

LOG_FILE = "requests.log"


class RequestLog:
    """Append and read the served prompts in ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, cipher=None, keep: int = 256) -> None:
        self.path = Path(root) / LOG_FILE
        self.lock = Path(root) / f".{LOG_FILE}.lock"
        self.cipher = cipher
        self.keep = keep

    def _read(self) -> dict:
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return {"next": 0, "entries": []}
        if self.cipher is not None:
            from omnidraft.client.state_key import is_encrypted

            if is_encrypted(blob):
                blob = self.cipher.decrypt(LOG_FILE, blob)
            elif not self.cipher.created:  # plaintext under an existing key: not written by this device
                blob = b""  # set aside below; the device trains on nothing it did not log itself
        try:
            data = json.loads(blob)
            return {"next": int(data["next"]), "entries": [(int(s), str(p)) for s, p in data["entries"]]}
        except (ValueError, KeyError, TypeError):  # unreadable: start a new log, keep the old file aside
            self.path.rename(self.path.with_name(f"{LOG_FILE}.corrupt"))
            return {"next": 0, "entries": []}

    def append(self, prompt: str) -> int:
        """Add ``prompt``; returns its sequence number."""
        with file_lock(self.lock):
            data = self._read()
            seq = data["next"]
            entries = (data["entries"] + [(seq, prompt)])[-self.keep :]
            blob = json.dumps({"next": seq + 1, "entries": entries}).encode()
            if self.cipher is not None:
                blob = self.cipher.encrypt(LOG_FILE, blob)
            write_bytes_atomic(self.path, blob)
        return seq

    def since(self, seq: int) -> list[tuple[int, str]]:
        """The kept entries numbered ``seq`` or later, oldest first."""
        with file_lock(self.lock, exclusive=False):
            return [(s, p) for s, p in self._read()["entries"] if s >= seq]
