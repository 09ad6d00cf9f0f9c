"""``--dtype auto``: the precision a target verifies fastest in on this machine, among those that
keep its greedy output exact.

Each candidate (``lossless_precisions``) is loaded and timed once at ``AUTO_BLOCKS`` only, and
the times are cached beside the cost profiles (``omnidraft.shared.engine.profiling``); the
chosen precision's full profile is measured when it is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from omnidraft.shared.engine import catalog, profiling
from omnidraft.shared.engine.profiling import CostProfile, cached, model_fingerprint

# What ``verification_score`` reads: ``--dtype auto`` measures each candidate at these block
# sizes only, and the chosen precision's full profile (``PROFILE_BLOCKS``) when it is used. On a
# noisy 2-core Zen 4 EPYC the full profile of the float32 candidate took 7.4 minutes.
AUTO_BLOCKS = (1, 4)


def verification_score(target_ms: dict[int, float]) -> float:
    """How ``--dtype auto`` ranks precisions: one decode step plus one typical verification
    block of 4 tokens (ms; ``target_ms`` holds at least ``AUTO_BLOCKS``)."""
    profile = CostProfile(target_ms, 0.0)
    return profile.target_cost(1) + profile.target_cost(4)


def choose_precision(
    target: str, candidates: tuple[str, ...] | None = None, *, refresh: bool = False, progress: bool = True
) -> tuple[str, dict[str, dict[int, float]]]:
    """Resolve ``--dtype auto`` for ``target``: the candidate precision with the lowest
    :func:`verification_score` on this machine, and each candidate's measured costs.

    Candidates default to :func:`lossless_precisions`; each one not cached yet is loaded and
    measured once, at ``AUTO_BLOCKS`` only. A single candidate is the choice without a
    measurement (and no costs): a model kept as GGUF on a machine the native kernels run, where
    loading and timing it would cost a first run ~20 s for Qwen2.5-Coder-1.5B.
    """
    from omnidraft.shared.engine import model_runner
    from omnidraft.shared.engine.precision import build_target_runner, load_dtype

    path = catalog.resolve(target, progress=progress)
    if candidates is None:
        candidates = lossless_precisions(path)
    if len(candidates) == 1:
        return candidates[0], {}
    costs: dict[str, dict[int, float]] = {}
    for precision in candidates:

        def measure_one(precision=precision) -> dict[int, float]:
            loaded = model_runner.load(str(path), load_dtype(precision), progress=progress, stream=precision == "int8")
            return profiling.measure_block_ms(
                build_target_runner(loaded.model, precision, loaded.checkpoint), AUTO_BLOCKS
            )

        costs[precision] = _cached_precision_costs(path, precision, measure_one, refresh)
    best = min(costs, key=lambda p: verification_score(costs[p]))
    return best, costs


def lossless_precisions(path: Path) -> tuple[str, ...]:
    """The precisions ``--dtype auto`` chooses among for the model at ``path``: those whose
    verification blocks are bit-identical to its one-token steps, so speculation keeps the
    target's own greedy output. That is int8 on the native kernels (Llama / Qwen2 on a CPU they
    run on) and fp32; bf16 and fbgemm int8 (other architectures, or no native kernels) round
    a block differently from a step and stay available only when asked for by name. A model
    kept as GGUF (a device's footprint) runs int8 only where that is exact: a float copy of it
    is what that format avoids."""
    from omnidraft.shared.engine.precision import fast_runner_supports
    from omnidraft.shared.runtime import gguf_weights
    from omnidraft.shared.runtime.native_kernels import native_library

    try:  # the config's fields as attributes, as on a loaded model's config
        config = SimpleNamespace(**json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError, TypeError):  # no readable config: nothing says the native kernels run it
        config = None
    native = fast_runner_supports(config) and native_library() is not None
    if native:
        return ("int8",) if gguf_weights.gguf_file(path) is not None else ("int8", "fp32")
    return ("fp32",)


def _cached_precision_costs(
    path: Path, precision: str, measure: Callable[[], dict[int, float]], refresh: bool
) -> dict[int, float]:
    """Costs of ``precision`` for the model at ``path`` from the auto-selection cache (which
    needs no loaded model to look up), else ``measure()``."""
    key = {
        "role": "auto-candidate",
        "model": model_fingerprint(path),
        "precision": precision,
        "blocks": list(AUTO_BLOCKS),
    }
    value = cached(key, lambda: {str(b): ms for b, ms in measure().items()}, refresh)
    return {int(b): ms for b, ms in value.items()}
