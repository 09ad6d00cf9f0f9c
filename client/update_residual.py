"""Error feedback for the compressed update a device sends (``shared.update_codec``).

What quantization drops from a round's update is kept in the device's directory
(``update-residual-<target>.safetensors``, never sent) and added to its next update for the same
target, so the quantization errors do not pile up in the global adapter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load, save

from omnidraft.client.device_state import slug
from omnidraft.shared.update_codec import decode, encode
from omnidraft.shared.util.atomic_io import write_bytes_atomic


class ErrorFeedback:
    """One device's residual for one target."""

    def __init__(self, device_dir: str | Path, target: str) -> None:
        self.path = Path(device_dir) / f"update-residual-{slug(target)}.safetensors"

    def compress(self, delta: dict[str, np.ndarray], bits: int) -> dict[str, np.ndarray]:
        """``delta`` plus the kept residual, encoded at ``bits``; the new residual is kept."""
        residual = load(self.path.read_bytes()) if self.path.exists() else {}
        if set(residual) - set(delta) or any(residual[k].shape != np.shape(delta[k]) for k in residual):
            residual = {}  # the adapter's shape changed (a new target spec): start afresh
        full = {k: np.asarray(v, np.float32) + residual.get(k, 0.0) for k, v in delta.items()}
        arrays = encode(full, bits)
        sent = decode(arrays, {k: v.shape for k, v in full.items()})
        write_bytes_atomic(self.path, save({k: (full[k] - sent[k]).astype(np.float32) for k in full}))
        return arrays
