"""Models kept as safetensors read one tensor at a time (omnidraft.shared.runtime.safetensors_weights).

Tiny random Llama (tied and untied head) and Qwen2 models saved with ``save_pretrained``, whole
and in shards: a streamed load leaves the decoder layers, embeddings and head on the meta device;
the int8 runner packed from the files layer by layer is bit-identical to the one packed from the
model ``from_pretrained`` gives; embedding rows equal the table's; the file's pages do not stay
mapped; an engine streams an int8 target and decodes exactly as with the whole model, its
drafter's embeddings left in the file; an architecture the native kernels do not run loads whole.
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_gguf_weights import VOCAB, _resident_bytes, assert_packed_from_the_file_as_from_the_model, tiny
from transformers import GPT2Config, GPT2LMHeadModel

from omnidraft.benchmarks.tiny_models import corpus, train_tokenizer
from omnidraft.shared.engine import model_runner
from omnidraft.shared.runtime import safetensors_weights, weight_packing
from omnidraft.shared.runtime.checkpoints import FileEmbedding
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import native_error, native_library

_TOKENIZER = []


def write_dir(model: torch.nn.Module, out, shard: str | None = None):
    """``model`` as a safetensors model directory with a tokenizer (``shard``: the largest
    shard, e.g. "100KB")."""
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    if not _TOKENIZER:
        _TOKENIZER.append(train_tokenizer(corpus(60), VOCAB))
    _TOKENIZER[0].save_pretrained(out)
    return out


@pytest.mark.parametrize("kind,shard", [("llama", None), ("llama-tied", None), ("qwen2", None), ("qwen2", "100KB")])
@pytest.mark.parametrize("native", [True, False], ids=["native", "fbgemm"])
def test_int8_runner_packed_layer_by_layer_is_bit_identical(tmp_path, monkeypatch, kind, shard, native):
    if native and native_library() is None:
        pytest.skip(f"native kernels unavailable: {native_error()}")
    monkeypatch.setattr(weight_packing, "PACK_SLICE_ROWS", 32)  # 300 rows: ten slices, the last padded
    path = write_dir(tiny(kind), tmp_path / "m", shard)
    assert (path / safetensors_weights.SHARD_INDEX).is_file() == bool(shard)
    full = model_runner.load(str(path), torch.float32, progress=False)
    streamed = model_runner.load(str(path), torch.float32, progress=False, stream=True)
    assert isinstance(streamed.checkpoint, safetensors_weights.SafetensorsCheckpoint)
    assert all(p.is_meta for p in streamed.model.model.layers.parameters())
    assert streamed.model.model.embed_tokens.weight.is_meta and not streamed.model.model.norm.weight.is_meta
    assert_packed_from_the_file_as_from_the_model(full, streamed, native)


def test_rows_are_the_rows_of_the_table_and_the_file_does_not_stay_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_weights.SafetensorsRows, "RELEASE_AFTER_ROWS", 64)
    path = write_dir(tiny("llama"), tmp_path / "m")
    table = model_runner.load(str(path), torch.float32, progress=False).model.model.embed_tokens.weight.clone()
    gc.collect()  # the whole load's model (transformers maps the file) is gone
    streamed = model_runner.load(str(path), torch.float32, progress=False, stream=True)
    rows = streamed.checkpoint.rows("model.embed_tokens.weight")
    assert rows.shape == (VOCAB, 64) and rows.clone() is rows
    for ids in ([0, 7, 299, 7, 150], [5, 6, 7, 8, 2, 3], [299], list(range(VOCAB))):
        got = rows.index_select(0, torch.tensor(ids))
        assert torch.equal(got, table[ids])
    file = path / safetensors_weights.SINGLE_FILE
    assert _resident_bytes(file) == 0  # the whole table was just read: closed
    rows.index_select(0, torch.tensor([1, 2, 3]))  # held open between reads
    assert _resident_bytes(file) > 0 and rows._slice is not None
    rows.index_select(0, torch.arange(VOCAB))  # the whole table: read, then closed
    assert rows._slice is None and _resident_bytes(file) == 0
    got = rows.index_select(0, torch.tensor([9]))  # opened again
    got.add_(1.0)  # memory of its own, not a view of the file
    assert torch.equal(rows.index_select(0, torch.tensor([9])), table[[9]])


def test_an_engine_streams_an_int8_target_kept_as_safetensors(tmp_path):
    from omnidraft.shared.engine.generation import GenerationConfig
    from omnidraft.shared.engine.pair import Engine

    drafter = write_dir(tiny("llama-tied", 1), tmp_path / "drafter")
    target = write_dir(tiny("qwen2", 2), tmp_path / "target")
    engine = Engine.load(str(drafter), str(target), "int8", progress=False)
    assert isinstance(engine.target.checkpoint, safetensors_weights.SafetensorsCheckpoint)
    # the drafter: read from its file and closed, its embeddings left there, its head its own
    embed = engine.drafter.model.get_input_embeddings()
    assert isinstance(embed, FileEmbedding) and _resident_bytes(drafter / safetensors_weights.SINGLE_FILE) == 0
    table = model_runner.load(str(drafter), torch.float32, progress=False).model.model.embed_tokens.weight
    assert torch.equal(embed(torch.tensor([[3, 299, 3]]))[0], table[[3, 299, 3]])
    assert torch.equal(engine.drafter.model.lm_head.weight.float(), table.bfloat16().float())  # held in bf16
    config = GenerationConfig(max_new_tokens=24)
    prompt = "def alpha(beta, gamma):\n"
    spec, alone = (engine.generate(prompt, config, method=m).token_ids for m in ("omnidraft", "ar"))
    assert spec == alone  # lossless
    whole = model_runner.load(str(target), torch.float32, progress=False).model
    runner = FastLlamaRunner(whole, weights="int8", prefill_weights=None, activation_bits=8)
    ids = engine.target.tokenizer(prompt)["input_ids"]
    expected = []
    logits = runner.forward(ids)
    for _ in range(24):
        expected.append(int(logits[-1].argmax()))
        logits = runner.forward(expected[-1:])
    assert alone == expected[: len(alone)]


def test_an_architecture_the_kernels_do_not_run_loads_whole(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    path = write_dir(model, tmp_path / "gpt2")
    assert not safetensors_weights.supported(path)
    loaded = model_runner.load(str(path), torch.float32, progress=False, stream=True)
    assert loaded.checkpoint is None and not any(p.is_meta for p in loaded.model.parameters())


def test_a_checkpoint_saved_under_other_names_loads_whole(tmp_path):
    """A directory whose tensors are not under the model's parameter names (saved from the base
    model: no ``model.`` prefix) is left to transformers' own load, which maps the names."""
    base = tiny("llama-tied").model  # LlamaModel: its state dict has no "model." prefix
    base.config.architectures = ["LlamaModel"]
    path = write_dir(base, tmp_path / "base")
    loaded = model_runner.load(str(path), torch.float32, progress=False, stream=True, embeddings_in_file=True)
    assert loaded.checkpoint is None and not any(p.is_meta for p in loaded.model.parameters())
    assert torch.equal(loaded.model.model.embed_tokens.weight, base.embed_tokens.weight)
