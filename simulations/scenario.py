"""A simulated fleet: targets registered with a coordinator, devices with local data, and the
Flower apps that connect them, run on Flower's Simulation Engine.

``Scenario`` says what to simulate (CLI flags or a TOML file, ``Scenario.from_toml``);
``fleet_setup.prepare(scenario, out)`` registers the targets under ``out/coordinator`` and writes one
``DeviceProfile`` per device under ``out/devices/<id>/`` (the only place its text is kept);
``run(scenario, out, on_round)`` runs the federation as a Flower App (``flower_app``) with
``flwr run`` on a local SuperLink (``flower_runner``).

* Devices are assigned to targets by the ``targets`` shares (interleaved, deterministic); their
  local prompts are disjoint shares of the corpus whose mix of sources is drawn from
  Dirichlet(``alpha``), or with ``data = "codebases"`` one project's functions per device,
  projects drawn by popularity, late joiners from known projects and one unseen project
  (``simulations.data``).
* ``probes`` devices per target never train: they evaluate every round's global state on the
  same held-out prompts (and the starting state as round 0), so rounds are comparable.
* Events: ``late_joiners`` devices join at ``join_round``; ``rollout`` is the operator's
  ``omnidraft fleet rollout TARGET --fraction SHARE`` before a round (every device can run the
  new target; the coordinator moves that share of them); ``rollback`` is ``omnidraft fleet
  rollback TARGET`` before a round; ``drift`` moves every device's traffic (and the probes'
  held-out prompts) to another source from a round on.

Workers never receive the devices' data through Flower or Ray: a device's profile is read from
its own directory in the worker process, and base models are loaded once per worker
(``flower_app.device_for``).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from omnidraft.client.device_profile import DeviceProfile
from omnidraft.coordinator.aggregation import AggregationConfig
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import ReleaseConfig
from omnidraft.coordinator.registry import TargetRegistry
from omnidraft.coordinator.secure_aggregation import SecAggConfig
from omnidraft.coordinator.server_opt import ServerOptConfig
from omnidraft.shared.engine.generation import DRAFT_STOPS

REAL_DRAFTER = "smollm2-135m"
REAL_TARGETS = {"qwen2.5-coder-0.5b": 0.5, "gemma3-270m": 0.5}
TINY_TARGETS = {"tiny-target-a": 0.5, "tiny-target-b": 0.5}


def parse_targets(text: str) -> dict[str, float]:
    """``name:share,name:share`` (shares default to 1)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, share = part.partition(":")
        try:
            out[name] = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"targets: bad share in {part!r} (expected NAME:NUMBER)") from None
    if not out:
        raise ValueError("targets names no target")
    return out


@dataclass
class Rollout:
    """Before ``round``, the operator rolls ``target`` (registered up front) out to a ``share``
    of the devices (``TargetRegistry.rollout``)."""

    target: str
    round: int
    share: float

    @classmethod
    def parse(cls, text: str) -> Rollout:
        """``TARGET@ROUND:SHARE``, e.g. ``qwen2.5-coder-1.5b@3:0.3``."""
        try:
            target, _, rest = text.partition("@")
            rnd, _, share = rest.partition(":")
            return cls(target, int(rnd), float(share))
        except ValueError:
            raise ValueError(
                f"--rollout {text!r}: expected TARGET@ROUND:SHARE, e.g. qwen2.5-coder-1.5b@3:0.3"
            ) from None


def _name_at_round(text: str, option: str, expected: str) -> tuple[str, int]:
    """``NAME@ROUND`` → (name, round); one-line ValueError naming ``option`` otherwise."""
    name, _, rnd = text.partition("@")
    try:
        return name, int(rnd)
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected {expected}") from None


@dataclass
class Rollback:
    """Before ``round``, the operator restores ``target``'s previous global state
    (``TargetRegistry.rollback``)."""

    target: str
    round: int

    @classmethod
    def parse(cls, text: str) -> Rollback:
        """``TARGET@ROUND``, e.g. ``qwen2.5-coder-1.5b@5``."""
        return cls(*_name_at_round(text, "--rollback", "TARGET@ROUND, e.g. qwen2.5-coder-1.5b@5"))


@dataclass
class Drift:
    """From ``round`` on, every device's traffic comes from ``source`` (held out of the
    first-phase split)."""

    source: str
    round: int

    @classmethod
    def parse(cls, text: str) -> Drift:
        """``SOURCE@ROUND``, e.g. ``pydoc@4``."""
        return cls(*_name_at_round(text, "--drift", "SOURCE@ROUND, e.g. pydoc@4"))


