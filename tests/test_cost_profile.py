"""The cost profile the throughput rule decides with: interpolation and extrapolation, block
timings that one disturbed trial cannot set, the on-disk cache reused and invalidated by machine
or model, and a device session (tiny models) that keeps its rule's calibration and lookup
history and measures the drafter once whatever adapter it merges."""

from __future__ import annotations

import json

import pytest
from runtime_models import PROMPTS
from tiny_pair import _engine

from omnidraft.shared.engine import profiling
from omnidraft.shared.engine.draft_policy import ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.profiling import CostProfile


def test_cost_profile_interpolates_and_extrapolates():
    p = CostProfile({1: 10.0, 4: 16.0, 8: 24.0}, 1.0)
    assert p.target_cost(1) == 10.0 and p.target_cost(2) == pytest.approx(12.0)
    assert p.target_cost(6) == pytest.approx(20.0) and p.target_cost(12) == pytest.approx(32.0)
    noisy = CostProfile({1: 10.0, 2: 9.0, 4: 16.0}, 1.0)  # a measured dip is noise
    assert noisy.target_ms == {1: 10.0, 2: 10.0, 4: 16.0}
    assert p.drafter_block_cost(0) == 0.0 and p.drafter_block_cost(3) == 3.0  # no feed costs: steps
    fed = CostProfile({1: 10.0}, 2.0, {1: 2.0, 8: 4.0})
    assert fed.drafter_block_cost(1) == 2.0 and fed.drafter_block_cost(8) == 4.0
    assert fed.drafter_block_cost(15) == pytest.approx(6.0)  # extrapolated from the last two sizes


def test_a_block_past_the_largest_measured_one_costs_its_last_doubling_s_slope():
    """The kernels' cost rises in steps: 14 and 16 tokens are both two 8-row passes. A line
    through the last two sizes priced every block past 16 at 16's cost (the 24-token block of a
    draft with the lookup's continuation 0.79x its measured cost on a Zen 4 EPYC); the slope from
    the largest size at most half the last one is the passes' mean cost per token."""
    stepped = CostProfile({1: 10.0, 8: 20.0, 14: 40.0, 16: 40.0}, 1.0)
    assert stepped.target_cost(24) == pytest.approx(40.0 + (40.0 - 20.0) / 8 * 8)
    assert stepped.target_cost(16) == 40.0 and stepped.target_cost(15) == 40.0
    assert CostProfile({4: 20.0}, 1.0).target_cost(8) == pytest.approx(40.0)  # one size: proportional
    assert {17, 32} <= set(profiling.PROFILE_BLOCKS)  # past 16 measured, not extrapolated


def test_the_profile_check_flags_a_profile_whose_drafter_to_target_ratio_is_off():
    """Each figure within STALE_RATIO of use but the drafter step 1.3x dearer, relative to a target
    step, than the profile says (it was measured in a slow spell of the target's measurement):
    the rule would draft too long, so the profile is measured again next time. Both slower or
    faster alike is not stale."""
    profile = CostProfile({1: 78.0, 4: 78.0}, 7.5)

    def check(target_ms: float, drafter_ms: float) -> dict:
        timings = profiling.StepTimings()
        for _ in range(6):
            timings.record_target(1, target_ms)
            timings.record_drafter_step(drafter_ms)
        return timings.check(profile)

    skewed = check(58.0, 7.2)  # target 0.74x its figure, drafter 0.96x: relative 1.29
    assert all(1 / profiling.STALE_RATIO <= r["ratio"] <= profiling.STALE_RATIO for r in skewed["steps"].values())
    assert skewed["drafter_vs_target"] == pytest.approx(1.291, abs=1e-3) and skewed["stale"]
    both = check(58.0, 5.6)  # both 0.74-0.75x: the rule's ratios hold
    assert not both["stale"] and both["drafter_vs_target"] == pytest.approx(1.0, abs=0.02)
    assert "drafter_vs_target" not in profiling.StepTimings().check(profile)  # nothing timed yet


