"""What a learning device's update holds in memory, and the board settings that lower it:
activations recomputed in the backward pass, the heap's free memory handed back before each
backward pass, the memory limit that decides both, held weights read from mappings of their own."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_pair import CONFIG, PROMPTS, _engine

from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.learning.adapters import LoraSpec
from omnidraft.shared.runtime import heap


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_recomputed_activations_train_exactly_as_held_ones(pair_dir, monkeypatch, autocast):
    """With ``recompute_layers`` the update runs each drafter layer's forward again in the
    backward pass (transformers' activation checkpointing) instead of holding its activations:
    the adapter after an update is the same, bit for bit; drafting forwards are not
    checkpointed. Unset, it is on only on a machine with little memory (a board)."""
    from omnidraft.client import online_learner

    states, calls = [], []  # calls: bytes held for the backward pass
    for recompute in (0, 1):
        torch.manual_seed(0)  # the same LoRA initialization
        engine = _engine(pair_dir)
        session = DeviceSession(
            engine,
            target_name="t",
            lora=LoraSpec(rank=4),
            online=OnlineConfig(interval=100, lr=1e-2, bf16_autocast=autocast, recompute_layers=recompute),
        )
        samples = [session.generate(p, CONFIG, observe=False).training_sample for p in PROMPTS[:3]]
        held_bytes = []  # what the update's forwards keep for the backward pass, outside checkpoints

        def pack(t, held=held_bytes):
            held.append(t.nbytes)
            return t

        session.learner.buffer = list(samples)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            report = session.learner.update()
        calls.append(sum(held_bytes))
        states.append((report.loss, session.adapters.state_dict("t")))
    assert calls[1] < 0.6 * calls[0]  # the layers' activations are not held (the rest: the LM head's, the loss's)
    (loss0, held), (loss1, recomputed) = states
    assert loss0 == loss1 and held.keys() == recomputed.keys()
    assert all(torch.equal(held[k], recomputed[k]) for k in held)
    monkeypatch.setattr(heap, "memory_limit_bytes", lambda: 4 * 2**30)
    assert online_learner.default_recompute_layers() == 1
    monkeypatch.setattr(heap, "memory_limit_bytes", lambda: 24 * 2**30)
    assert online_learner.default_recompute_layers() == 0


def test_on_a_board_each_backward_pass_starts_with_the_forwards_freed_memory_handed_back(pair_dir, monkeypatch):
    """Where memory is short, the heap's free memory (what the sample's forward freed: layer
    temporaries that glibc would keep) goes back to the system before each sample's backward
    pass, whose own transients (the LM head's float32 copy, under float32 training) then make
    a lower peak; elsewhere it is not. The adapter is the same either way."""
    from omnidraft.client import online_learner

    states = []
    for board in (False, True):
        monkeypatch.setattr(heap, "memory_limit_bytes", lambda board=board: (4 if board else 24) * 2**30)
        torch.manual_seed(0)
        session = DeviceSession(
            _engine(pair_dir),
            target_name="t",
            lora=LoraSpec(rank=4),
            online=OnlineConfig(interval=100, lr=1e-2, bf16_autocast=False, recompute_layers=0),
        )
        samples = [session.generate(p, CONFIG, observe=False).training_sample for p in PROMPTS[:3]]
        events = []
        backward = torch.Tensor.backward
        monkeypatch.setattr(online_learner, "release_freed_memory", lambda events=events: events.append("trim"))
        monkeypatch.setattr(
            torch.Tensor,
            "backward",
            lambda t, *a, events=events, backward=backward, **k: (events.append("backward"), backward(t, *a, **k)),
        )
        session.learner.buffer = list(samples)
        report = session.learner.update()
        monkeypatch.setattr(torch.Tensor, "backward", backward)
        n = len(samples)  # then the acceptance head's own step
        assert events[: 2 * n] == ["trim", "backward"] * n if board else "trim" not in events and len(events) > n
        states.append((report.loss, session.adapters.state_dict("t")))
    (loss0, a0), (loss1, a1) = states
    assert loss0 == loss1 and all(torch.equal(a0[k], a1[k]) for k in a0)


def test_the_memory_limit_is_a_control_groups_where_that_is_lower(tmp_path, monkeypatch):
    """A device in a container limited to 3 GiB on a larger host counts as a board, and so does
    any process told ``OMNIDRAFT_MEMORY_MB`` (a board's settings on a workstation)."""
    from omnidraft.client import online_learner

    monkeypatch.delenv(heap.MEMORY_ENV, raising=False)
    monkeypatch.setattr(heap, "CGROUP_LIMITS", (str(tmp_path / "absent"), str(tmp_path / "memory.max")))
    physical = heap.memory_limit_bytes()  # no limit files: the machine's memory
    assert physical == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    assert heap.memory_limit_bytes() == physical
    (tmp_path / "memory.max").write_text(f"{3 * 2**30}\n")
    assert heap.memory_limit_bytes() == min(physical, 3 * 2**30)
    assert online_learner.default_recompute_layers() == 1
    (tmp_path / "memory.max").write_text("max\n")
    monkeypatch.setenv(heap.MEMORY_ENV, "4096")
    assert heap.memory_limit_bytes() == 4 * 2**30 and heap.small_machine()
    for bad in ("4 GB", "0", "-1"):
        monkeypatch.setenv(heap.MEMORY_ENV, bad)
        with pytest.raises(ValueError, match=heap.MEMORY_ENV):
            heap.memory_limit_bytes()
    with pytest.raises(ValueError, match="recompute_layers"):
        OnlineConfig(recompute_layers=-1).validate()


def test_a_held_weight_reads_the_same_float32_values_from_a_mapping_of_its_own():
    """Inside ``mapped_reads`` (peft's injection) a held weight's float32 copy lives in a
    mapping of its own rather than glibc's heap: the same values, and bf16 as held under bf16
    autocast either way."""
    from torch.nn.utils import parametrize

    from omnidraft.shared.runtime.held_weights import ReadAsFloat32, mapped_reads

    linear = torch.nn.Linear(64, 32, bias=False).requires_grad_(False)
    held = linear.weight.detach().to(torch.bfloat16)
    linear.weight.data = held
    parametrize.register_parametrization(linear, "weight", ReadAsFloat32(), unsafe=True)
    heap = linear.weight
    with mapped_reads():
        mapped = linear.weight
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear.weight.dtype == torch.bfloat16
    assert heap.dtype == mapped.dtype == torch.float32 and torch.equal(heap, mapped)
    assert torch.equal(heap, held.float()) and mapped.untyped_storage().data_ptr() != heap.untyped_storage().data_ptr()


def test_a_held_weight_is_copied_once_while_peft_reads_it_again_and_again(monkeypatch):
    """peft reads each base weight about 20 times while wrapping it: inside ``mapped_reads`` the
    float32 copy is made once per weight (the latest one kept, as long as the weight is
    unchanged), the values always the held ones, and nothing is kept once the block ends."""
    from torch.nn.utils import parametrize

    from omnidraft.shared.runtime import held_weights

    copies = []
    real = held_weights.zeros_on_demand
    monkeypatch.setattr(held_weights, "zeros_on_demand", lambda *a: copies.append(a) or real(*a))
    linears = [torch.nn.Linear(64, 32, bias=False).requires_grad_(False) for _ in range(2)]
    for linear in linears:
        linear.weight.data = linear.weight.detach().to(torch.bfloat16)
        parametrize.register_parametrization(linear, "weight", held_weights.ReadAsFloat32(), unsafe=True)
    first, second = linears
    with held_weights.mapped_reads():
        reads = [first.weight for _ in range(20)]
        assert len(copies) == 1 and all(r is reads[0] for r in reads) and hasattr(first, "weight")
        assert torch.equal(second.weight, second.parametrizations.weight.original.float()) and len(copies) == 2
        assert torch.equal(first.weight, reads[0]) and len(copies) == 3  # the latest one only
        first.parametrizations.weight.original.mul_(2)  # changed: read again
        assert torch.equal(first.weight, first.parametrizations.weight.original.float()) and len(copies) == 4
        assert not torch.equal(first.weight, reads[0])
    assert held_weights._last_mapped_read is None
    assert first.weight is not first.weight  # outside the block every read is its own copy


def test_a_held_head_is_applied_a_block_of_rows_at_a_time_never_copied_whole(monkeypatch):
    """A frozen Linear held in bf16 and read as float32 (an LM head: 108 MB as float32 for
    SmolLM2-135M, copied at every read) is applied by ``read_in_row_blocks`` in blocks of rows
    (here 16 of 50, the last block short): the logits and the input's gradient equal the module's
    own float32 forward and backward up to the products' rounding, and the weight is never read
    whole as float32, forward or backward. A Linear not held is returned as it is."""
    from torch.nn.utils import parametrize

    from omnidraft.shared.runtime import held_weights

    torch.manual_seed(0)
    head = torch.nn.Linear(24, 50, bias=False).requires_grad_(False)
    assert held_weights.read_in_row_blocks(head) is head
    head.weight.data = head.weight.detach().to(torch.bfloat16)
    parametrize.register_parametrization(head, "weight", held_weights.ReadAsFloat32(), unsafe=True)
    x = torch.randn(3, 5, 24, requires_grad=True)
    grad = torch.randn(3, 5, 50)
    ref = head(x)
    (ref_grad,) = torch.autograd.grad(ref, x, grad)

    whole_reads = []
    read = held_weights.ReadAsFloat32.forward
    monkeypatch.setattr(
        held_weights.ReadAsFloat32, "forward", lambda self, w: whole_reads.append(w.shape) or read(self, w)
    )
    logits = held_weights.read_in_row_blocks(head, rows=16)(x)
    (x_grad,) = torch.autograd.grad(logits, x, grad)
    assert not whole_reads and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad, ref_grad, rtol=1e-5, atol=1e-6)
