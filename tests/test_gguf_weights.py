"""Models kept as GGUF (omnidraft.shared.runtime.gguf_weights): read exactly, packed layer by layer.

Tiny random Llama (query/key rows permuted in GGUF, as llama.cpp's converter stores them) and
Qwen2 (q/k/v biases) models are written to GGUF with gguf-py, some tensors Q8_0-quantized and
the rest float32, beside their config. Loading gives exactly the float32 values the GGUF
holds; the int8 target runner packed from the GGUF layer by layer (its layers left on the meta
device, its embeddings read row by row, its LM head in slices) is bit-identical to the runner
packed from the fully loaded model; an engine over GGUF directories decodes exactly as one over
safetensors directories.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from omnidraft.benchmarks.tiny_models import corpus, train_tokenizer
from omnidraft.shared.engine import model_runner
from omnidraft.shared.engine.catalog import GGUF_FILE
from omnidraft.shared.runtime import gguf_weights, weight_packing
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import native_error, native_library

VOCAB = 300
QUANTIZED = ("q_proj", "gate_proj", "down_proj", "embed_tokens", "lm_head")  # stored Q8_0


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=kind == "llama-tied",
        rope_theta=10000.0,
    )
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.08)
    return model.eval().requires_grad_(False)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for Llama query/key weights (transformers reverses it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TOKENIZER = []


def write_gguf_dir(model: torch.nn.Module, out) -> dict[str, torch.Tensor]:
    """``model`` as a GGUF-format model directory (config.json, a tokenizer, model.gguf);
    returns the float32 values each parameter holds in the GGUF (Q8_0 round trip where
    quantized)."""
    config = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out.mkdir(parents=True)
    config.save_pretrained(out)
    if not _TOKENIZER:
        _TOKENIZER.append(train_tokenizer(corpus(60), VOCAB))
    _TOKENIZER[0].save_pretrained(out)
    writer = gguf.GGUFWriter(out / GGUF_FILE, gguf.MODEL_ARCH_NAMES[arch])
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue  # GGUF keeps tied weights once
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.float().numpy()
        stored = w
        if config.model_type == "llama" and suffix == "weight" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            stored = _llama_permute(w, heads)
        name = names.get_name(base) + "." + suffix
        if any(q in base for q in QUANTIZED) and w.ndim == 2:
            data = quants.quantize(stored, GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.Q8_0)
            # the values a reader gets back, in the model's own row order
            back = quants.dequantize(data, GGMLQuantizationType.Q8_0)
            if stored is not w:  # the reader restores the model's row order
                back = _unpermute(back, heads)
            expected[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
        else:
            writer.add_tensor(name, np.ascontiguousarray(stored))
            expected[hf_name] = tensor.float().clone()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2"])
def test_load_gives_exactly_the_values_the_gguf_holds(tmp_path, kind):
    model = tiny(kind)
    expected = write_gguf_dir(model, tmp_path / kind)
    loaded = model_runner.load(str(tmp_path / kind), torch.float32, progress=False)
    state = loaded.model.state_dict()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    if kind == "llama-tied":
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    # float32 tensors are stored as they are: those equal the original model's exactly
    original = model.state_dict()
    assert torch.equal(
        state["model.layers.0.self_attn.k_proj.weight"], original["model.layers.0.self_attn.k_proj.weight"]
    )
    assert loaded.checkpoint is None and not any(p.is_meta for p in loaded.model.parameters())


def test_bf16_load_casts_after_dequantizing(tmp_path):
    expected = write_gguf_dir(tiny("qwen2"), tmp_path / "m")
    loaded = model_runner.load(str(tmp_path / "m"), torch.bfloat16, progress=False)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(loaded.model.state_dict()[q], expected[q].to(torch.bfloat16))


def test_rows_are_the_rows_of_the_whole_tensor(tmp_path):
    expected = write_gguf_dir(tiny("llama"), tmp_path / "m")
    streamed = model_runner.load(str(tmp_path / "m"), torch.float32, progress=False, stream=True)
    rows = streamed.checkpoint.rows("model.embed_tokens.weight")
    ids = torch.tensor([0, 7, 299, 7, 150])
    assert rows.shape == (VOCAB, 64)
    assert torch.equal(rows.index_select(0, ids), expected["model.embed_tokens.weight"][ids])


def test_a_gguf_missing_a_weight_is_refused(tmp_path):
    model = tiny("llama")
    write_gguf_dir(model, tmp_path / "m")
    with pytest.raises(ValueError, match="no tensor for"):
        gguf_weights.GgufCheckpoint(tmp_path / "m" / GGUF_FILE, tiny("qwen2"))


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "fbgemm"])
def test_int8_runner_packed_layer_by_layer_is_bit_identical(tmp_path, monkeypatch, kind, native):
    if native and native_library() is None:
        pytest.skip(f"native kernels unavailable: {native_error()}")
    monkeypatch.setattr(weight_packing, "PACK_SLICE_ROWS", 32)  # 300 rows: ten slices, the last padded
    write_gguf_dir(tiny(kind), tmp_path / "m")
    full = model_runner.load(str(tmp_path / "m"), torch.float32, progress=False)
    streamed = model_runner.load(str(tmp_path / "m"), torch.float32, progress=False, stream=True)
    assert all(p.is_meta for p in streamed.model.model.layers.parameters())
    assert_packed_from_the_file_as_from_the_model(full, streamed, native)


def assert_packed_from_the_file_as_from_the_model(full, streamed, native: bool) -> None:
    """An int8 runner packed layer by layer from ``streamed``'s checkpoint holds the bytes of
    one packed from the whole model ``full`` and computes the same logits, bit for bit; nothing
    of the float layers stays in memory (they go back to the meta device)."""
    kwargs = dict(weights="int8", prefill_weights=None, native=native, activation_bits=8)
    a = FastLlamaRunner(full.model, **kwargs)
    b = FastLlamaRunner(streamed.model, checkpoint=streamed.checkpoint, **kwargs)
    assert all(p.is_meta for p in streamed.model.model.layers.parameters())
    assert streamed.model.model.embed_tokens.weight.is_meta
    if native:  # the same bytes (the head's last tensor is its pointer table)
        for x, y in zip(
            a._packing.native_tensors + a._head_tensors[:-1], b._packing.native_tensors + b._head_tensors[:-1]
        ):
            assert torch.equal(x, y)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    for chunk in (ids[:20], ids[20:21], ids[21:25], ids[25:26]):
        assert torch.equal(a.forward(chunk), b.forward(chunk))
    a.crop(10), b.crop(10)
    assert torch.equal(a.forward(ids[30:33]), b.forward(ids[30:33]))
    assert torch.equal(a.last_hidden(), b.last_hidden())


def test_engine_over_gguf_dirs_decodes_as_over_safetensors(tmp_path):
    """A drafter and an int8 target kept as GGUF give the same greedy tokens as the same
    weights saved as safetensors, with speculation and with the target alone; the GGUF
    target's float layers never stay in memory."""
    from omnidraft.shared.engine.generation import GenerationConfig
    from omnidraft.shared.engine.pair import Engine

    dirs = {}
    for role, kind, seed in (("drafter", "llama-tied", 1), ("target", "qwen2", 2)):
        write_gguf_dir(tiny(kind, seed), tmp_path / f"{role}-gguf")
        loaded = model_runner.load(str(tmp_path / f"{role}-gguf"), torch.float32, progress=False)
        loaded.model.save_pretrained(tmp_path / f"{role}-st")
        loaded.tokenizer.save_pretrained(tmp_path / f"{role}-st")
        dirs[role] = (str(tmp_path / f"{role}-gguf"), str(tmp_path / f"{role}-st"))
    config = GenerationConfig(max_new_tokens=24)
    outputs = []
    for i in (0, 1):
        engine = Engine.load(dirs["drafter"][i], dirs["target"][i], "int8", progress=False)
        if i == 0:
            assert engine.target.checkpoint is not None
            assert all(p.is_meta for p in engine.target.model.model.layers.parameters())
        outputs.append(
            [engine.generate("def alpha(beta, gamma):\n", config, method=m).token_ids for m in ("omnidraft", "ar")]
        )
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == outputs[0][1]  # lossless: speculation decodes what the target alone does


