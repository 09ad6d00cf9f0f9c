"""The coordinator's server-side optimizer: how one target's aggregated update moves its global
adapter (Reddi et al., "Adaptive Federated Optimization", arXiv 2003.00295).

The aggregate of a round (FedAvg's weighted mean, the median, the trimmed mean, or the mean that
SecAgg+ reveals) defines a pseudo-gradient ``g = global - aggregate``. The server step applies
it with a ``torch.optim`` optimizer over the global adapter's tensors:

* ``avg``: the aggregate becomes the new global adapter (plain FedAvg; no state);
* ``momentum``: SGD with momentum and a server learning rate (FedAvgM);
* ``adam``: Adam with a server learning rate (FedAdam): every round moves each coordinate by
  about ``lr`` in the direction the fleet agrees on, however small the devices' own steps were.

Flower's ``FedAvgM`` / ``FedAdam`` strategies do the same after FedAvg's mean only and keep
their moments in memory; here the step follows whichever aggregate the round used, and its
state (the optimizer's moments and step count) is saved with each committed version of the
target, so a restarted coordinator continues where it stopped and a rollback starts afresh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

KINDS = ("avg", "momentum", "adam")
DEFAULT_LR = {"avg": 1.0, "momentum": 1.0, "adam": 1e-3}


@dataclass(frozen=True)
class ServerOptConfig:
    """The server step (see the module docstring)."""

    kind: str = "avg"  # avg | momentum | adam
    lr: float | None = None  # server learning rate (None: 1 for momentum, 1e-3 for adam; avg ignores it)
    beta1: float = 0.9  # momentum (SGD) / first-moment decay (Adam)
    beta2: float = 0.99  # second-moment decay (Adam)
    eps: float = 1e-8  # Adam's denominator floor (the paper's tau)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown server optimizer {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError("the server learning rate must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("server optimizer betas must be in [0, 1)")
        if not self.eps > 0:
            raise ValueError("the server optimizer's eps must be > 0")

    @property
    def rate(self) -> float:
        """The learning rate in use (``lr`` or the kind's default)."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.kind]

    def as_dict(self) -> dict:
        return {**asdict(self), "lr": self.rate}


class ServerOptimizer:
    """One target's server step and its state (``state()`` / the ``state`` argument: flat
    tensors ``<adapter key>/<moment>`` plus ``step``, for safetensors)."""

    def __init__(
        self, config: ServerOptConfig = ServerOptConfig(), state: dict[str, torch.Tensor] | None = None
    ) -> None:
        config.validate()
        self.config = config
        self._saved = dict(state or {})
        self._params: dict[str, torch.nn.Parameter] = {}
        self._optimizer: torch.optim.Optimizer | None = None

    def _build(self, keys: list[str]) -> None:
        c = self.config
        self._params = {k: torch.nn.Parameter(torch.zeros(0)) for k in keys}
        params = list(self._params.values())
        if c.kind == "momentum":
            self._optimizer = torch.optim.SGD(params, lr=c.rate, momentum=c.beta1)
        else:
            self._optimizer = torch.optim.Adam(params, lr=c.rate, betas=(c.beta1, c.beta2), eps=c.eps)

    def step(self, current: dict[str, np.ndarray], aggregate: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global adapter from the ``current`` one and the round's ``aggregate`` (same
        keys, shapes and dtypes); computed in float32, returned in the current dtypes."""
        if self.config.kind == "avg":
            return {k: np.asarray(aggregate[k], dtype=current[k].dtype) for k in current}
        keys = sorted(current)
        if self._optimizer is None or sorted(self._params) != keys:
            self._build(keys)
            self._restore(keys, current)
        for k in keys:
            p = self._params[k]
            p.data = torch.from_numpy(np.asarray(current[k], dtype=np.float32)).clone()
            p.grad = p.data - torch.from_numpy(np.asarray(aggregate[k], dtype=np.float32))
        self._optimizer.step()
        return {k: self._params[k].data.numpy().astype(current[k].dtype) for k in keys}

    def _restore(self, keys: list[str], current: dict[str, np.ndarray]) -> None:
        """Load the saved moments when they fit the adapter; otherwise start afresh."""
        saved = self._saved
        if not saved:
            return
        moments = {"momentum": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}[self.config.kind]
        state = {}
        for i, k in enumerate(keys):
            entry = {m: saved.get(f"{k}/{m}") for m in moments}
            if any(v is None or tuple(v.shape) != current[k].shape for v in entry.values()):
                return  # another adapter shape or optimizer: fresh moments
            if self.config.kind == "adam":
                entry["step"] = saved["step"].clone().float()
            state[i] = {m: v.clone().float() for m, v in entry.items()}
        sd = self._optimizer.state_dict()
        sd["state"] = state
        self._optimizer.load_state_dict(sd)

    def state(self) -> dict[str, torch.Tensor]:
        """The moments and step count to save with the committed version ({} for ``avg`` or
        before the first step)."""
        if self._optimizer is None:
            return {}
        keys = sorted(self._params)
        out: dict[str, torch.Tensor] = {}
        for i, entry in self._optimizer.state_dict()["state"].items():
            for m, v in entry.items():
                if m == "step":
                    out["step"] = torch.as_tensor(v, dtype=torch.float32).reshape(())
                elif v is not None:
                    out[f"{keys[i]}/{m}"] = v.detach().clone().contiguous()
        return out
