"""``python simulations/run.py`` on tiny models: bad input in one line, device profiles with
rollout, drift and personal codebases, a smoke run of 50 devices whose outputs (metrics,
summary, plots, report, device and coordinator state) are checked, plus determinism given the
seed, rollout/drift/rollback events in a run, ``flwr run`` of the repository, and a hostile
fleet that cannot stop or take over a round. The tiny models (``tiny``, ``home``) and the smoke
run are module fixtures, built once for the tests here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnidraft.simulations import data, report
from omnidraft.simulations.scenario import Drift, Rollout, Scenario

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "simulations" / "run.py"


def _run(*args: str, home: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMNIDRAFT_HOME": str(home)}
    return subprocess.run(
        [sys.executable, str(RUN), *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny):
    return tiny["tiny-drafter"].parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omnidraft.benchmarks.tiny_models import ensure_tiny_fleet

    return ensure_tiny_fleet(tmp_path_factory.mktemp("home") / "tiny")


def test_bad_input_is_one_line_and_exit_2(tmp_path, home):
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = 'three'\n")
    for args in (
        ["--devices", "0"],
        ["--scenario", str(bad)],
        ["--scenario", str(tmp_path / "none.toml")],
        ["--rollout", "nonsense"],
        ["--models", "tiny", "--targets", "nope:1"],
        ["--draft-stop", "fast"],
    ):
        res = _run(*args, "--out", str(tmp_path / "o"), home=home, timeout=120)
        assert res.returncode == 2, (args, res.stderr[-500:])
        assert "Traceback" not in res.stderr and res.stderr.strip().startswith("error:"), res.stderr[-500:]


def test_profiles_apply_rollout_and_drift(tmp_path, home, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.simulations.fleet_setup import prepare

    s = Scenario(
        models="tiny",
        devices=8,
        rounds=4,
        targets={"tiny-target-a": 1.0},
        probes=1,
        prompts_per_device=3,
        heldout_per_device=1,
        rollout=Rollout("tiny-target-b", 3, 0.5),
        drift=Drift("tiny", 4),
        late_joiners=2,
    )
    profiles = prepare(s, tmp_path / "run")
    members = [p for p in profiles if not p.probe]
    assert len(members) == 8 and all(
        p.offers == {"tiny-target-b": p2.target_model} for p in members for p2 in profiles[-1:]
    )  # all can run the new target
    assert [p.target for p in profiles if p.probe] == ["tiny-target-a", "tiny-target-b"]
    assert [p.joins_at_round for p in members][-2:] == [4, 4]
    p = members[0]
    assert p.at_round(4).prompts == p.drift_prompts != p.prompts and p.at_round(3).prompts == p.prompts
    assert DeviceProfile.load(p.state_dir) == p  # what a worker reads from the device's directory
    from omnidraft.client.device_profile import cached_profile
    from omnidraft.client.fleet_device import FleetDevice, StateMismatch

    moved = FleetDevice(p.at_round(4), pool=None).switch("tiny-target-b")  # a rollout chose it
    assert moved.profile.target == "tiny-target-b" and moved.profile.prompts == p.drift_prompts
    stored = DeviceProfile.load(p.state_dir)
    assert stored.target == "tiny-target-b" and stored.offers == {"tiny-target-a": p.target_model}
    assert stored.prompts == p.prompts and cached_profile(p.state_dir) == stored
    with pytest.raises(StateMismatch, match="cannot serve"):
        FleetDevice(stored, pool=None).switch("tiny-target-c")


def test_profiles_on_personal_codebases(tmp_path, home, monkeypatch):
    """With codebases each device works in one project: its prompts and held-out prompts come
    from that project, and the last late joiner's project is one no other member works in."""
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.simulations.fleet_setup import prepare

    s = Scenario(
        models="tiny",
        devices=12,
        rounds=2,
        targets={"tiny-target-a": 1.0},
        probes=1,
        data="codebase:click,codebase:flwr,codebase:peft",
        prompts_per_device=4,
        heldout_per_device=2,
        late_joiners=2,
    )
    profiles = prepare(s, tmp_path / "run")
    corpus = data.load_corpus(s.data)
    source = dict(zip(corpus.prompts, corpus.labels))
    for p in profiles:
        assert p.project.startswith("codebase:") and {source[t] for t in p.prompts + p.heldout} == {p.project}
    members = [p for p in profiles if not p.probe]
    assert members[-1].project not in {p.project for p in members[:-2]}
    assert members[-2].project in {p.project for p in members[:-2]}
    assert DeviceProfile.load(members[-1].state_dir).project == members[-1].project