def test_the_tensor_table_is_the_one_gguf_py_reads(tmp_path):
    """The table read without decoding the metadata's strings places and shapes every tensor
    (block-quantized ones as rows of bytes, float ones as values) as gguf-py's reader does."""
    expected = write_gguf_dir(tiny("qwen2"), tmp_path / "m")
    path = tmp_path / "m" / GGUF_FILE
    arch, tensors = gguf_weights.tensor_table(path)
    reader = gguf.GGUFReader(path)
    assert arch == "qwen2" and len(tensors) == len(reader.tensors) == len(expected)
    assert {t.qtype for t in tensors} == {GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32}
    for got, want in zip(tensors, reader.tensors, strict=True):
        assert (got.gguf_name, got.qtype, got.offset) == (want.name, want.tensor_type, int(want.data_offset))
        assert (got.shape, got.dtype) == (want.data.shape, want.data.dtype)
        assert np.array_equal(got.map(path), want.data)
    path.write_bytes(path.read_bytes()[:400])  # cut inside the header
    with pytest.raises(ValueError, match="cut short"):
        gguf_weights.tensor_table(path)


def test_the_name_map_is_built_once_per_load_and_is_transformers_own(tmp_path, monkeypatch):
    """transformers asks gguf-py for the tensor name map once per submodule; a load builds it
    once, gets the map transformers' unpatched call gives, and leaves gguf-py as it was."""
    write_gguf_dir(tiny("qwen2"), tmp_path / "m")
    builds = []
    build = gguf.get_tensor_name_map

    def counted(arch, blocks):
        builds.append((arch, blocks))
        return build(arch, blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)
    model = gguf_weights.skeleton(tmp_path / "m", torch.float32)
    checkpoint = gguf_weights.GgufCheckpoint(tmp_path / "m" / GGUF_FILE, model)
    assert len(builds) == 1 and gguf.get_tensor_name_map is counted
    unpatched = gguf_weights.get_gguf_hf_weights_map(model, checkpoint._processor)
    assert len(builds) > 10 and checkpoint._hf_names == unpatched


