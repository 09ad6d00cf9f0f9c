"""A device's side of SecAgg+ (``coordinator.secure_aggregation``).

In a SecAgg+ round the ``train`` reply carries no adapter: the device keeps its update (trained
adapter minus the global adapter it started from) in ``secagg-update.safetensors`` in its own
directory, checked and clipped, until the secure aggregation asks for it. The coordinator cannot
inspect an update it only sees masked, so the device does what the coordinator does in the
clear: it refuses a non-finite update and scales it to the fleet's L2 clip norm.
``secaggplus_mod`` then weights, quantizes and masks it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from omnidraft.shared.util.atomic_io import write_bytes_atomic

UPDATE_FILE = "secagg-update.safetensors"


class UpdateError(ValueError):
    """The kept update cannot be sent (missing, for another round or target, or not finite)."""


def update_delta(trained: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A round's update, ``trained - start`` per tensor (float64, sorted names); ``UpdateError``
    when the two adapters do not have the same tensors."""
    if set(trained) != set(start):
        raise UpdateError("the trained adapter's tensors differ from the global adapter's")
    return {k: trained[k].double() - start[k].double() for k in sorted(start)}


def keep_update(
    device_dir: str | Path,
    trained: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    *,
    target: str,
    round_: int,
    version: int,
    tokens: int,
    clip_norm: float | None = None,
) -> float:
    """Store ``trained - start`` for the round's secure aggregation; returns its L2 norm before
    clipping. Raises ``UpdateError`` for an update with NaN or Inf."""
    delta = update_delta(trained, start)
    norm = math.sqrt(sum(float((d * d).sum()) for d in delta.values()))
    if not math.isfinite(norm):
        raise UpdateError("the update holds NaN or Inf")
    scale = clip_norm / norm if clip_norm is not None and norm > clip_norm else 1.0
    tensors = {k: (d * scale).float().contiguous() for k, d in delta.items()}
    meta = {"target": target, "round": str(round_), "version": str(version), "tokens": str(int(tokens))}
    write_bytes_atomic(Path(device_dir) / UPDATE_FILE, save_safetensors(tensors, metadata=meta))
    return norm


def take_update(device_dir: str | Path, *, target: str, round_: int, version: int) -> tuple[list[np.ndarray], int]:
    """The kept update as arrays in sorted tensor-name order (how the coordinator reshapes the
    sum) and its weight (trained tokens); the file is removed once read."""
    path = Path(device_dir) / UPDATE_FILE
    if not path.exists():
        raise UpdateError("no update kept for secure aggregation")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if (meta.get("target"), meta.get("round"), meta.get("version")) != (target, str(round_), str(version)):
        raise UpdateError(
            f"the kept update is for {meta.get('target')!r} round {meta.get('round')} "
            f"version {meta.get('version')}, not {target!r} round {round_} version {version}"
        )
    path.unlink()
    return [tensors[k].numpy() for k in sorted(tensors)], int(meta["tokens"])
