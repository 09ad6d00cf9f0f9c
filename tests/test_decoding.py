"""Cross-vocabulary speculative decoding on tiny models with different vocabularies:
greedy identity with the target alone, exact stopping, and lossless sampling."""

from __future__ import annotations

import collections

import pytest
import torch
from sampling_checks import assert_follows

from omnidraft.benchmarks.tiny_models import build_pair
from omnidraft.shared.engine.decoding import CrossVocabDecoder, TargetOnlyDecoder
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.model_runner import ModelRunner
from omnidraft.shared.engine.sampling import warp
from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.vocab.token_healing import TokenHealer
from omnidraft.shared.vocab.translation import NgramTranslator, TextTranslator, build_expand_map
from omnidraft.shared.vocab.vocab_bridge import VocabBridge


@pytest.fixture(scope="module")
def pair():
    """The tiny pair with the target in float64: greedy identity is exact in exact arithmetic,
    and fp64 is close enough that a block forward and one-token steps never flip a near-tie on
    any CPU (fp32 ones did on an AMD EPYC, where the matmul kernel changes with the block
    size). Exact identity in the fast int8 runtime is tested in test_precision.py."""
    p = build_pair()
    p.target.double()
    return p


@pytest.fixture(scope="module")
def bridge(pair):
    return VocabBridge.from_tokenizers(
        pair.draft_tokenizer, pair.target_tokenizer, pair.drafter.config.vocab_size, pair.target.config.vocab_size
    )


@pytest.fixture(scope="module", params=["text", "ngram"])
def translate(request):
    return request.param


def make_decoders(pair, bridge, cache=None, translate="text", drafter=None, target=None, **options):
    """The speculative decoder (``drafter``: a runner in place of the pair's drafter model;
    ``target``: one runner both decoders share, as an engine's do, in place of one each;
    ``options``: more ``CrossVocabDecoder`` arguments) and the target alone."""
    cache = cache if cache is not None else NgramCache()
    target = target if target is not None else pair.target
    spd = CrossVocabDecoder(
        drafter if drafter is not None else pair.drafter,
        pair.draft_tokenizer,
        target,
        bridge,
        cache,
        expand_map=build_expand_map(bridge, pair.target_tokenizer),
        translate=translate,
        target_tokenizer=pair.target_tokenizer,
        **options,
    )
    return spd, TargetOnlyDecoder(target, bridge)


PROMPTS = [
    "def alpha_3(beta, gamma):\n",
    'def total_1(index, value):\n    """Return index',
    "    return ",
    "def items_9(count, result):\n    items = count // result\n",
    "\n\ndef",
    "x = 1\n",
    'def delta_0(total, items):\n    """Return total * items."""\n    delta = total',
    "🙂 unicode ünïcødé 中文 prompt\n",
]


@pytest.mark.parametrize("k_max,confidence", [(1, 0.0), (4, 0.0), (8, 0.3), (12, 0.0)])
def test_greedy_output_identical_to_target_alone(pair, bridge, k_max, confidence, translate):
    spd, ar = make_decoders(pair, bridge, translate=translate)
    tt = pair.target_tokenizer
    accepted = 0
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, k_max=k_max, confidence=confidence)
        ids = tt.encode(prompt)
        expected = ar.generate(ids, config)
        got = spd.generate(prompt, ids, config)
        assert got.token_ids == expected.token_ids, prompt
        assert got.text == expected.text
        assert got.finish_reason == expected.finish_reason
        s = got.stats
        assert s.new_tokens == len(got.token_ids)
        assert s.accepted_tokens <= s.proposed_tokens
        assert s.target_calls <= expected.stats.target_calls
        accepted += s.accepted_tokens
    assert accepted > 0, "the trained tiny drafter should get some tokens accepted"


