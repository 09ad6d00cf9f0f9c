"""``python simulations/run.py``: scenarios (flags, TOML), the non-IID split, events, and a smoke
run of 50 tiny devices whose outputs (metrics, summary, plots, report, device and coordinator
state) are checked, plus determinism given the seed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
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


# -- data ------------------------------------------------------------------------------------------


def test_sources_are_real_text_with_labels():
    corpus = data.load_corpus(None)
    counts = Counter(corpus.labels)
    assert counts["humaneval"] == 164 and counts["stdlib"] > 1000 and counts["pydoc"] > 500
    i = corpus.labels.index("stdlib")
    assert (
        corpus.prompts[i].startswith(("def ", "async def "))
        and '"""' in corpus.prompts[i]
        or "'''" in corpus.prompts[i]
    )
    assert all(len(p) <= data.MAX_CHARS + 2 for p, lab in zip(corpus.prompts, corpus.labels) if lab == "pydoc")


def test_dirichlet_split_is_disjoint_deterministic_and_skewed():
    corpus = data.load_corpus("humaneval,pydoc")
    parts = data.split(corpus, 40, 5, alpha=0.1, seed=3)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 40 * 5 and {len(p) for p in parts} == {5}
    assert parts == data.split(corpus, 40, 5, alpha=0.1, seed=3)
    assert parts != data.split(corpus, 40, 5, alpha=0.1, seed=4)

    def majority(parts):  # mean share of each device's most common source
        return sum(Counter(corpus.labels[i] for i in p).most_common(1)[0][1] / len(p) for p in parts) / len(parts)

    assert majority(parts) > majority(data.split(corpus, 40, 5, alpha=100.0, seed=3)) + 0.1
    with pytest.raises(ValueError, match="need"):
        data.split(corpus, 400, 5, alpha=0.5, seed=0)


def test_jsonl_data_without_labels_is_split_iid(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"text number {i}"}) + "\n" for i in range(30)))
    corpus = data.load_corpus(str(path))
    parts = data.split(corpus, 6, 5, alpha=0.5, seed=0)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 30
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        data.load_corpus(str(tmp_path / "bad.jsonl"))


def test_codebase_projects_split_by_popularity_with_unseen_newcomer():
    """One project per device, drawn by popularity; a contiguous stretch of its functions;
    newcomers from known projects, the last one from a project nobody else works in."""
    sizes = {"a": 100, "b": 60, "c": 30, "d": 20, "e": 10, "f": 10}
    labels = [f"codebase:{n}" for n, k in sizes.items() for _ in range(k)]
    corpus = data.Corpus([f"def f{i}(): pass" for i in range(len(labels))], labels)
    assert data.is_codebases(corpus) and not data.is_codebases(data.Corpus(["x"], ["humaneval"]))
    newcomers = frozenset(range(26, 30))
    parts, projects = data.split_projects(corpus, 30, 5, seed=1, newcomers=newcomers)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 150
    for part, project in zip(parts, projects):
        assert {labels[i] for i in part} == {project} and part == list(range(part[0], part[0] + 5))
    counts = Counter(projects[:26])
    assert counts["codebase:a"] > counts.get("codebase:d", 0) and len(counts) >= 3  # popular ones, and a tail
    known = set(projects[:26])
    assert all(projects[d] in known for d in (26, 27, 28))
    assert projects[29] not in known and projects.count(projects[29]) == 1  # a project the fleet never saw
    assert (parts, projects) == data.split_projects(corpus, 30, 5, seed=1, newcomers=newcomers)
    assert projects != data.split_projects(corpus, 30, 5, seed=2, newcomers=newcomers)[1]
    with pytest.raises(ValueError, match="too few.*--share-projects"):
        data.split_projects(corpus, 60, 5, seed=0)
    # more devices than disjoint stretches: teammates share a project's stretches, in turn
    parts, projects = data.split_projects(corpus, 60, 5, seed=0, newcomers=frozenset(range(56, 60)), share=True)
    assert len(parts) == 60 and len({tuple(p) for p in parts}) < 60  # some devices share a stretch
    for part, project in zip(parts, projects):
        assert {labels[i] for i in part} == {project} and part == list(range(part[0], part[0] + 5))
        assert (part[0] - labels.index(project)) % 5 == 0  # one of the project's own stretches
    assert projects[59] not in set(projects[:59])  # the unseen project stays unseen
    assert data.split_projects(corpus, 30, 5, seed=1, newcomers=newcomers, share=True) == data.split_projects(
        corpus, 30, 5, seed=1, newcomers=newcomers
    )  # room enough: sharing changes nothing


