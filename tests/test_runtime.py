"""The CPU runtime: target precisions, greedy identity per precision, the native int8 target's
block invariance and the cached cost profile (tiny models; the throughput rule itself is in
test_throughput_rule.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from omnidraft.benchmarks.tiny_models import build_pair
from omnidraft.shared.engine import profiling
from omnidraft.shared.engine.decoding import CrossVocabDecoder, TargetOnlyDecoder, build_expand_map
from omnidraft.shared.engine.draft_policy import ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.model_runner import ModelRunner
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.engine.precision import build_target_runner, precision_name, quantize_linear_int8
from omnidraft.shared.engine.profiling import CostProfile
from omnidraft.shared.runtime import native_kernels
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import NATIVE_ISAS, native_error, native_library
from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.vocab.vocab_bridge import VocabBridge

HAS_NATIVE = native_library() is not None


def needs_isa(isa: str) -> None:
    if native_library(isa) is None:
        pytest.skip(f"native {isa} kernels unavailable: {native_error(isa)}")


PROMPTS = [
    "def alpha_3(beta, gamma):\n",
    "def items_9(count, result):\n    items = count // result\n",
    "\n\ndef",
    'def delta_0(total, items):\n    """Return total * items."""\n    delta = total',
]


@pytest.fixture(scope="module")
def pair():
    return build_pair()


@pytest.fixture(scope="module")
def bridge(pair):
    return VocabBridge.from_tokenizers(
        pair.draft_tokenizer, pair.target_tokenizer, pair.drafter.config.vocab_size, pair.target.config.vocab_size
    )


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
    return model.eval().requires_grad_(False)


def test_qwen2_runs_on_the_fast_runner_and_matches_transformers():
    model = tiny_qwen2()
    assert any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = ModelRunner(model)
    ref.reset()
    expected = ref.forward(ids)
    fast = FastLlamaRunner(model, weights="fp32", max_positions=128)
    fast.reset()
    got = torch.cat([fast.forward(ids[:30]), fast.forward(ids[30:34]), *[fast.forward([t]) for t in ids[34:]]])
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


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
    for block in (2, 3, 4, 5, 8, 12, 16, 19):  # 4-row blocks and every tail after them
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


def test_draft_stop_cost_needs_a_profile(pair, bridge):
    spd, _ = _decoders(pair, bridge, ModelRunner(pair.target))
    with pytest.raises(ValueError, match="cost profile"):
        spd.generate("x = 1\n", pair.target_tokenizer.encode("x = 1\n"), GenerationConfig(draft_stop="cost"))
    with pytest.raises(ValueError, match="draft_stop"):
        GenerationConfig(draft_stop="sometimes").validate()


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


def test_block_timing_takes_the_median_of_trials_and_retries_outliers(monkeypatch):
    """One disturbed trial cannot set a figure: each trial keeps its minimum, the median of the
    trials is kept, and trials continue while they disagree."""
    trials = iter([9.0, 50.0, 10.0, 11.0, 10.0, 10.5, 10.2])
    monkeypatch.setattr(profiling, "_time_block", lambda runner, context, block, repeats: next(trials))

    class Runner:
        max_positions = 512

        def reset(self): ...
        def forward(self, ids, logits_to_keep=0): ...

    # warm-up pass (1 value), then trials 50, 10, 11 disagree (50 > 1.25 * 10): more until
    # max_trials; the median of [50, 10, 11, 10, 10.5, 10.2] is 10.35
    ms = profiling.measure_block_ms(Runner(), (1,), trials=3, max_trials=6)
    assert ms[1] == pytest.approx(10.35)


def test_profile_cache_is_reused_and_invalidated_by_machine_or_model(tmp_path, monkeypatch):
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
    machine = profiling.machine_fingerprint()
    monkeypatch.setattr(profiling, "machine_fingerprint", lambda: {**machine, "cpu": "Another CPU"})
    assert costs() == {"1": 2.0} and len(calls) == 2  # another machine: measured again
    (model_dir / "config.json").write_text('{"a": 2}')
    assert costs() == {"1": 3.0} and len(calls) == 3  # the model changed: measured again
    assert costs() == {"1": 3.0} and len(calls) == 3
    (tmp_path / "home" / "profiles").joinpath("junk.json").write_text("{")  # unrelated junk is ignored
    assert costs() == {"1": 3.0}


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


def test_native_kernels_come_from_the_install_and_a_stale_build_is_not_used(monkeypatch, tmp_path):
    """``pip install`` (setup.py) built this CPU's kernels, and the runtime loads that build; an
    installed build of other sources (an edited checkout) is ignored and the set is built at
    first use under ``$OMNIDRAFT_HOME``; with neither a build nor a compiler the reason says so."""
    isa = native_kernels.default_native_isa()
    if isa is None or native_error(isa) is not None:
        pytest.skip(f"no native kernels on this machine: {native_error(isa) if isa else 'no instruction set'}")
    assert native_kernels.installed_library(isa) is not None, (
        f"no up-to-date installed build of the {isa} kernels: run `pip install -e .` (setup.py builds them)"
    )
    monkeypatch.setattr(native_kernels, "_native_state", {})
    assert native_kernels.library_origin(isa) == "installed"

    real_key = native_kernels.source_key
    monkeypatch.setattr(native_kernels, "source_key", lambda name: "0" * 16 if name == isa else real_key(name))
    assert native_kernels.installed_library(isa) is None  # built from other sources: not used
    monkeypatch.setattr(native_kernels, "source_key", real_key)
    monkeypatch.setattr(native_kernels, "installed_library", lambda name: None)
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    monkeypatch.setattr(native_kernels, "_native_state", {})
    assert native_kernels.library_origin(isa) == "built at first use"
    assert len(list((tmp_path / "fast_drafter").glob(f"fd_{isa}_*.so"))) == 1

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native_kernels, "_native_state", {})
    assert native_library(isa) is None and "cannot run" in native_error(isa)


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
    assert len(list((tmp_path / "home" / "profiles").glob("*.json"))) == 3  # target, drafter, overheads
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


def test_device_state_keeps_the_rule_calibration_and_the_lookup_history(tmp_path, monkeypatch):
    from omnidraft.client.session import DeviceSession

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    build_pair(tmp_path / "pair")
    engine = Engine.load(
        str(tmp_path / "pair" / "drafter"),
        str(tmp_path / "pair" / "target"),
        "fp64",
        drafter_weights="fp32",
        progress=False,
    )
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


def test_a_merged_adapter_keeps_the_drafter_costs(tmp_path, monkeypatch):
    """A trained adapter is merged into its runner's weights: the drafter costs the same as
    without it, so the session's rule keeps deciding with the one profile measured (no second
    drafter measurement), and the profile check compares the adapter's steps with it."""
    import torch

    from omnidraft.client.session import DeviceSession

    monkeypatch.setenv("OMNIDRAFT_PROFILES", str(tmp_path / "profiles"))
    build_pair(tmp_path / "pair")
    engine = Engine.load(
        str(tmp_path / "pair" / "drafter"),
        str(tmp_path / "pair" / "target"),
        "fp64",
        drafter_weights="fp32",
        progress=False,
    )
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
    drafter_entries = [
        p for p in (tmp_path / "profiles").glob("*.json") if json.loads(p.read_text())["key"]["role"] == "drafter"
    ]
    assert len(drafter_entries) == 1  # measured once, for every adapter
    assert engine.check_profile()["steps"]  # the adapter's steps are checked against it


