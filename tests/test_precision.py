"""Target precisions on tiny models: the native int8 target's block verification bit-identical
to one-token steps (every instruction set, both activation modes) and close to fp32, greedy
identity per precision, the runner and translator interfaces the decoders use, the native
kernels loaded once for a stream of prompts, int8 where no fast runner exists, the engine's
int8 path end to end, and ``--dtype auto`` choosing only lossless precisions (the throughput
rule itself is in test_throughput_rule.py, the cost profile in test_cost_profile.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_models import PROMPTS, needs_isa, tiny_qwen2

from omnidraft.benchmarks.tiny_models import build_pair
from omnidraft.shared.engine import auto_precision, profiling
from omnidraft.shared.engine.decoding import CrossVocabDecoder, TargetOnlyDecoder
from omnidraft.shared.engine.draft_policy import ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.model_runner import ModelRunner, prefill
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.engine.precision import build_target_runner, precision_name, quantize_linear_int8
from omnidraft.shared.engine.profiling import CostProfile
from omnidraft.shared.runtime import native_kernels
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import NATIVE_ISAS, native_error, native_library
from omnidraft.shared.vocab.draft_context import common_prefix_len
from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.vocab.translation import build_expand_map
from omnidraft.shared.vocab.vocab_bridge import VocabBridge

HAS_NATIVE = native_library() is not None


@pytest.fixture(scope="module")
def pair():
    return build_pair()


@pytest.fixture(scope="module")
def bridge(pair):
    return VocabBridge.from_tokenizers(
        pair.draft_tokenizer, pair.target_tokenizer, pair.drafter.config.vocab_size, pair.target.config.vocab_size
    )


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("make", [tiny_qwen2, lambda: copy.deepcopy(build_pair().target)], ids=["qwen2", "llama"])
def test_native_int8_block_verification_is_bit_identical_to_single_steps(make, bits, isa, monkeypatch):
    """Each row of a block is computed alone (per-token scales, exact int32 sums): a k-token
    verification gives exactly the logits of k one-token steps, whatever k, on every
    instruction set (``OMNIDRAFT_NATIVE_ISA`` picks one; ``amx`` runs blocks on AMX tiles and
    single steps on AVX-512 VNNI) and in both activation modes (8-bit: targets; 16-bit: drafters)."""
    needs_isa(isa)
    monkeypatch.setenv("OMNIDRAFT_NATIVE_ISA", isa)
    monkeypatch.setattr("omnidraft.shared.engine.precision.TARGET_ACTIVATION_BITS", bits)
    runner = build_target_runner(make(), "int8")
    assert runner.backend.startswith("native-int8") and runner.prefill_weights is None
    assert runner.native_isa == isa and ("avx2" in runner.backend) == (isa == "avx2")
    assert runner.activation_bits == bits and ("amx" in runner.backend) == (isa == "amx")
    ids = [5 + (7 * i) % 250 for i in range(60)]
    runner.reset()
    runner.forward(ids[:40])
    for block in (2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 19):  # every pass width and tail (9, 17: a lone last row)
        runner.crop(40)
        together = runner.forward(ids[40 : 40 + block])
        runner.crop(40)
        alone = torch.cat([runner.forward([t]) for t in ids[40 : 40 + block]])
        assert torch.equal(together, alone), block


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
@pytest.mark.parametrize("bits,tol", [(16, 0.1), (8, 0.15)])
def test_native_int8_activation_modes_stay_close_to_fp32(bits, tol, isa):
    needs_isa(isa)
    model = tiny_qwen2(seed=1)
    ids = [5 + (11 * i) % 290 for i in range(48)]
    ref = ModelRunner(model)
    ref.reset()
    expected = ref.forward(ids)
    runner = FastLlamaRunner(
        model, weights="int8", prefill_weights=None, activation_bits=bits, max_positions=128, native_isa=isa
    )
    runner.reset()
    got = torch.cat([runner.forward(ids[:40]), runner.forward(ids[40:])])
    assert (got - expected).abs().max() < tol
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.85  # int8 weights of random models
    with pytest.raises(ValueError):
        FastLlamaRunner(model, weights="int8", activation_bits=4)


def _decoders(pair, bridge, runner, rule=None, translate="text"):
    spd = CrossVocabDecoder(
        pair.drafter,
        pair.draft_tokenizer,
        runner,
        bridge,
        NgramCache(),
        expand_map=build_expand_map(bridge, pair.target_tokenizer),
        translate=translate,
        target_tokenizer=pair.target_tokenizer,
        rule=rule,
    )
    return spd, TargetOnlyDecoder(runner, bridge)


@pytest.mark.parametrize("precision", ["fp64", "int8"])
@pytest.mark.parametrize("draft_stop", ["confidence", "cost"])
def test_greedy_identity_per_precision(pair, bridge, precision, draft_stop):
    """Greedy speculative output equals the target alone run in the same precision. fp64 is the
    exact-arithmetic reference; int8 is exact where the native kernels run (fbgemm's per-tensor
    activation scales make a block's rows depend on each other, as bf16 rounding does)."""
    if precision == "int8" and not HAS_NATIVE:
        pytest.skip(f"exact int8 identity needs the native kernels: {native_error()}")
    model = copy.deepcopy(pair.target)
    runner = build_target_runner(model.double() if precision == "fp64" else model, precision)
    rule = ThroughputRule(CostProfile({1: 10.0, 4: 12.0, 16: 20.0}, 1.0)) if draft_stop == "cost" else None
    spd, ar = _decoders(pair, bridge, runner, rule)
    tt = pair.target_tokenizer
    accepted = 0
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, k_max=8, draft_stop=draft_stop)
        ids = tt.encode(prompt)
        expected = ar.generate(ids, config)
        got = spd.generate(prompt, ids, config)
        assert got.token_ids == expected.token_ids, prompt
        accepted += got.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
