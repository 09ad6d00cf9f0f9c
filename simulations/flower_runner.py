"""Running a Flower App on Flower's simulation runtime, the way Flower supports it now: a
SuperLink in simulation mode and ``flwr run`` against it (``run_simulation`` is deprecated).

``run_app`` starts a private SuperLink for the run (a free loopback port, its own ``FLWR_HOME``,
no runtime dependency installation: the app runs in this environment), submits the app with
``flwr run --stream``, calls ``watch()`` while it runs, and stops the SuperLink and everything it
started (the simulation process, Ray) when the run ends, fails or is interrupted. Every one of
them stays in this process's group (the SuperLink runs with ``--isolation process`` and the
SuperExec that launches the simulation is started here, not in a session of its own), so
killing the group stops the whole fleet; on Linux they are also told to stop when this process
dies (``PR_SET_PDEATHSIG``). Flower's output
goes to ``<flwr_home>/flower.log``. ``flwr run`` is given a copy of the files the app's bundle
holds (``<flwr_home>/app``), not the app's own directory: it reads every file under the directory
it is given before it keeps the bundle's few, and the repository, the simulation's app, holds
the virtual environment (52,000 files and about 10 s a run).

Environment given to the SuperLink, and so to the simulation and its Ray workers: Ray binds to
127.0.0.1 only and its accelerator warning is silenced, each worker runs torch with as many
threads as the CPUs a device is given. With ``ray_address`` the simulation joins a Ray cluster
started elsewhere (``RAY_ADDRESS``); that cluster's workers take their environment from where
``ray start`` ran, so start it with the same ``OMNIDRAFT_HOME``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from omnidraft.shared.util.processes import toml_pairs

CONNECTION = "simulation"
START_TIMEOUT_S = 60.0


class FlowerRunError(RuntimeError):
    """The Flower run did not complete (one line; the log has the details)."""


def run_app(
    app_dir: str | Path,
    run_config: dict[str, object],
    supernodes: int,
    flwr_home: str | Path,
    *,
    cpus_per_device: int = 1,
    total_cpus: int | None = None,
    ray_address: str | None = None,
    verbose: bool = False,
    watch: Callable[[], None] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Run the Flower App in ``app_dir`` with ``supernodes`` simulated SuperNodes until it ends.

    ``run_config``: overrides of the app's ``[tool.flwr.app.config]``; ``total_cpus``: CPUs Ray
    may use (default: all available); ``watch``: called every ``poll_s`` seconds while the run
    is going (and once at its end). Raises ``FlowerRunError`` when Flower reports a failure."""
    home = Path(flwr_home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    app = _bundle_files(Path(app_dir), home / "app")
    env = _environment(home, cpus_per_device, verbose)
    if ray_address:
        _check_reachable(ray_address)
        env["RAY_ADDRESS"] = ray_address
    (http_port,) = _free_ports(1)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "127.0.0.1:{http_port}"\ninsecure = true\n'
    )
    log_path = home / "flower.log"
    federation = {
        "num-supernodes": supernodes,
        "client-resources-num-cpus": cpus_per_device,
        "init-args-logging-level": "info" if verbose else "error",
    }
    if not ray_address:
        federation["init-args-num-cpus"] = total_cpus or len(os.sched_getaffinity(0))
    with open(log_path, "ab") as log:

        def start(*cmd: str) -> subprocess.Popen:
            return subprocess.Popen(
                [_executable(cmd[0], env), *cmd[1:]],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_stop_with_parent,
            )

        # the SuperLink's own SuperExec would run in a session of its own: start it here instead
        superlink = start(
            "flower-superlink",
            "--insecure",
            "--simulation",
            "--isolation",
            "process",
            "--host",
            "127.0.0.1",
            "--port",
            str(http_port),
            "--disable-runtime-dependency-installation",
        )
        superexec = None
        try:
            _wait_until_up(superlink, http_port, log_path)
            superexec = start(
                "flower-superexec",
                "--insecure",
                "--runtime-api-address",
                f"127.0.0.1:{http_port}",
                "--parent-pid",
                str(os.getpid()),
            )
            run = subprocess.Popen(
                [
                    _executable("flwr", env),
                    "run",
                    str(app),
                    CONNECTION,
                    "--stream",
                    "--run-config",
                    toml_pairs(run_config),
                    "--federation-config",
                    toml_pairs(federation),
                ],
                env=env,
                stdout=None if verbose else log,
                stderr=subprocess.STDOUT,
            )
            try:
                while run.poll() is None:
                    if watch is not None:
                        watch()
                    time.sleep(poll_s)
            finally:
                _stop(run)
            if watch is not None:
                watch()
            if run.returncode != 0:
                raise FlowerRunError(f"flwr run exited with code {run.returncode} (see {log_path})")
        finally:
            for proc in (superexec, superlink):
                if proc is not None:
                    _stop(proc)


def _bundle_files(app_dir: Path, dest: Path) -> Path:
    """Copy what the app bundle of ``app_dir`` holds into ``dest``, emptied first; return ``dest``:
    its ``pyproject.toml`` and the files its ``[tool.flwr.app] fab-include`` names. Only plain
    file names are taken (ValueError otherwise): Flower reads patterns the way ``.gitignore``
    does, and a pattern matched here would have to walk the whole directory again."""
    config = tomllib.loads((app_dir / "pyproject.toml").read_text(encoding="utf-8"))
    names = config.get("tool", {}).get("flwr", {}).get("app", {}).get("fab-include")
    if names is None:
        raise ValueError(f"{app_dir / 'pyproject.toml'}: [tool.flwr.app] fab-include must name the bundle's files")
    for name in names:
        if any(c in name for c in "*?[]!\\") or name.startswith("/") or not (app_dir / name).is_file():
            raise ValueError(f"fab-include {name!r} in {app_dir / 'pyproject.toml'}: not a file of the app")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ["pyproject.toml", *names]:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(app_dir / name, dest / name)
    return dest


def _environment(home: Path, cpus_per_device: int, verbose: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {"FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    )
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    env.setdefault("OMNIDRAFT_THREADS", str(cpus_per_device))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not verbose:  # no weight-loading bars or library deprecation notes in the workers' logs
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    # Flower's executables and the ones they start are found beside this interpreter first
    env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH")]))
    return env


def _stop_with_parent() -> None:
    """In the child before it runs: SIGTERM when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _executable(name: str, env: dict[str, str]) -> str:
    found = shutil.which(name, path=env["PATH"])
    if found is None:
        raise FlowerRunError(f"{name} is not installed (it comes with flwr: pip install 'omnidraft-fleet[sim]')")
    return found


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _wait_until_up(superlink: subprocess.Popen, port: int, log_path: Path) -> None:
    """Until the SuperLink answers on ``port`` (``START_TIMEOUT_S`` at most)."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if superlink.poll() is not None:
            raise FlowerRunError(f"flower-superlink exited with code {superlink.returncode} (see {log_path})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise FlowerRunError(f"flower-superlink did not start within {START_TIMEOUT_S:.0f} s (see {log_path})")


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop ``proc`` and every process it started (SIGTERM, then SIGKILL after ``grace_s``)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ValueError unless ``address`` (``HOST:PORT`` of a Ray head's GCS) accepts a TCP
    connection within ``timeout_s`` seconds; Ray itself retries an unreachable head for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r}: expected HOST:PORT of a Ray head (ray start --head)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None
