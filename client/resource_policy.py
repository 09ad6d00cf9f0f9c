"""What a device owner allows the fleet to use: threads, cache memory, when to train, uplink.

``ResourcePolicy`` is part of the device's profile (``device join --max-threads --cache-mb
--train-when --uplink-mb-per-day``). Before a federated round the device checks it against its
``DeviceConditions`` — on mains power? idle (no request served for ``idle_s``)? — and its
``UplinkLedger`` (bytes sent today); a device that may not train says so in its status
(``busy``), the coordinator leaves it out of the round with that reason, and a train message
that reaches it anyway is refused. Conditions are injectable: tests and simulations pass their
own; ``SystemConditions`` reads Linux's power-supply class and the request log's age.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from omnidraft.shared.util.atomic_io import file_lock, write_bytes_atomic

TRAIN_WHEN = ("always", "idle", "power", "idle+power")
LEDGER_FILE = "uplink.json"


@dataclass(frozen=True)
class ResourcePolicy:
    """The owner's limits (0 means no limit / the default)."""

    max_threads: int = 0  # torch threads for decoding and training (0: every core)
    cache_mb: float = 0.0  # n-gram cache memory budget in MB (0: the cache's entry limit only)
    train_when: str = "always"  # always | idle | power | idle+power
    idle_s: float = 300.0  # "idle": no request served for this long (seconds)
    uplink_mb_per_day: float = 0.0  # bytes federated rounds may send per UTC day, in MB (0: no limit)

    def validate(self) -> None:
        if self.train_when not in TRAIN_WHEN:
            raise ValueError(f"train-when must be one of {', '.join(TRAIN_WHEN)}")
        if self.max_threads < 0 or self.cache_mb < 0 or self.idle_s < 0 or self.uplink_mb_per_day < 0:
            raise ValueError("max threads, cache MB, idle seconds and uplink MB per day must be >= 0")

    @property
    def cache_bytes(self) -> int | None:
        return int(self.cache_mb * 1e6) if self.cache_mb else None


class DeviceConditions(Protocol):
    """What the device is doing now."""

    def on_power(self) -> bool: ...

    def seconds_since_last_request(self) -> float: ...


class SystemConditions:
    """Linux: mains power from ``/sys/class/power_supply`` (no battery counts as mains); the
    last request from the request log's modification time (``device serve`` writes it)."""

    def __init__(self, state_dir: str | Path, power_supply: str | Path = "/sys/class/power_supply") -> None:
        self.state_dir = Path(state_dir)
        self.power_supply = Path(power_supply)

    def on_power(self) -> bool:
        supplies = list(self.power_supply.glob("*")) if self.power_supply.is_dir() else []

        def read(p: Path, name: str) -> str:
            try:
                return (p / name).read_text().strip()
            except OSError:
                return ""

        batteries = [p for p in supplies if read(p, "type") == "Battery"]
        if not batteries:
            return True
        if any(read(p, "type") in ("Mains", "USB") and read(p, "online") == "1" for p in supplies):
            return True
        return all(read(p, "status") in ("Charging", "Full", "Not charging") for p in batteries)

    def seconds_since_last_request(self) -> float:
        try:
            return max(0.0, time.time() - (self.state_dir / "requests.log").stat().st_mtime)
        except OSError:
            return math.inf


class UplinkLedger:
    """Bytes sent by federated rounds per UTC day, in ``<state_dir>/uplink.json``."""

    def __init__(self, state_dir: str | Path, clock=time.time) -> None:
        self.path = Path(state_dir) / LEDGER_FILE
        self.clock = clock

    def _today(self) -> str:
        return datetime.fromtimestamp(self.clock(), UTC).strftime("%Y-%m-%d")

    def used_today(self) -> int:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return 0
        return int(data.get("bytes", 0)) if data.get("day") == self._today() else 0

    def add(self, sent: int) -> None:
        with file_lock(self.path.with_name(f".{LEDGER_FILE}.lock")):
            write_bytes_atomic(
                self.path, json.dumps({"day": self._today(), "bytes": self.used_today() + int(sent)}).encode()
            )


def busy_reason(policy: ResourcePolicy, conditions: DeviceConditions, ledger: UplinkLedger, expected_bytes: int) -> str:
    """Why the device may not train now ("" when it may); ``expected_bytes``: what a round
    sends (the last round's uplink)."""
    if "power" in policy.train_when and not conditions.on_power():
        return "on battery (train-when power)"
    if "idle" in policy.train_when:
        quiet = conditions.seconds_since_last_request()
        if quiet < policy.idle_s:
            return f"in use (last request {quiet:.0f} s ago, train-when idle after {policy.idle_s:.0f} s)"
    if policy.uplink_mb_per_day:
        budget = int(policy.uplink_mb_per_day * 1e6)
        if ledger.used_today() + expected_bytes > budget:
            return f"uplink budget spent ({ledger.used_today()} of {budget} bytes today)"
    return ""
