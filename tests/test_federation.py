"""Federations end to end on Flower's Simulation Engine with tiny models: a 6-device, 3-round
federation on two targets (one device sends NaN adapters, one crashes; late joiners evaluated
with and without the global state), a privacy audit of every payload a device sent, device
state that stays on the device, a coordinator killed or stopped anywhere in a round that
resumes without losing or repeating anything, and SecAgg+ summing adapters the coordinator
never sees. The module-scoped ``federation`` fixture runs the first once for the tests here."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from omnidraft.client.device_state import slug
from omnidraft.coordinator.aggregation import AggregationConfig
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import NgramRelease, ReleaseConfig
from omnidraft.coordinator.registry import TargetRegistry

TESTS = Path(__file__).resolve().parent


pytestmark = pytest.mark.usefixtures("flower_task")  # hand-made Messages need a task identity


def _scenario(**kw):
    from omnidraft.simulations.scenario import Scenario

    base = dict(
        models="tiny",
        devices=6,
        rounds=3,
        prompts_per_device=6,
        heldout_per_device=2,
        prompts_per_round=3,
        max_new_tokens=12,
        late_joiners=1,
        lora_rank=2,
        lr=1e-2,
        probes=0,
        newcomer_evals=0,
        measure_ar=False,
        release=ReleaseConfig(k=2),
    )
    base.update(kw)
    return Scenario(**base)


def _run_with(out: Path, tiny, scenario, mods, hooks=()) -> tuple[list, list[dict], list[dict]]:
    """Run ``scenario`` under ``out`` with client ``mods`` (from ``fleet_mods``, which run in the
    Ray workers and write to ``$OMNIDRAFT_TEST_CAPTURE``); returns (device profiles, round
    records, captured records)."""
    from omnidraft.simulations.scenario import run

    capture = out / "capture"
    env = {
        "OMNIDRAFT_TEST_CAPTURE": str(capture),
        "OMNIDRAFT_HOME": str(tiny["tiny-drafter"].parents[2]),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    records = []
    try:
        profiles = run(scenario, out / "run", records.append, mods=mods, coordinator_hooks=hooks)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return profiles, records, [pickle.loads(p.read_bytes()) for p in capture.glob("*.pkl")]


@pytest.fixture(scope="module")
def federation(tmp_path_factory, tiny):
    """A 6-device, 3-round federation on two tiny targets; device 0 sends NaN adapters, device 1
    crashes in training, and every reply a device sends is captured."""
    import fleet_mods

    out = tmp_path_factory.mktemp("fed")
    profiles, records, captured = _run_with(out, tiny, _scenario(), [fleet_mods.capture_mod, fleet_mods.poison_mod])
    return out / "run", profiles, records, captured


def test_federation_rounds_versions_and_bad_updates(federation):
    out, profiles, records, captured = federation
    # a simulation's round names each sampled device's prompts ahead (query.announce) before training it
    announced = {c["partition"] for c in captured if c["type"] == "query.announce"}
    assert {c["partition"] for c in captured if c["type"] == "train"} <= announced
    assert sorted({(r["round"], r["target"]) for r in records}) == [
        (rnd, t) for rnd in (1, 2, 3) for t in ("tiny-target-a", "tiny-target-b")
    ]
    reasons = " | ".join(x for r in records for x in r["rejected"])
    assert "NaN" in reasons and "device error" in reasons  # poisoned and crashed devices
    assert all(r["aggregated"] >= 1 for r in records)  # every round completed with the rest
    reg = TargetRegistry(out / "coordinator")
    for t in ("tiny-target-a", "tiny-target-b"):
        m = reg.manifest(t)
        assert m.version == 3 and m.round == 3
        assert np.isfinite(np.concatenate([v.numpy().ravel() for v in reg.load(t).adapter.values()])).all()
    # devices that never trained (the late joiner at round 3; the crashing device 1 every round)
    # get a first session with and without the global state, once a trained state exists
    late = [r for r in records if r.get("new-warm-devices")]
    assert any(r["round"] == 3 for r in late) and all(r["round"] > 1 for r in late)
    assert all(r["new-cold-devices"] == r["new-warm-devices"] >= 1 for r in late)
    # devices that trained before decode their held-out prompts with the same state (the reference)
    assert any(r.get("veteran-devices", 0) >= 1 and 0 <= r["veteran-fixed-k-acceptance"] <= 1 for r in late)
    assert records[-1]["downlink-bytes-per-device"] > 0
    assert json.loads((out / "coordinator" / "coordinator.json").read_text())["round"] == 3


def test_privacy_audit_no_local_text_or_token_runs_in_any_payload(federation):
    out, profiles, _, captured = federation
    from transformers import AutoTokenizer

    assert captured and {c["type"] for c in captured} >= {"train", "evaluate", "query.status"}
    payloads = [b for c in captured for b in c["payload"]]
    blob = b"\x00".join(payloads)
    texts = []
    for p in profiles:
        texts += p.prompts + p.heldout
        texts += (
            [
                h["output"]
                for h in json.loads(
                    "[" + ",".join((Path(p.state_dir) / "history.jsonl").read_text().splitlines()) + "]"
                )
            ]
            if (Path(p.state_dir) / "history.jsonl").exists()
            else []
        )
    assert any(len(t) >= 8 for t in texts)
    grams = {t[i : i + 8].encode() for t in texts for i in range(len(t) - 7)}
    leaked = [g for g in grams if g in blob]
    assert not leaked, leaked[:3]
    planted = blob + texts[0][:8].encode()  # the check itself catches a planted leak
    assert any(g in planted for g in grams)
    # no run of 4 consecutive local token ids (drafter or target tokenization), in any integer encoding
    toks = [AutoTokenizer.from_pretrained(profiles[0].drafter)] + [
        AutoTokenizer.from_pretrained(m) for m in {p.target_model for p in profiles}
    ]
    runs = set()
    for tok in toks:
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False)
            for i in range(len(ids) - 3):
                run = ids[i : i + 4]
                if len(set(run)) > 1:  # a repeated id (e.g. spaces) is not a run of text
                    for dt in ("<u2", "<i4", "<i8", "<f4"):
                        runs.add(np.array(run, dtype=dt).tobytes())
                    runs.add(bytes(run) if max(run) < 128 else b"")  # protobuf packed varints
    runs.discard(b"")
    hits = [r for r in runs if r in blob]
    assert not hits, len(hits)
    ids = toks[0].encode(texts[0], add_special_tokens=False)[:4]
    assert np.array(ids, dtype="<i8").tobytes() in runs or len(set(ids)) == 1


def test_device_state_stays_on_the_device(federation):
    out, profiles, _, _ = federation
    for p in profiles[2:5]:
        d = Path(p.state_dir)
        assert (d / "history.jsonl").is_file() and (d / "global").is_dir()
        pair = d / f"{slug(p.drafter)}--{slug(p.target_model)}"  # where `device serve` keeps it too
        assert (pair / "state.json").is_file() and (pair / "adapter.safetensors").is_file()
        # the lookup history (the device's own prompts and outputs as target ids) exists, so the
        # privacy audit above ran with it present: none of its runs reached any payload
        assert (pair / "lookup_history.safetensors").is_file()


def test_restart_resumes_after_the_last_finished_round(tmp_path, tiny):
    """Kill the coordinator's process (with its Ray workers) after round 1, start again: it runs
    rounds 2..3 only, from the committed round-1 state."""
    script = tmp_path / "fed.py"
    script.write_text(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from omnidraft.simulations.scenario import Scenario, run\n"
        "from omnidraft.coordinator.ngram_release import ReleaseConfig\n"
        "from omnidraft.coordinator.server_opt import ServerOptConfig\n"
        "out = Path(sys.argv[1])\n"
        "s = Scenario(models='tiny', devices=2, rounds=3, prompts_per_device=2, heldout_per_device=1,\n"
        "             prompts_per_round=2, max_new_tokens=8, lora_rank=2, probes=0, release=ReleaseConfig(k=1),\n"
        "             server_opt=ServerOptConfig('adam', lr=1e-2))\n"
        "def on_round(r):\n"
        "    with open(out / 'rounds.jsonl', 'a') as f: f.write(json.dumps([r['round'], r['target'], r['version']]) + '\\n')\n"
        "run(s, out / 'run', on_round)\n"
    )
    env = {**os.environ, "OMNIDRAFT_HOME": str(tiny["tiny-drafter"].parents[2])}
    state = tmp_path / "run" / "coordinator" / "coordinator.json"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if state.exists() and json.loads(state.read_text())["round"] >= 1:
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_after = json.loads(state.read_text())["round"]
    assert 1 <= killed_after < 3, "the coordinator was not killed between rounds"
    recorded = tmp_path / "rounds.jsonl"  # what on_round saw before the kill (it follows the coordinator)
    seen = [json.loads(line) for line in recorded.read_text().splitlines()] if recorded.exists() else []
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    after = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()][len(seen) :]
    assert sorted({r for r, _, _ in after}) == list(range(killed_after + 1, 4))  # finished rounds not rerun
    reg = TargetRegistry(tmp_path / "run" / "coordinator")
    assert all(reg.manifest(t).version == 3 for t in reg.names())
    # the server optimizer's state was saved with each version and taken up after the restart
    assert all(float(reg.server_state(t)["step"]) == 3 for t in reg.names())


@pytest.mark.parametrize("point", ["before-send", "mid-replies", "after-ledger", "after-commit", "after-records"])
def test_a_coordinator_stopped_anywhere_in_a_round_resumes_without_losing_or_repeating_anything(tmp_path, tiny, point):
    """The coordinator stops at ``point`` of its last round (tests/fleet_mods.crash_hook) and runs again
    on the same directory: every target ends at one version per round, each committed round is
    charged to the privacy ledger once, and each round is recorded once."""
    import fleet_mods

    from omnidraft.coordinator.round_log import ROUNDS_FILE
    from omnidraft.simulations.flower_runner import FlowerRunError

    scenario = _scenario(
        devices=4,
        rounds=2,
        late_joiners=0,
        prompts_per_device=3,
        prompts_per_round=3,
        max_new_tokens=8,
        release=ReleaseConfig(k=1),
    )
    os.environ["OMNIDRAFT_TEST_CRASH"] = f"{point}@2"
    try:
        with pytest.raises(FlowerRunError):
            _run_with(tmp_path, tiny, scenario, [], hooks=[fleet_mods.crash_hook])
    finally:
        del os.environ["OMNIDRAFT_TEST_CRASH"]
    _run_with(tmp_path, tiny, scenario, [])  # the same run directory: it resumes
    coord = tmp_path / "run" / "coordinator"
    reg = TargetRegistry(coord)
    records = [json.loads(line) for line in (coord / ROUNDS_FILE).read_text().splitlines()]
    assert sorted((r["round"], r["target"]) for r in records) == [
        (rnd, t) for rnd in (1, 2) for t in ("tiny-target-a", "tiny-target-b")
    ]  # each round once
    for t in ("tiny-target-a", "tiny-target-b"):
        m = reg.manifest(t)
        assert (m.version, m.round) == (2, 2) and reg.versions(t) == [0, 1, 2], (point, t)
        ledger = NgramRelease(ReleaseConfig(k=1), reg.privacy_ledger(t))
        assert ledger.accountant.num_releases == 2, (point, t)  # charged once per committed round
    if point == "after-commit":  # the first target's round-2 commit survived: the rerun did not train it again
        assert any(r.get("recovered") for r in records if r["round"] == 2)


def test_secagg_sums_adapters_without_the_coordinator_seeing_one(tmp_path, tiny):
    """With SecAgg+ no train reply carries an adapter (devices send only masked vectors), and
    the unmasked weighted mean equals plain FedAvg of the same devices' updates."""
    import fleet_mods

    kw = dict(rounds=1, late_joiners=0, newcomer_evals=0)
    # float32 updates in the clear: the reference is the same updates' exact FedAvg
    _, plain, _ = _run_with(
        tmp_path / "plain", tiny, _scenario(aggregation=AggregationConfig(update_bits=32), **kw), []
    )
    _, secure, wire = _run_with(tmp_path / "secure", tiny, _scenario(secagg=True, **kw), [fleet_mods.wire_mod])
    assert (
        [(r["target"], r["aggregated"], r["rejected"]) for r in secure]
        == [(r["target"], r["aggregated"], []) for r in plain]
        == [("tiny-target-a", 3, []), ("tiny-target-b", 3, [])]
    )
    trains = [w for w in wire if w["type"] == "train"]
    assert trains and not any({"adapter", "update"} & set(w["arrays"]) for w in trains)  # nothing in the clear
    masked = [w for w in trains if "secaggplus_configs" in w["configs"]]
    assert len(masked) == 6 * 4 and any(w["array-bytes"] == 0 for w in masked)  # 4 protocol stages per device
    a = TargetRegistry(tmp_path / "plain" / "run" / "coordinator")
    b = TargetRegistry(tmp_path / "secure" / "run" / "coordinator")
    for t in ("tiny-target-a", "tiny-target-b"):
        from safetensors.torch import load_file

        start = load_file(a._dir(t) / TargetRegistry._file("adapter", 0))  # version 0: before the round
        for key, value in a.load(t).adapter.items():
            moved = (value - start[key]).abs().max().item()
            err = (b.load(t).adapter[key] - value).abs().max().item()
            assert err <= 1e-5 + 1e-3 * moved, (t, key, err, moved)
        assert any((v - start[k]).abs().max() > 0 for k, v in a.load(t).adapter.items())  # it learned
    assert all(r["uplink-bytes-per-device"] > 0 for r in secure)


