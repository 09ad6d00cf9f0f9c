"""What transparent huge pages give the native kernels' forwards, measured in one process
(docs/engine.md, "Fast CPU runtime").

The pair is loaded twice: once with its packed weights on ordinary 4 KB pages (the packing's
buffers made by ``torch.empty``, as before ``heap.empty_in_huge_pages``) and once as the
engine packs them now (a private mapping advised ``MADV_HUGEPAGE``). Their forwards then take
turns after the same 256 cached tokens: a one-token target step, target blocks of 4 and 8
tokens and a drafter step, each a median of a few repeats per trial; the ratio of the two
loads is taken per trial (the machine's slow spells hit both alike) and its median printed,
with how much of the process's memory the system gave huge pages (``AnonHugePages``).

    python scripts/huge_pages_ab.py --trials 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import omnidraft.shared.runtime.weight_packing as weight_packing
from omnidraft.shared.engine.catalog import CatalogError
from omnidraft.shared.engine.pair import Engine

CONTEXT = 256  # cached tokens before each timed forward
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kb() -> int:
    """The process's anonymous memory in huge pages (kB, ``/proc/self/smaps_rollup``)."""
    line = next(x for x in Path("/proc/self/smaps_rollup").read_text().splitlines() if x.startswith("AnonHugePages"))
    return int(line.split()[1])


def load(drafter: str, target: str, dtype: str):
    """The pair's target runner and a drafting runner on its packed weights."""
    engine = Engine.load(drafter, target, dtype, progress=False)
    return engine.target_runner, engine.drafter_runner


def median_ms(runner, block: int, repeats: int) -> float:
    """Median wall time (ms) of ``repeats`` forwards of ``block`` tokens after ``CONTEXT``."""
    times = []
    for _ in range(repeats):
        runner.crop(CONTEXT)
        t0 = time.perf_counter()
        runner.forward(list(range(1000, 1000 + block)), logits_to_keep=int(block == 1))
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    if args.trials < 1:
        sys.exit("error: --trials must be at least 1")
    if not Path("/proc/self/smaps_rollup").exists():
        sys.exit("error: this measurement reads /proc/self/smaps_rollup (Linux)")
    advised = weight_packing.empty_in_huge_pages
    try:
        weight_packing.empty_in_huge_pages = lambda shape, dtype: torch.empty(shape, dtype=dtype)
        small = load(args.drafter, args.target, args.dtype)
        before = huge_kb()
        weight_packing.empty_in_huge_pages = advised
        huge = load(args.drafter, args.target, args.dtype)
    except (CatalogError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    setting = THP_SETTING.read_text().strip() if THP_SETTING.exists() else "not available"
    print(
        f"transparent_hugepage: {setting}; huge pages: {before // 1024} MiB after the 4 KB load, "
        f"{huge_kb() // 1024} MiB after both"
    )
    ids = list(range(1000, 1000 + CONTEXT))
    for runner in (*small, *huge):
        runner.reset()
        runner.forward(ids)
    cases = {
        "target, 1 token": (0, 1, 3),
        "target, 4 tokens": (0, 4, 3),
        "target, 8 tokens": (0, 8, 3),
        "drafter step": (1, 1, 8),
    }
    times = {name: ([], []) for name in cases}
    for _ in range(args.trials):
        for name, (which, block, repeats) in cases.items():
            times[name][0].append(median_ms(small[which], block, repeats))
            times[name][1].append(median_ms(huge[which], block, repeats))
    for name, (a, b) in times.items():
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(
            f"{name:17s} 4 KB pages {statistics.median(a):6.2f} ms, huge pages {statistics.median(b):6.2f} ms, "
            f"ratio per trial (median) {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
