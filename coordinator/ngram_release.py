"""Releasing frequent n-gram cache entries from many devices, privately.

A device reports which target tokens it learned as n-gram entries in a round: a presence bitmap
over the target vocabulary (``omnidraft.v1.NgramStats``), so each entry counts at most once per
device and round, and no drafter ids, order or counts leave the device. The coordinator:

1. bounds each device's contribution to ``max_entries_per_device`` ids (a random subset when it
   reports more), so one device changes the count vector by at most ``sqrt(m)`` in L2;
2. sums the bitmaps into per-token device counts;
3. optionally adds Gaussian noise ``N(0, (noise_multiplier * sqrt(m))^2)`` to every non-zero
   count and accounts the release with Flower's ``RdpAccountant`` (one Gaussian event per
   round, no sampling amplification claimed: the coordinator does not know how many devices
   run a target);
4. releases a token only if its (noisy) count reaches ``k`` devices.

Privacy caveat, stated plainly: the accountant covers the noisy counts. Releasing only the ids
that pass the threshold (partition selection) adds a small extra delta that depends on ``k``
and the noise; it is not included in the reported epsilon. With ``noise_multiplier = 0`` the
release is k-anonymous only (epsilon is reported as infinite).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omnidraft.shared.atomic_io import write_bytes_atomic
from omnidraft.shared.fleet_wire import StatsError, decode_stats, encode_stats  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class ReleaseConfig:
    """k-threshold and noise settings of the n-gram release."""

    k: int = 5  # devices that must hold an entry before it is released
    noise_multiplier: float = 0.0  # Gaussian std in units of the L2 sensitivity; 0: no noise
    max_entries_per_device: int = 256  # ids one device may contribute per round
    delta: float = 1e-5  # delta at which epsilon is reported

    def validate(self) -> None:
        if self.k < 1:
            raise ValueError("the release threshold k must be >= 1 device")
        if self.noise_multiplier < 0 or not math.isfinite(self.noise_multiplier):
            raise ValueError("the noise multiplier must be a finite number >= 0")
        if self.max_entries_per_device < 1:
            raise ValueError("max entries per device must be >= 1")
        if not 0 < self.delta < 1:
            raise ValueError("delta must be in (0, 1)")


@dataclass
class ReleaseReport:
    """What one round's release did (for metrics.jsonl)."""

    devices: int
    reported_ids: int  # distinct target ids at least one device reported
    released: int  # ids that passed the threshold
    noise_std: float  # std of the noise added to each count (devices)
    epsilon: float  # cumulative epsilon at ``delta`` for this target (inf without noise)
    delta: float

    def to_dict(self) -> dict:
        return asdict(self)


# -- wire format --------------------------------------------------------------------------------

# -- the mechanism ------------------------------------------------------------------------------

class NgramRelease:
    """One target's release mechanism and its privacy ledger (persisted at ``path``)."""

    def __init__(self, config: ReleaseConfig, path: Path | None = None) -> None:
        config.validate()
        self.config = config
        self.path = path
        self.accountant = None
        if config.noise_multiplier > 0:
            from flwr.serverapp import PrivacyConfig, RdpAccountant
            from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod

            self.accountant = RdpAccountant(PrivacyConfig(
                target_delta=config.delta, population_size=1,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION))
            if path is not None and path.is_file():
                self.accountant.load_state_dict(json.loads(path.read_text()))

    @property
    def sensitivity(self) -> float:
        """L2 change of the count vector when one device joins or leaves (devices)."""
        return math.sqrt(self.config.max_entries_per_device)

    def epsilon(self) -> float:
        if self.accountant is None or self.accountant.num_releases == 0:
            return math.inf if self.accountant is None else 0.0
        return self.accountant.get_epsilon(self.config.delta)

    def release(self, bitmaps: list[np.ndarray], rng: np.random.Generator) -> tuple[dict[int, float], ReleaseReport]:
        """Released target ids with their (noisy) device counts, and the round's report."""
        cfg = self.config
        if not bitmaps:
            return {}, ReleaseReport(0, 0, 0, 0.0, self.epsilon(), cfg.delta)
        counts = np.zeros(bitmaps[0].shape[0], dtype=np.float64)
        for bits in bitmaps:
            ids = np.flatnonzero(bits)
            if ids.size > cfg.max_entries_per_device:
                ids = rng.choice(ids, cfg.max_entries_per_device, replace=False)
            counts[ids] += 1.0
        reported = np.flatnonzero(counts)
        noise_std = cfg.noise_multiplier * self.sensitivity
        noisy = counts[reported]
        if noise_std > 0:
            noisy = noisy + rng.normal(0.0, noise_std, size=noisy.shape)
            from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

            self.accountant.compose(GaussianPrivacyEvent(cfg.noise_multiplier, 1, 1))
            if self.path is not None:
                write_bytes_atomic(self.path, json.dumps(self.accountant.state_dict()).encode())
        keep = noisy >= cfg.k
        released = {int(t): float(c) for t, c in zip(reported[keep], noisy[keep])}
        return released, ReleaseReport(len(bitmaps), int(reported.size), len(released), noise_std,
                                       self.epsilon(), cfg.delta)