def test_a_gguf_that_does_not_match_its_config_is_refused(tmp_path):
    write_gguf_dir(tiny("llama"), tmp_path / "m")
    config = (tmp_path / "m" / "config.json").read_text()
    (tmp_path / "m" / "config.json").write_text(config.replace('"intermediate_size": 128', '"intermediate_size": 96'))
    with pytest.raises(ValueError, match=r"is \(128, 64\) in model.gguf, \(96, 64\) in config.json"):
        model_runner.load(str(tmp_path / "m"), torch.float32, progress=False)


def _resident_bytes(path) -> int:
    """This process's resident bytes of the mappings of file ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: address range ... [path]
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_rows_read_one_by_one_stay_resident_up_to_a_bound(tmp_path, monkeypatch):
    """A decode reads one embedding row a step: its pages stay resident (releasing them every
    read made the next read fault), but never more than ``RELEASE_AFTER_ROWS`` rows' worth;
    one read of the whole table releases all of it."""
    monkeypatch.setattr(gguf_weights.GgufRows, "RELEASE_AFTER_ROWS", 64)
    rows, cols = 1200, 4096  # a Q8_0 row: 4,352 bytes, more than a page
    table = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    path = tmp_path / GGUF_FILE
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor(
        "token_embd.weight", quants.quantize(table, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, tensors = gguf_weights.tensor_table(path)
    embeddings = gguf_weights.GgufRows(path, tensors[0])
    expected = quants.dequantize(quants.quantize(table, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    resident = []
    for i in range(3 * 64):
        got = embeddings.index_select(0, torch.tensor([i]))
        assert torch.equal(got[0], torch.from_numpy(expected[i]))
        resident.append(_resident_bytes(path))
    # kept from one read to the next, every page released each 64 rows read (the kernel maps
    # a file's pages in folios of up to megabytes, so the bytes between releases vary)
    assert all(r > 0 for k, r in enumerate(resident) if (k + 1) % 64)
    assert [k for k, r in enumerate(resident) if r == 0] == [63, 127, 191]
    whole = embeddings.index_select(0, torch.arange(rows))
    assert torch.equal(whole, torch.from_numpy(expected)) and _resident_bytes(path) == 0


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.BF16,  # gguf-py's reader gives it as bytes per row too
    ],
)
def test_dequantizing_many_rows_a_pass_gives_gguf_pys_values_bit_for_bit(qtype):
    """``_dequantize`` (``DEQUANTIZE_ROWS`` rows a pass) against gguf-py's own ``dequantize`` on
    every bit pattern a block can hold (random bytes: scales that are huge, tiny, inf or NaN
    included), over a row count that ends inside a pass."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = gguf_weights.DEQUANTIZE_ROWS * 2 + 7
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (rows, 3 * type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):  # the inf and NaN scales
        ours = gguf_weights._dequantize(raw, qtype)
        theirs = np.asarray(gguf.dequantize(raw, qtype), dtype=np.float32)
    assert ours.shape == theirs.shape == (rows, 3 * block_size) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
