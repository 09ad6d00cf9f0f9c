"""The coordinator's record of finished rounds on disk, under its root folder.

``rounds.jsonl`` holds one JSON line per finished round and target (``fleet status`` and the
simulation's report read it); ``coordinator.json`` holds the last finished round. A round's lines
are written first and ``coordinator.json`` last, both atomically, so the second is the round's
commit point: a coordinator restarted after a crash resumes after the last finished round and
drops the lines of one that never finished. ``PhaseClock`` times a round's phases for its record
(``phase-s``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omnidraft.shared.util.atomic_io import write_bytes_atomic

STATE_FILE = "coordinator.json"
ROUNDS_FILE = "rounds.jsonl"


class PhaseClock:
    """Wall seconds of a round's phases, in order: ``lap(name)`` charges the time since the
    previous lap (or since the clock started) to ``name``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def last_round(root: str | Path) -> int:
    """The last finished round (0: none, or an unreadable ``coordinator.json``)."""
    try:
        return int(json.loads((Path(root) / STATE_FILE).read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def round_history(root: str | Path) -> list[dict]:
    """Every recorded round (``rounds.jsonl``), oldest first; [] when none."""
    try:
        return [json.loads(line) for line in (Path(root) / ROUNDS_FILE).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def forget_unfinished(root: str | Path, start: int) -> None:
    """Drop the lines of rounds from ``start`` on (a round that never finished: the coordinator
    stopped after writing them, before ``coordinator.json``): its rerun writes them again.
    Round 0's lines are written with round 1's."""
    history = Path(root) / ROUNDS_FILE
    if not history.exists():
        return
    lines = history.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if start > 1 and json.loads(line)["round"] < start]
    if len(kept) != len(lines):
        write_bytes_atomic(history, b"".join(kept))


def finish_round(root: str | Path, rnd: int, records: list[dict]) -> None:
    """Append round ``rnd``'s ``records`` (one line each) and then mark the round finished."""
    history = Path(root) / ROUNDS_FILE
    lines = "".join(json.dumps(r, default=float) + "\n" for r in records).encode()
    write_bytes_atomic(history, (history.read_bytes() if history.exists() else b"") + lines)
    write_bytes_atomic(Path(root) / STATE_FILE, json.dumps({"round": rnd, "time": time.time()}).encode())
