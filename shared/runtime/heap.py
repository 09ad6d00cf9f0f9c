"""Handing freed memory back to the system, and zeroed buffers that cost memory only once written.

glibc keeps memory that Python and torch free in its heap for reuse; after a burst of large
temporaries (packing a model layer by layer, a learner update's activations and gradients) that
is hundreds of MB counted as resident although nothing uses it: 0.9 GB after packing
Qwen2.5-Coder-1.5B, ~0.4 GB after an adapter update of SmolLM2-135M. On a 4 GB board that is
the difference between fitting and swapping.

Packed model weights live in memory advised for transparent huge pages
(``empty_in_huge_pages``): a forward streams every byte of them, and on 4 KB pages the walk
through 1.5 GB of a target's weights costs a one-token step 3-8 % (a drafter step 5-12 %).

How much memory the process may use (``memory_limit_bytes``: the machine's, its container's
limit, or ``$OMNIDRAFT_MEMORY_MB``) decides where time is traded for memory (``small_machine``:
a learner recomputing activations, a re-pack handing each layer's temporaries back).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
from pathlib import Path

import torch


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc: in the process's own symbols
    except (OSError, AttributeError):  # another C library (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim(0)``; a no-op with
    other C libraries). Costs milliseconds, and the pages handed back fault in again when
    reused: call it after a burst, not per token."""
    if _TRIM is not None:
        _TRIM(0)


# a board: where memory matters more than time (a training forward's activations, about 1 MB
# per token of a sample for SmolLM2-135M; what glibc keeps of a re-pack's temporaries)
SMALL_MACHINE_BYTES = 8 * 2**30
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
MEMORY_ENV = "OMNIDRAFT_MEMORY_MB"  # act as a device with this much memory (a board's settings elsewhere)


def memory_limit_bytes() -> int:
    """The memory this process may use, in bytes: the machine's physical memory, or its
    control group's limit where that is lower (a container on a larger host), or
    ``$OMNIDRAFT_MEMORY_MB`` where that is set (ValueError unless a positive whole number)."""
    forced = os.environ.get(MEMORY_ENV, "").strip()
    if forced:
        if not forced.isdigit() or int(forced) == 0:
            raise ValueError(f"{MEMORY_ENV} must be a positive whole number of MB, got {forced!r}")
        return int(forced) * 2**20
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def small_machine() -> bool:
    """True where this process may use at most ``SMALL_MACHINE_BYTES`` (``memory_limit_bytes``)."""
    return memory_limit_bytes() <= SMALL_MACHINE_BYTES


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose memory becomes resident only where it is written: an anonymous
    ``mmap``, whose pages the system maps (zeroed) on first write, where ``torch.zeros`` writes
    every byte (and numpy's ``zeros`` asks for huge pages, 2 MB resident per first write). A KV
    cache sized for ``max_positions`` (117 MB for Qwen2.5-Coder-1.5B at 4,096) then holds
    resident only the pages of the positions its sequences reached."""
    return _on_anonymous_mapping(shape, dtype)


def _on_anonymous_mapping(
    shape: tuple[int, ...], dtype: torch.dtype, flags: int = mmap.MAP_SHARED, advice: int | None = None
) -> torch.Tensor:
    """A zero tensor on an anonymous ``mmap`` of exactly its size (``flags``; ``advice`` given
    to ``madvise`` where the system takes it), unmapped when the tensor dies."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=flags)
    if advice is not None:
        with contextlib.suppress(OSError):  # e.g. a kernel without transparent huge pages
            buffer.madvise(advice)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def empty_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor (zeroed until written) on an anonymous ``mmap`` advised for transparent huge
    pages (Linux ``MADV_HUGEPAGE``), for weights a forward streams whole (``weight_packing``).

    On 4 KB pages a pass over 1.5 GB of packed weights walks ~390,000 pages, and the
    hardware prefetchers stop at every page boundary; on 2 MB pages a one-token step of
    Qwen2.5-Coder-1.5B in int8 ran 0.92-0.97x its time and a SmolLM2-135M step 0.88-0.95x
    (AMD EPYC with AVX-512, one process, the two alternating; ``scripts/huge_pages_ab.py``).
    Where the system's ``transparent_hugepage`` setting is ``madvise`` (the default of many
    distributions) only advised memory gets them; with ``always`` all of it does, with
    ``never`` none, and the advice is then ignored, as it is by systems without it. The
    mapping is exactly ``nbytes`` long: the system gives 2 MB pages to the aligned 2 MB ranges
    inside it and 4 KB pages to its edges, so no memory is added; it is unmapped when the
    tensor dies."""
    # private: a shared anonymous mapping is shmem, which the ``madvise`` setting never gives huge pages
    return _on_anonymous_mapping(shape, dtype, mmap.MAP_PRIVATE, getattr(mmap, "MADV_HUGEPAGE", None))