def test_a_decode_of_the_prompt_the_target_alone_just_decoded_starts_from_its_prefill(pair, bridge):
    """On one target runner (as an engine's decoders share it), speculation on the prompt the
    target alone just decoded starts from the prefill that decode left in the cache: one
    forward less, the same output bit for bit (greedy, and sampled with a seed, against a fresh
    runner), its time counted at the prefill's measured seconds. A prompt that differs before its
    last token, one that extends it, or a reset cache prefill anew."""
    runner = ModelRunner(pair.target)
    spd, ar = make_decoders(pair, bridge, target=runner)
    fresh, _ = make_decoders(pair, bridge, target=ModelRunner(pair.target))
    tt = pair.target_tokenizer
    prompt = 'def delta_0(total, items):\n    """Return total * items."""\n    delta = total'
    ids = tt.encode(prompt)
    greedy = GenerationConfig(max_new_tokens=24, k_max=4, confidence=0.0)
    alone = ar.generate(ids, greedy)
    calls = runner.forward_calls
    got = spd.generate(prompt, ids, greedy)
    assert got.token_ids == alone.token_ids
    assert got.stats.prefills_reused == 1 and runner.forward_calls - calls == got.stats.target_calls
    assert got.stats.prefill_s == alone.stats.prefill_s and got.stats.wall_s > got.stats.prefill_s
    sampled = GenerationConfig(max_new_tokens=24, k_max=4, confidence=0.0, temperature=0.9, seed=11)
    assert spd.generate(prompt, ids, sampled).token_ids == fresh.generate(prompt, ids, sampled).token_ids
    # the prefill covers all but the prompt's last token: another last token starts from it too
    assert spd.generate(tt.decode(ids[:-1] + [ids[-1] + 1]), ids[:-1] + [ids[-1] + 1], greedy).stats.prefills_reused
    for other in (ids[:1] + [ids[1] + 1] + ids[2:], ids + tt.encode(" +"), tt.encode("x = 1\n")):
        assert spd.generate(tt.decode(other), other, greedy).stats.prefills_reused == 0
    ar.generate(ids, greedy)
    runner.reset()
    assert spd.generate(prompt, ids, greedy).stats.prefills_reused == 0