def test_a_prompt_that_begins_like_the_sequence_before_prefills_only_the_rest(pair, bridge, isa):
    """On the native int8 kernels with one activation width (the target's runner) every cached
    position holds the bits any forward writes there, so a prompt that shares its beginning
    with what the cache holds (the previous prompt and its output) keeps those positions and
    forwards the rest: logits bit for bit those of a prefill from an empty cache, greedy output
    the target alone's on a fresh runner, the kept positions counted
    (``prompt_tokens_cached``) and the same prompt decoded next starting from that prefill. A
    runner whose prefill and steps differ in activation width (a drafter's) keeps only positions
    a prefill wrote, with a rest long enough to be a prefill; a transformers runner never keeps
    positions."""
    needs_isa(isa)

    def target_runner(**bits):
        options = {"activation_bits": 8, **bits}
        return FastLlamaRunner(
            pair.target,
            weights="int8",
            native=True,
            native_isa=isa,
            max_positions=512,
            prefill_weights=None,
            **options,
        )

    runner, fresh_runner = target_runner(), target_runner()
    spd, ar = _decoders(pair, bridge, runner)
    _, fresh = _decoders(pair, bridge, fresh_runner)
    tt = pair.target_tokenizer
    header = "def items_9(count, result):\n    items = count // result\n    total = items * count\n"
    config = GenerationConfig(max_new_tokens=24, k_max=4, confidence=0.0)
    cached = []
    for prompt in (header + "    return total\n", header + "    delta = result", "x = 1\n"):
        ids = tt.encode(prompt)
        shared = min(common_prefix_len(runner.held, ids[:-1]), len(ids) - 1)
        got = spd.generate(prompt, ids, config)
        fresh_runner.reset()
        assert got.token_ids == fresh.generate(ids, config).token_ids, prompt
        assert got.stats.prompt_tokens_cached == shared and got.stats.prefills_reused == 0
        again = ar.generate(ids, config)  # the same prompt next: from that prefill, as counted then
        assert again.stats.prefills_reused == 1 and again.stats.prompt_tokens_cached == shared
        assert again.stats.prefill_s == got.stats.prefill_s
        cached.append(shared)
    assert cached[0] == 0 and cached[1] > 20
    ids = tt.encode(header + "    return items\n")
    kept = prefill(runner, ids[:-1])  # after the decodes above, which end in "x = 1"
    assert kept.cached == 0 and runner.held == ids[:-1]
    spd.generate(header, tt.encode(header), config)
    kept = prefill(runner, ids[:-1])
    assert kept.cached > 20 and runner.prefilled is kept and runner.held == ids[:-1]
    fresh_runner.reset()
    fresh_runner.forward(ids[:-1], logits_to_keep=1)
    assert torch.equal(runner.forward(ids[-1:]), fresh_runner.forward(ids[-1:]))
    widths = target_runner(activation_bits=16, prefill_activation_bits=8)  # a drafter's
    first = tt.encode(header + "    return total\n")
    prefill(widths, first)
    for t in tt.encode(" + items\n    return"):  # steps: 16-bit activations
        widths.forward([t])
    second = widths.held + tt.encode(" total * count - items // 3 + result % 7 - count\n")
    kept = prefill(widths, second)
    assert kept.cached == min(len(first), len(second) - widths.prefill_min_tokens - 1) > 20
    fresh_widths = target_runner(activation_bits=16, prefill_activation_bits=8)
    fresh_widths.forward(second, logits_to_keep=1)
    assert torch.equal(widths.forward(ids[-1:]), fresh_widths.forward(ids[-1:]))
    plain, _ = _decoders(pair, bridge, ModelRunner(pair.target))
    for prompt in (header + "    return total\n", header + "    delta = result"):
        assert plain.generate(prompt, tt.encode(prompt), config).stats.prompt_tokens_cached == 0


