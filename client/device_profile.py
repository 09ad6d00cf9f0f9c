"""Who a fleet device is and what it holds locally: ``DeviceProfile`` (its target, drafter,
local prompts, generation and learning settings, the owner's resource limits), kept in
``<state_dir>/profile.json``, the device's own directory and the only place its text is kept."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.resource_policy import ResourcePolicy
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.learning.distill import LossConfig
from omnidraft.shared.util.atomic_io import write_bytes_atomic

PROFILE_FILE = "profile.json"


@dataclass
class DeviceProfile:
    """Who a device is and what it holds locally (``prompts``/``heldout`` never leave it).

    ``offers``: other targets the device can run ({registry name: model}); the coordinator
    may move it to one of them during a staged rollout (``FleetDevice.switch``). From
    ``drift_round`` on its traffic comes from ``drift_prompts`` / ``drift_heldout`` (a domain
    drift). A ``probe`` device never trains:
    it only evaluates global states (a fixed panel that makes rounds comparable)."""

    device_id: str
    target: str  # registry name of the target it serves
    target_model: str  # catalog name or directory the target loads from
    drafter: str
    prompts: list[str]
    heldout: list[str]
    state_dir: Path
    prompts_per_round: int = 4
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=32))
    online: OnlineConfig = field(default_factory=lambda: OnlineConfig(interval=4))
    translate: str = "ngram"
    joins_at_round: int = 1  # the device is not part of the fleet before this round
    probe: bool = False
    offers: dict[str, str] = field(default_factory=dict)
    speed_prompts: int = 0  # held-out prompts an evaluation decodes adaptively, timed (0: all)
    drift_round: int | None = None
    drift_prompts: list[str] = field(default_factory=list)
    drift_heldout: list[str] = field(default_factory=list)
    fleet_key: str = ""  # the coordinator's Ed25519 public key(s), hex, comma-separated ("": no check)
    state_key: str = ""  # key file that encrypts the device state at rest ("": not encrypted)
    policy: ResourcePolicy = field(default_factory=ResourcePolicy)  # the owner's limits
    project: str = ""  # simulations: the codebase the device's user works in ("": not one project)
    # simulations: where the target's greedy decodes are recorded (``recordings``): a learning
    # decode of a prompt recorded before replays it, at the drafter's cost ("": the target always runs)
    recordings: str = ""

    @property
    def speed_heldout(self) -> list[str]:
        """The held-out prompts an evaluation decodes adaptively (a probe: timed and live)."""
        return self.heldout[: self.speed_prompts or len(self.heldout)]

    def at_round(self, round_: int) -> DeviceProfile:
        """The device as it is at ``round_`` (domain drift applied)."""
        out = self
        if self.drift_round is not None and round_ >= self.drift_round and self.drift_prompts:
            out = replace(out, prompts=self.drift_prompts, heldout=self.drift_heldout or self.heldout)
        return out

    # -- on disk: the device's own directory is the only place its text is kept ----------------
    def save(self) -> Path:
        """Write ``<state_dir>/profile.json`` atomically; returns its path."""
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        path = Path(self.state_dir) / PROFILE_FILE
        write_bytes_atomic(path, json.dumps(data).encode())
        return path

    @classmethod
    def load(cls, state_dir: str | Path) -> DeviceProfile:
        """The saved profile; keys this version does not know (written by another version) are
        ignored."""
        data = json.loads((Path(state_dir) / PROFILE_FILE).read_text())
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        gen = data.pop("generation")
        gen["stop_strings"] = tuple(gen.get("stop_strings", ()))
        online = data.pop("online")
        online["loss"] = LossConfig(**online.get("loss", {}))
        data["policy"] = ResourcePolicy(**data.get("policy", {}))
        return cls(
            **{
                **data,
                "state_dir": Path(data["state_dir"]),
                "generation": GenerationConfig(**gen),
                "online": OnlineConfig(**online),
            }
        )


_PROFILES: dict[str, tuple[int, DeviceProfile]] = {}


def cached_profile(state_dir: str | Path) -> DeviceProfile:
    """``DeviceProfile.load(state_dir)``, read again only when the file changed (a switch in
    another worker process rewrites it)."""
    key = os.path.abspath(state_dir)
    stamp = os.stat(os.path.join(key, PROFILE_FILE)).st_mtime_ns
    held = _PROFILES.get(key)
    if held is None or held[0] != stamp:
        held = _PROFILES[key] = (stamp, DeviceProfile.load(state_dir))
    return held[1]
