"""One target's adapter updates summed with Flower's SecAgg+: the coordinator sees only the sum.

Flower 1.41 runs SecAgg+ only on its legacy stack: ``SecAggPlusWorkflow`` driven by a
``LegacyContext`` whose strategy's ``configure_fit`` names the clients. A round with SecAgg+
has two phases per target:

1. the ``train`` message as usual; the device trains, keeps its update (adapter minus the
   global adapter, checked and clipped *on the device*, see ``client.secure_update``) and
   replies with metrics and n-gram statistics only, no adapter;
2. one ``SecAggPlusWorkflow`` over the devices whose phase-1 reply passed the checks
   (``aggregation.check_reply``): setup, key sharing, masked vectors, unmasking (four message
   waves). Each device's ``secaggplus_mod`` weights its update by its trained tokens /
   ``max_weight``, quantizes it within ``[-clipping_range, clipping_range]`` and masks it; the
   coordinator unmasks only the weighted mean (dropouts up to the reconstruction threshold are
   tolerated).

What the coordinator cannot do under SecAgg+: check or clip an individual update (the device
does it: non-finite updates are not sent, the L2 clip norm and the element range are applied
before masking), or use a robust aggregate (median, trimmed mean): only the weighted mean.
The n-gram statistics stay in the clear: their release already requires k devices per entry.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import FitIns, parameters_to_ndarrays
from flwr.server import ServerConfig
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from omnidraft.coordinator.aggregation import payload_bytes
from omnidraft.shared.wire import FleetKey

log = logging.getLogger("omnidraft.coordinator")


@dataclass(frozen=True)
class SecAggConfig:
    """SecAgg+ settings (``enabled`` off: adapters travel in the clear)."""

    enabled: bool = False
    clipping_range: float = 0.25  # each weighted update element is clipped to +-this before quantization
    quantization_range: int = 1 << 22  # levels over [-clipping_range, clipping_range]
    share_fraction: float = 1.0  # key shares per device, as a fraction of the target's devices that round
    threshold_fraction: float = 0.6  # fraction of the shares needed to reconstruct a dropped device's masks
    min_devices: int = 3  # fewer devices of a target in a round: its round is not aggregated
    timeout_s: float = 600.0  # longest wait of each of the four message waves (seconds)

    def validate(self) -> None:
        if not self.clipping_range > 0:
            raise ValueError("the SecAgg+ clipping range must be > 0")
        if self.min_devices < 2:
            raise ValueError("SecAgg+ needs at least 2 devices per target and round")
        if not 0 < self.threshold_fraction <= 1 or not 0 < self.share_fraction <= 1:
            raise ValueError("SecAgg+ share and threshold fractions must be in (0, 1]")


@dataclass(frozen=True)
class _Node:
    """What ``SecAggPlusWorkflow`` needs of a legacy ``ClientProxy``."""

    node_id: int


class _NamedNodes(LegacyFedAvg):
    """A legacy strategy that sends the fit instructions to the given nodes (no sampling)."""

    def __init__(self, nodes: list[int], config: dict) -> None:
        super().__init__(fraction_evaluate=0.0, accept_failures=True)
        self.nodes = nodes
        self.fit_config = config

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Node(n), FitIns(parameters, dict(self.fit_config))) for n in self.nodes]


class _MeteredGrid:
    """A Grid that counts the bytes each node receives and sends through ``send_and_receive``
    (the only call ``SecAggPlusWorkflow`` makes), for the round's report."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.down: defaultdict[int, int] = defaultdict(int)
        self.up: defaultdict[int, int] = defaultdict(int)

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for m in messages:
            self.down[m.metadata.dst_node_id] += payload_bytes(m)
        for m in replies:
            if not m.has_error():
                self.up[m.metadata.src_node_id] += payload_bytes(m)
        return replies


def secure_mean_update(
    grid: Grid,
    context: Context,
    rnd: int,
    target: str,
    version: int,
    weights: dict[int, float],
    shapes: dict[str, tuple[int, ...]],
    config: SecAggConfig,
) -> tuple[dict[str, np.ndarray] | None, dict[int, int], dict[int, int]]:
    """Run SecAgg+ over ``weights``' nodes for ``target``; returns (the weighted mean update by
    adapter key, or None when the protocol halted; bytes sent to and received from each node).

    ``shapes``: the adapter's tensors, in the order the devices flatten them (sorted keys)."""
    nodes = sorted(weights)
    fit_config = {FleetKey.ROUND: rnd, FleetKey.TARGET: target, FleetKey.STATE_VERSION: version}
    legacy = LegacyContext(context, ServerConfig(num_rounds=1), _NamedNodes(nodes, fit_config))
    state = legacy.state  # the ServerApp's own: the workflow's records are removed afterwards
    state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
    state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()  # no parameters go down: devices hold the global adapter
    metered = _MeteredGrid(grid)
    workflow = SecAggPlusWorkflow(
        num_shares=float(config.share_fraction),
        reconstruction_threshold=float(config.threshold_fraction),
        max_weight=max(weights.values()),
        clipping_range=config.clipping_range,
        quantization_range=config.quantization_range,
        timeout=config.timeout_s,
    )
    try:
        workflow(metered, legacy)
    finally:
        result = state.array_records.pop(MAIN_PARAMS_RECORD)
        state.config_records.pop(MAIN_CONFIGS_RECORD)
    if not len(result):
        return None, metered.down, metered.up
    flat = parameters_to_ndarrays(compat.arrayrecord_to_parameters(result, keep_input=True))
    if len(flat) != len(shapes) or any(f.size != math.prod(s) for f, s in zip(flat, shapes.values())):
        log.warning("round %d, %s: SecAgg+ returned arrays of unexpected shapes", rnd, target)
        return None, metered.down, metered.up
    mean = {k: f.reshape(s).astype(np.float32) for f, (k, s) in zip(flat, shapes.items())}
    return mean, metered.down, metered.up
