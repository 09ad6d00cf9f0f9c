"""FastLlamaRunner (omnidraft.shared.runtime.fast_drafter) against HF's own forward with a DynamicCache.

Tiny random Llama models (no download): fp32 must match HF to ~1e-4 through prefill,
single-token steps, multi-token blocks and crop-and-refeed; bf16 / int8 must stay close; crop
must be exact; LM-head pruning must give -inf at pruned ids and the same logits elsewhere.
The ``real_models`` test checks greedy agreement on SmolLM2-135M.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from omnidraft.shared.engine.model_runner import ModelRunner
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import NATIVE_ISAS, native_error, native_library

VOCAB = 300

# label -> (weights, native, native instruction set); the int8 fbgemm path runs everywhere, each
# native instruction set wherever the CPU has it (an AVX-512 machine also runs the AVX2 kernels)
KINDS = {
    "fp32": ("fp32", None, None),
    "bf16": ("bf16", None, None),
    "int8-fbgemm": ("int8", False, None),
    **{f"int8-native-{isa}": ("int8", True, isa) for isa in NATIVE_ISAS},
}


def kind_of(label: str) -> tuple[str, bool | None, str | None]:
    weights, native, isa = KINDS[label]
    if native and native_library(isa) is None:
        pytest.skip(f"native {isa} kernels unavailable: {native_error(isa)}")
    return KINDS[label]


def tiny_llama(tied: bool, bias: bool = False, seed: int = 0, unit_norms: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
        rope_theta=10000.0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and not unit_norms:  # non-trivial gains exercise the folding
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif "proj" in name or "embed" in name or "lm_head" in name:
                param.normal_(0.0, 0.08)
    model.eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module", params=["tied", "untied", "bias"])
def model(request):
    return tiny_llama(tied=request.param == "tied", bias=request.param == "bias")


def seq(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def script(runner) -> list[torch.Tensor]:
    """Prefill, single steps, a block, crop-and-refeed, and more steps; every call's logits."""
    ids = seq(60)
    runner.reset()
    out = [runner.forward(ids[:20])]
    out += [runner.forward([t]) for t in ids[20:25]]
    out.append(runner.forward(ids[25:29]))
    runner.crop(22)  # drop 7 positions, then continue from position 22 with other tokens
    out.append(runner.forward(ids[40:43]))
    out += [runner.forward([t]) for t in ids[43:46]]
    out.append(runner.forward(ids[46:56], logits_to_keep=1))
    out.append(runner.forward(ids[56:59], logits_to_keep=2))
    runner.crop(3)
    out.append(runner.forward(ids[10:14]))
    assert runner.length == 7
    return out


def make(model, kind, **kw) -> FastLlamaRunner:
    weights, native, isa = kind
    return FastLlamaRunner(model, weights=weights, native=native, native_isa=isa, max_positions=128, **kw)


def test_fp32_matches_hf(model):
    ref = script(ModelRunner(model))
    fast = make(model, kind_of("fp32"))
    got = script(fast)
    assert fast.forward_calls == len(got)
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bf16", "int8-fbgemm", *(f"int8-native-{isa}" for isa in NATIVE_ISAS)])
def test_quantized_close_to_hf(model, kind):
    kind = kind_of(kind)
    ref = torch.cat(script(ModelRunner(model)))
    got = torch.cat(script(make(model, kind, prefill_weights=None)))
    err = (got - ref).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    scale = ref.abs().max().item()
    # random tiny models have nearly flat logits (many near-ties), hence the modest agreement floors
    max_err, min_agree = {("bf16", None): (0.03, 0.9), ("int8", False): (0.15, 0.75), ("int8", True): (0.04, 0.85)}[
        kind[:2]
    ]
    assert err <= max_err * scale, (kind, err, scale)
    assert agree >= min_agree, (kind, agree)


def test_bf16_without_onednn_prepacking(model, monkeypatch):
    """CPUs oneDNN cannot prepack bf16 for (AVX2-only) run bf16 weights on torch's own GEMM."""
    from omnidraft.shared.runtime import fast_drafter, weight_packing

    monkeypatch.setattr(weight_packing, "onednn_bf16_linear", lambda: False)  # the kernels
    monkeypatch.setattr(fast_drafter, "onednn_bf16_linear", lambda: False)  # the backend's name
    runner = make(model, kind_of("bf16"), prefill_weights=None)
    assert runner.backend == "torch-bf16"
    ref = torch.cat(script(ModelRunner(model)))
    got = torch.cat(script(runner))
    assert (got - ref).abs().max().item() <= 0.03 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("kind", list(KINDS))