def test_the_timings_in_use_sample_the_whole_run_not_its_start():
    """Past ``limit`` forwards of a size the kept samples are a uniform sample of all of them:
    a machine twice as slow in the second half of a run shows in the check, where keeping the
    first ``limit`` would report only the first half."""
    timings = profiling.StepTimings(limit=64)
    for i in range(4000):
        timings.record_target(4, 40.0 if i < 2000 else 80.0)
        timings.record_drafter_step(5.0 if i < 2000 else 10.0)
    assert timings.seen == {4: 4000, "drafter": 4000}
    assert len(timings.target[4]) == len(timings.drafter_steps) == 64
    late = sum(ms == 80.0 for ms in timings.target[4])
    assert 16 <= late <= 48  # about half (binomial, 64 draws: far outside 3 sigma otherwise)
    assert 16 <= sum(ms == 10.0 for ms in timings.drafter_steps) <= 48
    assert timings.total_ms == 2000 * (40 + 80 + 5 + 10)


class _TimedRunner:
    """A runner whose forwards do nothing: the tests replace ``profiling._time_block``."""

    max_positions = 512

    def __init__(self, name: str = "runner") -> None:
        self.name = name

    def reset(self): ...
    def forward(self, ids, logits_to_keep=0): ...


def test_block_timing_takes_the_median_of_trials_and_retries_outliers(monkeypatch):
    """One disturbed trial cannot set a figure: each trial keeps its minimum, the median of the
    trials is kept, and trials continue while they disagree."""
    trials = iter([9.0, 50.0, 10.0, 11.0, 10.0, 10.5, 10.2])
    monkeypatch.setattr(profiling, "_time_block", lambda runner, context, block, repeats: next(trials))

    # warm-up pass (1 value), then trials 50, 10, 11 disagree (50 > 1.25 * 10): more until
    # max_trials; the median of [50, 10, 11, 10, 10.5, 10.2] is 10.35
    ms = profiling.measure_block_ms(_TimedRunner(), (1,), trials=3, max_trials=6)
    assert ms[1] == pytest.approx(10.35)


def test_a_pair_is_measured_in_shared_trials_so_a_slow_spell_keeps_its_ratio(monkeypatch):
    """The target and the drafter are timed in the same trials (every block size of each in turn,
    then the next trial): a machine that turns 1.4x slower from the third trial on slows both
    alike, so the drafter's step keeps its true ratio to the target's (what the rule weighs);
    timed one after the other, the target would have been measured fast and the drafter slow."""
    cost = {("target", 1): 40.0, ("target", 4): 48.0, ("drafter", 1): 4.0, ("drafter", 2): 5.0}
    order: list[tuple[str, int]] = []

    def time_block(runner, context, block, repeats):
        order.append((runner.name, block))
        timed = [o for o in order if o[0] == "target" and o[1] == 1]  # a trial starts with the target's step
        slow = 1.4 if len(timed) > 3 else 1.0  # one warm-up pass and two trials fast, the rest slow
        return cost[runner.name, block] * slow

    monkeypatch.setattr(profiling, "_time_block", time_block)

    target_ms, drafter_ms = profiling.measure_together(
        [(_TimedRunner("target"), (1, 4), 5), (_TimedRunner("drafter"), (1, 2), 10)], trials=3, max_trials=7
    )
    trial = [("target", 1), ("target", 4), ("drafter", 1), ("drafter", 2)]
    assert order == trial + trial * 7  # warm-up, then trials until they agree (never, here: max_trials)
    assert drafter_ms[1] / target_ms[1] == pytest.approx(0.1) and target_ms[1] == pytest.approx(56.0)
    assert drafter_ms[2] / target_ms[4] == pytest.approx(5 / 48)


def test_profile_cache_is_reused_and_invalidated_by_machine_or_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "home" / "profiles"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"a": 1}')
    calls = []

    def measure():
        calls.append(1)
        return {"1": float(len(calls))}

    def costs():
        return profiling.cached({"model": profiling.model_fingerprint(model_dir), "precision": "int8"}, measure)

    assert costs() == {"1": 1.0} and costs() == {"1": 1.0} and len(calls) == 1
    # a measurement says what it measures (a first run must not look stalled); a cached read is silent
    assert capsys.readouterr().err.splitlines() == [
        "measuring this machine's costs: measurement int8 (cached for later runs)"
    ]
    machine = profiling.machine_fingerprint()
    monkeypatch.setattr(profiling, "machine_fingerprint", lambda: {**machine, "cpu": "Another CPU"})
    assert costs() == {"1": 2.0} and len(calls) == 2  # another machine: measured again
    (model_dir / "config.json").write_text('{"a": 2}')
    assert costs() == {"1": 3.0} and len(calls) == 3  # the model changed: measured again
    assert costs() == {"1": 3.0} and len(calls) == 3
    (tmp_path / "home" / "profiles").joinpath("junk.json").write_text("{")  # unrelated junk is ignored
    assert costs() == {"1": 3.0}


