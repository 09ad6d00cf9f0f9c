"""The coordinator's ``ServerApp`` for a real deployment (``flwr run`` against a SuperLink).

The same ``Coordinator`` round loop as in the simulation; its settings come from the run config
(``flwr run APP_DIR CONNECTION --run-config "fleet-dir='/srv/fleet' rounds=2"``; defaults in
``flower_app/pyproject.toml``, whose components point here and at
``omnidraft.client.supernode_app:app``):

=================  ==========================================================================
``fleet-dir``      the coordinator directory (registry, keys, round history); required
``rounds``         rounds to run now, after the ones already finished in ``fleet-dir``
``fraction``       share of the joined devices sampled per round
``min-devices``    devices that must be connected before a round starts
``wait-s``         longest wait for them (seconds)
``round-timeout-s``  longest wait for one wave of replies (seconds)
``k``, ``noise``   n-gram release threshold (devices) and Gaussian noise multiplier
``aggregation``    fedavg | median | trimmed; ``clip-norm`` (0: none)
``dp-noise``       DP-FedAvg on the updates: Gaussian noise multiplier (0: off; needs ``clip-norm``)
``update-bits``    bits per value of the update a device sends: 4, 8 or 32 (float32)
``secagg``         sum the adapter updates with SecAgg+ (fedavg only)
``evaluate``       evaluate each new global state on the devices; ``newcomer-evals``; ``seed``
=================  ==========================================================================
"""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from omnidraft.coordinator.aggregation import AggregationConfig
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import ReleaseConfig
from omnidraft.coordinator.registry import TargetRegistry
from omnidraft.coordinator.round_log import last_round
from omnidraft.coordinator.secure_aggregation import SecAggConfig
from omnidraft.coordinator.server_app import Coordinator

log = logging.getLogger("omnidraft.coordinator")


def config_from_run(run_config: dict, root: Path) -> FleetConfig:
    """The ``FleetConfig`` a run config asks for (see the module docstring); ValueError with
    one line for a bad value."""
    known = {
        "fleet-dir",
        "rounds",
        "fraction",
        "min-devices",
        "wait-s",
        "round-timeout-s",
        "k",
        "noise",
        "aggregation",
        "clip-norm",
        "dp-noise",
        "update-bits",
        "evaluate",
        "newcomer-evals",
        "seed",
        "secagg",
    }
    unknown = sorted(set(run_config) - known)
    if unknown:
        raise ValueError(f"unknown run config key(s): {', '.join(unknown)}")
    try:
        clip = float(run_config.get("clip-norm", 0.0))
        config = FleetConfig(
            rounds=last_round(root) + int(run_config.get("rounds", 1)),
            fraction=float(run_config.get("fraction", 1.0)),
            min_devices=int(run_config.get("min-devices", 1)),
            wait_s=float(run_config.get("wait-s", 120.0)),
            round_timeout_s=float(run_config.get("round-timeout-s", 1800.0)),
            evaluate=bool(run_config.get("evaluate", True)),
            newcomer_evals=int(run_config.get("newcomer-evals", 2)),
            seed=int(run_config.get("seed", 0)),
            aggregation=AggregationConfig(
                method=str(run_config.get("aggregation", "fedavg")),
                clip_norm=clip if clip > 0 else None,
                dp_noise=float(run_config.get("dp-noise", 0.0)),
                update_bits=int(run_config.get("update-bits", 8)),
            ),
            release=ReleaseConfig(
                k=int(run_config.get("k", 5)),
                noise_multiplier=float(run_config.get("noise", ReleaseConfig.noise_multiplier)),
            ),
            secagg=SecAggConfig(enabled=bool(run_config.get("secagg", False))),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad run config: {exc}") from None
    config.validate()
    return config


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the requested rounds over the registry in ``fleet-dir``."""
    run_config = dict(context.run_config)
    if not run_config.get("fleet-dir"):
        raise ValueError(
            "run config: set fleet-dir to the coordinator directory (omnidraft fleet register-target --root)"
        )
    root = Path(str(run_config["fleet-dir"])).expanduser()
    if not TargetRegistry(root).names():
        raise ValueError(f"run config: {root} has no registered target (omnidraft fleet register-target --root {root})")
    config = config_from_run(run_config, root)
    log.info("omnidraft coordinator: rounds %d..%d over %s", last_round(root) + 1, config.rounds, root)
    Coordinator(root, config).run(grid, context)