def test_draft_stop_cost_needs_a_profile(pair, bridge):
    spd, _ = _decoders(pair, bridge, ModelRunner(pair.target))
    with pytest.raises(ValueError, match="cost profile"):
        spd.generate("x = 1\n", pair.target_tokenizer.encode("x = 1\n"), GenerationConfig(draft_stop="cost"))
    with pytest.raises(ValueError, match="draft_stop"):
        GenerationConfig(draft_stop="sometimes").validate()


def test_every_runner_and_translator_has_the_interface_the_decoders_use(pair, bridge):
    """The decoders take any ``Runner`` (``forward``/``crop``/``reset``, ``length``,
    ``forward_calls``) and any ``Translator``: each implementation satisfies its Protocol, and
    an object missing a member does not."""
    from omnidraft.shared.engine.model_runner import Runner
    from omnidraft.shared.engine.recorded_target import RecordedTarget
    from omnidraft.shared.vocab.translation import NgramTranslator, TextTranslator, Translator

    runners = [
        ModelRunner(pair.target),
        FastLlamaRunner(tiny_qwen2(), weights="fp32", max_positions=32),
        RecordedTarget([1, 2, 3], 10),
    ]
    assert all(isinstance(r, Runner) for r in runners)
    for r in runners:  # the members work, not only exist
        r.reset()
        assert r.forward([1, 2], logits_to_keep=1).shape[0] == 1 and r.length == 2
        r.crop(1)
        assert r.length == 1 and r.forward_calls >= 1
    encode = pair.target_tokenizer.encode
    translators = [NgramTranslator(bridge, NgramCache(), {}, encode), TextTranslator(bridge, encode)]
    assert all(isinstance(t, Translator) for t in translators)

    class NoCrop:
        length = forward_calls = 0

        def forward(self, ids, logits_to_keep=0): ...

        def reset(self): ...

    assert not isinstance(NoCrop(), Runner) and not isinstance(NoCrop(), Translator)


def test_native_kernels_build_once_for_a_stream_of_prompts(pair, bridge, monkeypatch):
    """The native library is loaded once (the installed build, or one compiled at first use) and
    then serves every shape: no rebuild or recompilation across prompts of different lengths."""
    if not HAS_NATIVE:
        pytest.skip(f"native int8 kernels unavailable: {native_error()}")
    builds = []
    real_build = native_kernels._build_native
    monkeypatch.setattr(native_kernels, "_native_state", {})
    monkeypatch.setattr(native_kernels, "_build_native", lambda isa: builds.append(isa) or real_build(isa))
    runner = build_target_runner(copy.deepcopy(pair.target), "int8")
    spd, ar = _decoders(pair, bridge, runner)
    tt = pair.target_tokenizer
    for prompt in PROMPTS + [p * 3 for p in PROMPTS]:
        ids = tt.encode(prompt)
        spd.generate(prompt, ids, GenerationConfig(max_new_tokens=12))
        ar.generate(ids, GenerationConfig(max_new_tokens=5))
    assert builds == [runner.native_isa]


def test_int8_on_an_architecture_without_a_fast_runner_quantizes_transformers_linears(pair):
    model = copy.deepcopy(pair.target)
    model.config.model_type = "other"  # as for Gemma-3: no fast runner
    runner = build_target_runner(model, "int8")
    assert isinstance(runner, ModelRunner)
    linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert linears and all("quantized" in type(m).__module__ for m in linears)
    assert quantize_linear_int8(model) is model  # idempotent
    runner.reset()
    assert torch.isfinite(runner.forward([3, 4, 5])).all()


def test_precision_names():
    assert precision_name(torch.float32) == "fp32" and precision_name("int8") == "int8"
    with pytest.raises(ValueError):
        precision_name("fp8")