def test_device_state_keeps_the_rule_calibration_and_the_lookup_history(tmp_path, monkeypatch, pair_dir):
    from omnidraft.client.session import DeviceSession

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    engine = _engine(pair_dir)
    session = DeviceSession(engine, state_dir=tmp_path / "state", learn=False, adaptive=False)
    for prompt in PROMPTS:
        session.generate(prompt, GenerationConfig(max_new_tokens=16), learn=False)
    assert len(session.lookup.history) == 0  # generations that do not learn leave no trace
    session.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16), learn=True, observe=False)
    assert len(session.lookup.history) > 0
    learned = session.rule.calibration()
    fresh = ThroughputRule(engine.cost_profile()).calibration()
    assert sum(learned["tables"]["confidence"]["seen"]) > sum(fresh["tables"]["confidence"]["seen"])
    session.save()
    again = DeviceSession(engine, state_dir=tmp_path / "state", learn=False, adaptive=False)
    again.decoder()
    assert again.rule.calibration() == learned and not again.problems
    assert again.lookup.history.tokens == session.lookup.history.tokens
    # a damaged calibration is reported and replaced, never a crash
    again._saved_rule, again.rule = {"tables": {"confidence": [1.0]}}, None
    again.decoder()
    assert again.problems and again.rule.calibration() == fresh


def test_a_strangers_decode_drafts_nothing_from_the_owners_lookup_history(tmp_path, monkeypatch, pair_dir):
    """The lookup history holds what the device's owner wrote and was answered. A decode for a
    caller who is not the owner (``owner=False``: ``device serve`` without the owner token) never
    drafts from it (how fast its drafts were accepted would tell the caller whether the owner's
    text continues its prompt) and does not add to it; the owner's decode of the same prompt does
    draft from it."""
    from omnidraft.client.session import DeviceSession

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    session = DeviceSession(_engine(pair_dir), state_dir=tmp_path / "state", learn=False, adaptive=False)
    config = GenerationConfig(max_new_tokens=24)
    session.generate(PROMPTS[1], config, learn=True, observe=False)  # the owner's: joins the history
    held = list(session.lookup.history.tokens)
    sources = []
    propose = session.lookup.propose
    session.lookup.propose = lambda k, after=(): (lambda found: (sources.append(found and found.source), found)[1])(
        propose(k, after)
    )
    stranger = session.generate(PROMPTS[1], config, learn=True, owner=False)
    assert "history" not in sources and session.lookup.history.tokens == held
    assert stranger.training_sample is None and session.last_update is None  # a stranger teaches nothing
    sources.clear()
    owners = session.generate(PROMPTS[1], config)
    assert "history" in sources and owners.token_ids == stranger.token_ids


def test_a_merged_adapter_keeps_the_drafter_costs(tmp_path, monkeypatch, pair_dir):
    """A trained adapter is merged into its runner's weights: the drafter costs the same as
    without it, so the session's rule keeps deciding with the one profile measured (no second
    drafter measurement), and the profile check compares the adapter's steps with it."""
    import torch

    from omnidraft.client.session import DeviceSession

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    engine = _engine(pair_dir)
    session = DeviceSession(engine, state_dir=tmp_path / "state", learn=False, adaptive=False)
    session.decoder()
    base = session.rule.profile
    untrained = session.adapters.runner()
    assert untrained.lora_rank == 0  # an untrained adapter drafts on the base weights
    with torch.no_grad():  # what an update does: the adapter's B matrices move off zero
        for name, param in session.adapters.peft.named_parameters():
            if "lora_B" in name:
                param.add_(0.01)
    session.adapters.invalidate()
    session.drafter_changed()
    session.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8), learn=False)
    runner = session.adapters.runner()
    assert runner.lora_rank > 0 and runner._packing is not runner._base_packing  # merged
    assert session.rule.profile is base and engine.cost_profile() is base
    pair_entries = [
        p for p in (tmp_path / "profiles").glob("*.json") if json.loads(p.read_text())["key"]["role"] == "pair"
    ]
    assert len(pair_entries) == 1  # measured once, for every adapter
    assert engine.check_profile()["steps"]  # the adapter's steps are checked against it


