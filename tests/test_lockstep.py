"""Decodes side by side: several sequences' drafter forwards in one native call
(``shared.runtime.batched_steps``), decodes that take turns (``shared.engine.lockstep``) and a
fixed-k pass that replays its prompts side by side (``client.evaluation.FixedKPass``).

What must hold: each runner gets, bit for bit, the logits and cache its own ``forward`` gives,
whatever else shares the call; jobs run one at a time, in a fixed order, and their exceptions
reach the caller; a side-by-side fixed-k pass reports what one prompt after another reports.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from test_fast_drafter import VOCAB, kind_of, tiny_llama
from test_fleet_device import _probe_profile

from omnidraft.shared.engine.lockstep import Lockstep
from omnidraft.shared.runtime import batched_steps
from omnidraft.shared.runtime.batched_steps import forward_together
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import NATIVE_ISAS, default_native_isa, native_library


def _native_isa() -> str:
    """This machine's native kernels' instruction set (the test is skipped without them)."""
    isa = default_native_isa()
    if isa is None or native_library(isa) is None:
        pytest.skip("no native int8 kernels on this machine")
    return isa


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
@pytest.mark.parametrize("variant", ["tied", "bias", "pruned", "act8"])
def test_forwards_together_equal_each_runners_own(isa, variant, monkeypatch):
    """Four sequences of different lengths on forks of one runner: steps of 1-4 tokens (and a
    longer one, which runs alone with 16-bit activations; 8-bit ones, a target's, take up to
    eight rows a call) keeping 0, 1 or 2 logits rows, together and one runner at a time give
    equal logits, the same cache contents and the same last hidden state."""
    weights, native, isa = kind_of(f"int8-native-{isa}")
    model = tiny_llama(tied=variant == "tied", bias=variant == "bias")
    rows = torch.arange(0, VOCAB, 3) if variant == "pruned" else None
    bits = 8 if variant == "act8" else 16
    base = FastLlamaRunner(
        model, weights=weights, native=native, native_isa=isa, max_positions=128, vocab_rows=rows, activation_bits=bits
    )
    assert batched_steps.rows_per_call(base) == (8 if bits == 8 else 4)
    alone = [base.fork(current=True) for _ in range(4)]
    together = [base.fork(current=True) for _ in range(4)]
    for k, (a, b) in enumerate(zip(alone, together)):  # prompts of 3-40 tokens
        prompt = _ids(3 + 12 * k, seed=k)
        assert torch.equal(a.forward(prompt, 1), b.forward(prompt, 1))
    steps = [[1, 1, 1, 1], [2, 1, 3, 1], [1, 4, 1, 1], [6, 1, 1, 2], [1, 1, 4, 4]]
    real, widths = batched_steps._forward_rows, []
    monkeypatch.setattr(batched_steps, "_forward_rows", lambda calls: widths.append(len(calls)) or real(calls))
    for s, lengths in enumerate(steps):
        calls = [(_ids(n, seed=100 * s + k), (0, 1, 2)[(s + k) % 3]) for k, n in enumerate(lengths)]
        want = [runner.forward(ids, keep) for runner, (ids, keep) in zip(alone, calls)]
        widths.clear()
        got = forward_together([(runner, ids, keep) for runner, (ids, keep) in zip(together, calls)])
        if bits == 8 and sum(lengths) <= 8:
            assert widths == [4]  # every sequence's step in one call
        for w, g in zip(want, got):
            assert g.shape == w.shape and torch.equal(g, w)
        for a, b in zip(alone, together):
            assert a.held == b.held
            assert torch.equal(a.last_hidden(), b.last_hidden())


def _prefilling_runner(prefill_bits: int) -> FastLlamaRunner:
    """A runner that prefills on the native kernels too, as a drafter does, with
    ``prefill_bits``-bit activations (8: the drafter's, per-row scales) and 16-bit steps."""
    return FastLlamaRunner(
        tiny_llama(tied=True),
        weights="int8",
        native=True,
        native_isa=_native_isa(),
        max_positions=128,
        prefill_weights=None,
        prefill_activation_bits=prefill_bits,
    )


@pytest.mark.parametrize("prefill_bits", [16, 8])
def test_a_prefill_takes_the_prefix_it_shares_with_another_sequence_and_stays_exact(prefill_bits, monkeypatch):
    """Three prompts of 50 tokens: the second shares its first 30 with the first (a tail of 20,
    more than a step: it copies them and forwards 20 tokens), the third its first 40 (a tail of
    10: with one activation width it copies 40 and forwards 10; where a step's activations are
    not a prefill's, it forwards 17, the shortest tail computed as a prefill, and copies 33).
    Logits and the steps after them equal those of prefills from nothing."""
    base = _prefilling_runner(prefill_bits)
    first = _ids(50, seed=1)
    prompts = [first, first[:30] + _ids(20, seed=2), first[:40] + _ids(10, seed=3)]
    fresh = [base.fork(current=True) for _ in prompts]
    want = [runner.forward(ids, 1) for runner, ids in zip(fresh, prompts)]
    forwarded = []
    real = FastLlamaRunner.forward
    monkeypatch.setattr(
        FastLlamaRunner, "forward", lambda self, ids, *a, **k: forwarded.append(len(ids)) or real(self, ids, *a, **k)
    )
    shared = [base.fork(current=True) for _ in prompts]
    got = forward_together([(runner, ids, 1) for runner, ids in zip(shared, prompts)])
    assert forwarded == [50, 20, 10 if prefill_bits == 16 else 17]
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    for step in range(3):
        ids = _ids(1, seed=10 + step)
        for a, b in zip(fresh, shared):
            assert torch.equal(a.forward(ids, 1), b.forward(ids, 1))
            assert a.held == b.held


@pytest.mark.parametrize("prefill_bits", [16, 8])
def test_a_prefill_takes_from_another_sequence_only_the_positions_its_own_prefill_writes_alike(
    prefill_bits, monkeypatch
):
    """Another sequence holds a prompt of 30 tokens and 6 one-token steps after it; a prompt of
    those 36 tokens and 20 more copies what a prefill of its own would write alike: all 36 where
    prefill and steps share one activation width, only the prompt's 30 where the steps' 16-bit
    activations differ from the prefill's 8-bit ones (it forwards the other 26). Logits, cache
    and the steps after them equal those of a prefill from nothing."""
    base = _prefilling_runner(prefill_bits)
    donor = base.fork(current=True)
    donor.forward(_ids(30, seed=1), 1)
    for step in range(6):
        donor.forward(_ids(1, seed=20 + step), 1)
    prompt = donor.held + _ids(20, seed=2)
    fresh = base.fork(current=True)
    want = fresh.forward(prompt, 1)
    forwarded = []
    real = FastLlamaRunner.forward
    monkeypatch.setattr(
        FastLlamaRunner, "forward", lambda self, ids, *a, **k: forwarded.append(len(ids)) or real(self, ids, *a, **k)
    )
    runner = base.fork(current=True)
    (_, got) = forward_together([(donor, _ids(1, seed=9), 1), (runner, prompt, 1)])
    assert forwarded == [20 if prefill_bits == 16 else 26]
    assert torch.equal(want, got) and runner.held == fresh.held
    for step in range(3):
        ids = _ids(1, seed=40 + step)
        assert torch.equal(fresh.forward(ids, 1), runner.forward(ids, 1))


def test_forwards_of_runners_on_other_weights_do_not_share_a_call(monkeypatch):
    """Runners on different packings (another adapter) each get their own native call."""
    isa = _native_isa()
    runners = [
        FastLlamaRunner(tiny_llama(tied=True, seed=seed), weights="int8", native=True, native_isa=isa)
        for seed in (0, 1)
    ]
    groups = []
    real = batched_steps._forward_rows
    monkeypatch.setattr(batched_steps, "_forward_rows", lambda calls: groups.append(len(calls)) or real(calls))
    want = [r.fork(current=True).forward([5, 6], 1) for r in runners]
    got = forward_together([(r.fork(current=True), [5, 6], 1) for r in runners])
    assert groups == [1, 1]
    assert all(torch.equal(w, g) for w, g in zip(want, got))


class _CountingRunner:
    """A stand-in runner (not batchable): forward returns the ids it was given, as logits."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def forward(self, ids, logits_to_keep=0):
        self.held.extend(ids)
        return torch.tensor(ids, dtype=torch.float32)


def test_jobs_take_turns_and_their_forwards_run_together(monkeypatch):
    """Three jobs of 2, 4 and 3 forwards: one job runs at a time, each gets its own logits,
    every round of forwards goes to ``forward_together`` at once (4 rounds) and the order in
    which the jobs run is the same on every run."""
    rounds = []
    real = forward_together
    monkeypatch.setattr(
        "omnidraft.shared.engine.lockstep.forward_together", lambda calls: rounds.append(len(calls)) or real(calls)
    )
    running, trace, lock = [0], [], threading.Lock()

    def job(runner, name: str, n: int):
        def run():
            out = []
            for step in range(n):
                with lock:
                    running[0] += 1
                    assert running[0] == 1  # never two jobs at once
                    trace.append((name, step))
                    running[0] -= 1
                out.append(int(runner.forward([step * 10 + len(name)])[0]))
            return name, out

        return run

    traces = []
    for _ in range(2):
        trace.clear()
        rounds.clear()
        group = Lockstep([_CountingRunner() for _ in range(3)])
        jobs = [job(group.runners[i], name, n) for i, (name, n) in enumerate([("a", 2), ("bb", 4), ("ccc", 3)])]
        results = group.run(jobs)
        assert results == [("a", [1, 11]), ("bb", [2, 12, 22, 32]), ("ccc", [3, 13, 23])]
        assert rounds == [3, 3, 2, 1] and group.forward_calls == 4
        assert group.runners[1].held == [2, 12, 22, 32]  # the wrapped runner's attributes
        traces.append(list(trace))
    assert traces[0] == traces[1]


def test_a_job_that_raises_stops_only_itself_and_reaches_the_caller():
    group = Lockstep([_CountingRunner() for _ in range(3)])
    done = []

    def fine(runner, n):
        def run():
            for step in range(n):
                runner.forward([step])
            done.append(n)
            return n

        return run

    def broken():
        group.runners[1].forward([1])
        raise RuntimeError("job 1 failed")

    with pytest.raises(RuntimeError, match="job 1 failed"):
        group.run([fine(group.runners[0], 3), broken, fine(group.runners[2], 2)])
    assert sorted(done) == [2, 3]
    with pytest.raises(ValueError, match="2 jobs for 3 runners"):
        Lockstep([_CountingRunner() for _ in range(3)]).run([lambda: 1, lambda: 2])


def test_a_fixed_k_pass_replays_its_prompts_side_by_side_with_the_same_figures(tiny, tmp_path, monkeypatch):
    """A Llama drafter of 64-wide layers runs on the native kernels (a tiny target's model
    drafting for the other target): the replayed fixed-k pass over five prompts side by side
    gives each prompt the output, acceptance and target calls that decoding them one by one
    gives, with drafter steps of several prompts in one native call."""
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.evaluation import FixedKPass, evaluate_fixed_k, target_alone
    from omnidraft.client.fleet_device import FleetDevice

    _native_isa()
    heldout = [f"def task_{n}(value):\n    total = value * {n}\n    for item in range({n + 2}):\n" for n in range(5)]
    # a probe of tiny-target-a whose drafter is tiny-target-b's model (64-wide: native kernels)
    profile = replace(_probe_profile(tiny, "p", heldout, tmp_path), drafter=str(tiny["tiny-target-b"]))
    session = FleetDevice(profile, EnginePool("fp32", "int8")).session(use_global=False)
    session.learn = False
    assert batched_steps.batchable(session.drafting_runner())
    config = profile.generation
    recordings = [r.token_ids for r in target_alone(session, heldout, config)]
    one_by_one = FixedKPass(session, config, 3)
    want = [one_by_one.decode(prompt, recording) for prompt, recording in zip(heldout, recordings)]
    widths = []
    real = batched_steps._forward_rows
    monkeypatch.setattr(batched_steps, "_forward_rows", lambda calls: widths.append(len(calls)) or real(calls))
    side_by_side = FixedKPass(session, config, 3)
    got = side_by_side.decode_together(heldout, recordings)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for field in ("target_calls", "proposed_tokens", "accepted_tokens", "drafter_steps", "new_tokens"):
            assert getattr(g.stats, field) == getattr(w.stats, field), field
    assert side_by_side.summary() == one_by_one.summary()
    assert max(widths) > 1  # steps of several prompts shared a native call
    summary = evaluate_fixed_k(session, heldout, config, 3, recordings=recordings)
    assert summary == one_by_one.summary()
