"""What a device's evaluation runs: decode held-out prompts with the current state (the deployed
draft rule, or a fixed draft length), and the target alone as the speed baseline. A fleet
round's evaluation (``fleet_device``) and ``omnidraft adapt`` (``omnidraft.benchmarks.adapt``)
measure with the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from tqdm import tqdm

from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.generation import GenerationConfig, GenerationResult, GenerationStats
from omnidraft.shared.engine.lockstep import Lockstep
from omnidraft.shared.engine.recorded_target import RecordedTarget
from omnidraft.shared.engine.recordings import Recording
from omnidraft.shared.runtime.batched_steps import batchable
from omnidraft.shared.wire import MetricKey


@dataclass
class Phase:
    """Totals over a set of generations, and each generation's output ids."""

    stats: GenerationStats = field(default_factory=GenerationStats)
    token_ids: list[list[int]] = field(default_factory=list)

    def add(self, result) -> None:
        self.stats.add(result.stats)
        self.token_ids.append(result.token_ids)

    def summary(self, ar_tokens_per_s: float | None = None, ar_decode_tokens_per_s: float | None = None) -> dict:
        """Totals; the speedups divide by the target alone's tok/s (``ar_tokens_per_s``) and its
        tok/s after the prompt's prefill (``ar_decode_tokens_per_s``), when given."""
        st = self.stats
        tps, decode_tps = st.tokens_per_s or 0.0, st.decode_tokens_per_s or 0.0
        return {
            "acceptance_rate": st.acceptance_rate or 0.0,
            "tokens_per_target_call": st.tokens_per_target_call or 0.0,
            "tokens_per_s": tps,
            "speedup_vs_ar": tps / ar_tokens_per_s if ar_tokens_per_s else None,
            "decode_tokens_per_s": decode_tps,
            "decode_speedup_vs_ar": decode_tps / ar_decode_tokens_per_s if ar_decode_tokens_per_s else None,
            "drafter_steps_per_target_call": st.drafter_steps / st.target_calls if st.target_calls else 0.0,
            "modelled_speedup_vs_ar": st.modelled_speedup,
            "decode_time_shares": st.decode_time_shares,
            "ms_per_target_call": st.ms_per_target_call,
            "new_tokens": st.new_tokens,
            "wall_s": st.wall_s,
        }


def warm_up(session: DeviceSession, prompt: str) -> None:
    """First-call initialization (allocations, kernel selection) outside every timing."""
    tiny = GenerationConfig(max_new_tokens=4)
    session.generate(prompt, tiny, learn=False)
    _, ids = session.engine.prompt_ids(prompt)
    session.engine.ar().generate(ids, tiny)


def evaluate(
    session: DeviceSession,
    prompts: list[str],
    config: GenerationConfig,
    label: str,
    ar: Phase | None = None,
    beside: tuple[DeviceSession, Phase] | None = None,
) -> Phase:
    """Decode ``prompts`` with the session's current state (no learning); with ``ar`` given,
    the target alone runs on each prompt too (interleaved) and is added to it. ``beside``: another
    session (on the same engine) that decodes each prompt too, added to its phase; the two
    sessions take turns going first, prompt by prompt, so neither gets a quieter machine."""
    phase = Phase()
    ar_decoder = session.engine.ar() if ar is not None else None
    for i, prompt in enumerate(tqdm(prompts, desc=label, unit="prompt", leave=False)):
        if ar_decoder is not None:
            _, ids = session.engine.prompt_ids(prompt)
            ar.add(ar_decoder.generate(ids, config))
        turns = [(session, phase)] if beside is None else [(session, phase), beside]
        if i % 2 == 0:
            turns.reverse()  # the two sessions take turns going first
        for who, into in turns:
            into.add(who.generate(prompt, config, learn=False))
    return phase