def test_the_round_overhead_leaves_out_a_reused_prefill(tmp_path, monkeypatch, pair_dir):
    """The overhead runs after the first start from the target's prefill of the prompt; their
    wall time counts its seconds without a forward run then. Made to take 2 s, it must not
    show in the per-round overhead (it would add 2 s over 48 steps: 42 ms a step)."""
    from omnidraft.shared.engine.model_runner import Prefill

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    engine = _engine(pair_dir)
    target = engine.target_runner
    real = target.forward

    def forward(ids, logits_to_keep=0):
        out = real(ids, logits_to_keep)
        held = target.prefilled
        if held is not None and held.ids == tuple(ids):  # this forward was the prefill: a slow one
            target.prefilled = Prefill(held.ids, held.seconds + 2.0)
        return out

    monkeypatch.setattr(target, "forward", forward)
    overheads = engine._measure_overheads(engine.drafter_runner, CostProfile({1: 1.0}, 1.0))
    assert target.prefilled is not None and target.prefilled.seconds >= 2.0  # the runs reused it
    assert overheads["step_ms"] < 15 and overheads["round_ms"] < 15


def test_confidence_drafting_measures_no_cost_profile(tmp_path, monkeypatch, pair_dir):
    """``draft_stop="confidence"`` decodes without the throughput rule, so neither the engine
    nor a device session reads or measures this machine's costs (under emulation, or on a slow
    board, a first measurement takes most of an hour); the output is the target alone's."""
    from omnidraft.client.session import DeviceSession

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    engine = _engine(pair_dir)

    def refuse(*args, **kwargs):
        raise AssertionError("a cost profile was measured")

    monkeypatch.setattr(profiling, "cached", refuse)
    config = GenerationConfig(max_new_tokens=16, draft_stop="confidence")
    ar = engine.generate(PROMPTS[0], config, method="ar")
    assert engine.generate(PROMPTS[0], config).token_ids == ar.token_ids
    session = DeviceSession(engine, state_dir=tmp_path / "state", learn=False, adaptive=False)
    assert session.generate(PROMPTS[0], config, learn=False).token_ids == ar.token_ids
    assert session.rule is None and not (tmp_path / "profiles").exists()
    with pytest.raises(AssertionError, match="a cost profile was measured"):  # the rule still measures
        engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16, draft_stop="cost"))


def test_a_decode_says_where_its_time_went(pair_dir, monkeypatch):
    """``GenerationStats`` splits a timed decode into the target's forwards, the drafter's and
    the rest: with every target forward made 20 ms slower, the target's share covers at least
    those 20 ms a call, the shares add up to 1, the target alone's decode has no drafter share,
    and a decoder that does not time its forwards reports no split instead of a wrong one."""
    import time

    engine = _engine(pair_dir)
    runner = engine.target_runner
    forward = runner.forward

    def slow_forward(ids, *args, **kwargs):
        time.sleep(0.02)
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", slow_forward)
    config = GenerationConfig(max_new_tokens=12, draft_stop="confidence", confidence=0.0, k_max=3)
    text, ids = engine.prompt_ids(PROMPTS[0])
    for result, drafted in (
        (engine.omnidraft(rule=False).generate(text, ids, config), True),
        (engine.ar().generate(ids, config), False),
    ):
        s = result.stats
        shares = s.decode_time_shares
        assert shares is not None and sum(shares.values()) == pytest.approx(1.0)
        assert s.target_forward_s >= 0.02 * s.target_calls
        assert shares["target"] > 0.5 and (shares["drafter"] > 0) == drafted
        assert s.target_forward_s + s.drafter_forward_s <= s.wall_s - s.prefill_s
    untimed = engine.omnidraft(rule=False)
    untimed.timings = untimed.side.timings = None
    assert untimed.generate(text, ids, config).stats.decode_time_shares is None
