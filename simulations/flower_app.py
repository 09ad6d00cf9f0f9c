"""The simulated fleet as a Flower App: the ``ServerApp`` and ``ClientApp`` that ``flwr run``
loads (the repository's ``pyproject.toml`` names them in ``[tool.flwr.app.components]``).

Both read one directory, the run's ``run-dir`` (run config; empty: ``$OMNIDRAFT_HOME/runs/
flwr-<run id>``, which the ServerApp and every ClientApp derive alike):

* ``simulations/run.py`` prepares it before starting the run (``fleet_setup.prepare``: the
  coordinator's registry under ``coordinator/``, one profile per device under
  ``devices/device-NNNN/``, the scenario in ``scenario.json``);
* a bare ``flwr run . --federation-config "num-supernodes=N"`` finds no ``scenario.json`` there:
  the ServerApp prepares the scenario named by ``scenario`` (a file in ``simulations/scenarios``
  or a path) for the ``N`` SuperNodes it sees (the probes included), then writes the same report
  as ``run.py`` when the rounds are done.

The ClientApp of partition ``p`` is the device in ``devices/device-p``; its profile is read from
disk in the worker (no device's text goes through Flower or Ray). ``client-mods`` (run config:
``MODULE:NAME`` paths, comma-separated) wraps the device's handlers in extra Flower mods, e.g.
to inject faults or to audit what leaves a device; ``coordinator-hooks`` (the same form) are
called with the ``Coordinator`` before its rounds (a test's crash at a chosen point). While the rounds run, the ServerApp writes
``progress.json`` (round, replies, messages sent) for ``run.py``'s progress bars; the round
records are the coordinator's ``coordinator/rounds.jsonl``; ``flower-run.json`` says how the run
ended (``finished``, or ``failed`` with the error).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
import traceback
from pathlib import Path

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from omnidraft.client.client_app import make_client_app
from omnidraft.client.device_profile import cached_profile
from omnidraft.client.engine_pool import shared_pool
from omnidraft.client.fleet_device import FleetDevice
from omnidraft.coordinator.round_log import ROUNDS_FILE
from omnidraft.coordinator.server_app import Coordinator
from omnidraft.shared.util.atomic_io import write_bytes_atomic

SCENARIO_FILE = "scenario.json"
PROGRESS_FILE = "progress.json"
OUTCOME_FILE = "flower-run.json"
SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"


def run_dir(context: Context) -> Path:
    """The run's directory: ``run-dir`` from the run config, else ``$OMNIDRAFT_HOME/runs/flwr-<run id>``."""
    given = str(context.run_config.get("run-dir", "") or "")
    if given:
        return Path(given).expanduser()
    from omnidraft.shared.engine.catalog import omnidraft_home

    return omnidraft_home() / "runs" / f"flwr-{context.run_id}"


def scenario_path(name: str) -> Path:
    """``name`` as a scenario file: a path, or a file in ``simulations/scenarios`` (``default``)."""
    path = Path(name).expanduser()
    if path.suffix != ".toml":
        path = SCENARIOS_DIR / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SCENARIOS_DIR.glob("*.toml")))
        raise ValueError(f"run config: scenario {name!r} is neither a file nor one of {known}")
    return path


@functools.lru_cache(maxsize=8)
def _saved_scenario(path: str, stamp: int) -> dict:
    return json.loads(Path(path).read_text())


def saved_scenario(directory: Path) -> dict:
    """The run's ``scenario.json`` (as ``Scenario.to_dict`` wrote it), read once per change."""
    path = directory / SCENARIO_FILE
    return _saved_scenario(str(path), path.stat().st_mtime_ns)


# -- the ServerApp ---------------------------------------------------------------------------------

server_app = ServerApp()


