"""The runtime around the native kernels: the fast runner runs Qwen2 (biases, tied embeddings)
as transformers does, the kernels come from the install (a stale build is not used; otherwise
they are built at first use), instruction-set overrides, prompt-prefill weights that follow the
instruction set, and KV caches resident only where positions were written (the kernels on
their own are in test_native_kernels.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_models import needs_isa, tiny_qwen2

from omnidraft.shared.engine.model_runner import ModelRunner
from omnidraft.shared.runtime import native_kernels
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.native_kernels import NATIVE_ISAS, native_error, native_library


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


def _mapping_flags(tensor: torch.Tensor) -> set[str]:
    """The ``VmFlags`` of the mapping in ``/proc/self/smaps`` that holds ``tensor``'s first byte."""
    address, flags, inside = tensor.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
    assert flags is not None, "no mapping holds the tensor"
    return flags


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_packed_weights_are_private_memory_advised_for_huge_pages():
    """The native kernels' packed weights (streamed whole by every forward) sit in private
    anonymous memory advised for transparent huge pages (``hg``); a shared mapping (``sh``, which
    ``mmap`` makes by default) would be shmem, which the system's ``madvise`` setting never gives
    huge pages. The buffers hold what the packing wrote and are the runner's own."""
    from omnidraft.shared.runtime.heap import empty_in_huge_pages

    buf = empty_in_huge_pages((4, 1024, 1024), torch.uint8)  # 4 MiB, zeroed until written
    assert buf.shape == (4, 1024, 1024) and not buf.any()
    flags = _mapping_flags(buf)
    assert "sh" not in flags and ("hg" in flags or not hasattr(__import__("mmap"), "MADV_HUGEPAGE")), flags
    isa = native_kernels.default_native_isa()
    if isa is None or native_error(isa) is not None:
        pytest.skip("no native kernels on this machine")
    runner = FastLlamaRunner(tiny_qwen2(), weights="int8", max_positions=64)
    packed = [t for t in runner._packing.native_tensors if t.dim() >= 3]  # weights and scales, not biases
    assert len(packed) == 2 * 4 * runner.num_layers  # four fused matrices a layer
    assert all("hg" in _mapping_flags(t) and "sh" not in _mapping_flags(t) for t in packed)
    assert all(t.any() for t in packed)  # written by the packing
