"""What a simulation is given, checked without running one: TOML scenarios and their events,
the shipped scenario files, the ``--attack`` flag, the Ray cluster's address and the thread
count its workers take from the scenario, the app bundle ``flwr run`` is given, and the report's
verdict on whether learning paid in speed."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from omnidraft.simulations import report
from omnidraft.simulations.profile_check import stale_notes
from omnidraft.simulations.scenario import Drift, Rollout, Scenario


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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Flower's FAB build uses deprecated pathspec patterns
def test_flwr_run_is_given_the_bundle_the_repository_would_make(tmp_path):
    """The copy of the app that the simulation hands `flwr run` builds the same app bundle (the
    same bytes, so the same hash) as Flower builds from the repository itself, where it reads
    every file of the checkout first."""
    from flwr.cli.build import build_fab_from_disk

    from omnidraft.simulations.flower_runner import _bundle_files
    from omnidraft.simulations.scenario import APP_DIR

    staged = _bundle_files(APP_DIR, tmp_path / "app")
    assert sorted(p.name for p in staged.iterdir()) == ["README.md", "pyproject.toml"]
    assert build_fab_from_disk(staged) == build_fab_from_disk(APP_DIR)
    (staged / "stale.py").write_text("")
    assert not (_bundle_files(APP_DIR, staged) / "stale.py").exists()  # staged afresh each run
    other = tmp_path / "other"
    other.mkdir()
    for include, message in ((None, "must name the bundle's files"), ('["*.md"]', "not a file of the app")):
        line = "" if include is None else f"fab-include = {include}\n"
        (other / "pyproject.toml").write_text(f"[tool.flwr.app]\npublisher = 'x'\n{line}")
        with pytest.raises(ValueError, match=message):  # a pattern would need the walk this copy avoids
            _bundle_files(other, tmp_path / "staged")


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
    # a slow spell in round 0 lifts that round's live ratio: live falls while the model rises
    spell = report.verdict(
        {"q": summary(1.36, 1.20, **{"modelled-speedup-first": 1.44, "modelled-speedup-last": 1.71})}
    )
    assert "disagree: 1.36x → 1.20x" in spell and "modelled speedup rose" in spell and "did not pay" not in spell
    agree = report.verdict({"q": summary(1.3, 1.1, **{"modelled-speedup-first": 1.44, "modelled-speedup-last": 1.30})})
    assert "did not pay: 1.30x → 1.10x" in agree


def test_a_new_devices_share_of_the_veterans_gain():
    """Warm over cold for new devices, against veterans over their own cold start (modelled
    speedups, pooled over the rounds that measured all four); the verdict says it."""

    def row(warm, cold, veteran, veteran_cold):
        speeds = dict(zip(report.FIRST_SESSIONS, (warm, cold, veteran, veteran_cold)))
        return {f"{who}-modelled-speedup": v for who, v in speeds.items()}

    # new devices gain 1.5/1.4 - 1 = 7.1 %, veterans 1.8/1.4 - 1 = 28.6 %: a quarter of it
    assert report.gain_share([row(1.5, 1.4, 1.8, 1.4)]) == pytest.approx((1.5 / 1.4 - 1) / (1.8 / 1.4 - 1))
    assert report.gain_share([row(1.5, 1.4, 1.8, 1.4), row(1.7, 1.4, 2.0, 1.6)]) == pytest.approx(
        (1.6 / 1.4 - 1) / (1.9 / 1.5 - 1)
    )
    assert report.gain_share([row(1.5, 1.4, 1.3, 1.4)]) is None  # the veterans gained nothing
    assert report.gain_share([{"new-warm-modelled-speedup": 1.5}]) is None  # not measured
    text = report.verdict(
        {
            "q": {
                "speedup-first": 1.2,
                "speedup-last": 1.35,
                "first-round": 0,
                "last-round": 3,
                "acceptance-k-first": None,
                "new-devices": 3,
                "new-warm-acceptance": 0.43,
                "new-cold-acceptance": 0.38,
                "new-warm-acceptance-k": None,
                "new-cold-acceptance-k": None,
                "new-warm-modelled-speedup": 1.5,
                "new-cold-modelled-speedup": 1.4,
                "veteran-modelled-speedup": 1.8,
                "veteran-cold-modelled-speedup": 1.4,
                "new-gain-share": 0.25,
            }
        }
    )
    assert "veterans 1.80x, 1.40x with nothing they hold: a new device starts with 25% of the veterans' gain" in text


def test_the_live_panels_profile_check_is_reported_round_by_round():
    """A live evaluation's profile check becomes two metrics (one-token target steps in use over
    the profile; the drafter step's ratio over that one), each only where the check had enough
    steps; the report tabulates them per round and target, and leaves the section out without
    them."""
    from omnidraft.client.evaluation import profile_check_metrics
    from omnidraft.shared.wire import MetricKey

    check = {
        "steps": {"target:1": {"ratio": 1.25}, "target:4": {"ratio": 1.1}, "drafter:1": {"ratio": 1.0}},
        "stale": False,
        "drafter_vs_target": 0.8,
    }
    assert profile_check_metrics(check) == {
        MetricKey.PROFILE_TARGET_STEP: 1.25,
        MetricKey.PROFILE_DRAFTER_VS_TARGET: 0.8,
    }
    assert profile_check_metrics({"steps": {"target:4": {"ratio": 1.1}}, "stale": False}) == {}
    records = [
        {"round": 1, "target": "q", "eval-profile-target-step": 1.25, "eval-profile-drafter-vs-target": 0.8},
        {"round": 0, "target": "q", "eval-profile-target-step": 0.9},
        {"round": 2, "target": "q"},
    ]
    table = report.profile_table(records).splitlines()
    assert table[2:] == ["| 0 | q | 0.90 | – |", "| 1 | q | 1.25 | 0.80 |"]
    assert report.profile_table([{"round": 1, "target": "q"}]) is None
    # the last checked round decides: 1.25x and 0.80x are within 1.5x, not within 1.2x
    real = {"models": "real", "cpus_per_device": 2, "dtype": "int8"}
    assert "1.25x" in stale_notes(records, real)[0] and stale_notes(records[1:], real) == []
    off = records[1:] + [
        {"round": 3, "target": "q", "eval-profile-target-step": 0.72, "eval-profile-drafter-vs-target": 1.38}
    ]
    (note,) = stale_notes(off, real)
    assert "round 3" in note and "0.72x" in note and "1.38x" in note
    assert note.endswith(
        "OMNIDRAFT_THREADS=2 omnidraft profile --drafter smollm2-135m --target q --dtype int8 --refresh"
    )
    (tiny,) = stale_notes(off[:-1] + [{"round": 3, "target": "q", "eval-profile-target-step": 1.6}], {"models": "tiny"})
    assert "1.60x" in tiny and "omnidraft profile" not in tiny  # tiny models: no catalog names to give
