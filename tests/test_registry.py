"""The coordinator's target registry on the tiny fleet (conftest's ``tiny``): versions,
checksums and signed manifests, concurrent commits and rollbacks that never write a version
twice, the privacy ledger charged once per committed round, rollbacks (an operator's, and a
scenario's scheduled one that a resumed round does not repeat), and the ``fleet`` commands that
register a target, print the public key, roll out, roll back and report status."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from omnidraft.coordinator.ngram_release import NgramRelease, ReleaseConfig
from omnidraft.coordinator.registry import RegistryError, TargetRegistry
from omnidraft.shared.learning.adapters import LoraSpec

pytestmark = pytest.mark.usefixtures("flower_task")  # hand-made Messages need a task identity


def test_registry_versions_checksums_and_errors(tmp_path, tiny):
    reg = TargetRegistry(tmp_path / "coord")
    m0 = reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    assert m0.version == 0 and reg.names() == ["tiny-target-a"]
    state = reg.load("tiny-target-a")
    assert all(torch.count_nonzero(v) == 0 for k, v in state.adapter.items() if "lora_B" in k)
    # the global cache carries released n-grams only: what the tokenizers imply is built on the devices
    assert len(state.cache()) == 0 and len(reg.candidates("tiny-target-a")) > 0
    m1 = reg.commit("tiny-target-a", state.adapter, state.cache(), round_=1, devices=3, tokens=90)
    assert (m1.version, m1.devices_total, m1.tokens_total) == (1, 3, 90)
    files = sorted(p.name for p in (tmp_path / "coord" / "targets" / "tiny-target-a").iterdir())
    assert {"adapter-v0.safetensors", "adapter-v1.safetensors", "manifest-v1.pb", "manifest-v1.sig"} <= set(files)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]))
    with pytest.raises(RegistryError, match="unknown target"):
        reg.load("nope")
    with pytest.raises(RegistryError, match="bad target name"):
        reg.register("a b", "x", "y")
    (tmp_path / "coord" / "targets" / "tiny-target-a" / "adapter-v1.safetensors").write_bytes(b"garbage")
    with pytest.raises(RegistryError, match="checksum"):
        reg.load("tiny-target-a")


def test_concurrent_commits_and_rollbacks_never_write_a_version_twice(tmp_path, tiny):
    """A `fleet rollback` (another process) while a round commits: each takes the target's lock,
    so the versions written are 1..N with no number written twice."""
    import multiprocessing as mp

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    reg.commit("tiny-target-a", state.adapter, state.cache(), round_=1, devices=1, tokens=1)
    ctx = mp.get_context("spawn")
    rollbacks = ctx.Process(target=_rollback_many, args=(str(tmp_path / "coord"), 6))
    rollbacks.start()
    for rnd in range(2, 8):
        reg.commit("tiny-target-a", state.adapter, state.cache(), round_=rnd, devices=1, tokens=1)
    rollbacks.join(120)
    assert rollbacks.exitcode == 0
    assert reg.manifest("tiny-target-a").version == 1 + 6 + 6  # every commit and every rollback got its own version
    from omnidraft.proto import fleet_pb2

    kept = reg.versions("tiny-target-a")
    for v in kept:  # each kept version's files match its own manifest
        m = fleet_pb2.StateManifest()
        m.ParseFromString((tmp_path / "coord" / "targets" / "tiny-target-a" / f"manifest-v{v}.pb").read_bytes())
        assert m.version == v and m.parent_version == v - 1


def test_privacy_is_charged_once_per_committed_round_and_never_rolled_back(tmp_path, tiny):
    """The ledger is written with the version it accounts for: a coordinator killed after a
    release and before the commit reruns the round from the last committed ledger (charged once),
    and a rollback carries the ledger forward."""
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    cfg = ReleaseConfig(k=1)
    maps = [np.ones(8, bool) for _ in range(3)]

    def one_round(rnd: int, commit: bool) -> None:
        release = NgramRelease(cfg, reg.privacy_ledger("tiny-target-a"))
        release.release(maps)
        if commit:
            reg.commit(
                "tiny-target-a",
                state.adapter,
                state.cache(),
                round_=rnd,
                devices=3,
                tokens=3,
                privacy_ledger=release.ledger(),
            )

    assert reg.privacy_ledger("tiny-target-a") is None
    one_round(1, commit=True)
    eps1 = NgramRelease(cfg, reg.privacy_ledger("tiny-target-a")).epsilon()
    one_round(2, commit=False)  # killed after the release, before the commit
    assert NgramRelease(cfg, reg.privacy_ledger("tiny-target-a")).epsilon() == pytest.approx(eps1)
    one_round(2, commit=True)  # the rerun
    ledger = NgramRelease(cfg, reg.privacy_ledger("tiny-target-a"))
    assert ledger.accountant.num_releases == 2 and ledger.epsilon() > eps1
    reg.rollback("tiny-target-a")  # the state goes back; the privacy spent does not
    assert NgramRelease(cfg, reg.privacy_ledger("tiny-target-a")).epsilon() == pytest.approx(ledger.epsilon())


def _rollback_many(root: str, n: int) -> None:
    reg = TargetRegistry(Path(root))
    for _ in range(n):
        reg.rollback("tiny-target-a")


def test_rollback_republishes_an_earlier_state_as_a_new_version(tmp_path, tiny):
    from omnidraft.cli import main
    from omnidraft.coordinator.registry import KEEP_VERSIONS

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    shas = [reg.manifest("tiny-target-a").adapter_sha256]
    for v in range(1, 4):
        adapter = {k: t + v for k, t in state.adapter.items()}
        shas.append(
            reg.commit(
                "tiny-target-a",
                adapter,
                state.cache(),
                round_=v,
                devices=1,
                tokens=10,
                server_state={"step": torch.tensor(float(v))},
            ).adapter_sha256
        )
    assert float(reg.server_state("tiny-target-a")["step"]) == 3  # the server optimizer's, with version 3
    m = reg.rollback("tiny-target-a")  # to version 2
    assert (m.version, m.parent_version, m.restored_from, m.adapter_sha256) == (4, 3, 2, shas[2])
    assert reg.server_state("tiny-target-a") == {}  # a restored state starts the server optimizer afresh
    assert reg.load("tiny-target-a").adapter_blob and reg.load("tiny-target-a").signature
    root = str(tmp_path / "coord")
    assert main(["fleet", "rollback", "tiny-target-a", "--to", "0", "--root", root]) == 0
    assert reg.manifest("tiny-target-a").adapter_sha256 == shas[0] and reg.manifest("tiny-target-a").version == 5
    assert reg.versions("tiny-target-a") == list(range(6 - KEEP_VERSIONS, 6))
    assert main(["fleet", "rollback", "tiny-target-a", "--to", "0", "--root", root]) == 2  # no longer kept
    assert main(["fleet", "rollback", "tiny-target-a", "--to", "9", "--root", root]) == 2
    with pytest.raises(RegistryError, match="roll back to"):
        reg.rollback("tiny-target-a", to=5)


def test_a_scheduled_rollback_is_not_repeated_when_its_round_is_resumed(tmp_path, tiny):
    """A scenario's rollback before round 3, replayed by a coordinator that resumes round 3
    (killed after the rollback, before or after the round's commit), publishes nothing more."""
    from omnidraft.simulations.scenario import Rollback, Scenario, operator_actions

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    for v in (1, 2):
        reg.commit(
            "tiny-target-a", {k: t + v for k, t in state.adapter.items()}, state.cache(), round_=v, devices=1, tokens=10
        )
    actions = operator_actions(Scenario(rollback=Rollback("tiny-target-a", 3)))
    actions(3, reg)
    rolled = reg.manifest("tiny-target-a")
    assert (rolled.version, rolled.restored_from, rolled.scheduled_before_round) == (3, 1, 3)
    actions(3, reg)  # resumed before the round's commit
    assert reg.manifest("tiny-target-a") == rolled
    reg.commit("tiny-target-a", state.adapter, state.cache(), round_=3, devices=1, tokens=10)
    actions(3, reg)  # resumed after the round's commit: the rollback is found among the kept versions
    assert reg.manifest("tiny-target-a").version == 4 and not reg.manifest("tiny-target-a").HasField("restored_from")
    actions(2, reg), actions(4, reg)  # other rounds: nothing scheduled
    assert reg.versions("tiny-target-a")[-1] == 4
    assert reg.rollback("tiny-target-a").version == 5  # an operator's own rollback is never deduplicated


def test_fleet_cli_register_and_status(tmp_path, tiny, capsys):
    from omnidraft.cli import main

    root = str(tmp_path / "c")
    args = [
        "fleet",
        "register-target",
        "tiny-target-b",
        "--model",
        str(tiny["tiny-target-b"]),
        "--drafter",
        str(tiny["tiny-drafter"]),
        "--lora-rank",
        "2",
        "--root",
        root,
    ]
    assert main(args) == 0
    assert main(args) == 2  # already registered: one-line error
    assert main(["fleet", "status", "--root", root, "--json"]) == 0
    assert main(["fleet", "register-target", "x y", "--model", "m", "--root", root]) == 2
    capsys.readouterr()
    assert main(["fleet", "public-key", "--root", root]) == 0
    assert (
        capsys.readouterr().out.strip() == TargetRegistry(root).public_key()
        and len(TargetRegistry(root).public_key()) == 64
    )
    # an operator's view after two rounds, a staged rollout and a rollback
    registry = TargetRegistry(root)
    state = registry.load("tiny-target-b")
    for rnd in (1, 2):
        registry.commit("tiny-target-b", state.adapter, state.cache(), round_=rnd, devices=3, tokens=100)
    rounds = [
        {"round": 0, "target": "tiny-target-b", "eval-acceptance": 0.2},
        {
            "round": 1,
            "target": "tiny-target-b",
            "sampled": 3,
            "aggregated": 2,
            "devices": 7,
            "uplink-bytes-per-device": 1000.0,
            "downlink-bytes-per-device": 500.0,
            "eval-acceptance": 0.25,
            "cache-entries": 40,
        },
        {
            "round": 2,
            "target": "tiny-target-b",
            "sampled": 3,
            "aggregated": 3,
            "devices": 8,
            "uplink-bytes-per-device": 1000.0,
            "downlink-bytes-per-device": 100.0,
            "eval-acceptance": 0.3,
            "cache-entries": 44,
        },
    ]
    (tmp_path / "c" / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    assert main(["fleet", "rollout", "tiny-target-b", "--fraction", "0.25", "--root", root]) == 0
    assert main(["fleet", "rollback", "tiny-target-b", "--root", root]) == 0
    assert main(["fleet", "rollout", "tiny-target-b", "--fraction", "1.5", "--root", root]) == 2
    capsys.readouterr()
    assert main(["fleet", "status", "--root", root, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["targets"][0]
    assert row["version"] == 3 and row["restored_from"] == 1 and row["rollout_fraction"] == 0.25
    assert row["rounds"] == 2 and row["devices"] == 8 and row["cache_entries"] == 44
    assert row["acceptance_trend"] == [0.2, 0.25, 0.3]
    assert row["bytes_moved"] == 2 * 1000 + 3 * 500 + 3 * 1000 + 3 * 100
    assert main(["fleet", "status", "--root", root]) == 0
    table = capsys.readouterr().out
    assert "v3<-v1" in table and "25%" in table and "0.20 0.25 0.30" in table