def test_secagg_settings_are_checked():
    from omnidraft.coordinator.secure_aggregation import SecAggConfig

    with pytest.raises(ValueError, match="weighted mean"):
        FleetConfig(aggregation=AggregationConfig(method="median"), secagg=SecAggConfig(enabled=True)).validate()
    with pytest.raises(ValueError, match="at least 2"):
        SecAggConfig(min_devices=1).validate()
    with pytest.raises(ValueError, match="weighted mean"):
        _scenario(secagg=True, aggregation=AggregationConfig(method="trimmed")).validate()


def test_a_round_no_device_answered_is_not_recorded_as_finished(tmp_path, tiny):
    """Every connected device's status query comes back as an error (their ClientApps crash, or
    the fleet is being torn down): the coordinator holds no round and records none, so a restart
    on the same directory runs every round instead of skipping the ones that did nothing."""
    from flwr.app import Error, Message

    from omnidraft.coordinator.round_log import last_round
    from omnidraft.coordinator.server_app import Coordinator
    from omnidraft.shared.learning.adapters import LoraSpec

    reg = TargetRegistry(tmp_path)
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))

    class CrashingFleet:
        """Two connected nodes whose every reply is a ClientApp error."""

        def __init__(self) -> None:
            self.sent: dict[str, Message] = {}

        def get_node_ids(self) -> list[int]:
            return [1, 2]

        def push_messages(self, messages) -> list[str]:
            ids = []
            for m in messages:
                mid = f"m{len(self.sent)}"
                self.sent[mid] = m
                ids.append(mid)
            return ids

        def pull_messages(self, ids) -> list[Message]:
            out = []
            for mid in list(ids):
                m = self.sent[mid]
                m.metadata.__dict__["_message_id"] = mid  # as Flower's grid sets them (no setters)
                reply = Message(error=Error(code=0, reason="ClientApp exception"), reply_to=m)
                reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                out.append(reply)
            return out

    rounds = []
    Coordinator(tmp_path, FleetConfig(rounds=2, wait_s=0), on_round=rounds.append).run(CrashingFleet())
    assert last_round(tmp_path) == 0 and rounds == []
    assert reg.manifest("tiny-target-a").version == 0