@server_app.main()
def serve(grid: Grid, context: Context) -> None:
    """Run the scenario's rounds over the fleet prepared in the run directory."""
    from omnidraft.simulations.fleet_setup import prepare
    from omnidraft.simulations.scenario import Scenario, fleet_config, operator_actions

    out = run_dir(context)
    out.mkdir(parents=True, exist_ok=True)
    standalone = not (out / SCENARIO_FILE).exists()
    t0 = time.perf_counter()
    try:
        if standalone:  # a bare `flwr run .`: size the scenario to the SuperNodes Flower started
            scenario = Scenario.from_toml(scenario_path(str(context.run_config.get("scenario", "default"))))
            nodes = len(list(grid.get_node_ids()))
            scenario.devices = nodes - scenario.probes * len(scenario.target_shares())
            if scenario.devices < 1:
                raise ValueError(
                    f"{nodes} SuperNodes leave no training device beside "
                    f"{scenario.probes} probes per target: raise num-supernodes"
                )
            scenario.late_joiners = min(scenario.late_joiners, scenario.devices - 1)
            prepare(scenario, out)
            write_bytes_atomic(out / SCENARIO_FILE, json.dumps(scenario.to_dict(), default=str).encode())
        else:
            scenario = Scenario.from_dict(saved_scenario(out), source=str(out / SCENARIO_FILE))
        nodes = sum(1 for _ in (out / "devices").iterdir())
        coordinator = Coordinator(
            out / "coordinator",
            fleet_config(scenario, nodes),
            progress=_progress_file(out),
            before_round=operator_actions(scenario),
        )
        for hook in _mods(str(context.run_config.get("coordinator-hooks", "") or "")):
            hook(coordinator)  # e.g. fault injection in tests: a crash at a chosen point of a round
        coordinator.run(grid, context)
        if standalone:  # the report run.py would write (its records are the coordinator's)
            from omnidraft.simulations import report

            write_bytes_atomic(out / "metrics.jsonl", (out / "coordinator" / ROUNDS_FILE).read_bytes())
            report.finish(out, scenario.to_dict(), time.perf_counter() - t0)
        write_bytes_atomic(out / OUTCOME_FILE, json.dumps({"status": "finished"}).encode())
    except BaseException as exc:
        write_bytes_atomic(
            out / OUTCOME_FILE,
            json.dumps(
                {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            ).encode(),
        )
        raise


def _progress_file(out: Path):
    """``progress(round, replies, sent)`` writing ``progress.json`` (at most every 0.2 s, and
    whenever a round's last reply arrives)."""
    last = [0.0]

    def progress(rnd: int, done: int, sent: int) -> None:
        now = time.monotonic()
        if done >= sent or now - last[0] >= 0.2:
            last[0] = now
            write_bytes_atomic(out / PROGRESS_FILE, json.dumps([rnd, done, sent]).encode())

    return progress


# -- the ClientApp ---------------------------------------------------------------------------------


def device_for(context: Context) -> FleetDevice:
    """The device of this partition, in the run directory."""
    out = run_dir(context)
    scenario = saved_scenario(out)
    # workers of a Ray cluster started elsewhere did not inherit the simulation's environment
    os.environ.setdefault("OMNIDRAFT_THREADS", str(max(1, int(scenario["cpus_per_device"]))))
    weights = "fp32" if scenario["models"] == "tiny" else "int8"
    profile = cached_profile(out / "devices" / f"device-{int(context.node_config['partition-id']):04d}")
    return FleetDevice(profile, shared_pool(scenario["dtype"], weights))


@functools.lru_cache(maxsize=16)
def _mods(paths: str) -> tuple:
    mods = []
    for path in filter(None, (p.strip() for p in paths.split(","))):
        module, _, name = path.partition(":")
        try:
            mods.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"run config: {path!r} is not importable: {exc}") from None
    return tuple(mods)


def run_config_mods(msg: Message, context: Context, call_next) -> Message:
    """The mods named by the run config's ``client-mods``, outermost first, around the device."""
    chain = call_next
    for mod in reversed(_mods(str(context.run_config.get("client-mods", "") or ""))):
        chain = functools.partial(mod, call_next=chain)
    return chain(msg, context)


client_app = make_client_app(device_for, mods=[run_config_mods])


def run_config(directory: Path, client_mods: tuple = (), coordinator_hooks: tuple = ()) -> dict[str, str]:
    """The run config that points ``flwr run`` at a prepared ``directory`` (``client_mods``:
    mod functions, importable by name in the workers; ``coordinator_hooks``: functions called
    with the ``Coordinator`` before it runs, importable in the ServerApp's process)."""

    def names(funcs: tuple) -> str:
        return ",".join(f"{f.__module__}:{f.__qualname__}" for f in funcs)

    return {
        "run-dir": str(Path(directory).resolve()),
        "client-mods": names(client_mods),
        "coordinator-hooks": names(coordinator_hooks),
    }


class RunFollower:
    """Calls ``on_round`` for each record the coordinator appends to ``coordinator/rounds.jsonl``
    and ``progress`` for each change of the ServerApp's ``progress.json``."""

    def __init__(self, out: Path, on_round, progress) -> None:
        self.rounds = out / "coordinator" / ROUNDS_FILE
        self.progress_path = out / PROGRESS_FILE
        self.on_round, self.progress = on_round, progress
        self.seen = self._lines()
        self.last = None

    def _lines(self) -> int:
        return len(self.rounds.read_text().splitlines()) if self.rounds.exists() else 0

    def __call__(self) -> None:
        if self.progress is not None and self.progress_path.exists():
            state = self.progress_path.read_text()
            if state != self.last:
                self.last = state
                self.progress(*json.loads(state))
        if self.on_round is not None and self.rounds.exists():
            lines = self.rounds.read_text().splitlines()
            for line in lines[self.seen :]:
                self.on_round(json.loads(line))
            self.seen = len(lines)
