"""A stale pair profile corrected from the forwards timed in use, for the next process.

``omnidraft profile`` measures for about a minute, so its figures come from one spell of the
machine; on a shared 2-core VM a one-token target step took 49-52 ms for the first 45 s of a
process and 32-38 ms after (docs/speed.md). The forwards a run times while decoding
(``StepTimings``: up to 256 per block size, sampled over the whole run) say what that run's
spells cost together. When the check finds the profile stale (``Engine.check_profile``), the
cached figures are replaced by them instead of being dropped: the next process then decides on
what this one met over minutes, not on the minute it starts in. The process that found the
profile stale keeps deciding with the one it has (no decision follows a run's own timings).

The target's cost of each profiled block size becomes the in-use median of that size where
``MIN_SAMPLES`` were timed; a size timed less often keeps its figure scaled by the in-use ratio
of the nearest size that was (the kernels' steps between sizes stay as measured). The drafter's
step and feeds scale by the ratio of its steps. Without enough of either, nothing is corrected
and the profile is dropped as before.
"""

from __future__ import annotations

import statistics
import time

from omnidraft.shared.engine.profiling import CostProfile, StepTimings

MIN_SAMPLES = 20  # forwards of a block size (or drafter steps) timed before they correct a figure


def corrected_costs(profile: CostProfile, timings: StepTimings, min_samples: int = MIN_SAMPLES) -> dict | None:
    """The pair's cache value (``profiling.pair_costs``: ``{"target": {block: ms}, "drafter":
    {block: ms}}``, plus what corrected it) with ``profile``'s figures corrected from
    ``timings``; None when fewer than ``min_samples`` target forwards of any size or drafter
    steps were timed."""
    ratios = {
        block: statistics.median(samples) / profile.target_cost(block)
        for block, samples in timings.target.items()
        if len(samples) >= min_samples and profile.target_cost(block) > 0
    }
    if not ratios or len(timings.drafter_steps) < min_samples or profile.drafter_ms_per_token <= 0:
        return None

    def ratio(block: int) -> float:  # of the nearest size timed often enough (the smaller on a tie)
        return ratios[min(ratios, key=lambda timed: (abs(timed - block), timed))]

    drafter = statistics.median(timings.drafter_steps) / profile.drafter_ms_per_token
    blocks = profile.drafter_block_ms or {1: profile.drafter_ms_per_token}
    return {
        "target": {str(b): ms * ratio(b) for b, ms in sorted(profile.target_ms.items())},
        "drafter": {str(b): ms * drafter for b, ms in sorted(blocks.items())},
        "corrected_from_use": {
            "at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "target_ratios": {str(b): round(r, 3) for b, r in sorted(ratios.items())},
            "drafter_ratio": round(drafter, 3),
            "samples": {str(b): len(s) for b, s in sorted(timings.target.items())}
            | {"drafter": len(timings.drafter_steps)},
        },
    }
