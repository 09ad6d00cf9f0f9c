"""Forwards of several sequences on the same drafter weights in one native call.

A one-token step of a small drafter on the native int8 kernels is bound by reading its weights
(SmolLM2-135M: 0.13 GB a step, 7.4 ms on a 2-core AMD EPYC with AVX-512), and the kernels compute
four activation rows per pass over a weight block (``native/fd_avx512.h``): four tokens cost
about what one does (8.3 ms there). ``forward_together`` runs the pending forwards of runners
that share their weights (``FastLlamaRunner.fork(current=True)``: each its own KV cache) as one
``fd_forward_rows`` call per group of up to ``rows_per_call`` token rows. Every row is computed
as it would be alone (a kernel's rows never mix), so each runner gets exactly the logits its own
``forward`` returns (``tests/test_lockstep.py`` checks it bit for bit); a longer forward (a
prompt's prefill) runs alone on its runner.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import torch

from omnidraft.shared.runtime.cached_positions import exact_prefix
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner

ROWS_PER_CALL = 4  # the kernels' rows per pass over a weight block (16-bit activations)
ROWS_PER_CALL_ACT8 = 8  # with 8-bit activations (a target's steps): eight rows a pass on AVX-512

# one pending forward: the runner, the ids it appends and how many logits rows it keeps (0: all)
Call = tuple[FastLlamaRunner, list[int], int]


def rows_per_call(runner: FastLlamaRunner) -> int:
    """Token rows one native call of ``runner``'s steps takes: what one pass over a weight block
    computes (``native/fd_avx512.h``; a kernel that computes fewer a pass makes more passes)."""
    return ROWS_PER_CALL_ACT8 if runner.activation_bits == 8 else ROWS_PER_CALL


def batchable(runner) -> bool:
    """True where ``runner``'s forwards can share a native call (int8 weights on the native kernels)."""
    return isinstance(runner, FastLlamaRunner) and runner.native_isa is not None


@torch.inference_mode()
def forward_together(calls: Sequence[Call]) -> list[torch.Tensor]:
    """Run every call (each as ``runner.forward(ids, logits_to_keep)`` would, with the same
    logits and the same cache afterwards); calls of up to ``rows_per_call`` tokens on batchable
    runners that share weights go together, in order, as few native calls as the rows allow."""
    out: list[torch.Tensor | None] = [None] * len(calls)
    group: list[int] = []  # the calls that share the next native call

    def flush() -> None:
        for j, logits in zip(group, _forward_rows([calls[j] for j in group])):
            out[j] = logits
        group.clear()

    for i, (runner, ids, keep) in enumerate(calls):
        if not batchable(runner) or len(ids) > rows_per_call(runner):
            out[i] = _forward_alone(runner, ids, keep, [c[0] for c in calls[:i]])
            continue
        rows = sum(len(calls[j][1]) for j in group)
        if group and (rows + len(ids) > rows_per_call(runner) or runner._packing is not calls[group[0]][0]._packing):
            flush()
        group.append(i)
    if group:
        flush()
    return out


def _forward_alone(runner, ids: list[int], keep: int, before: Sequence) -> torch.Tensor:
    """``runner.forward(ids, keep)``. A prompt's prefill into an empty cache first copies the
    keys and values of the longest prefix one of the runners ``before`` holds as that prefill
    would write it (the same weights: ``cached_positions.exact_prefix``; prompts from one module
    share its imports) and forwards the rest: the same cache and logits as the whole prefill."""
    if keep and not runner.held and batchable(runner):
        shared, donor = 0, None
        for other in before:
            same = batchable(other) and other._packing is runner._packing
            n = exact_prefix(other, runner, ids, same_weights=same, rest=1)
            if n > shared:
                shared, donor = n, other
        if donor is not None:
            runner.copy_positions(donor, ids[:shared])
            return runner.forward(ids[shared:], keep)
    return runner.forward(ids, keep)


def _forward_rows(calls: Sequence[Call]) -> list[torch.Tensor]:
    """One ``fd_forward_rows`` call for ``calls`` (their runners share weights): their logits."""
    t0 = time.perf_counter()
    first = calls[0][0]
    ids = [t for _, call_ids, _ in calls for t in call_ids]
    models, positions, kept = [], [], []
    for runner, call_ids, keep in calls:
        if not call_ids:
            raise ValueError("forward needs at least one token id")
        if runner.length + len(call_ids) > runner.max_positions:
            raise ValueError(f"sequence exceeds max_positions={runner.max_positions}")
        start = len(positions)
        models += [runner._fd_ref] * len(call_ids)
        positions += range(runner.length, runner.length + len(call_ids))
        n = min(keep, len(call_ids)) or len(call_ids)
        kept += range(start + len(call_ids) - n, start + len(call_ids))
    m = len(ids)
    h = first._embed.index_select(0, torch.tensor(ids, dtype=torch.long)).float()
    rmd = (ctypes.c_void_p * m)(*models)
    rpos = torch.tensor(positions, dtype=torch.int32)
    keep_rows = torch.tensor(kept, dtype=torch.int32)
    logits = torch.empty(len(kept), first._head_pad)
    first._fd.act8 = int(first.activation_bits == 8)  # a step's activations (the weights are the first row's)
    rc = first._lib.fd_forward_rows(
        rmd,
        rpos.data_ptr(),
        m,
        h.data_ptr(),
        len(kept),
        keep_rows.data_ptr(),
        logits.data_ptr(),
        first.threads or torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("native forward failed to allocate its work buffers")
    logits = logits[:, : first.head_rows]
    out, row, kept_row = [], 0, 0
    for runner, call_ids, keep in calls:
        n = min(keep, len(call_ids)) or len(call_ids)
        row += len(call_ids)
        out.append(runner._appended(call_ids, first._fd.act8, logits[kept_row : kept_row + n], h[row - 1], t0))
        kept_row += n
    return out
