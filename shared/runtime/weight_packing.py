"""Weight matrices packed for the runner's kernels (``fast_drafter.FastLlamaRunner``).

``make_linear(kind, w, b)`` wraps a float32 matrix as a torch callable (``fp32``: MKL;
``bf16``: oneDNN prepacked bf16; ``int8``: fbgemm dynamic quantization). ``pack_native`` lays
a matrix out for the native int8 kernels (``shared/runtime/native/``): uint8 weights in blocks of 16
rows x 4 inputs with a float scale per (row, 64 inputs); ``pack_native_slices`` does the same
from row slices read one at a time (an LM head read from a GGUF). The native buffers are allocated in transparent huge pages where the system
gives them (``heap.empty_in_huge_pages``): every forward streams them whole.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnidraft.shared.runtime.heap import empty_in_huge_pages
from omnidraft.shared.runtime.native_kernels import onednn_bf16_linear

WEIGHT_KINDS = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class Packing:
    """One set of packed decoder-layer weights: per torch kernel kind, per layer, the four fused
    Linears (qkv, o, gate_up, down); for the native kernels, their buffers and the pointer table."""

    torch_layers: dict[str, list[tuple[Callable, ...]]]
    native_tensors: list[torch.Tensor]
    layer_ptrs: torch.Tensor | None


def param_name(model: torch.nn.Module, param: torch.Tensor) -> str:
    """The name of ``param`` in ``model`` (the first one, for tied weights)."""
    return next(name for name, p in model.named_parameters() if p is param)


@contextlib.contextmanager
def _quantized_engine(name: str):
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def make_linear(kind: str, w: torch.Tensor, b: torch.Tensor | None):
    """A callable ``x -> x @ w.T + b`` for float32 ``w`` [out, in] using the ``kind`` kernel.

    The fp32 and int8 kernels return float32; the bf16 kernel returns bfloat16.
    """
    w = w.detach().float().contiguous()
    b = None if b is None else b.detach().float().contiguous()
    if kind == "fp32":
        return lambda x: F.linear(x, w, b)
    if kind == "bf16":
        bf16 = torch.bfloat16
        bb = None if b is None else b.to(bf16)
        if not onednn_bf16_linear():  # e.g. AVX2-only CPUs: torch's own (emulated) bf16 GEMM
            wt = w.to(bf16)
            return lambda x: F.linear(x.to(bf16), wt, bb)
        wb = torch.ops.mkldnn._reorder_linear_weight(w.to(bf16))
        lp = torch.ops.mkldnn._linear_pointwise
        return lambda x: lp(x.to(bf16), wb, bb, "none", [], "")
    if kind == "int8":
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated (but still the fastest here)
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        # fbgemm is the fastest engine here for M = 1..~16 (oneDNN/x86 are 10x slower for M > 1);
        # the packed object remembers its engine, so the global setting is restored afterwards.
        with _quantized_engine("fbgemm"):
            packed = torch.ops.quantized.linear_prepack(qw, b)
        lin = torch.ops.quantized.linear_dynamic
        return lambda x: lin(x, packed, True)
    raise ValueError(f"unknown weights kind {kind!r}: choose one of {', '.join(WEIGHT_KINDS)}")


def pack_native(w: torch.Tensor, b: torch.Tensor | None, lib) -> list[torch.Tensor | None]:
    """Native int8 layout (``lib``: the kernels' library, ``native_kernels.native_library``):
    [uint8 weights (q + 128) as [N/16][K/4][16][4], float scales per (row, group of 64 inputs)
    as [N/16][K/64][16], bias or None], with N padded to 16 (``fd_pack_rows`` in
    ``native/fd_driver.c``: one pass over ``w`` in C, where the torch expression it replaced made
    six and packed Qwen2.5-Coder-1.5B in 5 s)."""
    packed, scales, _ = pack_native_slices(lambda lo, hi: w[lo:hi], w.shape[0], lib)
    bias = None
    if b is not None:
        bias = torch.cat([b.detach().float(), torch.zeros(-w.shape[0] % 16)]).contiguous()
    return [packed, scales, bias]


# rows of a matrix read and packed at a time (a multiple of 16: slices pack to exactly the
# bytes of the whole matrix): an LM head read from a GGUF is in float32 a slice at a time
PACK_SLICE_ROWS = 2048


def pack_native_slices(read_rows: Callable[[int, int], torch.Tensor], n: int, lib) -> list[torch.Tensor | None]:
    """``pack_native`` of an ``[n, K]`` matrix without a bias, read as ``read_rows(lo, hi)``
    slices of ``PACK_SLICE_ROWS`` rows (an LM head read from a GGUF): the same bytes as packing
    it whole, with one slice in float32 at a time."""
    packed = scales = None
    for lo in range(0, n, PACK_SLICE_ROWS):
        part = read_rows(lo, min(lo + PACK_SLICE_ROWS, n)).detach().float().contiguous()
        rows, k = part.shape
        if k % 64:
            raise ValueError(f"the native layout needs inputs in groups of 64, not {k}")
        if packed is None:  # the whole matrix's buffers, filled slice by slice
            blocks = -(-n // 16)
            packed = empty_in_huge_pages((blocks, k // 4, 16, 4), torch.uint8)
            scales = empty_in_huge_pages((blocks, k // 64, 16), torch.float32)
        lib.fd_pack_rows(
            part.data_ptr(),
            rows,
            k,
            packed[lo // 16 :].data_ptr(),
            scales[lo // 16 :].data_ptr(),
            torch.get_num_threads(),
        )
    return [packed, scales, None]
