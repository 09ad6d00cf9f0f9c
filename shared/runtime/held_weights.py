"""A drafter's frozen Linear weights held in bf16, read as float32.

Once a drafter's base weights are packed for its kernels (``FastLlamaRunner``), nothing reads
its frozen float32 Linear weights but training forwards and adapter merges. Holding them in
bf16 in place (the float32 originals freed: about 0.2 GB for SmolLM2-135M) costs training
nothing under bf16 autocast, which casts them to bf16 anyway, and a float32 forward (CPUs
without native bf16) computes in float32 on the bf16 values (``torch.nn.utils.parametrize``).
Merges read the same values training reads. A tied LM head (the input embeddings, which the
runner reads rows of) stays float32.

Each float32 read copies the whole weight. For the decoder's matrices that is a few MB; for an
LM head it is the largest allocation of a float32 update (108 MB for SmolLM2-135M's 49,152 x
576 head, made for every 64-position slice of the sequence loss and again when its backward
pass recomputes it), and the peak of a learning device. ``read_in_row_blocks`` applies a held
head in float32 reading ``ROW_BLOCK`` rows of it at a time into one buffer instead. No library
op multiplies a float32 input by a bf16 weight in float32 without that copy (``torch.matmul``
wants one dtype; autocast computes in bf16), hence the small autograd function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.nn.utils import parametrize

from omnidraft.shared.runtime.heap import release_freed_memory, zeros_on_demand


class ReadAsFloat32(torch.nn.Module):
    """A weight held in a lower precision (``torch.nn.utils.parametrize``): it reads as held
    under CPU autocast to that dtype (which would cast it to that anyway), else as float32."""

    def forward(self, held: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == held.dtype:
            return held
        if _mapped_reads:
            global _last_mapped_read
            stamp = (held.data_ptr(), held._version)  # the same weight, unchanged since
            last = _last_mapped_read
            if last is None or last[0] is not held or last[1] != stamp:
                _last_mapped_read = last = (held, stamp, zeros_on_demand(held.shape, torch.float32).copy_(held))
            return last[2]
        return held.float()


_mapped_reads = 0  # ``mapped_reads`` blocks open
# inside them, the latest weight read and its float32 copy: peft reads a module's weight about
# 20 times while wrapping it (its device, dtype, shape, ``hasattr`` checks), one weight after
# another, and each read copied the whole weight (6.2 s of copies for SmolLM2-135M's 210
# Linears, AMD EPYC); the copy is made once per weight and only the latest is kept
_last_mapped_read: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None


@contextlib.contextmanager
def mapped_reads() -> Iterator[None]:
    """Inside the block a held weight read as float32 is copied into a mapping of its own,
    unmapped when the copy dies, instead of glibc's heap: for reads made between long-lived
    allocations (peft making each LoRA matrix as it reads the base weight), whose copies the
    heap kept resident, 0.4-0.5 GB by the end of peft's injection in some runs. About 15x
    slower than a heap copy (0.35 s against 0.02 s for SmolLM2-135M's frozen weights, AMD
    EPYC): training and merges read from the heap."""
    global _mapped_reads, _last_mapped_read
    _mapped_reads += 1
    try:
        yield
    finally:
        _mapped_reads -= 1
        if not _mapped_reads:
            _last_mapped_read = None  # its mapping is unmapped with it


def frozen_linears(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    """``(name, Linear)`` for every Linear in ``module`` whose weight does not train (LoRA's own
    matrices excluded), names relative to ``module``."""
    for name, mod in module.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".lora_" not in f".{name}" and not mod.weight.requires_grad:
            yield name, mod


@torch.no_grad()
def hold_frozen_weights(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Hold every frozen Linear weight of the causal LM ``model`` (its decoder's and an untied
    LM head's) in ``dtype``, in place, each read as float32 (``ReadAsFloat32``); weights held
    already are left as they are."""
    tied = getattr(model.get_input_embeddings(), "weight", None)
    for module in (model.get_decoder(), model.get_output_embeddings()):
        for _, mod in list(frozen_linears(module)):
            if mod.weight is tied or parametrize.is_parametrized(mod, "weight"):
                continue
            mod.weight.data = mod.weight.detach().to(dtype)
            parametrize.register_parametrization(mod, "weight", ReadAsFloat32(), unsafe=True)  # unsafe: a dtype change
    release_freed_memory()  # the float32 originals, kept by glibc otherwise


def held_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype ``model``'s frozen Linear weights are held in (``hold_frozen_weights``), or None."""
    for _, mod in frozen_linears(model.get_decoder()):
        if parametrize.is_parametrized(mod, "weight"):
            return mod.parametrizations.weight.original.dtype
    return None


ROW_BLOCK = 4096  # weight rows read as float32 at once by ``read_in_row_blocks`` (9.4 MB of 576 columns)


def _float32_row_blocks(weight: torch.Tensor, rows: int, like: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, those rows as float32)`` for ``rows`` rows of ``weight`` at a time, each read
    into the same buffer (made like ``like``): valid until the next block is read."""
    out_features, in_features = weight.shape
    buf = like.new_empty((min(rows, out_features), in_features))
    for lo in range(0, out_features, rows):
        yield lo, buf[: min(rows, out_features - lo)].copy_(weight[lo : lo + rows])


class _RowBlockLinear(torch.autograd.Function):
    """``x @ weight.T`` in float32 for a frozen ``weight`` held in a lower precision, ``rows``
    rows of the weight read as float32 at a time into one buffer, in the backward pass too (the
    input's gradient; the weight gets none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.rows = rows
        flat = x.reshape(-1, weight.shape[1])
        out = flat.new_empty((flat.shape[0], weight.shape[0]))
        for lo, block in _float32_row_blocks(weight, rows, flat):
            out[:, lo : lo + block.shape[0]] = flat @ block.T
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        flat = grad.reshape(-1, weight.shape[0])
        grad_x = flat.new_zeros((flat.shape[0], weight.shape[1]))
        for lo, block in _float32_row_blocks(weight, ctx.rows, flat):
            grad_x.addmm_(flat[:, lo : lo + block.shape[0]], block)
        return grad_x.view(*grad.shape[:-1], weight.shape[1]), None, None


def read_in_row_blocks(linear: torch.nn.Linear, rows: int = ROW_BLOCK) -> Callable[[torch.Tensor], torch.Tensor]:
    """``linear``'s forward outside autocast, for a frozen Linear whose weight is held in a lower
    precision (``hold_frozen_weights``): the float32 outputs and input gradient of ``linear``'s
    own float32 forward up to the products' rounding (the outputs bit for bit for a head of
    SmolLM2-135M's shape on the AVX-512 EPYC, not for every shape), without ever holding a
    float32 copy of the whole weight (``rows`` of its rows at a time). Any other Linear is
    returned as it is."""
    if not parametrize.is_parametrized(linear, "weight"):
        return linear
    held = linear.parametrizations.weight.original  # reading ``linear.weight`` would copy it whole
    if held.requires_grad:
        return linear

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = _RowBlockLinear.apply(x.float(), held, rows)
        return out if linear.bias is None else out + linear.bias

    return forward