def test_greedy_identity_over_corpus_prompts_and_cache_learns(pair, bridge, translate):
    cache = NgramCache()
    spd, ar = make_decoders(pair, bridge, cache, translate)
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=32, k_max=6, confidence=0.0)
    calls_spd = calls_ar = 0
    for text in pair.texts[:25]:
        prompt = text[: len(text) // 2]
        ids = tt.encode(prompt)
        expected = ar.generate(ids, config)
        got = spd.generate(prompt, ids, config)
        assert got.token_ids == expected.token_ids, prompt
        calls_spd += got.stats.target_calls
        calls_ar += expected.stats.target_calls
    assert calls_spd < calls_ar  # speculation saved target calls
    assert len(cache) > 0  # merged n-grams were learned from committed text


def test_token_healer_candidates():
    table = [b"\n", b"\n   ", b"\n    ", b"\n        ", b" if", b" ", b"ret", b"return", b"re", None, b"retry"]
    healer = TokenHealer(table)

    def names(ids):
        return sorted(table[i] for i in ids.tolist())

    # a whitespace run ending in a space: itself, its extensions, and itself minus that space
    assert names(healer.candidates(b"\n    ")) == [b"\n   ", b"\n    ", b"\n        "]
    # a word piece: itself and its extensions, never a shorter piece
    assert names(healer.candidates(b"ret")) == [b"ret", b"retry", b"return"]
    assert names(healer.extensions(b" ")) == [b" ", b" if"]
    assert healer.extensions(b"").numel() == 0


def test_translators_propose_only_new_bytes_of_a_healed_block():
    """A block whose first bytes re-spell committed text proposes only what follows them."""
    draft = [b"\n   ", b" if", b" x", b"ret", b"return"]
    target = [b"\n", b"    ", b"if", b" if", b" x", b"urn", b"    if"]
    bridge = type(
        "B",
        (),
        {"d2t": [-1, 3, 4, -1, -1], "draft_bytes": draft, "target_bytes": target, "special_draft_to_target": {}},
    )()

    def encode(text: str) -> list[int]:  # the target's own tokenization of the few texts used here
        return {"if": [2], "urn": [5], "    if": [6], " if x": [3, 4], "if x": [2, 4]}[text]

    ngram = NgramTranslator(bridge, NgramCache(), {}, encode)
    # committed "\n    ": "\n   " re-spells, " if" straddles (new bytes "if"), " x" maps directly
    assert [u.target_id for u in ngram([0, 1, 2], skip=5)] == [2, 4]
    assert [u.target_id for u in ngram([4, 2], skip=3)] == [5, 4]  # "ret" committed, "return" healed
    assert [u.target_id for u in ngram([1, 2])] == [3, 4]  # nothing committed: as before
    assert [u.target_id for u in NgramTranslator(bridge, NgramCache(), {})([0, 1, 2], skip=5)] == []
    text = TextTranslator(bridge, encode)
    assert [u.target_id for u in text([0, 1, 2], skip=5)] == [2, 4]
    assert [u.target_id for u in text([1, 2])] == [3, 4]


class _TableRunner:
    """A drafter whose next token is a fixed function of the last one (logits 10 vs 0)."""

    def __init__(self, following: dict[int, int], vocab: int) -> None:
        self.following, self.vocab, self.ids = following, vocab, []

    @property
    def length(self) -> int:
        return len(self.ids)

    def crop(self, length: int) -> None:
        del self.ids[length:]

    def forward(self, ids: list[int], logits_to_keep: int = 0) -> torch.Tensor:
        self.ids += ids
        rows = torch.zeros(len(ids), self.vocab)
        for row, t in zip(rows, ids):
            row[self.following.get(t, 0)] = 10.0
        return rows[-logits_to_keep:] if logits_to_keep else rows


def test_drafting_heals_a_context_that_ends_inside_a_drafter_word(pair, bridge):
    """The context ends in indentation ("a" + "\\n    ") while the drafter writes "\\n   " + " if":
    it re-spells the last token and drafts " if" after it, whose new bytes are "if"."""
    from omnidraft.shared.engine.generation import GenerationStats

    table = [b"a", b"\n   ", b"\n    ", b" if", b" x", b":"]
    following = {0: 1, 1: 3, 2: 5, 3: 4, 4: 5}  # after "a" the drafter writes "\n   ", ...
    spd, _ = make_decoders(pair, bridge)
    spd.bridge = type("B", (), {"draft_bytes": table})()
    spd.healer = TokenHealer(table)
    spd.drafter = _TableRunner(following, len(table))
    config = GenerationConfig(k_max=3, confidence=0.0)
    stats = GenerationStats()
    draft, fed = spd._draft([0, 2], [], config, stats, None, heal=True)
    assert [table[t] for t in draft.ids] == [b"\n   ", b" if", b" x", b":"]
    assert (draft.overlap, draft.healing, stats.healed_rounds) == (5, 1, 1)
    assert fed == [0, 1, 3, 4]  # the re-spelled token replaced the last one in the drafter's cache
    # without healing (or where the last token is what the drafter writes) it drafts after it
    draft, _ = spd._draft([0, 2], [], config, stats, None, heal=False)
    assert [table[t] for t in draft.ids] == [b":", b"a", b"\n   "] and draft.overlap == 0
    draft, _ = spd._draft([0, 1], [], config, stats, None, heal=True)
    assert [table[t] for t in draft.ids] == [b" if", b" x", b":"] and draft.healing == 0


def test_token_healing_keeps_greedy_identity(pair, bridge, translate):
    """With healing on (the default) and off, the output is the target's own."""
    spd, ar = make_decoders(pair, bridge, translate=translate)
    plain, _ = make_decoders(pair, bridge, translate=translate, heal=False)
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=32, k_max=4, confidence=0.0)
    for text in pair.texts[:25]:
        prompt = text[: len(text) // 2]
        ids = tt.encode(prompt)
        expected = ar.generate(ids, config).token_ids
        assert spd.generate(prompt, ids, config).token_ids == expected, prompt
        assert plain.generate(prompt, ids, config).token_ids == expected, prompt


def test_max_new_tokens_and_eos_exact(pair, bridge):
    spd, ar = make_decoders(pair, bridge)
    tt = pair.target_tokenizer
    for n in (1, 2, 3, 7):
        config = GenerationConfig(max_new_tokens=n, k_max=8, confidence=0.0)
        ids = tt.encode(PROMPTS[0])
        got = spd.generate(PROMPTS[0], ids, config)
        assert len(got.token_ids) == n
        assert got.token_ids == ar.generate(ids, config).token_ids
        assert got.finish_reason == "length"


def test_stop_strings_match_target_alone(pair, bridge):
    spd, ar = make_decoders(pair, bridge)
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=60, k_max=8, confidence=0.0, stop_strings=("return",))
    ids = tt.encode(PROMPTS[0])
    expected = ar.generate(ids, config)
    got = spd.generate(PROMPTS[0], ids, config)
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == "stop_string"
    assert got.text.endswith("return") or "return" in got.text[-12:]


