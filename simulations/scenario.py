"""A simulated fleet: targets registered with a coordinator, devices with local data, and the
Flower apps that connect them, run on Flower's Simulation Engine.

``Scenario`` says what to simulate; ``prepare(scenario, out)`` registers the targets under
``out/coordinator`` and builds one ``DeviceProfile`` per device (state under
``out/devices/<id>``, the only place its text is kept); ``run(scenario, out, on_round)`` runs
the federation. Devices are assigned to targets by the ``targets`` shares, in order; their
prompts are disjoint contiguous slices of the data (so neighbouring devices see related
prompts: non-IID by construction). The last ``late_joiners`` devices join at the last round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


from omnidraft.client.client_app import make_client_app
from omnidraft.client.fleet_device import DeviceProfile, EnginePool, FleetDevice
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.coordinator.aggregation import AggregationConfig
from omnidraft.coordinator.ngram_release import ReleaseConfig
from omnidraft.coordinator.registry import TargetRegistry
from omnidraft.coordinator.server_app import FleetConfig, make_server_app
from omnidraft.coordinator.simulation import run_federation
from omnidraft.shared.adapters import LoraSpec
from omnidraft.shared.generation import GenerationConfig

REAL_DRAFTER = "smollm2-135m"
REAL_TARGETS = {"qwen2.5-coder-0.5b": 0.5, "gemma3-270m": 0.5}
TINY_TARGETS = {"tiny-target-a": 0.5, "tiny-target-b": 0.5}


@dataclass
class Scenario:
    """What to simulate (sizes in devices, prompts and tokens)."""

    models: str = "real"  # real (catalog models) | tiny (built on the spot, for tests and scale)
    devices: int = 10
    rounds: int = 3
    fraction: float = 1.0
    targets: dict[str, float] | None = None  # registry name -> share of devices (None: the models' default)
    data: str | None = None  # humaneval | pydoc | PATH.jsonl (None: humaneval, or the tiny corpus)
    prompts_per_device: int = 8
    heldout_per_device: int = 2
    prompts_per_round: int = 4
    max_new_tokens: int = 32
    late_joiners: int = 0
    lora_rank: int = 8
    lr: float = 1e-3
    translate: str = "ngram"
    dtype: str = "fp32"
    seed: int = 0
    cpus_per_device: float = 1.0
    ray_address: str | None = None
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

    def validate(self) -> None:
        if self.models not in ("real", "tiny"):
            raise ValueError("--models must be real or tiny")
        if self.devices < 1 or self.rounds < 1:
            raise ValueError("devices and rounds must be >= 1")
        if self.prompts_per_device < 1 or self.heldout_per_device < 1 or self.prompts_per_round < 1:
            raise ValueError("prompts per device, held-out prompts and prompts per round must be >= 1")
        if not 0 < self.fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")
        if not 0 <= self.late_joiners < self.devices:
            raise ValueError("late joiners must be fewer than the devices")
        shares = self.target_shares()
        if not shares or any(v <= 0 for v in shares.values()):
            raise ValueError("target shares must be > 0")
        self.aggregation.validate()
        self.release.validate()

    def target_shares(self) -> dict[str, float]:
        return self.targets or (TINY_TARGETS if self.models == "tiny" else REAL_TARGETS)


def _models(scenario: Scenario) -> tuple[str, dict[str, str]]:
    """(drafter, {target name: model}) for the scenario."""
    if scenario.models == "tiny":
        from omnidraft.shared import catalog
        from omnidraft.shared.tiny_models import ensure_tiny_fleet

        dirs = ensure_tiny_fleet(catalog.omnidraft_home() / "tiny")
        unknown = set(scenario.target_shares()) - set(dirs)
        if unknown:
            raise ValueError(f"tiny models have no target {sorted(unknown)[0]!r} (choose tiny-target-a, tiny-target-b)")
        return str(dirs["tiny-drafter"]), {t: str(dirs[t]) for t in scenario.target_shares()}
    return REAL_DRAFTER, {t: t for t in scenario.target_shares()}


def _prompts(scenario: Scenario) -> list[str]:
    if scenario.models == "tiny" and scenario.data is None:
        from omnidraft.shared.tiny_models import corpus

        return [t[:40] for t in corpus(4000, seed=scenario.seed + 5)]
    from omnidraft.shared.bench import load_prompts

    return load_prompts(scenario.data or "humaneval", None)


def assign_targets(shares: dict[str, float], devices: int) -> list[str]:
    """Each device's target, by largest remainder of the shares (deterministic)."""
    total = sum(shares.values())
    exact = {t: devices * s / total for t, s in shares.items()}
    counts = {t: int(v) for t, v in exact.items()}
    for t in sorted(exact, key=lambda t: counts[t] - exact[t])[: devices - sum(counts.values())]:
        counts[t] += 1
    # interleave so that any prefix of devices mixes the targets
    order: list[str] = []
    left = dict(counts)
    while len(order) < devices:
        for t in shares:
            if left[t]:
                order.append(t)
                left[t] -= 1
    return order