def test_engine_int8_end_to_end_with_cached_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "home" / "profiles"))
    build_pair(tmp_path / "pair")
    drafter_dir, target_dir = tmp_path / "pair" / "drafter", tmp_path / "pair" / "target"
    engine = Engine.load(str(drafter_dir), str(target_dir), "int8", drafter_weights="fp32", progress=False)
    assert engine.precision == "int8"
    config = GenerationConfig(max_new_tokens=24)
    for prompt in PROMPTS:
        expected = engine.generate(prompt, config, method="ar")
        got = engine.generate(prompt, config, method="omnidraft")
        if HAS_NATIVE:
            assert got.token_ids == expected.token_ids
    profile = engine.cost_profile()
    assert set(profile.target_ms) == set(profiling.PROFILE_BLOCKS) and profile.drafter_ms_per_token > 0
    assert profile.drafter_block_ms and profile.round_overhead_ms >= 0 and profile.step_overhead_ms >= 0
    assert len(list((tmp_path / "home" / "profiles").glob("*.json"))) == 2  # the pair, measured together; overheads
    if HAS_NATIVE:  # the packed kernels run the target: its float weights were freed after packing
        assert all(p.is_meta for p in engine.target.model.parameters())
        assert engine.target.logit_rows == engine.target_runner.vocab  # shapes stay readable
        hf = engine.hf_target_model()  # transformers' own generate gets a float copy loaded again
        ids = torch.tensor([engine.prompt_ids(PROMPTS[0])[1]])
        assert not any(p.is_meta for p in hf.parameters()) and hf(ids).logits.isfinite().all()
        assert (
            engine.generate(PROMPTS[0], config, method="ar").token_ids
            == engine.generate(PROMPTS[0], config, method="omnidraft").token_ids
        )


def test_dtype_auto_measures_each_candidate_only_at_the_blocks_it_ranks_by(tmp_path, monkeypatch):
    """``--dtype auto`` times each candidate precision at ``AUTO_BLOCKS`` (what
    ``verification_score`` reads), not the full profile: the float32 candidate's full profile took
    minutes. The choice is the candidate with the lowest score, and it is cached: a second call
    measures nothing."""
    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    build_pair(tmp_path / "pair")
    measured: list[tuple[int, ...]] = []
    real = profiling.measure_block_ms

    def spy(runner, blocks, **kwargs):
        measured.append(tuple(blocks))
        return real(runner, blocks, **kwargs)

    monkeypatch.setattr(profiling, "measure_block_ms", spy)
    target = str(tmp_path / "pair" / "target")
    best, costs = auto_precision.choose_precision(target, progress=False)
    assert set(costs) == set(auto_precision.lossless_precisions(tmp_path / "pair" / "target"))
    assert measured == [auto_precision.AUTO_BLOCKS] * len(costs)
    assert all(set(c) == set(auto_precision.AUTO_BLOCKS) for c in costs.values())
    assert best == min(costs, key=lambda p: auto_precision.verification_score(costs[p]))
    measured.clear()
    assert auto_precision.choose_precision(target, progress=False) == (best, costs) and measured == []


def test_dtype_auto_chooses_only_among_lossless_precisions(tmp_path, monkeypatch):
    """``--dtype auto`` keeps the target's greedy output: native int8 only for architectures the
    native kernels run (and only where they load), fp32 always; never bf16 or fbgemm int8,
    whose verification blocks round differently from one-token steps. A GGUF-kept model runs
    int8 where that is exact, and a single candidate is chosen without being timed."""
    import json

    from omnidraft.shared.runtime import gguf_weights, native_kernels

    def model(name: str, model_type: str, layer_types: list[str], gguf: bool = False):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type, "layer_types": layer_types}))
        if gguf:
            (d / gguf_weights.GGUF_FILE).write_bytes(b"GGUF")
        return d

    qwen = model("qwen", "qwen2", ["full_attention"] * 2)
    qwen_gguf = model("qwen-gguf", "qwen2", ["full_attention"] * 2, gguf=True)
    gemma = model("gemma", "gemma3_text", ["sliding_attention", "full_attention"])
    gemma_gguf = model("gemma-gguf", "gemma3_text", ["sliding_attention"], gguf=True)
    sliding_llama = model("mistral-like", "llama", ["sliding_attention"])
    monkeypatch.setattr(native_kernels, "native_library", lambda isa=None: object())
    assert auto_precision.lossless_precisions(qwen) == ("int8", "fp32")
    assert auto_precision.lossless_precisions(qwen_gguf) == ("int8",)

    def unmeasurable(*args, **kwargs):
        raise AssertionError("a single lossless candidate was loaded and timed")

    monkeypatch.setattr(profiling, "measure_block_ms", unmeasurable)
    assert auto_precision.choose_precision(str(qwen_gguf), progress=False) == ("int8", {})  # nothing to choose
    for other in (gemma, gemma_gguf, sliding_llama, tmp_path / "missing"):
        assert auto_precision.lossless_precisions(other) == ("fp32",)
    monkeypatch.setattr(native_kernels, "native_library", lambda isa=None: None)  # no kernels: fbgemm only
    assert auto_precision.lossless_precisions(qwen) == ("fp32",)
    assert auto_precision.lossless_precisions(qwen_gguf) == ("fp32",)
