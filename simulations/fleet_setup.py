"""Setting a simulated fleet up on disk before a run: ``prepare(scenario, out)`` registers the
targets under ``out/coordinator`` (first run only) and writes one ``DeviceProfile`` per device
under ``out/devices/<id>/``, the only place a device's text is kept. Devices are assigned to
targets by the scenario's shares (``assign_targets``) and get disjoint shares of its corpus
(a Dirichlet mix of sources, or one project's functions per device: ``simulations.data``)."""

from __future__ import annotations

from pathlib import Path

from omnidraft.client.device_profile import DeviceProfile
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.coordinator.registry import TargetRegistry
from omnidraft.shared.engine import catalog
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.learning.adapters import LoraSpec
from omnidraft.simulations.scenario import REAL_DRAFTER, Scenario


def _models(scenario: Scenario) -> tuple[str, dict[str, str]]:
    """(drafter, {target name: model}) for the scenario."""
    if scenario.models == "tiny":
        from omnidraft.benchmarks.tiny_models import ensure_tiny_fleet

        dirs = ensure_tiny_fleet(catalog.omnidraft_home() / "tiny")
        unknown = set(scenario.all_targets()) - set(dirs)
        if unknown:
            raise ValueError(f"tiny models have no target {sorted(unknown)[0]!r} (choose tiny-target-a, tiny-target-b)")
        return str(dirs["tiny-drafter"]), {t: str(dirs[t]) for t in scenario.all_targets()}
    return REAL_DRAFTER, {t: t for t in scenario.all_targets()}


def _corpora(scenario: Scenario, devices: int, newcomers: frozenset[int] = frozenset()):
    """(first-phase corpus, each device's indices into it, each device's project or None (for
    codebases: ``data.split_projects``; ``newcomers`` are the late joiners' indices), drift
    corpus and indices or None)."""
    from omnidraft.simulations import data

    per = scenario.prompts_per_device + max(scenario.heldout_per_device, scenario.probe_heldout)
    if scenario.models == "tiny" and scenario.data is None:
        from omnidraft.benchmarks.tiny_models import corpus

        texts = [
            t[:40] for t in corpus(max(4000, devices * per * (2 if scenario.drift else 1)), seed=scenario.seed + 5)
        ]
        half = len(texts) // 2 if scenario.drift else len(texts)
        main = data.Corpus(texts[:half], [""] * half)
        drift = data.Corpus(texts[half:], [""] * (len(texts) - half)) if scenario.drift else None
    else:
        full = data.load_corpus(scenario.data)
        if scenario.drift is None:
            main, drift = full, None
        else:
            drift = data.load_corpus(scenario.drift.source)
            drift_set = set(drift.prompts)
            keep = [i for i, p in enumerate(full.prompts) if p not in drift_set]
            main = data.Corpus([full.prompts[i] for i in keep], [full.labels[i] for i in keep])
    projects = None
    if data.is_codebases(main):
        main_parts, projects = data.split_projects(
            main, devices, per, seed=scenario.seed, newcomers=newcomers, share=scenario.share_projects
        )
    else:
        main_parts = data.split(main, devices, per, alpha=scenario.alpha, seed=scenario.seed)
    drift_parts = data.split(drift, devices, per, alpha=scenario.alpha, seed=scenario.seed + 1) if drift else None
    return main, main_parts, projects, drift, drift_parts


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
    """Register the targets (first run only), build every device's profile and write it to the
    device's directory. Members come first (``device-0000`` ...), then the probes."""
    scenario.validate()
    drafter, models = _models(scenario)
    registry = TargetRegistry(out / "coordinator")
    for target, model in models.items():
        if target not in registry:
            registry.register(
                target, model, drafter, LoraSpec(rank=scenario.lora_rank, ffa=scenario.ffa), seed=scenario.seed
            )
    fleet_key = registry.public_key()  # every device pins the coordinator's signing key
    shares = scenario.target_shares()
    members = assign_targets(shares, scenario.devices)
    roles = [(t, False) for t in members] + [(t, True) for t in shares for _ in range(scenario.probes)]
    late = frozenset(range(scenario.devices - scenario.late_joiners, scenario.devices))
    main, parts, projects, drift, drift_parts = _corpora(scenario, len(roles), late)
    n = scenario.prompts_per_device
    join_round = scenario.join_round or scenario.rounds
    profiles = []
    for i, (target, probe) in enumerate(roles):
        local = [main.prompts[j] for j in parts[i]]
        name = f"device-{i:04d}"
        held = scenario.probe_heldout if probe else scenario.heldout_per_device
        p = DeviceProfile(
            device_id=name,
            target=target,
            target_model=models[target],
            drafter=drafter,
            prompts=local[:n],
            heldout=local[n : n + held],
            state_dir=out / "devices" / name,
            prompts_per_round=scenario.prompts_per_round,
            generation=GenerationConfig(max_new_tokens=scenario.max_new_tokens, draft_stop=scenario.draft_stop),
            online=OnlineConfig(interval=scenario.prompts_per_round, lr=scenario.lr, epochs=scenario.local_epochs),
            translate=scenario.translate,
            probe=probe,
            fleet_key=fleet_key,
            speed_prompts=scenario.probe_speed_prompts if probe else 0,
            joins_at_round=join_round if (not probe and i >= scenario.devices - scenario.late_joiners) else 1,
            project=projects[i] if projects else "",
            recordings=str(catalog.omnidraft_home() / "recordings") if scenario.replay else "",
        )
        if scenario.rollout is not None and not probe:  # every member can run the new target
            p.offers = {scenario.rollout.target: models[scenario.rollout.target]}
        if drift is not None:
            moved = [drift.prompts[j] for j in drift_parts[i]]
            p.drift_round = scenario.drift.round
            p.drift_prompts, p.drift_heldout = moved[:n], moved[n : n + held]
        p.save()
        profiles.append(p)
    if scenario.rollout is not None and scenario.probes:  # probes for the rolled-out target
        r = scenario.rollout
        for k in range(scenario.probes):
            base = profiles[len(members) + k]
            name = f"device-{len(profiles):04d}"
            p = DeviceProfile(
                **{
                    **base.__dict__,
                    "device_id": name,
                    "target": r.target,
                    "target_model": models[r.target],
                    "state_dir": out / "devices" / name,
                }
            )
            p.save()
            profiles.append(p)
    return profiles
