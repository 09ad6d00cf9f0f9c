"""Measure what a forward pass costs on this machine.

``measure_costs`` times the target's forward pass for blocks of 1..k_max new tokens on top of a
filled KV cache, and the drafter's single-token step, each as the minimum over repeats (the
least disturbed run). Used by ``omnidraft profile``; the decoder does not read it yet (issue 8:
choose dtype and draft length from a cached profile).
"""

from __future__ import annotations

import time

import torch

CONTEXT_TOKENS = 256


def _time_block(runner, block: int, repeats: int) -> float:
    """Minimum wall time (ms) of one forward of ``block`` new tokens after the context."""
    best = float("inf")
    ids = list(range(1000, 1000 + block))
    for _ in range(repeats):
        runner.crop(CONTEXT_TOKENS)
        t0 = time.perf_counter()
        runner.forward(ids, last_only=block == 1)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


@torch.inference_mode()
def measure_costs(target_runner, drafter_runner, blocks: list[int], repeats: int = 5) -> dict:
    """``{"target_ms": {block: ms}, "drafter_ms_per_token": ms}`` measured on this machine."""
    context = list(range(500, 500 + CONTEXT_TOKENS))
    for runner in (target_runner, drafter_runner):
        runner.reset()
        runner.forward(context)
        runner.forward([7], last_only=True)  # first-call initialization outside the timing
    target = {str(b): _time_block(target_runner, b, repeats) for b in blocks}
    drafter = _time_block(drafter_runner, 1, max(repeats, 20))
    return {"target_ms": target, "drafter_ms_per_token": drafter}