class FixedKPass:
    """Acceptance and tokens per target call when every round drafts exactly ``k`` drafter
    tokens (the paper's protocol: no acceptance head, no stopping rule), one prompt at a time
    (``decode``), so that a caller can interleave it with an ``AdaptivePass`` over the same
    prompts: the drafter's runner keeps the keys and values of the sequence it decoded last, so
    the second decode of a prompt does not read the prompt again."""

    def __init__(self, session: DeviceSession, config: GenerationConfig, k: int) -> None:
        self.session, self.k = session, k
        self.config = replace(config, draft_stop="confidence", confidence=0.0, k_max=k)
        self.phase = Phase()
        self._live = None

    def decode(self, prompt: str, recording: list[int] | None = None) -> GenerationResult:
        """Decode ``prompt``; returns the result (under greedy decoding its ``token_ids`` are the
        target's greedy output, a recording). ``recording`` (greedy only): the target's greedy
        output ids for ``prompt``, replayed instead of running the target (``RecordedTarget``: the
        same figures, at the drafter's cost)."""
        session = self.session
        text, ids = session.engine.prompt_ids(prompt)
        if recording is None:
            self._live = self._live or session.decoder()
            decoder = self._live
        else:
            if not self.config.greedy:
                raise ValueError("replayed acceptance needs greedy decoding")
            decoder = session.decoder(target=RecordedTarget(ids + recording, session.engine.target.logit_rows))
        result = decoder.generate(text, ids, self.config)
        self.phase.add(result)
        return result

    def decode_together(self, prompts: Sequence[str], recordings: Sequence[list[int]]) -> list[GenerationResult]:
        """Decode ``prompts`` replaying their ``recordings`` (greedy only; see ``decode``) side by
        side, each on its own fork of the drafting runner (the same weights, its own KV cache),
        their drafter forwards run together (``lockstep``): the results ``decode`` gives one
        prompt after another (only the n-gram cache, which the ``ngram`` translator reads, grows
        in another order), at a fraction of the drafter's time. Where the drafter's forwards
        cannot run together, the prompts are decoded one after another."""
        if not self.config.greedy:
            raise ValueError("replayed acceptance needs greedy decoding")
        session = self.session
        runner = session.drafting_runner()
        if len(prompts) < 2 or not batchable(runner):
            return [self.decode(prompt, recording) for prompt, recording in zip(prompts, recordings)]
        group = Lockstep([runner.fork(current=True) for _ in prompts])
        jobs = []
        for prompt, recording, drafter in zip(prompts, recordings, group.runners):
            text, ids = session.engine.prompt_ids(prompt)
            target = RecordedTarget(ids + recording, session.engine.target.logit_rows)
            jobs.append(partial(session.decoder(target, rule=False, drafter=drafter).generate, text, ids, self.config))
        results = group.run(jobs)
        for result in results:
            self.phase.add(result)
        return results

    def summary(self) -> dict:
        summary = self.phase.summary()
        return {
            "k": self.k,
            "acceptance_rate": summary["acceptance_rate"],
            "tokens_per_target_call": summary["tokens_per_target_call"],
            "new_tokens": summary["new_tokens"],
        }


def evaluate_fixed_k(
    session: DeviceSession,
    prompts: list[str],
    config: GenerationConfig,
    k: int,
    label: str | None = None,
    recordings: list[list[int]] | None = None,
) -> dict:
    """``FixedKPass`` over ``prompts``; ``label`` names a progress bar (None: no bar).
    ``recordings`` (greedy ``config`` only): the target's greedy output ids for each prompt,
    replayed instead of running the target."""
    if recordings is not None and (not config.greedy or len(recordings) != len(prompts)):
        raise ValueError("replayed acceptance needs greedy decoding and one recording per prompt")
    fixed = FixedKPass(session, config, k)
    if recordings is not None:  # side by side (no progress bar: they finish together)
        fixed.decode_together(prompts, recordings)
        return fixed.summary()
    for prompt in tqdm(prompts, desc=label, unit="prompt", leave=False, disable=label is None):
        fixed.decode(prompt)
    return fixed.summary()


def profile_check_metrics(check: dict) -> dict:
    """A profile check's (``Engine.check_profile``) figures as evaluation metrics: one-token
    target steps timed in use over the cached profile's figure, and the drafter step's ratio
    over that one (1.0: the rule weighed the two as they cost); each only where the check had
    enough steps of it."""
    ratios = {
        MetricKey.PROFILE_TARGET_STEP: check["steps"].get("target:1", {}).get("ratio"),
        MetricKey.PROFILE_DRAFTER_VS_TARGET: check.get("drafter_vs_target"),
    }
    return {key: float(ratio) for key, ratio in ratios.items() if ratio}