def test_codebase_sources_are_real_projects():
    corpus = data.load_corpus("codebase:click,codebase:peft")
    assert set(corpus.labels) == {"codebase:click", "codebase:peft"} and data.is_codebases(corpus)
    assert all(len([x for x in corpus.labels if x == lab]) <= data.PROJECT_PROMPTS for lab in set(corpus.labels))
    assert all("def " in p for p in corpus.prompts)
    with pytest.raises(ValueError, match="not installed"):
        data.load_corpus("codebase:no_such_package_here")


# -- scenarios -------------------------------------------------------------------------------------


def test_toml_scenario_and_events(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        'models = "tiny"\ndevices = 20\nrounds = 4\ntargets = "tiny-target-a:1"\n'
        'rollout = {target = "tiny-target-b", round = 3, share = 0.25}\n'
        'drift = "pydoc@4"\n[privacy]\nk = 3\nnoise = 0.5\n[aggregation]\nmethod = "median"\n'
    )
    s = Scenario.from_toml(path)
    s.validate()
    assert s.devices == 20 and s.targets == {"tiny-target-a": 1.0}
    assert s.rollout == Rollout("tiny-target-b", 3, 0.25) and s.drift == Drift("pydoc", 4)
    assert s.release.k == 3 and s.release.noise_multiplier == 0.5 and s.aggregation.method == "median"
    for text, match in (
        ("devices = 0\n", "devices"),
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("gamma = 0.7\n", "unknown key 'gamma'"),
        ("probe_speed_prompts = 30\n", "speed prompts"),
        ("rollout = 'x@9:0.5'\nrounds = 3\n", "rollout round"),
        ("devices = [\n", "s.toml"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            Scenario.from_toml(path).validate()


def test_shipped_scenarios_are_valid():
    """Every scenario file under simulations/scenarios parses and validates as run.py reads it
    (over default.toml, or tiny.toml for tiny models)."""
    from omnidraft.simulations.run import SCENARIOS, build_parser, scenario_from_args

    files = sorted(SCENARIOS.glob("*.toml"))
    assert {f.name for f in files} >= {"default.toml", "tiny.toml", "fleet10.toml"}
    for path in files:
        scenario_from_args(build_parser().parse_args(["--scenario", str(path)]))
    fleet = scenario_from_args(build_parser().parse_args(["--scenario", str(SCENARIOS / "fleet10.toml")]))
    # issue 5's federation: 10 devices from round 1, one fresh device per target at the last round
    assert fleet.devices - fleet.late_joiners == 10 and fleet.late_joiners == len(fleet.target_shares())
    assert fleet.fraction == 1.0 and fleet.newcomer_evals == 0 and fleet.join_round is None
    default = scenario_from_args(build_parser().parse_args([]))
    # the main job: >= 100 real devices on a Qwen2.5-Coder target, probes scoring 40 prompts per target
    assert default.models == "real" and default.devices >= 100 and default.rounds >= 3
    assert all(t.startswith("qwen2.5-coder") for t in default.target_shares())
    assert default.probes * default.probe_heldout >= 40 and 0 < default.probe_speed_prompts < default.probe_heldout
    # the runs BENCHMARKS.md records keep their configuration whatever default.toml becomes
    old = scenario_from_args(build_parser().parse_args(["--scenario", str(SCENARIOS / "two-targets.toml")]))
    assert set(old.target_shares()) == {"qwen2.5-coder-0.5b", "gemma3-270m"}
    assert (old.rounds, old.fraction, old.prompts_per_round, old.probe_heldout, old.probe_speed_prompts) == (
        4,
        0.1,
        3,
        3,
        0,
    )
    learn = scenario_from_args(build_parser().parse_args(["--scenario", str(SCENARIOS / "learning.toml")]))
    assert (
        learn.rounds,
        learn.fraction,
        learn.prompts_per_round,
        learn.heldout_per_device,
        learn.probe_heldout,
        learn.measure_ar,
    ) == (4, 0.3, 4, 3, 3, False)


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
    for r in records:
        assert 0 <= r["eval-acceptance"] <= 1 and r["eval-tokens-per-call"] >= 1 and r["eval-speedup"] > 0
        assert 0 < r["eval-modelled-speedup"] <= r["eval-tokens-per-call"]  # blocks never cost less than a step
        assert 0 <= r["eval-fixed-k-acceptance"] <= 1 and r["eval-fixed-k-tokens-per-call"] >= 1  # k = 4
        if r["round"]:
            assert r["aggregated"] >= 1 and r["uplink-bytes-per-device"] > 0 and r["cache-entries"] > 0
            assert "epsilon" in r["ngrams"] and "released" in r["ngrams"]
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
        for who in ("new-warm", "new-cold", "veteran")
    )
    assert any("veteran-fixed-k-acceptance" in r and "veteran-modelled-speedup" in r for r in records)
    trained_rounds = [r for r in records if r["round"]]
    assert all(0 <= r["train-replayed"] <= 1 and r["train-modelled-speedup"] > 0 for r in trained_rounds)
    assert "modelled tok/s (speedup)" in (out / "report.md").read_text()
    for r in trained_rounds:  # where each round's time went, phase by phase, adding up to the round
        phases = r["phase-s"]
        assert {"census", "newcomers", "train", "aggregate", "eval"} <= set(phases) and min(phases.values()) >= 0
        assert sum(phases.values()) <= r["round-s"] + 1e-6 and ("start-eval" in phases) == (r["round"] == 1)
    assert "## Where the time went (wall seconds)" in (out / "report.md").read_text()
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


def test_a_device_on_a_ray_cluster_started_elsewhere_gets_its_thread_count(tmp_path, monkeypatch):
    """Workers of a cluster started with `ray start` do not inherit the simulation's environment:
    the ClientApp takes the device's thread count from the run's scenario."""
    from flwr.app import Context, RecordDict

    from omnidraft.simulations import flower_app

    out = tmp_path / "run"
    (out / "devices").mkdir(parents=True)
    (out / flower_app.SCENARIO_FILE).write_text(json.dumps({**Scenario(cpus_per_device=3).to_dict()}))
    monkeypatch.delenv("OMNIDRAFT_THREADS", raising=False)
    monkeypatch.setattr(flower_app, "cached_profile", lambda path: path)
    monkeypatch.setattr(flower_app, "FleetDevice", lambda profile, pool: (profile, pool))
    monkeypatch.setattr(flower_app, "shared_pool", lambda dtype, weights: (dtype, weights))
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 4}, state=RecordDict(), run_config={"run-dir": str(out)}
    )
    profile, pool = flower_app.device_for(context)
    assert os.environ["OMNIDRAFT_THREADS"] == "3" and pool == ("fp32", "int8")
    assert profile == out / "devices" / "device-0004"


