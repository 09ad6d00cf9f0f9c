"""What a forward pass costs on this machine, measured once and cached.

``measure_block_ms`` times a runner's forward pass for blocks of new tokens on top of a filled KV
cache (the minimum over repeats: the least disturbed run). ``target_costs`` and
``drafter_cost`` wrap it with an on-disk cache under ``$OMNIDRAFT_HOME/profiles/``, keyed by a
fingerprint of the machine (CPU model, ISA capability, torch version, threads) and of the model
(its config and weight files) plus the precision and kernel backend: a change of any of them
measures again. ``CostProfile`` turns the measurements into the cost of any block size, which
the decoder's cost-aware draft stopping (``omnidraft.shared.draft_policy``) reads, and
``choose_precision`` resolves ``--dtype auto`` to the precision with the cheapest verification.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from omnidraft.shared import catalog
from omnidraft.shared.atomic_io import write_bytes_atomic

CONTEXT_TOKENS = 256
PROFILE_BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16)
PROFILE_VERSION = 2  # bump when a kernel changes: every cached measurement is then taken again


def _ids(n: int, offset: int = 0) -> list[int]:
    """``n`` ordinary token ids valid in any vocabulary (below 100)."""
    return [3 + (offset + i) % 97 for i in range(n)]


def _time_block(runner, context: int, block: int, repeats: int) -> float:
    """Minimum wall time (ms) of one forward of ``block`` new tokens after the context."""
    best = float("inf")
    ids = _ids(block, 11)
    for _ in range(repeats):
        runner.crop(context)
        t0 = time.perf_counter()
        runner.forward(ids, logits_to_keep=int(block == 1))
        best = min(best, time.perf_counter() - t0)
    return best * 1000


@torch.inference_mode()
def measure_block_ms(runner, blocks: tuple[int, ...] | list[int], repeats: int = 5) -> dict[int, float]:
    """``{block: ms}``: one forward of ``block`` new tokens after ``CONTEXT_TOKENS`` cached ones
    (fewer where the model's positions run out). Leaves the runner holding that context
    (callers reset it before decoding)."""
    limit = getattr(runner, "max_positions", None) or getattr(runner.model.config, "max_position_embeddings", 0)
    context = max(1, min(CONTEXT_TOKENS, (limit or CONTEXT_TOKENS * 2) - max(blocks) - 1))
    runner.reset()
    runner.forward(_ids(context))
    runner.forward([7], logits_to_keep=1)  # first-call initialization outside the timing
    return {b: _time_block(runner, context, b, repeats) for b in blocks}


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
    return {"cpu": cpu_name(), "machine": platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def model_fingerprint(path: str | Path) -> str:
    """sha256 over a model directory's config.json and the names, sizes and mtimes of its
    weight files (a re-converted or replaced model measures again)."""
    path = Path(path)
    h = hashlib.sha256()
    config = path / "config.json"
    h.update(config.read_bytes() if config.is_file() else str(path).encode())
    for f in sorted(path.glob("*.safetensors")):
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


def cached(key: dict, measure: Callable[[], dict], refresh: bool = False) -> dict:
    """The measurement stored under ``key`` (machine fingerprint added), or ``measure()``'s
    result, stored atomically for next time. ``refresh`` measures again."""
    key = {"version": PROFILE_VERSION, "machine": machine_fingerprint(), **key}
    path = _cache_file(key)
    if not refresh and path.is_file():
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                return stored["value"]
        except (OSError, ValueError):
            pass  # unreadable: measure again and overwrite
    value = measure()
    write_bytes_atomic(path, json.dumps({"key": key, "value": value}, indent=1).encode())
    return value


def target_costs(runner, model_path: str | Path, precision: str, backend: str,
                 blocks: tuple[int, ...] = PROFILE_BLOCKS, refresh: bool = False) -> dict[int, float]:
    """Target forward cost ``{block tokens: ms}`` on this machine (cached)."""
    key = {"role": "target", "model": model_fingerprint(model_path), "precision": precision,
           "backend": backend, "blocks": list(blocks), "context": CONTEXT_TOKENS}
    value = cached(key, lambda: {str(b): ms for b, ms in measure_block_ms(runner, blocks).items()}, refresh)
    return {int(b): ms for b, ms in value.items()}


def drafter_cost(runner, model_path: str | Path, backend: str, refresh: bool = False) -> float:
    """The drafter's cost of one decode step in ms on this machine (cached)."""
    key = {"role": "drafter", "model": model_fingerprint(model_path), "backend": backend,
           "context": CONTEXT_TOKENS}
    value = cached(key, lambda: {"1": measure_block_ms(runner, (1,), repeats=20)[1]}, refresh)
    return float(value["1"])


@dataclass
class CostProfile:
    """Measured costs: target forward ms per block size, drafter ms per token."""

    target_ms: dict[int, float]
    drafter_ms_per_token: float

    def __post_init__(self) -> None:
        # a larger block never costs less: a measured dip is noise (running maximum)
        top, smooth = 0.0, {}
        for b in sorted(self.target_ms):
            top = max(top, self.target_ms[b])
            smooth[b] = top
        self.target_ms = smooth

    def target_cost(self, block: float) -> float:
        """Target forward cost (ms) of ``block`` new tokens: piecewise linear between the
        measured sizes, extrapolated from the last two beyond them."""
        sizes = sorted(self.target_ms)
        if block <= sizes[0]:
            return self.target_ms[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if block <= hi:
                w = (block - lo) / (hi - lo)
                return self.target_ms[lo] * (1 - w) + self.target_ms[hi] * w
        if len(sizes) == 1:
            return self.target_ms[sizes[0]] * block
        lo, hi = sizes[-2], sizes[-1]
        slope = (self.target_ms[hi] - self.target_ms[lo]) / (hi - lo)
        return self.target_ms[hi] + slope * (block - hi)

    def to_dict(self) -> dict:
        return {"target_ms": {str(b): ms for b, ms in sorted(self.target_ms.items())},
                "drafter_ms_per_token": self.drafter_ms_per_token}


def verification_score(target_ms: dict[int, float]) -> float:
    """How ``--dtype auto`` ranks precisions: one decode step plus one typical verification
    block of 4 tokens (ms)."""
    profile = CostProfile(target_ms, 0.0)
    return profile.target_cost(1) + profile.target_cost(4)


def choose_precision(target: str, candidates: tuple[str, ...] | None = None, *, refresh: bool = False,
                     progress: bool = True) -> tuple[str, dict[str, dict[int, float]]]:
    """Resolve ``--dtype auto`` for ``target``: the candidate precision with the lowest
    :func:`verification_score` on this machine, and each candidate's measured costs.

    Candidates default to int8 and fp32, plus bf16 where the CPU has native bf16 (AMX or
    AVX512-BF16); each one not cached yet is loaded and measured once.
    """
    from omnidraft.shared import model_runner
    from omnidraft.shared.fast_drafter import cpu_has_native_bf16
    from omnidraft.shared.precision import build_target_runner, load_dtype, runner_backend

    if candidates is None:
        candidates = ("int8", "bf16", "fp32") if cpu_has_native_bf16() else ("int8", "fp32")
    path = catalog.resolve(target, progress=progress)
    costs: dict[str, dict[int, float]] = {}
    for precision in candidates:
        def measure_one(precision=precision) -> dict[int, float]:
            loaded = model_runner.load(str(path), load_dtype(precision), progress=progress)
            runner = build_target_runner(loaded.model, precision)
            return target_costs(runner, path, precision, runner_backend(runner), refresh=refresh)

        costs[precision] = _cached_precision_costs(path, precision, measure_one, refresh)
    best = min(costs, key=lambda p: verification_score(costs[p]))
    return best, costs


def _cached_precision_costs(path: Path, precision: str, measure: Callable[[], dict[int, float]],
                            refresh: bool) -> dict[int, float]:
    """Costs of ``precision`` for the model at ``path`` from the auto-selection cache (which
    needs no loaded model to look up), else ``measure()``."""
    key = {"role": "auto-candidate", "model": model_fingerprint(path), "precision": precision,
           "blocks": list(PROFILE_BLOCKS)}
    value = cached(key, lambda: {str(b): ms for b, ms in measure().items()}, refresh)
    return {int(b): ms for b, ms in value.items()}
