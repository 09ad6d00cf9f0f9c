"""A device's adaptation state on disk, on the tiny pair (conftest's ``pair_dir``): it round-trips,
a damaged part is set aside and rebuilt, a state directory that is a file is a clear error,
AES-GCM encryption at rest (wrong or missing keys, a plaintext swap, the migration), the CLI's
one-line wrong-key error, and exporting a learned adapter that peft loads."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from tiny_pair import CONFIG, PROMPTS, _engine

from omnidraft.client.device_state import ADAPTER_FILE, CACHE_FILE, HEAD_FILE, MANIFEST_FILE, DeviceState
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession


def test_state_round_trip(pair_dir, tmp_path):
    engine = _engine(pair_dir)
    s = DeviceSession(engine, target_name="t", state_dir=tmp_path, online=OnlineConfig(interval=2, lr=1e-2))
    for prompt in PROMPTS[:4]:
        s.generate(prompt, CONFIG)
    s.save()
    saved_adapter = s.adapters.state_dict("t")
    saved_cache = engine.cache.to_bytes()
    files = {p.name for p in s.state.dir.iterdir()}
    assert {ADAPTER_FILE, HEAD_FILE, CACHE_FILE, MANIFEST_FILE} <= files

    engine2 = _engine(pair_dir)
    s2 = DeviceSession(engine2, target_name="t", state_dir=tmp_path)
    assert s2.problems == []
    assert all(torch.equal(saved_adapter[k], v) for k, v in s2.adapters.state_dict("t").items())
    assert engine2.cache.to_bytes() == saved_cache
    assert s2.head.ready and s2.learner.updates == 2
    assert all(torch.equal(a, b) for a, b in zip(s.head.state_dict().values(), s2.head.state_dict().values()))


@pytest.mark.parametrize("victim", [ADAPTER_FILE, HEAD_FILE, CACHE_FILE, MANIFEST_FILE])
@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupted_state_is_set_aside_and_rebuilt(pair_dir, tmp_path, victim, damage):
    engine = _engine(pair_dir)
    s = DeviceSession(engine, target_name="t", state_dir=tmp_path, online=OnlineConfig(interval=2, lr=1e-2))
    for prompt in PROMPTS[:2]:
        s.generate(prompt, CONFIG)
    s.save()
    path = s.state.dir / victim
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 7)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s2 = DeviceSession(_engine(pair_dir), target_name="t", state_dir=tmp_path)
    assert s2.problems and victim in s2.problems[0]
    assert any("set aside" in str(w.message) for w in caught)
    assert list(s2.state.dir.glob(f"{victim}.corrupt-*"))  # kept for inspection, not deleted
    # the damaged part starts fresh; the session still works and saves a consistent state
    if victim in (ADAPTER_FILE, MANIFEST_FILE):
        assert all(float(v.abs().max()) == 0 for k, v in s2.adapters.state_dict("t").items() if "lora_B" in k)
    s2.generate(PROMPTS[3], CONFIG)
    s2.save()
    s3 = DeviceSession(_engine(pair_dir), target_name="t", state_dir=tmp_path)
    assert s3.problems == []


def test_state_dir_that_is_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DeviceState(f, "d", "t")


def test_encrypted_state_round_trip_wrong_key_and_migration(pair_dir, tmp_path):
    """With a key file the state is AES-GCM encrypted at rest; a wrong or missing key is a clear
    error that leaves the files untouched; a plaintext state is refused under a key that existed
    before, and read and encrypted at the next save under a key created for it."""
    from omnidraft.client.state_key import StateCipher, StateKeyError

    state, key = tmp_path / "state", tmp_path / "keys" / "state.key"
    s = DeviceSession(
        _engine(pair_dir), target_name="t", state_dir=state, state_key=key, online=OnlineConfig(interval=2, lr=1e-2)
    )
    for prompt in PROMPTS[:2]:
        s.generate(prompt, CONFIG)
    s.save()
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_bytes()) == 32
    on_disk = {p.name: p.read_bytes() for p in s.state.dir.iterdir()}
    assert all(b.startswith(b"ODS1") for b in on_disk.values())
    assert b'"updates"' not in on_disk[MANIFEST_FILE] and b"lora_A" not in on_disk[ADAPTER_FILE]
    s2 = DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=key)
    assert s2.problems == [] and s2.learner.updates == 1
    assert all(torch.equal(s.adapters.state_dict("t")[k], v) for k, v in s2.adapters.state_dict("t").items())
    with pytest.raises(StateKeyError, match="wrong key"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=tmp_path / "other.key")
    with pytest.raises(StateKeyError, match="encrypted: give its key"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state)
    assert {p.name: p.read_bytes() for p in s.state.dir.iterdir()} == on_disk  # nothing set aside
    with pytest.raises(ValueError, match="outside the state directory"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=state / "k")
    key.chmod(0o644)
    with pytest.raises(StateKeyError, match="chmod 600"):
        StateCipher(key)
    key.chmod(0o600)
    plain = tmp_path / "plain"
    p = DeviceSession(_engine(pair_dir), target_name="t", state_dir=plain)
    p.generate(PROMPTS[0], CONFIG)
    p.save()
    # someone who can write the state directory swaps the encrypted state for a plaintext one of
    # their own: with the existing key it is refused, untouched
    shutil.rmtree(s.state.dir)
    shutil.copytree(p.state.dir, s.state.dir)
    with pytest.raises(StateKeyError, match="refused in plaintext"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=key)
    # the migration: a plaintext state and a key file created now
    m = DeviceSession(_engine(pair_dir), target_name="t", state_dir=plain, state_key=tmp_path / "keys" / "new.key")
    assert m.problems == []
    m.save()
    assert all(f.read_bytes().startswith(b"ODS1") for f in m.state.dir.iterdir())


def test_cli_reports_a_wrong_state_key_in_one_line(pair_dir, tmp_path, capsys):
    from omnidraft.cli import main

    base = [
        "generate",
        "--drafter",
        str(pair_dir / "drafter"),
        "--target",
        str(pair_dir / "target"),
        "--dtype",
        "fp64",
        "--drafter-weights",
        "fp32",
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "4",
        "--state-dir",
        str(tmp_path / "s"),
    ]
    s = DeviceSession(
        _engine(pair_dir), target_name=str(pair_dir / "target"), state_dir=tmp_path / "s", state_key=tmp_path / "k1"
    )
    s.save()
    assert main(base + ["--state-key", str(tmp_path / "k1")]) == 0
    capsys.readouterr()
    assert main(base + ["--state-key", str(tmp_path / "k2")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the weight-loading bars
    assert err.startswith("error:") and "wrong key" in err


def test_a_learned_adapter_exports_to_a_directory_peft_loads(pair_dir, tmp_path, capsys):
    """`omnidraft device export-adapter` writes what peft itself writes: PeftModel.from_pretrained
    on the base drafter loads it, with the device's learned weights."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from omnidraft.cli import main

    state = tmp_path / "state"
    s = DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, online=OnlineConfig(interval=2, lr=1e-2))
    for prompt in PROMPTS[:2]:
        s.generate(prompt, CONFIG)
    s.save()
    assert s.learner.updates == 1
    drafter = str(pair_dir / "drafter")
    assert (
        main(
            [
                "device",
                "export-adapter",
                "--drafter",
                drafter,
                "--target",
                "t",
                "--state-dir",
                str(state),
                "--out",
                str(tmp_path / "peft"),
            ]
        )
        == 0
    )
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "peft").iterdir()}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(drafter), str(tmp_path / "peft"))
    loaded = get_peft_model_state_dict(model)
    learned = s.adapters.state_dict("t")
    assert set(loaded) == set(learned) and all(torch.equal(loaded[k], learned[k]) for k in learned)
    assert any(torch.count_nonzero(v) for k, v in learned.items() if "lora_B" in k)  # it did learn
    assert (
        main(
            [
                "device",
                "export-adapter",
                "--drafter",
                drafter,
                "--target",
                "other",
                "--state-dir",
                str(state),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )  # nothing saved for that target: one line, exit 2
    assert "no valid adapter" in capsys.readouterr().err


def test_a_save_rewrites_only_the_parts_that_changed(tmp_path):
    """A service saves after every sample while its adapter changes only at updates: an
    unchanged part is not written again (a 39 MB adapter at rank 32), unless another process
    saved the state since, or the part is gone from disk; what loads is always what was saved."""
    from omnidraft.shared.vocab.ngram_cache import NgramCache

    def stamp(state: DeviceState, name: str) -> tuple[int, int]:
        st = (state.dir / name).stat()
        return st.st_ino, st.st_mtime_ns  # an atomic write renames a new file into place

    state = DeviceState(tmp_path, "d", "t")
    adapter, cache = {"a": torch.arange(6.0).reshape(2, 3)}, NgramCache()
    state.save(adapter, {"w": torch.zeros(2)}, cache, {"updates": 0})
    first = stamp(state, ADAPTER_FILE), stamp(state, HEAD_FILE)
    state.save(adapter, {"w": torch.ones(2)}, cache, {"updates": 0})  # the head changed
    assert stamp(state, ADAPTER_FILE) == first[0] and stamp(state, HEAD_FILE) != first[1]
    loaded = DeviceState(tmp_path, "d", "t").load()
    assert not loaded.problems and torch.equal(loaded.adapter["a"], adapter["a"])
    assert torch.equal(loaded.head["w"], torch.ones(2))

    other = DeviceState(tmp_path, "d", "t")  # another process saves a new adapter
    other.load()
    other.save({"a": torch.full((2, 3), 7.0)}, None, cache, {"updates": 1})
    state.save(adapter, {"w": torch.ones(2)}, cache, {"updates": 0})  # not if_unchanged: overwrites
    loaded = DeviceState(tmp_path, "d", "t").load()
    assert not loaded.problems and torch.equal(loaded.adapter["a"], adapter["a"])

    (state.dir / ADAPTER_FILE).unlink()
    state.save(adapter, {"w": torch.ones(2)}, cache, {"updates": 0})
    loaded = DeviceState(tmp_path, "d", "t").load()
    assert not loaded.problems and torch.equal(loaded.adapter["a"], adapter["a"])