# -- the smoke run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, home):
    out = tmp_path_factory.mktemp("sim") / "run"
    res = _run("--models", "tiny", "--devices", "50", "--rounds", "3", "--seed", "7", "--out", str(out), home=home)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_smoke_run_writes_every_output(smoke):
    out, res = smoke
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    targets = {"tiny-target-a", "tiny-target-b"}
    assert {(r["round"], r["target"]) for r in records} == {(n, t) for n in range(4) for t in targets}
    released = dict.fromkeys(targets, 0)
    for r in sorted(records, key=lambda r: r["round"]):
        assert 0 <= r["eval-acceptance"] <= 1 and r["eval-tokens-per-call"] >= 1 and r["eval-speedup"] > 0
        assert r["eval-decode-speedup"] > 0  # the same decodes, the one prefill left out of both
        # the live panel checks the cost profile its rule decided from against its timed forwards (the
        # drafter's steps where it took enough of them: a tiny pair's rule may not draft)
        assert r["eval-profile-target-step"] > 0 and r.get("eval-profile-drafter-vs-target", 1.0) > 0
        assert 0 < r["eval-modelled-speedup"] <= r["eval-tokens-per-call"]  # blocks never cost less than a step
        assert 0 <= r["eval-fixed-k-acceptance"] <= 1 and r["eval-fixed-k-tokens-per-call"] >= 1  # k = 4
        if r["round"]:
            assert r["aggregated"] >= 1 and r["uplink-bytes-per-device"] > 0
            assert "epsilon" in r["ngrams"] and "released" in r["ngrams"]
            # the global cache holds the released n-grams only (the tokenizers' entries are built on devices)
            released[r["target"]] += r["ngrams"]["released"]
            assert r["cache-entries"] <= released[r["target"]] and r["cache-bytes"] > 0
    # newcomers and veterans: the fixed-k acceptance that compares states, and an adaptive decode that
    # replays the target's recorded output, so their speed is modelled only (no live tok/s)
    newcomers = [r for r in records if r.get("new-warm-devices")]
    assert newcomers and all(
        0 <= r[f"{who}-fixed-k-acceptance"] <= 1
        and 0 <= r[f"{who}-acceptance"] <= 1
        and r[f"{who}-modelled-tokens-per-s"] > 0
        and r[f"{who}-modelled-speedup"] > 0
        for r in newcomers
        for who in ("new-warm", "new-cold")
    )
    assert not any(
        f"{who}-tokens-per-s" in r or f"{who}-speedup" in r
        for r in records
        for who in ("new-warm", "new-cold", "veteran", "veteran-cold")
    )
    # veterans decode with the global state and with nothing they hold: their gain, the newcomers' reference
    assert any(
        all(f"{who}-fixed-k-acceptance" in r and f"{who}-modelled-speedup" in r for who in ("veteran", "veteran-cold"))
        for r in records
    )
    trained_rounds = [r for r in records if r["round"]]
    assert all(0 <= r["train-replayed"] <= 1 and r["train-modelled-speedup"] > 0 for r in trained_rounds)
    assert "modelled tok/s (speedup)" in (out / "report.md").read_text()
    assert "veterans cold" in (out / "report.md").read_text()
    for r in trained_rounds:  # where each round's time went, phase by phase, adding up to the round
        phases = r["phase-s"]
        assert {"census", "newcomers", "train", "aggregate", "eval"} <= set(phases) and min(phases.values()) >= 0
        assert sum(phases.values()) <= r["round-s"] + 1e-6 and ("start-eval" in phases) == (r["round"] == 1)
    assert "## Where the time went (wall seconds)" in (out / "report.md").read_text()
    assert "## The cost profile in use" in (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["devices"] == 50 and summary["wall_s"] > 0 and summary["peak_rss_mb"] > 100
    assert summary["peak_rss_scope"] == "all processes"  # a local Ray: the workers are descendants
    assert set(summary["targets"]) == targets
    for name in ("acceptance.png", "speedup.png", "cache.png", "bytes.png", "newcomers.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in (out / "report.md").read_text()
    devices = sorted((out / "devices").iterdir())
    assert len(devices) == 50 + 2 * 2  # members and two probes per target
    trained = [d for d in devices if (d / "history.jsonl").exists()]
    assert trained and all((d / "profile.json").exists() for d in devices)
    assert (out / "coordinator" / "coordinator.json").exists()
    assert "| tiny-target-a |" in res.stdout  # the summary table
    assert "**tiny-target-a**:" in res.stdout and "**tiny-target-a**:" in (out / "report.md").read_text()  # the verdict
    # Flower's supported path (flwr run on a local SuperLink): no deprecation notice anywhere
    log = (out / "flwr" / "flower.log").read_text()
    assert "run_simulation" not in log and "deprecat" not in (res.stdout + res.stderr + log).lower()


def test_same_seed_same_learning(smoke, tmp_path, home):
    """Acceptance and what the devices learned depend only on the seed (timings aside)."""
    out, _ = smoke
    again = tmp_path / "again"
    res = _run("--models", "tiny", "--devices", "50", "--rounds", "3", "--seed", "7", "--out", str(again), home=home)
    assert res.returncode == 0, res.stderr[-3000:]
    keys = (
        "round",
        "target",
        "aggregated",
        "eval-acceptance",
        "eval-tokens-per-call",
        "trained-tokens",
        "new-warm-fixed-k-acceptance",
        "new-cold-fixed-k-acceptance",
        "cache-entries",
    )

    def learned(run):
        return [{k: r.get(k) for k in keys} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    assert learned(out) == learned(again)
    # the second run replayed every learning decode from the first one's recordings (same machine,
    # same prompts): the same acceptance, training and global adapters as the live run
    again_records = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train-replayed"] == pytest.approx(1.0) for r in again_records if r["round"])
    for target in ("tiny-target-a", "tiny-target-b"):
        a, b = (run / "coordinator" / "targets" / target / "adapter-v3.safetensors" for run in (out, again))
        assert a.read_bytes() == b.read_bytes(), target
    for d in ("device-0003", "device-0010"):
        a, b = (run / "devices" / d / "history.jsonl" for run in (out, again))
        assert a.exists() == b.exists() and (not a.exists() or a.read_text() == b.read_text())


def fleet_manifest(root: Path, target: str, version: int):
    from omnidraft.proto import fleet_pb2

    m = fleet_pb2.StateManifest()
    m.ParseFromString((root / "targets" / target / f"manifest-v{version}.pb").read_bytes())
    return m


def test_rollout_and_drift_events_in_a_run(tmp_path, home):
    """Before round 2 the operator rolls tiny-target-b (registered up front, no device on it)
    out to half the devices; before round 3 they roll its state back; from round 3 every
    device's traffic is the drift corpus."""
    from omnidraft.coordinator.registry import TargetRegistry, rollout_rank

    out = tmp_path / "run"
    res = _run(
        "--models",
        "tiny",
        "--devices",
        "12",
        "--rounds",
        "3",
        "--fraction",
        "1",
        "--targets",
        "tiny-target-a:1",
        "--rollout",
        "tiny-target-b@2:0.5",
        "--drift",
        "tiny@3",
        "--rollback",
        "tiny-target-b@3",
        "--probes",
        "1",
        "--late-joiners",
        "0",
        "--no-ar",
        "--out",
        str(out),
        home=home,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    b = {r["round"]: r for r in rows if r["target"] == "tiny-target-b"}
    a = {r["round"]: r for r in rows if r["target"] == "tiny-target-a"}
    assert sorted(b) == [0, 2, 3] and sorted(a) == [0, 1, 2, 3]  # b's probe measures round 0
    assert a[1]["aggregated"] == 12 and a[2]["aggregated"] == b[2]["aggregated"] == 6
    assert b[2]["switched"] == 6 and b[2]["devices"] == a[2]["devices"] == 6 and b[3]["switched"] == 0
    # exactly the half first in the rollout order moved, and only they
    profiles = {
        d.name: json.loads((d / "profile.json").read_text())
        for d in (out / "devices").iterdir()
        if not json.loads((d / "profile.json").read_text())["probe"]
    }
    order = sorted(profiles, key=lambda n: rollout_rank("tiny-target-b", n))
    assert {n for n, p in profiles.items() if p["target"] == "tiny-target-b"} == set(order[:6])
    # round 2 published v1; the rollback published v2 = v0's state; round 3 trained v3 from it
    registry = TargetRegistry(out / "coordinator")
    assert b[3]["version"] == 3 and b[3]["eval-speedup"] == 0.0  # --no-ar: no speedup measured
    read = report.by_target(report.read_metrics(out / "metrics.jsonl"))["tiny-target-b"]
    assert all("eval-speedup" not in r for r in read)  # the report shows "–", not 0.00x
    text = (out / "report.md").read_text()  # no live speedup; the modelled one needs no target-alone run
    assert re.search(r"\| – \(\d+\.\d\dx\) → – \(\d+\.\d\dx\) \|", text), text[:2000]
    assert b[3]["started-from"] == {"version": 2, "restores": 0} and "started-from" not in b[2]
    restored = fleet_manifest(out / "coordinator", "tiny-target-b", 2)
    assert (
        restored.restored_from == 0 and restored.parent_version == 1 and registry.manifest("tiny-target-b").version == 3
    )
    profile = json.loads((out / "devices" / "device-0000" / "profile.json").read_text())
    history = [
        json.loads(line) for line in (out / "devices" / "device-0000" / "history.jsonl").read_text().splitlines()
    ]
    assert {h["round"] for h in history} == {1, 2, 3}
    assert all(h["prompt"] in profile["drift_prompts"] for h in history if h["round"] == 3)
    assert all(h["prompt"] in profile["prompts"] for h in history if h["round"] < 3)
    assert list((out / "devices" / "device-0000").glob("*--tiny-target-*/state.json"))  # the device's own state


def test_flwr_run_of_the_repository_runs_a_scenario(tmp_path, home):
    """The repository is a Flower App: `flwr run .` on the local simulation SuperLink that flwr
    starts itself runs a shipped scenario sized to the SuperNodes and writes the report."""
    import psutil

    from omnidraft.simulations.flower_runner import _free_ports

    http, control = _free_ports(2)
    env = {
        **os.environ,
        "OMNIDRAFT_HOME": str(home),
        "FLWR_HOME": str(tmp_path / "flwr"),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control),
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
    }
    out = tmp_path / "run"
    try:
        res = subprocess.run(
            [
                "flwr",
                "run",
                ".",
                "--stream",
                "--run-config",
                f'scenario="tiny" run-dir="{out}"',
                "--federation-config",
                "num-supernodes=9",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:  # flwr leaves the SuperLink it started running
        for p in psutil.process_iter(["cmdline"]):
            if "flower-superlink" in " ".join(p.info["cmdline"] or []) and str(http) in (p.info["cmdline"] or []):
                for child in [*p.children(recursive=True), p]:
                    child.kill()
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert json.loads((out / "flower-run.json").read_text())["status"] == "finished"
    config = json.loads((out / "summary.json").read_text())["config"]
    assert config["devices"] == 9 - 2 * 2 and config["rounds"] == 3  # tiny.toml: two probes per target
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["target"] for r in records if r["round"] == 0} == {"tiny-target-a", "tiny-target-b"}
    assert {r["round"] for r in records} == {0, 1, 2, 3}  # a fifth of 5 devices train: one target a round
    assert "# OmniDraft Fleet simulation report" in (out / "report.md").read_text()
    # a probe keeps its rule's counted acceptance between rounds (a cold rule each round would
    # measure the prior, not the state)
    profiles = [json.loads(f.read_text()) for f in (out / "devices").glob("*/profile.json")]
    probe_dirs = [out / "devices" / p["device_id"] for p in profiles if p.get("probe")]
    assert len(probe_dirs) == 2 * len({p["target"] for p in profiles})  # two per target
    for d in probe_dirs:
        saved = [json.loads(f.read_text()) for f in d.glob("*/state.json")]
        assert saved and all(m["throughput_rule"]["drafted"] > 0 for m in saved), d


# -- the hostile fleet ------------------------------------------------------------------------------


def test_hostile_devices_of_every_kind_cannot_stop_or_take_over_a_round(tmp_path, home):
    """One device of each attack kind among 28 veterans, every device sampled every round: the
    run completes, each spoiled reply is dropped alone with its reason (or clipped and capped),
    and what the coordinator commits stays finite."""
    import numpy as np

    from omnidraft.coordinator.registry import TargetRegistry

    out = tmp_path / "run"
    res = _run(
        "--models",
        "tiny",
        "--devices",
        "30",
        "--late-joiners",
        "2",
        "--rounds",
        "2",
        "--fraction",
        "1",
        "--targets",
        "tiny-target-a:1",
        "--attack",
        "all:0.03",
        "--no-ar",
        "--out",
        str(out),
        home=home,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["round"]]
    assert [r["round"] for r in trained] == [1, 2]
    reasons = " | ".join(x for r in trained for x in r["rejected"] + r.get("skipped", []))
    for expected in (
        "holds NaN or Inf",
        "device error",
        "metrics outside the schema",
        "metric trained-tokens",
        "update ",
        "stale state",
        "status field",
    ):
        assert expected in reasons, (expected, reasons)
    # 28 veterans, 11 attackers: the 17 honest ones, the huge-norm, huge-weight and sign-flip ones
    # are aggregated in round 1 (the replayer's first reply is honest), whatever order replies came in
    assert trained[0]["aggregated"] == 17 + 3 + 1 and trained[1]["aggregated"] == 17 + 3 + 2  # + the late joiners
    adapter = TargetRegistry(out / "coordinator").load("tiny-target-a").adapter
    assert all(np.isfinite(v.numpy()).all() for v in adapter.values())
    report_md = (out / "report.md").read_text()
    assert "## Rejected replies and skipped devices, by reason" in report_md and "attacks" in report_md
    assert len(list((out / "attacks").glob("replay-*.pkl"))) == 1  # the replayer's old update stays with the run
