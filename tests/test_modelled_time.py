"""The modelled decode time: each round charged its cost in the machine's cost profile, by part
(the target's forwards, the drafter's, the rest), beside the live time of the same parts."""

from __future__ import annotations

import pytest
import test_throughput_rule
from test_throughput_rule import REPETITIVE, spd

from omnidraft.shared.engine.decoding import TargetOnlyDecoder
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.profiling import CostProfile, StepTimings

pair, bridge = test_throughput_rule.pair, test_throughput_rule.bridge  # the tiny pair's fixtures


def test_modelled_speed_charges_each_round_its_profiled_cost(pair, bridge):
    """With blocks that cost what one target step does and nothing else charged, the modelled
    decoding time is 10 ms per target call and the target alone's 10 ms per token: the modelled
    speedup is exactly the tokens per call. Charging the drafter makes it lower, never higher."""
    flat = CostProfile({1: 10.0, 16: 10.0}, drafter_ms_per_token=0.0)
    charged = CostProfile({1: 10.0, 16: 10.0}, drafter_ms_per_token=0.5, round_overhead_ms=0.5, step_overhead_ms=0.5)
    ar = TargetOnlyDecoder(pair.target, bridge)
    for prompt in REPETITIVE:
        ids = pair.target_tokenizer.encode(prompt)
        config = GenerationConfig(max_new_tokens=40)
        assert ar.generate(ids, config).stats.modelled_s == 0.0  # the target alone has no profile
        s = spd(pair, bridge, flat).generate(prompt, ids, config).stats
        assert s.modelled_s == pytest.approx(s.target_calls * 0.010)
        assert s.modelled_target_alone_s == pytest.approx(s.new_tokens * 0.010)
        assert s.modelled_speedup == pytest.approx(s.tokens_per_target_call)
        c = spd(pair, bridge, charged).generate(prompt, ids, config).stats
        assert c.modelled_s > c.target_calls * 0.010 and c.modelled_speedup < c.tokens_per_target_call
        # by part: every call's block costs 10 ms and every round's work outside the forwards
        # 0.5 ms, so what is left is the drafter's (its feeds and steps at 0.5 ms a token)
        assert s.modelled_target_s == pytest.approx(s.modelled_s) and s.modelled_drafter_s == 0.0
        assert c.modelled_target_s == pytest.approx(c.target_calls * 0.010)
        rest = c.modelled_s - c.modelled_target_s - c.modelled_drafter_s
        assert rest == pytest.approx(c.target_calls * 0.0005)
        assert c.modelled_drafter_s >= c.drafter_steps * 0.0005 - c.target_calls * 0.0005 > 0


def test_the_modelled_drafter_time_prices_the_forwards_the_drafter_ran(pair, bridge):
    """At 1 ms a drafter token (no block table: a block of ``b`` tokens costs ``b`` ms), the
    modelled drafter time equals the tokens the drafter's forwards read: its prompt read at the
    first drafter round, each round's catch-up feed, and one step per drafted token but the
    last, which the next round feeds (the model once charged a step for it too)."""
    profile = CostProfile({1: 10.0, 16: 10.0}, drafter_ms_per_token=1.0)
    decoder = spd(pair, bridge, profile)
    read = []
    forward = decoder.drafter.forward
    decoder.drafter.forward = lambda ids, **kw: read.append(len(ids)) or forward(ids, **kw)
    for prompt in REPETITIVE:
        read.clear()
        stats = decoder.generate(
            prompt, pair.target_tokenizer.encode(prompt), GenerationConfig(max_new_tokens=40)
        ).stats
        assert stats.drafter_steps > stats.target_calls - stats.lookup_rounds - stats.plain_rounds > 0
        assert stats.modelled_drafter_s * 1000 == pytest.approx(sum(read))


def test_a_timed_decode_reports_each_part_of_a_call_live_and_modelled(pair, bridge):
    """``ms_per_target_call`` splits a call's decode time (prompt prefill excluded) into the
    target's forwards, the drafter's and the rest, live (timed) and under the profile: each side
    adds up to its decode time per call."""
    profile = CostProfile({1: 10.0, 16: 10.0}, drafter_ms_per_token=0.5, round_overhead_ms=0.5, step_overhead_ms=0.5)
    decoder = spd(pair, bridge, profile, timings=StepTimings())
    prompt = REPETITIVE[0]
    stats = decoder.generate(prompt, pair.target_tokenizer.encode(prompt), GenerationConfig(max_new_tokens=40)).stats
    per_call = stats.ms_per_target_call
    assert set(per_call) == {"live", "modelled"}
    assert all(set(parts) == {"target", "drafter", "rest"} for parts in per_call.values())
    live_ms = (stats.wall_s - stats.prefill_s) * 1000 / stats.target_calls
    assert sum(per_call["live"].values()) == pytest.approx(live_ms, abs=0.02)
    assert sum(per_call["modelled"].values()) == pytest.approx(stats.modelled_s * 1000 / stats.target_calls, abs=0.02)
    assert per_call["live"]["target"] > 0 and per_call["live"]["drafter"] > 0
    assert per_call["modelled"]["target"] == pytest.approx(10.0)
    assert (
        TargetOnlyDecoder(pair.target, bridge)
        .generate(pair.target_tokenizer.encode(prompt), GenerationConfig(max_new_tokens=8))
        .stats.ms_per_target_call
        is None
    )  # nothing modelled