@dataclass
class Scenario:
    """What to simulate (sizes in devices, prompts and tokens; rounds count from 1)."""

    models: str = "real"  # real (catalog models) | tiny (built on the spot, for tests and scale)
    devices: int = 10  # devices that train (the probes come in addition)
    rounds: int = 3
    fraction: float = 1.0  # share of the joined devices sampled to train per round
    targets: dict[str, float] | None = None  # registry name -> share of devices (None: the models' default)
    # comma list of humaneval,stdlib,pydoc,codebase:<package>, or codebases (one project per
    # device), or PATH.jsonl (None: humaneval,stdlib,pydoc, or the tiny corpus)
    data: str | None = None
    alpha: float = 0.5  # Dirichlet concentration of each device's mix of sources (small: skewed)
    # codebases with fewer prompts than devices x prompts per device: devices beyond a project's
    # disjoint stretches share its code (teammates; data.split_projects), instead of an error
    share_projects: bool = False
    prompts_per_device: int = 8
    heldout_per_device: int = 2
    prompts_per_round: int = 4
    max_new_tokens: int = 32
    probes: int = 2  # evaluation-only devices per target
    probe_heldout: int = 4  # held-out prompts per probe device (fixed-k acceptance)
    probe_speed_prompts: int = 0  # of them, decoded adaptively and timed every round (0: all)
    newcomer_evals: int = 2  # per target and round, new devices measured warm and cold
    late_joiners: int = 0
    join_round: int | None = None  # the late joiners' round (None: the last round)
    rollout: Rollout | None = None
    rollback: Rollback | None = None
    drift: Drift | None = None
    lora_rank: int = 8
    ffa: bool = False  # FFA-LoRA: A frozen, only B trained, so averaging is exact
    secagg: bool = False  # adapters summed with Flower's SecAgg+ (the coordinator sees only the mean)
    lr: float = 1e-3
    local_epochs: int = 1  # passes over a round's samples on the device
    translate: str = "ngram"
    dtype: str = "fp32"
    # "auto": the throughput rule (the machine's cached cost profile and counted acceptance:
    # deterministic once the profile is cached; every worker uses the same one); "confidence":
    # the drafter's confidence threshold, every round drafts
    draft_stop: str = "auto"
    measure_ar: bool = True  # probes also run the target alone (speedup)
    # training devices (and newcomers' held-out outputs) replay the target's greedy decode of a
    # prompt recorded before, in this run or an earlier one on this machine (shared.recordings):
    # the same decisions, acceptance and training, at the drafter's cost; their speed is modelled.
    # Probes' adaptive decodes always run the real target (the live panel).
    replay: bool = True
    acceptance_k: int = 4  # probes and newcomers also decode drafting exactly this many tokens (0: not)
    seed: int = 0
    cpus_per_device: int = 1  # CPUs (and torch threads) per simulated device; Flower takes whole CPUs
    ray_address: str | None = None
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    # fault injection: attack kind -> share of the training devices that behave so (simulations.attacks)
    attacks: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        if self.models not in ("real", "tiny"):
            raise ValueError("models must be real or tiny")
        if self.devices < 1 or self.rounds < 1:
            raise ValueError("devices and rounds must be >= 1")
        if self.prompts_per_device < 1 or self.heldout_per_device < 1 or self.prompts_per_round < 1:
            raise ValueError("prompts per device, held-out prompts and prompts per round must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("max new tokens must be >= 1")
        if self.cpus_per_device < 1:
            raise ValueError("cpus per device must be >= 1")
        if self.local_epochs < 1:
            raise ValueError("local epochs must be >= 1")
        if self.acceptance_k < 0:
            raise ValueError("the fixed draft length (acceptance_k) must be >= 0 (0: not measured)")
        if not 0 < self.fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")
        if self.alpha <= 0:
            raise ValueError("alpha must be > 0")
        if self.probe_heldout < 1:
            raise ValueError("probe held-out prompts must be >= 1")
        if not 0 <= self.probe_speed_prompts <= self.probe_heldout:
            raise ValueError("probe speed prompts must be in 0..probe_heldout (0: all of them)")
        if self.probes < 0 or self.newcomer_evals < 0:
            raise ValueError("probes and newcomer evaluations must be >= 0")
        if not 0 <= self.late_joiners < self.devices:
            raise ValueError("late joiners must be fewer than the devices")
        if self.join_round is not None and not 1 <= self.join_round <= self.rounds:
            raise ValueError(f"the join round must be in 1..{self.rounds}")
        if self.attacks:
            from omnidraft.simulations.attacks import assign, parse_attacks

            parse_attacks([f"{k}:{v}" for k, v in self.attacks.items()])
            assign(self.attacks, self.devices - self.late_joiners, self.seed)
        if self.draft_stop not in DRAFT_STOPS:
            raise ValueError(f"draft stop must be one of {', '.join(DRAFT_STOPS)}")
        shares = self.target_shares()
        if not shares or any(v <= 0 for v in shares.values()):
            raise ValueError("target shares must be > 0")
        if self.rollout is not None:
            if not 2 <= self.rollout.round <= self.rounds:
                raise ValueError(f"the rollout round must be in 2..{self.rounds}")
            if not 0 < self.rollout.share <= 1:
                raise ValueError("the rollout share must be in (0, 1]")
            if self.rollout.target in shares:
                raise ValueError(f"rollout target {self.rollout.target!r} is already one of the targets")
        if self.rollback is not None:
            if not 2 <= self.rollback.round <= self.rounds:
                raise ValueError(f"the rollback round must be in 2..{self.rounds}")
            if self.rollback.target not in self.all_targets():
                raise ValueError(f"rollback target {self.rollback.target!r} is not one of the targets")
        if self.drift is not None and not 2 <= self.drift.round <= self.rounds:
            raise ValueError(f"the drift round must be in 2..{self.rounds}")
        self.aggregation.validate()
        self.server_opt.validate()
        self.release.validate()
        if self.secagg and self.aggregation.method != "fedavg":
            raise ValueError("SecAgg+ reveals only the weighted mean: use the fedavg aggregation with it")
        if self.secagg and self.aggregation.dp_noise > 0:
            raise ValueError(
                "--dp-noise clips updates on the coordinator, which SecAgg+ never shows it: use one or the other"
            )

    def target_shares(self) -> dict[str, float]:
        return self.targets or (TINY_TARGETS if self.models == "tiny" else REAL_TARGETS)

    def all_targets(self) -> list[str]:
        return [*self.target_shares(), *([self.rollout.target] if self.rollout else [])]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["targets"] = self.target_shares()
        return out

    @classmethod
    def from_toml(cls, path: str | Path) -> Scenario:
        """A scenario from a TOML file (see ``from_dict``)."""
        return cls.from_dict(load_toml(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "scenario") -> Scenario:
        """Keys as the fields; ``rollout``, ``rollback``, ``drift`` and ``aggregation`` may be tables, and
        ``privacy`` a table of ``ReleaseConfig`` fields (``noise`` for ``noise_multiplier``)."""
        raw = dict(raw)
        names = {f.name for f in fields(cls)} | {"privacy"}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"{source}: unknown key {unknown[0]!r}")
        try:
            if isinstance(raw.get("targets"), str):
                raw["targets"] = parse_targets(raw["targets"])
            if isinstance(raw.get("rollout"), (dict, str)):
                r = raw["rollout"]
                raw["rollout"] = Rollout.parse(r) if isinstance(r, str) else Rollout(**r)
            if isinstance(raw.get("rollback"), (dict, str)):
                b = raw["rollback"]
                raw["rollback"] = Rollback.parse(b) if isinstance(b, str) else Rollback(**b)
            if isinstance(raw.get("drift"), (dict, str)):
                d = raw["drift"]
                raw["drift"] = Drift.parse(d) if isinstance(d, str) else Drift(**d)
            if isinstance(raw.get("aggregation"), dict):
                raw["aggregation"] = AggregationConfig(**raw["aggregation"])
            if isinstance(raw.get("server_opt"), dict):
                raw["server_opt"] = ServerOptConfig(**raw["server_opt"])
            privacy = raw.pop("privacy", None)
            if isinstance(privacy, dict):
                privacy = dict(privacy)
                if "noise" in privacy:
                    privacy["noise_multiplier"] = privacy.pop("noise")
                raw["release"] = ReleaseConfig(**privacy)
            elif isinstance(raw.get("release"), dict):
                raw["release"] = ReleaseConfig(**raw["release"])
            _check_types(raw, source)
            return cls(**raw)
        except TypeError as exc:
            raise ValueError(f"{source}: {exc}") from None


_OPTIONAL_TYPES = {"data": str, "join_round": int, "ray_address": str}


def _check_types(raw: dict, source: str) -> None:
    """Scalar settings must have their default's type (an int is a valid float)."""
    defaults = Scenario()
    for key, value in raw.items():
        default = getattr(defaults, key, None)
        want = _OPTIONAL_TYPES.get(key) or (type(default) if isinstance(default, (bool, int, float, str)) else None)
        if want is None or (value is None and key in _OPTIONAL_TYPES):
            continue
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"{source}: {key} must be a {want.__name__}, not {value!r}")