def test_instruction_set_overrides(monkeypatch):
    """``OMNIDRAFT_NATIVE_ISA`` picks the native kernels' instruction set and an unknown one is
    refused with its reason; ``ONEDNN_MAX_CPU_ISA`` below bf16 turns the bf16 paths off."""
    monkeypatch.setenv("OMNIDRAFT_NATIVE_ISA", "avx2")
    assert native_kernels.default_native_isa() == "avx2"
    monkeypatch.setenv("OMNIDRAFT_NATIVE_ISA", "sse2")
    assert native_library() is None and "unknown instruction set 'sse2'" in native_error()
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        FastLlamaRunner(tiny_qwen2(), weights="int8", native=True, max_positions=32)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not native_kernels.cpu_has_native_bf16()
    assert FastLlamaRunner(tiny_qwen2(), weights="int8", native=False, max_positions=32).prefill_weights is None


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
def test_prompt_prefill_kernels_follow_the_instruction_set(isa):
    """``prefill_weights="auto"``: a second bf16 copy for prompt prefill only where the CPU has
    native bf16 and the int8 kernels prefill with 16-bit activations on VNNI; on AMX tiles or
    with 8-bit prefill activations (drafters, targets) int8 prefill is faster and the runner
    keeps one copy of its weights."""
    needs_isa(isa)
    runner = FastLlamaRunner(tiny_qwen2(), weights="int8", native=True, native_isa=isa, max_positions=32)
    bf16 = native_kernels.cpu_has_native_bf16() and isa != "amx"
    assert runner.prefill_weights == ("bf16" if bf16 else None)
    assert ("bf16" in runner._packing.torch_layers) == bf16
    p8 = FastLlamaRunner(
        tiny_qwen2(), weights="int8", native=True, native_isa=isa, max_positions=32, prefill_activation_bits=8
    )
    assert p8.prefill_weights is None and "bf16" not in p8._packing.torch_layers


def test_dtype_auto_chooses_only_among_lossless_precisions(tmp_path, monkeypatch):
    """``--dtype auto`` keeps the target's greedy output: native int8 only for architectures the
    native kernels run (and only where they load), fp32 always; never bf16 or fbgemm int8,
    whose verification blocks round differently from one-token steps. A GGUF-kept model runs
    int8 where that is exact."""
    import json

    from omnidraft.shared.engine import profiling
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
    assert profiling.lossless_precisions(qwen) == ("int8", "fp32")
    assert profiling.lossless_precisions(qwen_gguf) == ("int8",)
    for other in (gemma, gemma_gguf, sliding_llama, tmp_path / "missing"):
        assert profiling.lossless_precisions(other) == ("fp32",)
    monkeypatch.setattr(native_kernels, "native_library", lambda isa=None: None)  # no kernels: fbgemm only
    assert profiling.lossless_precisions(qwen) == ("fp32",)
    assert profiling.lossless_precisions(qwen_gguf) == ("fp32",)


PROC_STATUS = Path("/proc/self/status")


def _resident_mb() -> float:
    line = next(x for x in PROC_STATUS.read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not PROC_STATUS.exists(), reason="reads /proc/self/status (Linux)")
def test_a_kv_cache_is_resident_only_where_positions_were_written():
    """``zeros_on_demand`` (a runner's KV cache): zeros everywhere, and resident memory grows
    with the pages written, not with the 64 MB allocated (``torch.zeros`` writes them all)."""
    from omnidraft.shared.runtime.heap import zeros_on_demand

    before = _resident_mb()
    cache = zeros_on_demand((32, 1024, 1024), torch.float16)  # 64 MiB
    cache[:, :16].fill_(1.0)  # the first 16 "positions" of each of 32 heads: 1 MiB
    grown = _resident_mb() - before
    assert grown < 16, grown
    assert not cache[:, 16:].any() and int(cache[:, :16].double().sum()) == 32 * 16 * 1024
    runner = FastLlamaRunner(tiny_qwen2(), weights="int8", max_positions=64)
    assert not runner._kcache.any() and not runner.fork()._vcache.any()
