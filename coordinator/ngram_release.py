"""Releasing frequent n-gram cache entries from many devices, with differential privacy.

A device reports which target tokens it learned as n-gram entries in a round: a presence bitmap
over the target vocabulary (``omnidraft.v1.NgramStats``), so each entry counts at most once per
device and round, and no drafter ids, order or counts leave the device. Per target and round the
coordinator runs one **Gaussian partition selection** (the mechanism of Google's DP libraries;
Desfontaines et al., "Differentially private partition selection", PoPETs 2022):

1. it bounds each device's contribution to ``m = max_entries_per_device`` ids (a random subset
   when it reports more), so one device changes the count vector by at most ``sqrt(m)`` in L2
   and by at most 1 per id;
2. sums the bitmaps into per-token device counts and adds ``N(0, sigma^2)`` with
   ``sigma = noise_multiplier * sqrt(m)`` to each reported id's count;
3. releases an id only if its noisy count reaches ``max(k, tau)``, with
   ``tau = 1 + sigma * Phi^-1(1 - selection_delta / m)``: an id held by one device alone (which
   the neighbouring fleet without that device never reports) is released with probability at
   most ``selection_delta / m``, so at most ``selection_delta`` over that device's ids.

One round is then ``(epsilon_round, delta_gauss + selection_delta)``-DP for any one device
joining or leaving; the Gaussian part is composed over rounds by Flower's ``RdpAccountant`` (no
sampling amplification claimed: the coordinator does not know how many devices run a target)
and the reported ``delta`` is ``delta + rounds * selection_delta``. A device serves one target
per round and every target's release uses the same noise, so one target's ledger (one event per
round) bounds what any device spent over all targets.

The noise comes from the operating system's entropy (``numpy.random.default_rng()`` with no
seed): a seeded generator would let anyone who knows the seed subtract it. Tests pass their own
generator. With ``noise_multiplier = 0`` the release is k-anonymous only and epsilon is infinite.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from omnidraft.shared.wire import StatsError, decode_stats, encode_stats  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class ReleaseConfig:
    """k-threshold and noise settings of the n-gram release."""

    k: int = 5  # devices that must hold an entry before it is released
    # Gaussian std in units of the L2 sensitivity (0: no noise, epsilon infinite); 2.1 spends
    # epsilon 3.79 at delta 1e-5 over the default run's 3 rounds
    noise_multiplier: float = 2.1
    max_entries_per_device: int = 4  # ids one device may contribute per round
    delta: float = 1e-5  # delta of the Gaussian part, at which epsilon is reported
    selection_delta: float = 1e-6  # per round: chance bound that an id one device alone holds is released

    def validate(self) -> None:
        if self.k < 1:
            raise ValueError("the release threshold k must be >= 1 device")
        if self.noise_multiplier < 0 or not math.isfinite(self.noise_multiplier):
            raise ValueError("the noise multiplier must be a finite number >= 0")
        if self.max_entries_per_device < 1:
            raise ValueError("max entries per device must be >= 1")
        if not 0 < self.delta < 1:
            raise ValueError("delta must be in (0, 1)")
        if not 0 < self.selection_delta < 1:
            raise ValueError("the selection delta must be in (0, 1)")


@dataclass
class ReleaseReport:
    """What one round's release did (for metrics.jsonl)."""

    devices: int
    reported_ids: int  # distinct target ids at least one device reported
    released: int  # ids that passed the threshold
    noise_std: float  # std of the noise added to each count (devices)
    threshold: float  # noisy count an id needed (devices)
    epsilon: float  # cumulative epsilon at ``delta`` for this target (inf without noise)
    delta: float  # cumulative delta: the Gaussian part plus each round's selection delta

    def to_dict(self) -> dict:
        return asdict(self)


# -- wire format --------------------------------------------------------------------------------

# -- the mechanism ------------------------------------------------------------------------------


