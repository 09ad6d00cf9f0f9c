"""Running a ServerApp and a ClientApp together on Flower's Simulation Engine (Ray).

``run_simulation`` is deprecated in Flower 1.41/1.42 but is the supported in-process entry point;
it is called only here so it can be swapped for a ``flwr run`` subprocess when it is removed.
Environment set before Ray starts: Ray binds to 127.0.0.1 only, its accelerator warning is
silenced, and each worker runs torch with as many threads as the CPUs a device is given. Workers
of a cluster started elsewhere (``ray start``) do not inherit this process's environment, so when
joining one this module connects to it itself, with those settings in the job's ``runtime_env``
(Flower's backend then finds Ray initialised and only passes ``PYTHONPATH``).
"""

from __future__ import annotations

import logging
import os
import warnings

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

# environment variables a device worker reads, passed on to every worker of the Ray job
WORKER_ENV = ("OMNIDRAFT_HOME", "OMNIDRAFT_THREADS", "OMNIDRAFT_NATIVE_ISA", "HF_HUB_DISABLE_PROGRESS_BARS",
              "TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS", "TOKENIZERS_PARALLELISM")


def run_federation(server_app: ServerApp, client_app: ClientApp, devices: int, *,
                   cpus_per_device: float = 1.0, total_cpus: int | None = None,
                   ray_address: str | None = None, verbose: bool = False) -> None:
    """Simulate ``devices`` devices (Flower SuperNodes) against ``server_app`` until it returns.

    ``total_cpus``: CPUs Ray may use (default: all available); ``ray_address``: join an existing
    Ray cluster (``ray start --head`` elsewhere) instead of starting a local one."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("OMNIDRAFT_THREADS", str(max(1, int(cpus_per_device))))
    if not verbose:  # workers inherit these: no weight-loading bars or library deprecation notes
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    from flwr.simulation import run_simulation

    init_args: dict = {"include_dashboard": False, "logging_level": "error" if not verbose else "info"}
    if ray_address:
        _join_cluster(ray_address, init_args)
    else:
        init_args["num_cpus"] = total_cpus or len(os.sched_getaffinity(0))
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)  # Flower's per-round INFO lines would break progress bars
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            run_simulation(server_app=server_app, client_app=client_app, num_supernodes=devices,
                           backend_config={"client_resources": {"num_cpus": cpus_per_device, "num_gpus": 0.0},
                                           "init_args": init_args},
                           verbose_logging=verbose)
        finally:
            flwr_logger.setLevel(level)


def _join_cluster(address: str, init_args: dict) -> None:
    """Connect this process to the Ray cluster at ``address``, giving the job's workers the
    device settings (``WORKER_ENV``) and this process's import path, as Flower gives the latter."""
    import sys

    import ray

    if ray.is_initialized():
        return
    _check_reachable(address)
    env = {name: os.environ[name] for name in WORKER_ENV if name in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(address=address, runtime_env={"env_vars": env}, **init_args)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ValueError unless ``address`` (``HOST:PORT`` of a Ray head's GCS) accepts a TCP
    connection within ``timeout_s`` seconds; Ray itself retries an unreachable head for minutes."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r}: expected HOST:PORT of a Ray head (ray start --head)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None