def test_an_unreachable_or_malformed_ray_address_is_a_value_error():
    """run.py turns ValueError into one line and exit 2; Ray alone would retry for minutes."""
    import socket

    from omnidraft.simulations.flower_runner import _check_reachable

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="cannot reach the Ray cluster"):
        _check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="HOST:PORT"):
        _check_reachable("nonsense")


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


def test_the_verdict_says_whether_learning_paid_in_speed():
    def summary(first, last, **kw):
        base = {
            "speedup-first": first,
            "speedup-last": last,
            "first-round": 0,
            "last-round": 3,
            "acceptance-k-first": 0.39,
            "acceptance-k-last": 0.44,
            "new-devices": 0,
        }
        return {**base, **kw}

    assert "learning paid: 1.20x → 1.35x" in report.verdict({"q": summary(1.2, 1.35)})
    assert "did not pay" in report.verdict({"q": summary(1.3, 1.1)})
    assert "slower than the target alone" in report.verdict({"q": summary(0.97, 0.88)})
    assert "unchanged within 5%" in report.verdict({"q": summary(1.2, 1.22)})
    assert "not measured" in report.verdict({"q": summary(None, None)})
    text = report.verdict(
        {"q": summary(1.2, 1.35, **{"new-devices": 3, "new-warm-acceptance-k": 0.43, "new-cold-acceptance-k": 0.38})}
    )
    assert "0.390 → 0.440" in text and "0.430 with the fleet's state vs 0.380 without" in text
    drift = report.verdict(
        {"q": summary(1.17, 0.86, **{"modelled-speedup-first": 1.41, "modelled-speedup-last": 1.52})}
    )
    assert (
        "slower than the target alone (1.17x → 0.86x)" in drift
        and "cost profile, decoding only: 1.41x → 1.52x" in drift
    )


# -- the hostile fleet ------------------------------------------------------------------------------


def test_attack_flag_is_checked():
    from omnidraft.simulations.attacks import KINDS, assign, parse_attacks

    assert parse_attacks(["all:0.1"]) == {k: 0.1 for k in KINDS}
    for bad in (["nan"], ["nope:0.1"], ["nan:1.5"], ["nan:x"]):
        with pytest.raises(ValueError):
            parse_attacks(bad)
    roles = assign({"nan": 0.1, "crash": 0.1}, 20, seed=0)
    assert sorted(Counter(roles.values()).values()) == [2, 2] and all(0 <= p < 20 for p in roles)
    assert roles == assign({"nan": 0.1, "crash": 0.1}, 20, seed=0)  # repeatable
    with pytest.raises(ValueError):
        assign({k: 0.1 for k in KINDS}, 8, seed=0)  # more attackers than devices


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