class NgramRelease:
    """One target's release mechanism and its privacy ledger (persisted at ``path``)."""

    def __init__(self, config: ReleaseConfig, ledger: dict | None = None, *, private_updates: bool = False) -> None:
        """``ledger``: what earlier rounds spent (``ledger()`` of the last committed release;
        the registry keeps it with each version, so a round that never committed is not charged).
        ``private_updates``: the round's adapter updates are released with differential privacy
        too (``account_updates``), composed into the same ledger."""
        config.validate()
        self.config = config
        self.accountant = None
        if config.noise_multiplier > 0 or private_updates:
            from flwr.serverapp import PrivacyConfig, RdpAccountant
            from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod

            self.accountant = RdpAccountant(
                PrivacyConfig(
                    target_delta=config.delta,
                    population_size=1,
                    neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                    sampling_method=SamplingMethod.NO_AMPLIFICATION,
                )
            )
            if ledger is not None:
                self.accountant.load_state_dict(ledger)

    @property
    def noise_std(self) -> float:
        """Std of the noise on each count (devices)."""
        return self.config.noise_multiplier * self.sensitivity

    @property
    def threshold(self) -> float:
        """The noisy device count an id must reach to be released."""
        cfg = self.config
        if cfg.noise_multiplier == 0:
            return float(cfg.k)
        tau = 1.0 + self.noise_std * NormalDist().inv_cdf(1.0 - cfg.selection_delta / cfg.max_entries_per_device)
        return max(float(cfg.k), tau)

    def total_delta(self) -> float:
        """The reported delta: the accountant's plus one selection delta per release so far."""
        if self.accountant is None:
            return self.config.delta
        return self.config.delta + self.accountant.num_releases * self.config.selection_delta

    @property
    def sensitivity(self) -> float:
        """L2 change of the count vector when one device joins or leaves (devices)."""
        return math.sqrt(self.config.max_entries_per_device)

    def ledger(self) -> dict | None:
        """The accountant's state after this release (JSON-able; None without noise), to commit
        with the version it accounts for."""
        return self.accountant.state_dict() if self.accountant is not None else None

    def epsilon(self) -> float:
        """Cumulative epsilon at ``delta`` over every release in the ledger (the n-gram releases
        and any private adapter updates); infinite while the n-gram release has no noise."""
        if self.accountant is None or self.config.noise_multiplier == 0:
            return math.inf
        if self.accountant.num_releases == 0:
            return 0.0
        return self.accountant.get_epsilon(self.config.delta)

    def account_updates(self, noise_multiplier: float) -> None:
        """Compose one round of DP-FedAvg on the adapter updates (the Gaussian mechanism at
        ``noise_multiplier`` times the clipping norm on the sum of clipped updates, one device
        joining or leaving; no sampling amplification claimed) into this target's ledger."""
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        if self.accountant is None:
            raise ValueError("this release was not built to account private updates")
        self.accountant.compose(GaussianPrivacyEvent(noise_multiplier, 1, 1))

    def release(
        self, bitmaps: list[np.ndarray], rng: np.random.Generator | None = None
    ) -> tuple[dict[int, float], ReleaseReport]:
        """Released target ids with their (noisy) device counts, and the round's report. ``rng``
        only for tests: the default draws from the operating system's entropy."""
        cfg = self.config
        rng = rng if rng is not None else np.random.default_rng()
        if not bitmaps:
            return {}, ReleaseReport(0, 0, 0, 0.0, self.threshold, self.epsilon(), self.total_delta())
        counts = np.zeros(bitmaps[0].shape[0], dtype=np.float64)
        for bits in bitmaps:
            ids = np.flatnonzero(bits)
            if ids.size > cfg.max_entries_per_device:
                ids = rng.choice(ids, cfg.max_entries_per_device, replace=False)
            counts[ids] += 1.0
        reported = np.flatnonzero(counts)
        noise_std = self.noise_std
        noisy = counts[reported]
        if noise_std > 0:
            noisy = noisy + rng.normal(0.0, noise_std, size=noisy.shape)
            from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

            self.accountant.compose(GaussianPrivacyEvent(cfg.noise_multiplier, 1, 1))
        keep = noisy >= self.threshold
        released = {int(t): float(c) for t, c in zip(reported[keep], noisy[keep])}
        return released, ReleaseReport(
            len(bitmaps),
            int(reported.size),
            len(released),
            noise_std,
            self.threshold,
            self.epsilon(),
            self.total_delta(),
        )
