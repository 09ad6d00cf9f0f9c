"""A federation's settings: the round schedule, what a round evaluates, and the aggregation,
server optimizer, n-gram release and SecAgg+ settings (each checked by ``validate``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnidraft.coordinator.aggregation import AggregationConfig
from omnidraft.coordinator.ngram_release import ReleaseConfig
from omnidraft.coordinator.secure_aggregation import SecAggConfig
from omnidraft.coordinator.server_opt import ServerOptConfig


@dataclass
class FleetConfig:
    """Round schedule and the aggregation / privacy settings of a federation."""

    rounds: int = 3  # total rounds; a restarted coordinator runs the ones left
    fraction: float = 1.0  # share of connected devices sampled per round
    min_devices: int = 1  # devices that must be connected before a round starts
    wait_s: float = 120.0  # longest wait for min_devices (seconds)
    round_timeout_s: float = 1800.0  # longest wait for replies of one message wave (seconds)
    evaluate: bool = True  # the round's devices evaluate the new global state
    measure_ar: bool = False  # evaluation also runs the target alone (for speedups)
    fixed_k: int = 0  # evaluation also decodes drafting exactly this many tokens per round (0: not)
    newcomer_evals: int = 2  # per target and round, newcomers measured with and without the global state (0: all)
    newcomer_speed: bool = False  # newcomers and veterans also decode adaptively (their speed) beside fixed k
    # simulations: sampled devices and probes name the round's prompts ahead (query.announce), so
    # that the target's outputs they lack are recorded together
    announce_recordings: bool = False
    seed: int = 0
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)  # how an aggregate moves the global adapter
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)

    def validate(self) -> None:
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if not 0 < self.fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")
        if self.min_devices < 1:
            raise ValueError("min devices must be >= 1")
        if self.fixed_k < 0:
            raise ValueError("the fixed draft length must be >= 0 (0: not measured)")
        self.aggregation.validate()
        self.server_opt.validate()
        self.release.validate()
        self.secagg.validate()
        if self.secagg.enabled and self.aggregation.method != "fedavg":
            raise ValueError("SecAgg+ reveals only the weighted mean: use the fedavg aggregation with it")
        if self.secagg.enabled and self.aggregation.dp_noise > 0:
            raise ValueError(
                "differential privacy on the updates clips them on the coordinator, which SecAgg+ "
                "never shows it: use one or the other"
            )
