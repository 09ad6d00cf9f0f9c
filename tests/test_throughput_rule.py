"""The throughput rule (draft length including zero, never slower, re-fitting when the drafter
changes) and model-free drafts from the device's own text: unit behaviour, determinism, greedy
identity and sampling exactness with lookups (tiny models)."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from sampling_checks import assert_follows

from omnidraft.benchmarks.tiny_models import build_pair
from omnidraft.shared.engine import decoding
from omnidraft.shared.engine.decoding import CrossVocabDecoder, TargetOnlyDecoder
from omnidraft.shared.engine.draft_policy import DRAFTER, HEAD_SCORE_EVERY, LOOKUP, PLAIN, RETRY_ROUNDS, ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.lookup_drafts import LookupDraft, LookupDrafter
from omnidraft.shared.engine.profiling import CostProfile, StepTimings
from omnidraft.shared.engine.sampling import warp
from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.vocab.translation import build_expand_map
from omnidraft.shared.vocab.vocab_bridge import VocabBridge

FLAT = CostProfile({1: 100.0, 16: 101.0}, drafter_ms_per_token=1.0)  # blocks cost what one token does


def drafted_length(rule: ThroughputRule, feature: float, k_max: int = 32) -> int:
    rule.begin(k_max)
    n = 1
    while rule.keep_drafting(feature) and n < k_max:
        n += 1
    return n


def drafter_round(rule: ThroughputRule, accepted: int, drafted: int = 2, feature: float = 0.9) -> None:
    """One drafter round through the public API: ``drafted`` tokens, ``accepted`` kept."""
    rule.begin(drafted)
    for _ in range(drafted):
        rule.keep_drafting(feature)
    rule.observe(accepted_drafts=accepted, drafted=drafted, proposed=drafted, committed=accepted + 1)


# -- the rule -------------------------------------------------------------------------------------
def test_draft_length_follows_the_machine_and_the_measured_acceptance():
    flat = ThroughputRule(FLAT)
    steep = ThroughputRule(CostProfile({1: 100.0, 2: 200.0, 16: 1600.0}, drafter_ms_per_token=1.0))
    # cheap blocks: keep drafting while tokens are likely accepted; block cost linear in its
    # size: a second token never pays (it costs a whole target step for < 1 expected token)
    assert drafted_length(flat, 0.95) > 8
    assert drafted_length(steep, 0.95) == 1
    slow = ThroughputRule(CostProfile({1: 100.0, 16: 101.0}, drafter_ms_per_token=40.0))
    assert drafted_length(slow, 0.95) < drafted_length(flat, 0.95)
    # a fixed cost per round (measured into the profile) favours longer drafts
    busy = ThroughputRule(CostProfile({1: 50.0, 4: 60.0, 16: 120.0}, 8.0, round_overhead_ms=60.0))
    idle = ThroughputRule(CostProfile({1: 50.0, 4: 60.0, 16: 120.0}, 8.0))
    assert drafted_length(busy, 0.7) > drafted_length(idle, 0.7)
    # calibration: tokens drafted at confidence 0.95 that the target keeps rejecting
    before = drafted_length(flat, 0.95)
    for _ in range(200):
        drafter_round(flat, accepted=0, feature=0.95)
    assert flat.calibrated(0.95) < 0.1
    assert drafted_length(flat, 0.95) < before
    assert json.dumps(flat.state())


def test_speculation_pauses_when_it_does_not_pay_and_is_retried():
    # cheap blocks: even before any evidence the prior expects drafting to pay
    assert ThroughputRule(CostProfile({1: 100.0, 16: 110.0}, drafter_ms_per_token=5.0)).plan() == (DRAFTER, 0)
    rule = ThroughputRule(CostProfile({1: 100.0, 16: 400.0}, drafter_ms_per_token=30.0))
    for _ in range(5):  # every drafter round commits one token for more than a plain step costs
        drafter_round(rule, accepted=0)
    assert rule.drafter_rate() < rule.plain_rate()
    kinds = [rule.plan()[0] for _ in range(RETRY_ROUNDS + 1)]
    assert kinds[:RETRY_ROUNDS] == [PLAIN] * RETRY_ROUNDS  # paused: plain target steps
    assert kinds[RETRY_ROUNDS] == DRAFTER  # retried after RETRY_ROUNDS plain rounds
    # a drafter that pays is kept
    good = ThroughputRule(CostProfile({1: 100.0, 16: 110.0}, drafter_ms_per_token=5.0))
    for _ in range(5):
        drafter_round(good, accepted=4, drafted=4)
    assert good.drafter_rate() > good.plain_rate()
    assert {good.plan()[0] for _ in range(40)} == {DRAFTER}


def test_a_fresh_rule_is_not_paused_by_one_unlucky_round_but_a_useless_drafter_is():
    """The drafter's rate starts from a prior worth PRIOR_ROUNDS rounds: a first round that
    commits one token of three drafted does not stop a drafter the prior expects to pay (a
    pause costs RETRY_ROUNDS plain steps; with a prior worth 2 rounds it did), and one that
    never gets a token accepted is paused after two rounds."""
    profile = CostProfile({1: 50.0, 2: 52.0, 4: 60.0, 8: 80.0, 16: 120.0}, drafter_ms_per_token=8.0)
    unlucky = ThroughputRule(profile)
    drafter_round(unlucky, accepted=0, drafted=3)
    assert unlucky.plan()[0] == DRAFTER
    drafter_round(unlucky, accepted=3, drafted=3)  # then a good one: drafting goes on
    assert unlucky.plan()[0] == DRAFTER
    useless = ThroughputRule(profile)
    rounds = 0
    while useless.plan()[0] == DRAFTER:
        drafter_round(useless, accepted=0, drafted=3)
        rounds += 1
    assert rounds == 2 and useless.drafter_rate() < useless.plain_rate()


def test_lookup_drafts_are_chosen_by_expected_tokens_per_cost():
    rule = ThroughputRule(CostProfile({1: 100.0, 16: 104.0}, drafter_ms_per_token=10.0))
    for _ in range(5):  # the drafter: 2 tokens for ~125 ms
        drafter_round(rule, accepted=1)
    found = LookupDraft(list(range(12)), 4, "context")
    for _ in range(30):  # long context matches are almost always right
        rule.observe_lookup("context", 4, proposed=12, accepted=12)
    kind, n = rule.plan(found)
    assert (kind, n) == (LOOKUP, 12)
    for _ in range(200):  # history matches of length 2 are always wrong
        rule.observe_lookup("history", 2, proposed=4, accepted=0)
    assert rule.plan(LookupDraft([1, 2, 3], 2, "history"))[0] == DRAFTER
    assert rule.lookup_acceptance("history", 2) < 0.05 and rule.lookup_acceptance("context", 4) > 0.9


def test_a_draft_likely_accepted_carries_the_lookup_that_continues_it():
    """``extend_draft``: the lookup's continuation of a draft is verified after it while it
    raises the round's expected tokens per ms: all of it when more rows cost little, none when
    each row costs a step, when the lookup is usually wrong, or when nothing was drafted."""
    found = LookupDraft(list(range(6)), 4, "context")

    def extension(profile: CostProfile, lookup_right: bool, drafted: int = 2) -> int:
        rule = ThroughputRule(profile)
        for _ in range(40):
            rule.observe_lookup("context", 4, proposed=6, accepted=6 if lookup_right else 0)
        rule.begin(drafted)
        for _ in range(drafted):
            rule.keep_drafting(0.95)
        return rule.extend_draft(found, drafted)

    gentle = CostProfile({1: 100.0, 16: 115.0}, drafter_ms_per_token=1.0)  # 1 ms a row
    assert extension(gentle, lookup_right=True) == 6
    assert extension(CostProfile({1: 100.0, 2: 200.0, 16: 1600.0}, 1.0), lookup_right=True) == 0
    assert extension(gentle, lookup_right=False) == 0
    assert extension(FLAT, lookup_right=False) == 1  # a row that costs nothing is worth a long shot
    assert extension(gentle, lookup_right=True, drafted=0) == 0
    # a few cheap rows, then each costs a step: only the cheap ones are worth verifying
    assert extension(CostProfile({1: 100.0, 5: 101.0, 6: 200.0, 16: 1200.0}, 1.0), lookup_right=True) == 2


def test_rule_refits_when_the_drafter_changes():
    rule = ThroughputRule(CostProfile({1: 100.0, 16: 400.0}, drafter_ms_per_token=30.0))
    for _ in range(100):
        drafter_round(rule, accepted=0, feature=0.85)
    stale = rule.calibrated(0.85)
    for _ in range(RETRY_ROUNDS):
        assert rule.plan()[0] == PLAIN
    rule.drafter_changed()
    assert rule.calibrated(0.85) > stale  # most of the old drafter's evidence is gone
    assert rule.plan()[0] == DRAFTER  # and the new drafter is tried at once
    for _ in range(6):  # the new drafter is right: the rule believes it within a few rounds
        drafter_round(rule, accepted=2, feature=0.85)
    assert rule.calibrated(0.85) > 0.5


def test_a_hesitant_token_followed_by_confident_ones_keeps_the_draft_going():
    """Tokens drafted at 0.45 are accepted about half the time, but what follows one of them is
    almost always accepted (a name chosen, the rest of the line follows): once counted, the rule
    drafts on past the hesitant token instead of expecting every later token at 0.45."""
    profile = CostProfile({1: 60.0, 4: 75.0, 8: 90.0, 16: 130.0}, drafter_ms_per_token=5.0)
    rule = ThroughputRule(profile)

    def length_after_hesitation() -> int:
        rule.begin(16)
        n = 0
        for f in (0.95, 0.95, 0.45) + (0.95,) * 13:
            n += 1
            if not rule.keep_drafting(f):
                break
        return n

    cold = length_after_hesitation()
    assert cold == 3  # the prior: every later token expected like the hesitant one
    for i in range(200):  # the hesitant token itself: accepted every other time, but always what follows
        rule.begin(8)
        for f in (0.95, 0.45, 0.95, 0.95):
            rule.keep_drafting(f)
        ok = i % 2 == 0
        rule.observe(accepted_drafts=4 if ok else 1, drafted=4, proposed=4, committed=5 if ok else 2)
    assert rule.calibrated(0.45) == pytest.approx(0.5, abs=0.05)
    assert rule.next_tables["confidence"].rate(4) > 0.9
    assert length_after_hesitation() > cold  # it drafts on past the hesitant token
    assert "next_acceptance_by_confidence" in rule.state()


def test_the_head_decides_only_while_it_predicts_acceptance_better_than_the_confidence():
    import random

    def rounds(rule: ThroughputRule, head_knows: bool, n: int = 300) -> None:
        rng = random.Random(0)
        for _ in range(n):  # one token per round: accepted at random; one feature knows, the other is noise
            accepted = rng.random() < 0.5
            knowing, noise = (0.95 if accepted else 0.05), rng.random()
            rule.begin(1, head=True)
            rule.keep_drafting(noise if head_knows else knowing, knowing if head_knows else noise)
            rule.observe(accepted_drafts=int(accepted), drafted=1, proposed=1, committed=1 + int(accepted))

    good_head, bad_head = ThroughputRule(FLAT), ThroughputRule(FLAT)
    assert good_head.feature_in_use() == "confidence"  # before any evidence
    rounds(good_head, head_knows=True)
    rounds(bad_head, head_knows=False)
    assert good_head.feature_in_use() == "head" and bad_head.feature_in_use() == "confidence"
    good_head.begin(4, head=True)
    assert good_head.feature == "head"
    good_head.begin(4, head=False)  # no head this round: the confidence decides
    assert good_head.feature == "confidence"
    assert good_head.state()["squared_error"]["head"] < good_head.state()["squared_error"]["confidence"]
    # the head runs every round where it decides, and one round in HEAD_SCORE_EVERY where it does
    # not (its error keeps being measured on a uniform sample of rounds)
    assert all(good_head.wants_head() for _ in range(12))
    asked = [bad_head.wants_head() for _ in range(4 * HEAD_SCORE_EVERY)]
    assert sum(asked) == 4 and asked[:HEAD_SCORE_EVERY].count(True) == 1
    assert ThroughputRule(FLAT).wants_head()  # a new rule scores the head in its first round


def test_calibration_round_trips_and_rejects_what_does_not_fit():
    rule = ThroughputRule(FLAT)
    drafter_round(rule, accepted=1)
    rule.observe_lookup("history", 3, proposed=5, accepted=2)
    saved = json.loads(json.dumps(rule.calibration()))
    again = ThroughputRule(FLAT)
    again.load_calibration(saved)
    assert again.calibration() == rule.calibration()
    assert again.drafter_rate() == pytest.approx(rule.drafter_rate())
    older = {k: v for k, v in saved.items() if k != "next_tables"} | {
        "version": 2
    }  # saved before the next-token tables
    ThroughputRule(FLAT).load_calibration(older)
    for bad in (
        {},
        {"version": 1},
        {**saved, "tables": {"confidence": {"accepted": [1], "seen": [1]}}},
        {**saved, "rate": "fast"},
    ):
        with pytest.raises(ValueError, match="does not fit"):
            ThroughputRule(FLAT).load_calibration(bad)


# -- decoding with the rule and lookups (tiny models) ---------------------------------------------
REPETITIVE = [
    'def alpha_3(beta, gamma):\n    """Return beta + gamma."""\n    alpha = beta + gamma\n    return alpha\n\n'
    "def alpha_4(beta, gamma):\n",
    "def total_1(index, value):\n    total = index * value\n    return total\n\ndef total_2(index, value):\n",
    "x = 1\n",
    "def items_9(count, result):\n    items = count // result\n",
]


@pytest.fixture(scope="module")
def pair():
    p = build_pair()
    p.target.double()  # exact-enough arithmetic: block verification never flips a near-tie
    return p


@pytest.fixture(scope="module")
def bridge(pair):
    return VocabBridge.from_tokenizers(
        pair.draft_tokenizer, pair.target_tokenizer, pair.drafter.config.vocab_size, pair.target.config.vocab_size
    )


def spd(
    pair, bridge, profile: CostProfile, lookup: LookupDrafter | None = None, timings: StepTimings | None = None
) -> CrossVocabDecoder:
    return CrossVocabDecoder(
        pair.drafter,
        pair.draft_tokenizer,
        pair.target,
        bridge,
        NgramCache(),
        expand_map=build_expand_map(bridge, pair.target_tokenizer),
        target_tokenizer=pair.target_tokenizer,
        rule=ThroughputRule(profile),
        lookup=lookup if lookup is not None else LookupDrafter(),
        timings=timings,
    )


@pytest.mark.parametrize(
    "profile",
    [
        CostProfile({1: 10.0, 4: 12.0, 16: 20.0}, 1.0),  # speculation pays: drafter and lookups
        CostProfile({1: 10.0, 2: 20.0, 16: 160.0}, 30.0),  # it never pays: plain steps
    ],
)
def test_greedy_output_identical_with_lookups_and_plain_steps(pair, bridge, profile):
    decoder = spd(pair, bridge, profile)
    ar = TargetOnlyDecoder(pair.target, bridge)
    kinds = collections.Counter()
    for _ in range(2):  # the second pass can also look up the first pass's outputs (history)
        for prompt in REPETITIVE:
            ids = pair.target_tokenizer.encode(prompt)
            config = GenerationConfig(max_new_tokens=40)
            expected = ar.generate(ids, config)
            got = decoder.generate(prompt, ids, config)
            assert got.token_ids == expected.token_ids, prompt
            assert got.finish_reason == expected.finish_reason
            s = got.stats
            kinds.update(
                lookup=s.lookup_rounds, plain=s.plain_rounds, drafter=s.target_calls - s.lookup_rounds - s.plain_rounds
            )
    if profile.target_cost(2) < 2 * profile.target_cost(1):
        assert kinds["lookup"] > 0 and kinds["drafter"] > 0
    else:
        assert kinds["plain"] > kinds["drafter"] and kinds["lookup"] == 0


def test_a_drafts_lookup_tail_keeps_greedy_output(pair, bridge):
    """Where verifying more rows costs little, drafter rounds carry the lookup's continuation of
    their draft (``extend_draft``): the output stays the target alone's and some tail tokens are
    accepted; a decoder without tails (``lookup_tails=False``) verifies none."""
    profile = CostProfile({1: 10.0, 4: 10.2, 16: 10.5}, drafter_ms_per_token=0.5)
    decoder, untailed = spd(pair, bridge, profile), spd(pair, bridge, profile)
    untailed.lookup_tails = False
    ar = TargetOnlyDecoder(pair.target, bridge)
    proposed = accepted = 0
    for prompt in REPETITIVE * 2:
        ids = pair.target_tokenizer.encode(prompt)
        config = GenerationConfig(max_new_tokens=40)
        got = decoder.generate(prompt, ids, config)
        expected = ar.generate(ids, config).token_ids
        assert got.token_ids == expected, prompt
        s = got.stats
        assert s.tail_accepted <= s.tail_proposed and s.tail_accepted <= s.accepted_tokens
        proposed, accepted = proposed + s.tail_proposed, accepted + s.tail_accepted
        plain = untailed.generate(prompt, ids, config)
        assert plain.token_ids == expected and plain.stats.tail_proposed == 0
    assert proposed > 0 and accepted > 0


def test_decisions_do_not_depend_on_the_clock(pair, bridge, monkeypatch):
    """The rule decides from the profile and counts alone: with the clock perturbed, the same
    inputs take the same rounds."""
    profile = CostProfile({1: 10.0, 4: 12.0, 16: 20.0}, 1.0, round_overhead_ms=3.0, step_overhead_ms=1.0)

    def run() -> list[dict]:
        decoder = spd(pair, bridge, profile)
        out = []
        for prompt in REPETITIVE:
            r = decoder.generate(prompt, pair.target_tokenizer.encode(prompt), GenerationConfig(max_new_tokens=40))
            counts = {
                k: v
                for k, v in r.stats.to_dict().items()
                if k not in ("wall_s", "tokens_per_s", "prefill_s", "decode_tokens_per_s")
            }
            out.append({**counts, "ids": r.token_ids})
        return out

    first = run()
    noise = iter(torch.rand(100000, generator=torch.Generator().manual_seed(0)).tolist())
    monkeypatch.setattr(decoding.time, "perf_counter", lambda: next(noise) * 1e3)
    assert run() == first


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_with_lookup_drafts_follows_the_target_distribution(pair, bridge, temperature, top_p):
    """Total variation between the empirical first-token distribution and the exact target
    distribution stays within sampling noise when the first position is verified against a
    model-free draft (2000 samples)."""
    prompt = "def total_1(index, value):\n    total = index * value\n    return total\n\ndef total_2(index,"
    ids = pair.target_tokenizer.encode(prompt)
    with torch.inference_mode():
        logits = pair.target(input_ids=torch.tensor([ids])).logits[0, -1:].float()
    exact = warp(logits.masked_fill(bridge.target_invalid_mask[: logits.shape[-1]], float("-inf")), temperature, top_p)[
        0
    ]
    # verifying blocks is free and the drafter is slow: lookups are worth proposing
    profile = CostProfile({1: 10.0, 16: 10.5}, drafter_ms_per_token=50.0)
    decoder = spd(pair, bridge, profile, LookupDrafter(capacity=0))
    drafter_round(decoder.rule, accepted=0)  # the drafter has been seen not to pay
    n, counts, lookup_rounds = 2000, collections.Counter(), 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=2, temperature=temperature, top_p=top_p, seed=seed)
        out = decoder.generate(prompt, ids, config)
        counts[out.token_ids[0]] += 1
        lookup_rounds += out.stats.lookup_rounds
    assert lookup_rounds == n  # every first position was verified against a lookup
    assert_follows(counts, exact)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_with_a_drafts_lookup_tail_follows_the_target_distribution(
    pair, bridge, monkeypatch, temperature, top_p
):
    """The token at the first position of a draft's lookup tail follows the target's marginal
    distribution there (sum over the first token of p(t1) p(t2 | t1)) within sampling noise, and
    the first token the target's own (2000 samples; every first round drafts one token and
    carries the tail)."""
    prompt = "def total_1(index, value):\n    total = index * value\n    return total\n\ndef total_2(index"
    ids = pair.target_tokenizer.encode(prompt)
    mask = bridge.target_invalid_mask
    with torch.inference_mode():
        logits = pair.target(input_ids=torch.tensor([ids])).logits[0, -1:].float()
        first = warp(logits.masked_fill(mask[: logits.shape[-1]], float("-inf")), temperature, top_p)[0]
        support = first.nonzero().flatten().tolist()
        after = pair.target(input_ids=torch.tensor([ids + [t] for t in support])).logits[:, -1].float()
        after = warp(after.masked_fill(mask[: after.shape[-1]], float("-inf")), temperature, top_p)
    second = (first[support, None] * after).sum(0)
    # verifying blocks is free, the drafter is cheap, and this generation's lookups are always right
    decoder = spd(pair, bridge, CostProfile({1: 10.0, 16: 10.1}, drafter_ms_per_token=0.1), LookupDrafter(capacity=0))
    for match in range(1, 9):
        decoder.rule.observe_lookup("context", match, proposed=8, accepted=8)
    monkeypatch.setattr(decoder.rule, "plan", lambda found=None, drafter=True: (DRAFTER, 0))
    n, counts1, counts2, tails = 2000, collections.Counter(), collections.Counter(), 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=3, temperature=temperature, top_p=top_p, seed=seed, k_max=1)
        out = decoder.generate(prompt, ids, config)
        counts1[out.token_ids[0]] += 1
        counts2[out.token_ids[1]] += 1
        tails += out.stats.tail_proposed > 0
    assert tails == n  # every first round verified a tail after its one-token draft
    assert_follows(counts1, first)
    assert_follows(counts2, second)


def test_lookup_acceptance_is_measured_in_rounds_that_verified_no_lookup(pair, bridge, monkeypatch):
    """While drafter rounds win every plan, each round still scores the model-free candidate
    against the tokens the target committed: the lookup tables hold exactly what verifying the
    candidates would have counted (recomputed here from the output), so a lookup source the plan
    never tries is not left at its prior."""
    decoder = spd(pair, bridge, CostProfile({1: 10.0, 4: 12.0, 16: 20.0}, 1.0))
    rule, lookup = decoder.rule, decoder.lookup
    monkeypatch.setattr(rule, "plan", lambda found=None, drafter=True: (DRAFTER, 0))
    rounds, position = [], [0]  # (tokens generated when proposed, candidate), per round
    propose, commit = lookup.propose, lookup.commit

    def recording_propose(k, after=()):
        if after:  # a continuation of a draft (``extend_draft``): none here, so only rounds are scored
            return None
        found = propose(k)
        rounds.append((position[0], found))
        return found

    def counting_commit(ids):
        position[0] += len(ids)
        commit(ids)

    monkeypatch.setattr(lookup, "propose", recording_propose)
    monkeypatch.setattr(lookup, "commit", counting_commit)
    expected = {"context": [[0.0, 0.0] for _ in range(8)], "history": [[0.0, 0.0] for _ in range(8)]}
    for prompt in REPETITIVE:
        rounds.clear()
        position[0] = 0
        out = decoder.generate(prompt, pair.target_tokenizer.encode(prompt), GenerationConfig(max_new_tokens=40))
        assert out.stats.lookup_rounds == 0
        ends = [pos for pos, _ in rounds[1:]] + [len(out.token_ids)]
        for (pos, found), end in zip(rounds, ends):
            if found is None or not found.ids:
                continue
            cell = expected[found.source][min(found.match, 8) - 1]
            committed = out.token_ids[pos:end]
            for i in range(min(len(found.ids), len(committed))):  # up to and including the first miss
                cell[0] += found.ids[i] == committed[i]
                cell[1] += 1
                if found.ids[i] != committed[i]:
                    break
    got = {s: [[a, n] for a, n in zip(t.accepted, t.seen)] for s, t in rule.lookup.items()}
    assert got == expected
    seen = sum(n for cells in expected.values() for _, n in cells)
    accepted = sum(a for cells in expected.values() for a, _ in cells)
    assert seen > 20 and accepted / seen > 0.5  # repetitive text: its lookups are mostly right