def prepare(scenario: Scenario, out: Path) -> list[DeviceProfile]:
    """Register the targets (first run only) and build every device's profile."""
    scenario.validate()
    drafter, models = _models(scenario)
    registry = TargetRegistry(out / "coordinator")
    for target, model in models.items():
        if target not in registry:
            registry.register(target, model, drafter, LoraSpec(rank=scenario.lora_rank), seed=scenario.seed)
    prompts = _prompts(scenario)
    per = scenario.prompts_per_device + scenario.heldout_per_device
    profiles = []
    for i, target in enumerate(assign_targets(scenario.target_shares(), scenario.devices)):
        local = [prompts[(i * per + j) % len(prompts)] for j in range(per)]
        profiles.append(DeviceProfile(
            device_id=f"device-{i:04d}", target=target, target_model=models[target], drafter=drafter,
            prompts=local[: scenario.prompts_per_device], heldout=local[scenario.prompts_per_device:],
            state_dir=out / "devices" / f"device-{i:04d}", prompts_per_round=scenario.prompts_per_round,
            generation=GenerationConfig(max_new_tokens=scenario.max_new_tokens),
            online=OnlineConfig(interval=scenario.prompts_per_round, lr=scenario.lr),
            translate=scenario.translate,
            joins_at_round=scenario.rounds if i >= scenario.devices - scenario.late_joiners else 1))
    return profiles


_POOLS: dict[tuple, EnginePool] = {}  # per worker process: base models loaded once


def device_factory(profiles: list[DeviceProfile], dtype: str, drafter_weights: str):
    """``Context -> FleetDevice`` for simulation (partition-id indexes ``profiles``)."""

    def device_for(context) -> FleetDevice:
        key = (dtype, drafter_weights)
        if key not in _POOLS:
            _POOLS[key] = EnginePool(dtype, drafter_weights)
        return FleetDevice(profiles[int(context.node_config["partition-id"])], _POOLS[key])

    return device_for


def run(scenario: Scenario, out: Path, on_round=None, mods=()) -> list[DeviceProfile]:
    """Prepare and run the federation; ``on_round`` gets one metrics dict per round and target."""
    out = Path(out)
    profiles = prepare(scenario, out)
    config = FleetConfig(rounds=scenario.rounds, fraction=scenario.fraction,
                         min_devices=scenario.devices, wait_s=120, seed=scenario.seed,
                         aggregation=scenario.aggregation, release=scenario.release)
    weights = "fp32" if scenario.models == "tiny" else "int8"
    client = make_client_app(device_factory(profiles, scenario.dtype, weights), mods=mods)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_federation(make_server_app(out / "coordinator", config, on_round), client, scenario.devices,
                   cpus_per_device=scenario.cpus_per_device, ray_address=scenario.ray_address)
    return profiles