def test_eos_stops_generation(pair, bridge):
    """Declare the 5th token of a reference output a stop id: both decoders keep it and stop."""
    spd, ar = make_decoders(pair, bridge)
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=50, k_max=8, confidence=0.0)
    prompt = "def alpha_3(beta, gamma):\n"
    ids = tt.encode(prompt)
    reference = ar.generate(ids, config).token_ids
    stop_id = reference[4]
    for decoder in (spd, ar):
        decoder.side.stop_ids = frozenset({tt.eos_token_id, stop_id})
    a = ar.generate(ids, config)
    b = spd.generate(prompt, ids, config)
    first = reference.index(stop_id)
    assert a.token_ids == reference[: first + 1] == b.token_ids
    assert a.finish_reason == b.finish_reason == "eos"


def test_padded_logit_rows_never_produced(pair, bridge):
    """The tiny target has 13 LM-head rows beyond its tokenizer (like Qwen); they are masked."""
    assert pair.target.config.vocab_size > len(pair.target_tokenizer)
    spd, _ = make_decoders(pair, bridge)
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=30, temperature=5.0, seed=3, k_max=4, confidence=0.0)
    for seed in range(10):
        config.seed = seed
        out = spd.generate(PROMPTS[1], tt.encode(PROMPTS[1]), config)
        assert max(out.token_ids) < len(tt)


def test_untranslatable_block_still_progresses(pair, bridge):
    """With no direct map at all, every round proposes nothing and still commits one token."""
    spd, ar = make_decoders(pair, bridge, translate="ngram")
    spd.translate.d2t = [-1] * len(spd.translate.d2t)
    spd.translate.expand = {}
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=12, k_max=4, confidence=0.0)
    ids = tt.encode(PROMPTS[0])
    got = spd.generate(PROMPTS[0], ids, config)
    assert got.token_ids == ar.generate(ids, config).token_ids
    assert got.stats.target_calls == 12


def _exact_first_token_probs(pair, bridge, prompt, temperature, top_p):
    ids = pair.target_tokenizer.encode(prompt)
    with torch.inference_mode():
        logits = pair.target(input_ids=torch.tensor([ids])).logits[0, -1:].float()
    logits = logits.masked_fill(bridge.target_invalid_mask[: logits.shape[-1]], float("-inf"))
    return warp(logits, temperature, top_p)[0], ids


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_first_token_follows_target_distribution(pair, bridge, temperature, top_p, translate):
    """Total variation between the empirical first-token distribution of speculative sampling
    and the exact target distribution stays within sampling noise (2000 samples)."""
    prompt = "def alpha_3(beta, gamma):\n"
    exact, ids = _exact_first_token_probs(pair, bridge, prompt, temperature, top_p)
    spd, _ = make_decoders(pair, bridge, translate=translate)
    n = 2000
    counts = collections.Counter()
    proposals_accepted = 0
    for seed in range(n):
        config = GenerationConfig(
            max_new_tokens=2, temperature=temperature, top_p=top_p, seed=seed, k_max=3, confidence=0.0
        )
        out = spd.generate(prompt, ids, config)
        counts[out.token_ids[0]] += 1
        proposals_accepted += out.stats.accepted_tokens
    assert_follows(counts, exact)
    assert proposals_accepted > 0


def test_sampling_is_reproducible_with_seed(pair, bridge):
    spd, _ = make_decoders(pair, bridge)
    tt = pair.target_tokenizer
    config = GenerationConfig(max_new_tokens=20, temperature=1.0, seed=42, k_max=4, confidence=0.0)
    a = spd.generate(PROMPTS[0], tt.encode(PROMPTS[0]), config)
    b = spd.generate(PROMPTS[0], tt.encode(PROMPTS[0]), config)
    assert a.token_ids == b.token_ids


def test_bad_config_rejected(pair, bridge):
    spd, ar = make_decoders(pair, bridge)
    ids = pair.target_tokenizer.encode(PROMPTS[0])
    for bad in (
        GenerationConfig(max_new_tokens=0),
        GenerationConfig(temperature=-1),
        GenerationConfig(top_p=0),
        GenerationConfig(k_max=0),
    ):
        with pytest.raises(ValueError):
            spd.generate(PROMPTS[0], ids, bad)
    with pytest.raises(ValueError):
        ar.generate([], GenerationConfig())


