"""What a forward pass costs on this machine, measured once and cached.

``measure_together`` times runners' forward passes for blocks of new tokens on top of a filled KV
cache: after an untimed warm-up pass, each trial keeps the minimum over repeats, and the median
of the trials is kept (more trials while they disagree: an outlier trial cannot set the figure).
``pair_costs`` measures a target and its drafter in the same trials, so the ratio of their costs
(what the throughput rule weighs) comes from one spell of the machine; it and ``target_costs``
keep what they measure in an on-disk cache under
``$OMNIDRAFT_HOME/profiles/``, keyed by a fingerprint of the machine (CPU model, ISA capability,
torch version, threads) and of the model (its config and weight files) plus the precision and
kernel backend: a change of any of them measures again. ``CostProfile`` turns the measurements
into the cost of any block size, which the throughput rule (``omnidraft.shared.engine.draft_policy``)
reads (``omnidraft.shared.engine.auto_precision`` resolves ``--dtype auto`` from the same
measurements). ``StepTimings`` times the forward passes of real decoding and checks the cached
profile against them; a profile they contradict is dropped and measured again next time.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnidraft.shared.engine import catalog
from omnidraft.shared.util.atomic_io import file_lock, write_bytes_atomic

CONTEXT_TOKENS = 256
# Verification blocks measured. The native kernels compute rows in groups, so a block's cost
# rises in steps, not in a line: both edges of each step are measured, or interpolating across
# one misprices every size in between. The AVX-512 kernels with 8-bit activations run 8-row
# passes while more than 4 rows remain, then a 4-row pass, and a lone last row alone (steps at
# 4 | 5, 9 | 10, 12 | 13: 10 and 11 tokens cost what 12 do, not the line from 9 to 12, which
# priced 10 tokens 10 % low on a Zen 4 EPYC); with 16-bit activations 4-row passes and a lone
# last row (steps at 5 | 6, 9 | 10, 13 | 14); the AVX2 ones groups of 4, 2 and 1. Past 16 the
# rule verifies a full model-free draft (17 tokens with the pending one) and a drafter's draft
# with the lookup's continuation after it (up to ~25): 17 (a lone row past two 8-row passes) and
# 32 are measured, the sizes between interpolated. Extrapolated from 14 and 16 instead, 17-32
# were priced 22-31 % low on a Zen 4 EPYC (docs/findings.md, "Blocks past 16 tokens").
PROFILE_BLOCKS = (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 32)
# forwards per trial of a block past 16 tokens (140-215 ms each for the 1.5B target on a Zen 4
# EPYC: five added ~2.3 s to every trial of a first run's profile, two add about 1 s)
LONG_BLOCK = 16
LONG_BLOCK_REPEATS = 2
# the drafter's: a step, the catch-up feeds of committed tokens, and its read of a prompt at a
# decode's first drafter round (about 100-600 tokens; 32 costs what 16 does, 128 ~4x that on a
# Zen 4 EPYC, so extrapolated from 16 a 150-token prompt read was priced 3x its cost)
DRAFTER_BLOCKS = (1, 2, 4, 8, 16, 32, 128)
PROFILE_VERSION = 13  # bump when a kernel or the method changes: every cached measurement is taken again
TRIALS = 3  # trials per measurement (each the minimum of its repeats); the median is kept
MAX_TRIALS = 7  # trials at most, while they disagree
SPREAD_LIMIT = 1.25  # trials whose slowest is more than this times the fastest disagree
STALE_RATIO = 1.5  # a profile whose steps in use differ from it by more than this is measured again
# The rule weighs drafter steps against target steps: a profile whose drafter step, relative to a
# one-token target step, costs more than this times (or less than 1/this of) what it does in use
# drafts too long or too short, and is measured again.
RELATIVE_STALE_RATIO = 1.2


def off_by_more_than(ratio: float | None, limit: float) -> bool:
    """True when ``ratio`` (in use over profiled; None: not measured) lies outside 1/limit..limit."""
    return ratio is not None and not 1 / limit <= ratio <= limit


def _ids(n: int, offset: int = 0) -> list[int]:
    """``n`` ordinary token ids valid in any vocabulary (below 100)."""
    return [3 + (offset + i) % 97 for i in range(n)]


def _time_block(runner, context: int, block: int, repeats: int) -> float:
    """Minimum wall time (ms) of ``repeats`` forwards of ``block`` new tokens after the context."""
    best = float("inf")
    ids = _ids(block, 11)
    for _ in range(repeats):
        runner.crop(context)
        t0 = time.perf_counter()
        runner.forward(ids, logits_to_keep=int(block == 1))
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _fill_context(runner, blocks) -> int:
    """Fill ``runner``'s cache with ``CONTEXT_TOKENS`` (fewer where the model's positions run out
    before ``max(blocks)`` more) and warm its kernels and caches with one untimed pass over every
    block size; the context length kept."""
    limit = getattr(runner, "max_positions", None) or getattr(runner.model.config, "max_position_embeddings", 0)
    context = max(1, min(CONTEXT_TOKENS, (limit or CONTEXT_TOKENS * 2) - max(blocks) - 1))
    runner.reset()
    runner.forward(_ids(context))
    runner.forward([7], logits_to_keep=1)  # first-call initialization outside the timing
    for b in blocks:
        _time_block(runner, context, b, 1)
    return context


@torch.inference_mode()
def measure_together(
    parts: list[tuple[object, tuple[int, ...], int]], trials: int = TRIALS, max_trials: int = MAX_TRIALS
) -> list[dict[int, float]]:
    """``{block: ms}`` per part ``(runner, blocks, repeats)``: one forward of ``block`` new tokens
    after ``CONTEXT_TOKENS`` cached ones. Leaves each runner holding that context (callers reset
    it before decoding).

    Each trial times every part's block sizes in turn, each the minimum over its ``repeats``
    forwards (``LONG_BLOCK_REPEATS`` past ``LONG_BLOCK`` tokens), and a block's figure is the
    median of its trials; while the trials of some block size disagree by more than
    ``SPREAD_LIMIT`` (the machine was busy for part of the time: an outlier) more trials are
    taken, up to ``max_trials``. The parts share every trial, so the ratio of their costs (what
    the throughput rule weighs) comes from one spell of the machine: on a shared VM it moves by
    a quarter between spells (docs/findings.md)."""
    contexts = [_fill_context(runner, blocks) for runner, blocks, _ in parts]
    samples: list[dict[int, list[float]]] = [{b: [] for b in blocks} for _, blocks, _ in parts]
    for trial in range(max_trials):
        for (runner, blocks, repeats), context, kept in zip(parts, contexts, samples):
            for b in blocks:
                kept[b].append(_time_block(runner, context, b, repeats if b <= LONG_BLOCK else LONG_BLOCK_REPEATS))
        agree = all(max(v) <= SPREAD_LIMIT * min(v) for kept in samples for v in kept.values())
        if trial + 1 >= trials and agree:
            break
    return [{b: statistics.median(v) for b, v in kept.items()} for kept in samples]


def measure_block_ms(
    runner, blocks: tuple[int, ...] | list[int], repeats: int = 5, trials: int = TRIALS, max_trials: int = MAX_TRIALS
) -> dict[int, float]:
    """``{block: ms}`` for one runner (``measure_together`` with one part)."""
    return measure_together([(runner, tuple(blocks), repeats)], trials, max_trials)[0]


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo, or platform.processor() elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_fingerprint() -> dict:
    """What makes a measurement valid on another run: CPU model and ISA, torch, threads."""
    return {
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def model_fingerprint(path: str | Path) -> str:
    """sha256 over a model directory's config.json and the names, sizes and mtimes of its
    weight files (a re-converted or replaced model measures again)."""
    path = Path(path)
    h = hashlib.sha256()
    config = path / "config.json"
    h.update(config.read_bytes() if config.is_file() else str(path).encode())
    for f in sorted([*path.glob("*.safetensors"), *path.glob("*.gguf")]):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def profiles_dir() -> Path:
    """Where measured profiles are cached: ``$OMNIDRAFT_PROFILES``, default
    ``$OMNIDRAFT_HOME/profiles``."""
    override = os.environ.get("OMNIDRAFT_PROFILES")
    return Path(override).expanduser() if override else catalog.omnidraft_home() / "profiles"


def _cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return profiles_dir() / f"{digest}.json"


def _full_key(key: dict) -> dict:
    return {"version": PROFILE_VERSION, "machine": machine_fingerprint(), **key}


def forget(key: dict) -> bool:
    """Drop the measurement stored under ``key`` (the next use measures again); True if one
    was stored."""
    path = _cache_file(_full_key(key))
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _stored(path: Path, key: dict) -> dict | None:
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["value"]
    except (OSError, ValueError):
        pass  # missing or unreadable: measure again and overwrite
    return None


def cached(key: dict, measure: Callable[[], dict], refresh: bool = False) -> dict:
    """The measurement stored under ``key`` (machine fingerprint added), or ``measure()``'s
    result, stored atomically for next time. ``refresh`` measures again. Processes that need the
    same measurement at once (a simulation's workers) take it once: the first measures under a
    lock, the others wait and read it, so they all decide from the same profile. A measurement
    takes from seconds to minutes (an fp32 candidate of ``--dtype auto`` on a slow CPU): one line
    on stderr says what is being measured, so a first run does not look stalled."""
    key = _full_key(key)
    path = _cache_file(key)
    if not refresh:
        value = _stored(path, key)
        if value is not None:
            return value
    with file_lock(path.with_suffix(".lock")):
        value = None if refresh else _stored(path, key)
        if value is None:
            print(f"measuring this machine's costs: {_describe(key)} (cached for later runs)", file=sys.stderr)
            value = measure()
            write_bytes_atomic(path, json.dumps({"key": key, "value": value}, indent=1).encode())
    return value


def _describe(key: dict) -> str:
    """What a cache key measures, in a few words (``target int8, native-int8-avx2-a8``)."""
    role = key.get("role", "measurement")
    details = [str(key[f]) for f in ("precision", "backend", "drafter_backend") if key.get(f)] + list(
        key.get("backends", ())
    )
    return f"{role} {', '.join(details)}" if details else role


def target_key(model_path: str | Path, precision: str, backend: str, blocks: tuple[int, ...] = PROFILE_BLOCKS) -> dict:
    """The cache key of a target's costs."""
    return {
        "role": "target",
        "model": model_fingerprint(model_path),
        "precision": precision,
        "backend": backend,
        "blocks": list(blocks),
        "context": CONTEXT_TOKENS,
    }


def pair_key(
    target_path: str | Path, precision: str, target_backend: str, drafter_path: str | Path, drafter_backend: str
) -> dict:
    """The cache key of a pair's costs, measured together (adapters are merged into the drafting
    runner's weights, so they do not change its costs)."""
    return {
        "role": "pair",
        "target": model_fingerprint(target_path),
        "precision": precision,
        "backend": target_backend,
        "drafter": model_fingerprint(drafter_path),
        "drafter_backend": drafter_backend,
        "context": CONTEXT_TOKENS,
        "blocks": list(PROFILE_BLOCKS),
        "drafter_blocks": list(DRAFTER_BLOCKS),
    }


def target_costs(
    runner,
    model_path: str | Path,
    precision: str,
    backend: str,
    blocks: tuple[int, ...] = PROFILE_BLOCKS,
    refresh: bool = False,
) -> dict[int, float]:
    """Target forward cost ``{block tokens: ms}`` on this machine (cached)."""
    key = target_key(model_path, precision, backend, blocks)
    value = cached(key, lambda: {str(b): ms for b, ms in measure_block_ms(runner, blocks).items()}, refresh)
    return {int(b): ms for b, ms in value.items()}


def pair_costs(
    key: dict, target_runner, drafter_runner, refresh: bool = False
) -> tuple[dict[int, float], dict[int, float]]:
    """The target's and the drafter's forward costs ``{block tokens: ms}`` on this machine,
    measured together (``measure_together``) and cached under ``key`` (``pair_key``). The
    drafter's block 1 is one decode step; larger blocks are what feeding it committed tokens
    costs."""
    parts = [(target_runner, PROFILE_BLOCKS, 5), (drafter_runner, DRAFTER_BLOCKS, 10)]

    def measure() -> dict:
        target_ms, drafter_ms = measure_together(parts)
        return {
            "target": {str(b): ms for b, ms in target_ms.items()},
            "drafter": {str(b): ms for b, ms in drafter_ms.items()},
        }

    value = cached(key, measure, refresh)
    return (
        {int(b): float(ms) for b, ms in value["target"].items()},
        {int(b): float(ms) for b, ms in value["drafter"].items()},
    )


def _interpolate(table: dict[int, float], block: float) -> float:
    """Piecewise linear in the block size between measured sizes; beyond the largest, ``L``,
    the mean cost per token from the largest size at most ``L / 2`` up to ``L`` (the last
    two sizes where none is that small; proportionally from a single one). A table's last
    two sizes may both lie on one step of the kernels' cost (14 and 16 tokens are two 8-row
    passes each), and a line through them prices every larger block at one step's cost."""
    sizes = sorted(table)
    if block <= sizes[0]:
        return table[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if block <= hi:
            w = (block - lo) / (hi - lo)
            return table[lo] * (1 - w) + table[hi] * w
    hi = sizes[-1]
    if len(sizes) == 1:
        return table[hi] * block / hi
    lo = max((b for b in sizes[:-1] if 2 * b <= hi), default=sizes[-2])
    return table[hi] + (table[hi] - table[lo]) / (hi - lo) * (block - hi)


def _running_max(table: dict[int, float]) -> dict[int, float]:
    """A larger block never costs less: a measured dip is noise."""
    top, smooth = 0.0, {}
    for b in sorted(table):
        top = max(top, table[b])
        smooth[b] = top
    return smooth


@dataclass
class CostProfile:
    """Measured costs, all in ms: the target's forward per block size, the drafter's decode
    step, the drafter's forward per block size (feeding it committed tokens; empty: one step
    per token) and the fixed work of a decoding round outside the forward passes (a drafter
    round's, and a plain or model-free round's)."""

    target_ms: dict[int, float]
    drafter_ms_per_token: float
    drafter_block_ms: dict[int, float] = field(default_factory=dict)
    round_overhead_ms: float = 0.0  # a drafter round's work outside forwards (translation, ...)
    step_overhead_ms: float = 0.0  # a plain or model-free round's

    def __post_init__(self) -> None:
        self.target_ms = _running_max(self.target_ms)
        self.drafter_block_ms = _running_max(self.drafter_block_ms)

    def target_cost(self, block: float) -> float:
        """Target forward cost (ms) of ``block`` new tokens."""
        return _interpolate(self.target_ms, block)

    def drafter_block_cost(self, block: float) -> float:
        """Drafter forward cost (ms) of feeding it ``block`` tokens at once (0 for none)."""
        if block <= 0:
            return 0.0
        if not self.drafter_block_ms:
            return self.drafter_ms_per_token * block
        return _interpolate(self.drafter_block_ms, block)

    def to_dict(self) -> dict:
        return {
            "target_ms": {str(b): round(ms, 3) for b, ms in sorted(self.target_ms.items())},
            "drafter_ms_per_token": round(self.drafter_ms_per_token, 3),
            "drafter_block_ms": {str(b): round(ms, 3) for b, ms in sorted(self.drafter_block_ms.items())},
            "round_overhead_ms": round(self.round_overhead_ms, 3),
            "step_overhead_ms": round(self.step_overhead_ms, 3),
        }


def describe_check(report: dict) -> str:
    """A profile check's (``StepTimings.check``) figures on one line: ``name in-use/cached`` ms
    per block size, e.g. ``target:1 33.2/33.4, drafter:1 3.9/4.2``."""
    return ", ".join(f"{k} {v['in_use_ms']:.1f}/{v['profile_ms']:.1f}" for k, v in report["steps"].items())


class StepTimings:
    """Forward passes timed while decoding, by block size (ms), to check the cached profile
    against what the machine does in use. Never read by a decision (those use the profile
    alone). At most ``limit`` samples are kept per block size: a uniform sample of all timed so
    far (reservoir sampling), so a long run's check covers all of it, not its first minutes (a
    machine's speed drifts by ±10 % between them)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.target: dict[int, list[float]] = {}
        self.drafter_steps: list[float] = []
        self.total_ms = 0.0  # every timed forward (prefills and drafter feeds included)
        self.seen: dict[int | str, int] = {}  # forwards timed, per block size ("drafter": drafter steps)
        self._pick = random.Random(0)  # which samples a full reservoir replaces (fixed: reports repeat)

    def _sample(self, key: int | str, samples: list[float], ms: float) -> None:
        seen = self.seen[key] = self.seen.get(key, 0) + 1
        if len(samples) < self.limit:
            samples.append(ms)
        elif (slot := self._pick.randrange(seen)) < self.limit:
            samples[slot] = ms

    def record(self, ms: float) -> None:
        """A timed forward that is neither a verification nor a drafter step (a prefill, the
        drafter's catch-up feed): counted in ``total_ms`` only."""
        self.total_ms += ms

    def record_target(self, block: int, ms: float) -> None:
        self.total_ms += ms
        self._sample(block, self.target.setdefault(block, []), ms)

    def record_drafter_step(self, ms: float) -> None:
        self.total_ms += ms
        self._sample("drafter", self.drafter_steps, ms)

    def check(self, profile: CostProfile, min_samples: int = 5) -> dict:
        """In-use medians against the profile, per block size with at least ``min_samples``
        samples; ``stale`` when one differs by more than ``STALE_RATIO`` either way, or when the
        drafter step's ratio differs from the one-token target step's by more than
        ``RELATIVE_STALE_RATIO`` (``drafter_vs_target``: the first over the second)."""
        measured = {f"target:{b}": (steps, profile.target_cost(b)) for b, steps in sorted(self.target.items())}
        measured["drafter:1"] = (self.drafter_steps, profile.drafter_ms_per_token)
        out = {}
        for name, (samples, cached) in measured.items():
            if len(samples) >= min_samples:
                used = statistics.median(samples)
                ratio = round(used / cached, 3) if cached > 0 else None
                out[name] = {
                    "in_use_ms": round(used, 2),
                    "profile_ms": round(cached, 2),
                    "samples": len(samples),
                    "ratio": ratio,
                }
        report = {"steps": out, "stale": any(off_by_more_than(r["ratio"], STALE_RATIO) for r in out.values())}
        drafter, target = out.get("drafter:1", {}).get("ratio"), out.get("target:1", {}).get("ratio")
        if drafter and target:
            relative = drafter / target
            report["drafter_vs_target"] = round(relative, 3)
            report["stale"] = report["stale"] or off_by_more_than(relative, RELATIVE_STALE_RATIO)
        return report