def target_alone(session: DeviceSession, prompts: list[str], config: GenerationConfig) -> list:
    """The target alone on each prompt (its ``GenerationResult``s): with greedy ``config`` their
    ``token_ids`` are the recordings ``evaluate_fixed_k`` replays; their tok/s is the speed
    baseline."""
    decoder = session.engine.ar()
    return [decoder.generate(session.engine.prompt_ids(prompt)[1], config) for prompt in prompts]


class AdaptivePass:
    """Prompts decoded as the device decodes (adaptive draft length), without learning, one at
    a time (``decode``); ``metrics`` gives the round's metrics (``MetricKey``).

    ``measure_ar``: the target alone decodes each prompt just before it (``{"ids", "tokens",
    "s", "prefill_s"}``: the speedup's baseline, timed beside it); the speculative decode starts
    from the prompt's prefill that run left in the target's cache, counted at its measured
    seconds in both (``speedup``), or left out of both (``decode-speedup``: what the modelled
    speedup models); the cost profile is then checked against the forwards timed in use
    (``profile_check_metrics``; a stale one is reported, not dropped). A replayed decode
    (``decode(replay=...)``) runs the target's recorded output instead of the target (the speed is
    then only modelled: no live tok/s or speedup, no profile check). ``modelled``: the pass
    reports only modelled speed whatever ran (a simulation's pass that replays where it can and
    records its live decodes where it cannot: its figures must not depend on which it did)."""

    def __init__(
        self, session: DeviceSession, config: GenerationConfig, measure_ar: bool = False, modelled: bool = False
    ) -> None:
        self.session, self.config, self.measure_ar = session, config, measure_ar
        self.alone: list[dict] = []  # the target alone's timed runs (measure_ar)
        self.phase = Phase()
        self.modelled = modelled  # speed reported modelled only (set by any replayed decode)
        self.last: GenerationResult | None = None  # the latest decode's result

    def decode(self, prompt: str, replay: dict | None = None) -> dict | None:
        """Decode ``prompt`` (its result: ``last``); returns the target alone's run of it when
        measured (else None). ``replay``: the target's recorded output (``{"ids"}``)."""
        run = recording = None
        if self.measure_ar:
            result = target_alone(self.session, [prompt], self.config)[0]
            st = result.stats
            run = {"ids": result.token_ids, "tokens": st.new_tokens, "s": st.wall_s, "prefill_s": st.prefill_s}
            self.alone.append(run)
        if replay is not None:
            _, ids = self.session.engine.prompt_ids(prompt)
            recording = Recording(ids + replay["ids"], len(ids))
            self.modelled = True
        self.last = self.session.generate(prompt, self.config, learn=False, replay=recording)
        self.phase.add(self.last)
        return run

    def metrics(self) -> dict:
        alone = self.alone
        ar_tps = ar_decode_tps = None
        if alone:
            tokens = sum(r["tokens"] for r in alone)
            ar_tps = tokens / max(sum(r["s"] for r in alone), 1e-9)
            ar_decode_tps = tokens / max(sum(r["s"] - r["prefill_s"] for r in alone), 1e-9)
        out = self.phase.summary(ar_tps, ar_decode_tps)
        st = self.phase.stats
        metrics = {
            MetricKey.ACCEPTANCE: out["acceptance_rate"],
            MetricKey.TOKENS_PER_CALL: out["tokens_per_target_call"],
            MetricKey.MODELLED_SPEEDUP: out["modelled_speedup_vs_ar"] or 0.0,
            MetricKey.MODELLED_TOKENS_PER_S: st.new_tokens / st.modelled_s if st.modelled_s else 0.0,
            MetricKey.GENERATED_TOKENS: out["new_tokens"],
        }
        if not self.modelled:
            metrics.update(
                {
                    MetricKey.TOKENS_PER_S: out["tokens_per_s"],
                    MetricKey.SPEEDUP: out["speedup_vs_ar"] or 0.0,
                    MetricKey.DECODE_SPEEDUP: out["decode_speedup_vs_ar"] or 0.0,
                }
            )
        if alone:  # timed live: did the profile its decisions read hold in use? (kept either way: a
            # fleet's panel, whose runs with one seed decide alike)
            metrics.update(profile_check_metrics(self.session.engine.check_profile(forget_stale=False)))
        return metrics