@pytest.mark.parametrize("k_max", [1, 4])
def test_replaying_the_recorded_target_gives_the_live_decode(pair, bridge, translate, k_max):
    """Greedy decoding against ``RecordedTarget`` (the target alone's output, replayed) commits
    the same tokens with the same proposals, acceptances and target calls as the live target,
    without running it; a stop string ends both at the same point."""
    from omnidraft.shared.engine.recorded_target import RecordedTarget

    tt = pair.target_tokenizer
    vocab = pair.target.config.vocab_size
    for config in (
        GenerationConfig(max_new_tokens=40, k_max=k_max, confidence=0.0),
        GenerationConfig(max_new_tokens=60, k_max=k_max, confidence=0.0, stop_strings=("return",)),
    ):
        for prompt in PROMPTS + [t[: len(t) // 2] for t in pair.texts[:10]]:
            ids = tt.encode(prompt)
            live, ar = make_decoders(pair, bridge, translate=translate)  # each with an empty cache
            recorded = ar.generate(ids, config).token_ids
            live = live.generate(prompt, ids, config)
            replay, _ = make_decoders(pair, bridge, translate=translate)
            replay.side.runner = RecordedTarget(ids + recorded, vocab)
            got = replay.generate(prompt, ids, config)
            assert got.token_ids == live.token_ids == recorded, prompt
            for name in ("proposed_tokens", "accepted_tokens", "target_calls", "drafter_steps"):
                assert getattr(got.stats, name) == getattr(live.stats, name), (prompt, name)
            assert replay.side.runner.forward_calls == live.stats.target_calls + (len(ids) > 1)


def test_the_drafter_keeps_the_prefix_the_next_prompt_shares(pair, bridge, translate):
    """A drafter runner that tracks the ids it holds (``FastLlamaRunner.held``) keeps the part of
    its cache the next prompt shares with the previous sequence: that prompt's first drafter
    forward feeds only the rest. Greedy output stays the target alone's, and a weight change
    (an adapter merged) empties what it holds."""
    from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
    from omnidraft.shared.vocab.draft_context import DraftContext, common_prefix_len

    runner = FastLlamaRunner(pair.drafter, weights="fp32", max_positions=512)
    spd, ar = make_decoders(pair, bridge, translate=translate, drafter=runner)
    fed: list[int] = []
    forward = runner.forward

    def counted(ids, logits_to_keep=0):
        fed.append(len(ids))
        return forward(ids, logits_to_keep)

    runner.forward = counted
    header = "def items_9(count, result):\n    items = count // result\n    total = items * count\n"
    config = GenerationConfig(max_new_tokens=24, k_max=4, confidence=0.0)
    shared = []
    for prompt in (header + "    return total\n", header + "    delta = result", "x = 1\n"):
        held = list(runner.held)
        context = DraftContext(spd._encode, bridge.draft_bytes, prompt).ids
        fed.clear()
        ids = pair.target_tokenizer.encode(prompt)
        assert spd.generate(prompt, ids, config).token_ids == ar.generate(ids, config).token_ids, prompt
        keep = min(common_prefix_len(held, context), len(context) - 1)
        assert fed[0] == len(context) - keep  # the prompt's first drafter forward: only the unshared part
        shared.append(keep)
    assert shared[0] == 0 and shared[1] > 20 and shared[2] == 0
    runner.set_lora(None)  # back to the base weights: positions computed with others are dropped
    assert runner.held == [] and runner.length == 0


def test_recorded_target_rows_and_errors():
    from omnidraft.shared.engine.recorded_target import RecordedTarget

    target = RecordedTarget([5, 6, 7, 8], vocab_size=10)
    target.forward([5, 6])  # the prefill: positions 0, 1
    rows = target.forward([7, 9, 9])  # positions 2, 3, 4 (past the end repeats the last token)
    assert rows.argmax(-1).tolist() == [8, 8, 8] and target.length == 5
    assert torch.isinf(rows[0, :8]).all() and rows[0, 8] == 0
    target.crop(2)
    assert target.forward([1], logits_to_keep=1).argmax(-1).tolist() == [8]
    target.reset()
    assert target.forward([5, 6], logits_to_keep=1).argmax(-1).tolist() == [7]
    with pytest.raises(ValueError, match="at least one generated"):
        RecordedTarget([5], vocab_size=10)
    with pytest.raises(ValueError, match="lie in"):
        RecordedTarget([5, 10], vocab_size=10)