def test_crop_equals_never_fed(kind):
    model = tiny_llama(tied=True, seed=3)
    kind = kind_of(kind)
    ids, junk = seq(40, seed=5), seq(9, seed=6)
    a = make(model, kind, prefill_weights=None)
    a.forward(ids[:20])
    a.forward(junk[:5])
    a.forward([junk[5]])
    a.forward(junk[6:])
    a.crop(20)
    got = [a.forward(ids[20:24]), a.forward([ids[24]]), a.forward(ids[25:27], logits_to_keep=1)]
    b = make(model, kind, prefill_weights=None)
    b.forward(ids[:20])
    want = [b.forward(ids[20:24]), b.forward([ids[24]]), b.forward(ids[25:27], logits_to_keep=1)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert a.length == b.length == 27
    assert a.held == b.held == ids[:27]  # the ids at the cached positions, whatever was cropped
    a.reset()
    assert a.held == [] and a.length == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_prefill_is_kept_while_the_cache_holds_it(kind):
    """``prefilled`` names the first forward into the empty cache while every position it wrote
    is still held: a decode of the same prompt starting from it computes the bits a fresh
    prefill gives. A crop into it, a reset or new weights drop it."""
    model = tiny_llama(tied=True, seed=3)
    kind = kind_of(kind)
    ids = seq(40, seed=5)
    a = make(model, kind, prefill_weights=None)
    a.forward(ids[:20])
    assert a.prefilled.ids == tuple(ids[:20]) and a.prefilled.seconds > 0
    a.forward(ids[20:31])
    a.crop(20)
    assert a.prefilled.ids == tuple(ids[:20])  # a later forward or a crop to its end keeps it
    got = [a.forward(ids[20:24]), a.forward([ids[24]])]
    b = make(model, kind, prefill_weights=None)
    b.forward(ids[:20])
    want = [b.forward(ids[20:24]), b.forward([ids[24]])]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    a.crop(19)
    assert a.prefilled is None
    a.forward(ids[19:25])  # not a first forward into an empty cache
    assert a.prefilled is None
    a.reset()
    a.forward(ids[:5])
    assert a.prefilled.ids == tuple(ids[:5])
    a.reset()
    assert a.prefilled is None
    b._use_packing(b._base_packing)  # new weights (an adapter merged): the cache is not theirs
    assert b.prefilled is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_vocab_rows_pruning(kind):
    model = tiny_llama(tied=False, seed=4)
    kind = kind_of(kind)
    keep = torch.tensor([3, 7, 8, 100, 150, 151, 299, 42, 7])  # unsorted, with a duplicate
    ids = seq(30, seed=7)
    full = make(model, kind, prefill_weights=None)
    pruned = make(model, kind, prefill_weights=None, vocab_rows=keep)
    for chunk in (ids[:12], ids[12:13], ids[13:16]):
        f, p = full.forward(chunk), pruned.forward(chunk)
        assert p.shape == f.shape == (len(chunk), VOCAB)
        kept = torch.zeros(VOCAB, dtype=torch.bool)
        kept[keep] = True
        assert torch.isneginf(p[:, ~kept]).all()
        torch.testing.assert_close(p[:, kept], f[:, kept], atol=1e-5, rtol=1e-5)
        assert p.argmax(-1).tolist() == [int(keep.unique()[i]) for i in f[:, kept].argmax(-1)]


def _group_quantized(model):
    """A copy of ``model`` whose Linear weights are rounded like the native int8 packing
    (a scale per output row and 64 inputs): the reference for int8 runners."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight.shape[1] % 64 == 0:
                g = mod.weight.view(mod.weight.shape[0], -1, 64)
                s = g.abs().amax(-1, keepdim=True) / 127
                mod.weight.copy_((torch.round(g / s) * s).view_as(mod.weight))
    return model


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
def test_native_kernels_match_dequantized_weights(isa):
    """The native int8 path equals HF run on the same group-quantized weights (its 16-bit
    activations are nearly lossless), which checks the kernels' arithmetic itself, on every
    instruction set this CPU runs."""
    kind = kind_of(f"int8-native-{isa}")
    model = tiny_llama(tied=False, seed=8, unit_norms=True)
    ref = torch.cat(script(ModelRunner(_group_quantized(model))))
    got = torch.cat(script(make(model, kind, prefill_weights=None)))
    torch.testing.assert_close(got, ref, atol=2e-3 * ref.abs().max().item(), rtol=0)


def lora_pair(model, seed: int = 11, rank: int = 4):
    """``model`` (left untouched) and a peft copy of it with a random, non-trivial LoRA adapter
    on every Linear of the decoder, plus that adapter's matrices in ``set_lora``'s format."""
    from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec

    adapters = DrafterAdapters(copy.deepcopy(model), LoraSpec(rank=rank), drafter_weights="fp32")
    adapters.add("t")
    torch.manual_seed(seed)
    adapters.load_state_dict("t", {k: 0.1 * torch.randn_like(v) for k, v in adapters.state_dict("t").items()})
    return adapters, adapters.lora_layers(adapters.active)


@pytest.mark.parametrize("label", ["fp32", "bf16", *(f"int8-native-{isa}" for isa in NATIVE_ISAS)])
def test_merged_adapter_matches_peft(label):
    """An adapter merged into the packed weights equals peft's forward with the adapter merged
    (``merge_and_unload``); for int8, with the merged weights group-quantized as the runner
    packs them. Removing the adapter returns to the base model's logits."""
    kind = kind_of(label)
    # int8: unit norm gains, or the reference's quantized weights would differ from the packed
    # ones (the runner quantizes weights with the gains folded in); fp32/bf16 check the folding
    model = tiny_llama(tied=False, seed=12, bias=True, unit_norms=kind[0] == "int8")
    adapters, layers = lora_pair(model)
    merged = copy.deepcopy(adapters.peft).merge_and_unload()
    ref = torch.cat(script(ModelRunner(_group_quantized(merged) if kind[0] == "int8" else merged)))
    plain = torch.cat(script(ModelRunner(_group_quantized(model) if kind[0] == "int8" else model)))
    fast = make(model, kind, prefill_weights=None)
    fast.set_lora(layers)
    assert fast.lora_rank == 4
    got = torch.cat(script(fast))
    scale = ref.abs().max().item()
    assert (ref - plain).abs().max() > 0.05 * scale  # the adapter changes the logits a lot
    tol = {"fp32": 1e-4, "bf16": 0.03, "int8": 2e-3}[kind[0]]
    torch.testing.assert_close(got, ref, atol=tol * scale, rtol=0)
    fast.set_lora(None)  # removed again: the base model's logits
    assert fast.lora_rank == 0
    torch.testing.assert_close(torch.cat(script(fast)), plain, atol=tol * scale, rtol=0)


def test_a_template_runner_holds_no_kv_cache_and_its_forks_decode_as_it_did():
    """``as_template`` frees the base runner's KV cache (a device's adapters only fork it); a
    fork made afterwards has a full cache and gives the logits the runner gave before, and the
    template refuses to run."""
    model = tiny_llama(tied=True, seed=17)
    base = FastLlamaRunner(model, weights="int8", prefill_weights=None, max_positions=64)
    before = torch.cat(script(base))
    cache_bytes = base._kcache.nbytes + base._vcache.nbytes
    base.as_template()
    assert base._kcache.nbytes + base._vcache.nbytes == 0 < cache_bytes
    with pytest.raises(RuntimeError, match="template"):
        base.forward([1, 2])
    fork = base.fork()
    assert fork._kcache.nbytes + fork._vcache.nbytes == cache_bytes
    assert fork.held == [] and fork.held is not base.held
    assert torch.equal(torch.cat(script(fork)), before)
    assert torch.equal(torch.cat(script(base.fork())), before)  # forks keep their own caches


def test_lora_on_the_prefill_kernels_and_forks():
    """The prefill kernels run the merged adapter too; a fork shares the base packing, keeps its
    own KV cache, and merging an adapter into it leaves the base runner's weights alone."""
    model = tiny_llama(tied=True, seed=13)
    adapters, layers = lora_pair(model)
    ref = script(ModelRunner(adapters.peft))
    base = FastLlamaRunner(model, weights="int8", prefill_weights="fp32", prefill_min_tokens=4, max_positions=64)
    fork = base.fork()
    fork.set_lora(layers)
    plain = script(base)  # the base runner has no adapter and its own cache
    got = script(fork)
    for r, g in zip(ref, got):
        assert (g - r).abs().max() <= 0.05 * r.abs().max()
    assert torch.equal(torch.cat(script(base)), torch.cat(plain))
    assert fork.fork()._packing is base._packing  # a fork of a merged runner starts from the base
    with pytest.raises(ValueError, match="layers"):
        fork.set_lora(layers[:1])
    bad = [dict(mods) for mods in layers]
    a, b = bad[0]["q_proj"]
    bad[0]["q_proj"] = (a[:, :-1], b)
    with pytest.raises(ValueError, match="q_proj has shapes"):
        fork.set_lora(bad)
    assert torch.equal(torch.cat(script(fork)), torch.cat(got))  # a refused adapter changes nothing


def test_prefill_path_switch():
    """int8 with a bf16 prefill: blocks longer than prefill_min_tokens take the other kernels."""
    model = tiny_llama(tied=True, seed=9)
    ref = script(ModelRunner(model))
    fast = FastLlamaRunner(model, weights="int8", prefill_weights="fp32", prefill_min_tokens=4, max_positions=64)
    got = script(fast)
    for r, g in zip(ref, got):
        assert g.shape == r.shape
        assert (g - r).abs().max() <= 0.05 * r.abs().max()


def test_limits_and_errors():
    model = tiny_llama(tied=True, seed=2)
    r = FastLlamaRunner(model, weights="fp32", max_positions=16)
    with pytest.raises(ValueError):
        r.forward([])
    r.forward(seq(16))
    with pytest.raises(ValueError):
        r.forward([1])
    r.crop(10)
    assert r.length == 10
    assert r.forward([1, 2], logits_to_keep=1).shape == (1, VOCAB)
    with pytest.raises(ValueError):
        FastLlamaRunner(model, weights="int4")


@pytest.mark.real_models
def test_smollm2_greedy_agreement():
    from transformers import AutoTokenizer

    from omnidraft.shared.engine import catalog, model_runner

    path = catalog.resolve("smollm2-135m")
    model = model_runner.load(str(path), torch.float32, progress=False).model  # a GGUF-kept pull too
    model.eval()
    prompt = AutoTokenizer.from_pretrained(path).encode(
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    )
    hf = ModelRunner(model)
    logits = hf.forward(prompt, logits_to_keep=1)
    path = []
    for _ in range(50):  # HF's greedy continuation
        path.append(int(logits[-1].argmax()))
        logits = hf.forward([path[-1]], logits_to_keep=1)
    for weights, minimum in (("fp32", 1.0), ("int8", 0.9)):
        fast = FastLlamaRunner(model, weights=weights)
        logits = fast.forward(prompt, logits_to_keep=1)
        agree = 0
        for t in path:  # teacher-forced along HF's path: does the runner pick the same token?
            agree += int(logits[-1].argmax()) == t
            logits = fast.forward([t], logits_to_keep=1)
        rate = agree / len(path)
        print(f"SmolLM2 {weights} ({fast.backend}) greedy agreement with HF fp32: {rate:.2f}")
        assert rate >= minimum, (weights, rate)


@pytest.mark.parametrize("isa", list(NATIVE_ISAS))
def test_prefill_activation_bits(isa):
    """``prefill_activation_bits=8`` runs calls longer than ``prefill_min_tokens`` with the 8-bit
    activation kernels and every other call with the 16-bit ones, bit for bit."""
    kind = kind_of(f"int8-native-{isa}")
    model = tiny_llama(tied=False, seed=21)
    mixed = make(model, kind, prefill_weights=None, prefill_activation_bits=8)
    a8 = make(model, kind, prefill_weights=None, activation_bits=8)
    a16 = make(model, kind, prefill_weights=None)
    assert mixed.backend.endswith("-p8") and not a16.backend.endswith("-p8")
    ids = seq(40)
    prefills = [r.forward(ids[:30]) for r in (mixed, a8, a16)]
    assert torch.equal(prefills[0], prefills[1]) and not torch.equal(prefills[0], prefills[2])
    for r in (mixed, a16):
        r.reset()
        r.forward(ids[:10])  # short calls: 16-bit activations
    assert torch.equal(mixed.forward(ids[10:14]), a16.forward(ids[10:14]))
    with pytest.raises(ValueError, match="activation_bits"):
        make(model, kind, prefill_activation_bits=4)


@pytest.mark.parametrize("rows", [300, 32, 7])
def test_native_packing_in_row_slices_is_the_documented_layout(monkeypatch, rows):
    """``pack_native`` (``fd_pack_rows`` in C) quantizes a matrix a slice of rows at a time (32
    here: ten slices of a 300-row matrix, the last padded); the bytes are the documented layout
    computed whole by torch: per (row, 64 inputs) a scale max|w| / 127 (at least 1e-30),
    weights round(w / scale) to the nearest, ties to even, + 128 as uint8 in blocks of 16 rows x
    4 inputs, padding rows zero. Exact ties and an all-zero group are among the inputs."""
    from omnidraft.shared.runtime import weight_packing

    lib = native_library()
    if lib is None:
        pytest.skip(f"no native kernels: {native_error()}")
    monkeypatch.setattr(weight_packing, "PACK_SLICE_ROWS", 32)
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(rows, 128, generator=g) * torch.rand(rows, 1, generator=g), torch.randn(rows, generator=g)
    w[0, :64] = 0.0  # an all-zero group: scale 1e-30, weights 128
    w[-1, 64:70] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5])  # scale 1: ties, to even
    packed, scales, bias = weight_packing.pack_native(w, b, lib)

    n = -(-rows // 16) * 16
    whole = torch.cat([w, torch.zeros(n - rows, 128)]).view(n, 2, 64)
    scale = (whole.abs().amax(-1) / 127.0).clamp_min(1e-30)
    q = (torch.round(whole / scale[..., None]).clamp(-127, 127) + 128).to(torch.uint8).view(n, 128)
    for r in (0, rows - 1, n - 1):
        for c in (0, 63, 64, 127):
            assert packed[r // 16, c // 4, r % 16, c % 4] == q[r, c]
            assert scales[r // 16, c // 64, r % 16] == scale[r, c // 64]
    assert packed.shape == (n // 16, 32, 16, 4) and scales.shape == (n // 16, 2, 16)
    assert torch.equal(packed.permute(0, 2, 1, 3).reshape(n, 128), q)
    assert torch.equal(scales.permute(0, 2, 1).reshape(n, 2), scale)
    assert q[rows - 1, 64:70].tolist() == [255, 128, 130, 130, 126, 128] and q[0, :64].eq(128).all()
    assert torch.equal(bias, torch.cat([b, torch.zeros(n - rows)]))


def test_merging_an_adapter_on_a_board_hands_each_layers_temporaries_back(monkeypatch):
    """``set_lora`` re-packs every layer from its float32 weights plus the adapter's deltas. On a
    board (``heap.small_machine``) it hands the C heap's free memory back to the system after
    each layer: freed among packed buffers that stay, glibc kept the temporaries (SmolLM2-135M
    re-packed after an update rose 0.38 GB over its resident set and made a learning device's
    peak: BENCHMARKS.md, device memory). Elsewhere it does not: pages handed back fault in
    again, 0.3 s more per re-pack there."""
    from omnidraft.shared.runtime import fast_drafter

    model = tiny_llama(tied=False, seed=3)
    runner = make(model, ("int8", None, None))  # the best kernels here
    _, layers = lora_pair(model)
    real_fold = fast_drafter.fold_layer
    folded: list[int] = []  # layers folded so far, each time the heap is handed back

    def fold_layer(*args):
        folded.append(len(folded))
        return real_fold(*args)

    released_after: list[int] = []
    monkeypatch.setattr(fast_drafter, "fold_layer", fold_layer)
    monkeypatch.setattr(fast_drafter, "release_freed_memory", lambda: released_after.append(len(folded)))
    for board in (False, True):
        monkeypatch.setattr(fast_drafter, "small_machine", lambda board=board: board)
        folded.clear()
        runner.set_lora(layers)
        assert runner.lora_rank == 4
    assert released_after == list(range(1, model.config.num_hidden_layers + 1))  # after every layer, on the board