def load_toml(path: str | Path) -> dict:
    """A scenario file's keys (one-line ``ValueError`` when it cannot be read or parsed)."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"scenario file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"scenario file {path}: {exc}") from None


def operator_actions(scenario: Scenario):
    """``before_round(round, registry)`` for the coordinator: the scenario's rollout and
    rollback, done as ``omnidraft fleet rollout|rollback`` would do them. Both are safe to run
    again when a restarted coordinator resumes the round (a rollout sets a share; a rollback is
    recorded with its round and not repeated)."""

    def before_round(rnd: int, registry: TargetRegistry) -> None:
        if scenario.rollout is not None and rnd == scenario.rollout.round:
            registry.rollout(scenario.rollout.target, scenario.rollout.share)
        if scenario.rollback is not None and rnd == scenario.rollback.round:
            registry.rollback(scenario.rollback.target, before_round=rnd)

    return before_round


def fleet_config(scenario: Scenario, nodes: int) -> FleetConfig:
    """The coordinator's settings for ``scenario`` on ``nodes`` devices: one reply weighs at most
    what a round asks of a device (every local prompt, each at most ``max_new_tokens``)."""
    aggregation = replace(
        scenario.aggregation, max_trained_tokens=float(scenario.prompts_per_round * scenario.max_new_tokens)
    )
    return FleetConfig(
        rounds=scenario.rounds,
        fraction=scenario.fraction,
        min_devices=nodes,
        wait_s=300,
        seed=scenario.seed,
        measure_ar=scenario.measure_ar,
        newcomer_evals=scenario.newcomer_evals,
        fixed_k=scenario.acceptance_k,
        newcomer_speed=scenario.replay,
        announce_recordings=scenario.replay,
        server_opt=scenario.server_opt,
        aggregation=aggregation,
        release=scenario.release,
        secagg=SecAggConfig(enabled=scenario.secagg),
    )


def run(
    scenario: Scenario, out: Path, on_round=None, mods=(), progress=None, verbose: bool = False, coordinator_hooks=()
) -> list[DeviceProfile]:
    """Prepare the fleet under ``out`` and run it as the Flower App (``simulations.flower_app``)
    through ``flwr run`` on a private local SuperLink (``simulations.flower_runner``).

    ``on_round`` gets one metrics dict per round and target as the coordinator records it,
    ``progress(round, replies, messages)`` is called as replies arrive; ``mods``: extra ClientApp
    mods (importable by name in the workers); ``coordinator_hooks``: functions called with the
    ``Coordinator`` in the ServerApp's process before its rounds. A failed run raises
    ``FlowerRunError``."""
    from omnidraft.shared.util.atomic_io import write_bytes_atomic
    from omnidraft.simulations import flower_app
    from omnidraft.simulations.flower_runner import FlowerRunError, run_app

    app = APP_DIR / "pyproject.toml"
    if not app.is_file() or "[tool.flwr.app]" not in app.read_text(encoding="utf-8"):
        raise ValueError(f"the simulated fleet runs from a checkout of the repository: {app} is not its Flower App")
    out = Path(out).resolve()
    from omnidraft.simulations.fleet_setup import prepare  # it builds on this module's Scenario

    profiles = prepare(scenario, out)
    write_bytes_atomic(out / flower_app.SCENARIO_FILE, json.dumps(scenario.to_dict(), default=str).encode())
    for stale in (flower_app.OUTCOME_FILE, flower_app.PROGRESS_FILE):
        (out / stale).unlink(missing_ok=True)
    follow = flower_app.RunFollower(out, on_round, progress)
    if scenario.attacks:
        from omnidraft.simulations.attacks import attack_mod

        mods = (*mods, attack_mod)
    run_app(
        APP_DIR,
        flower_app.run_config(out, tuple(mods), tuple(coordinator_hooks)),
        len(profiles),
        out / "flwr",
        cpus_per_device=scenario.cpus_per_device,
        ray_address=scenario.ray_address,
        verbose=verbose,
        watch=follow,
    )
    outcome = out / flower_app.OUTCOME_FILE
    result = (
        json.loads(outcome.read_text()) if outcome.exists() else {"status": "failed", "error": "no outcome recorded"}
    )
    if result["status"] != "finished":
        raise FlowerRunError(f"the simulated fleet failed: {result['error']} (see {out / 'flwr' / 'flower.log'})")
    return profiles


# the Flower App: the repository's pyproject.toml ([tool.flwr.app]); simulations/ sits beside it
APP_DIR = Path(__file__).resolve().parent.parent
