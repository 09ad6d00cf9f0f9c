"""A whole deployment on this machine, with the project's commands and Flower's executables.

    python deploy/loopback.py --out runs/loopback [--rounds 2] [--drafter NAME --target NAME]

What it runs (the steps of README's "Edge boards" section, on loopback):

1. ``omnidraft fleet register-target`` and ``omnidraft fleet init`` (CA, SuperLink certificate)
   in ``<out>/coordinator``; each device makes its own key pair (``omnidraft device keygen``);
2. ``omnidraft fleet superlink`` (TLS + SuperNode authentication, the SuperLink on a loopback
   control port behind the gateway the devices use), ``omnidraft fleet register-node
   --public-key`` of two devices' public keys (the coordinator never holds a device's private key);
3. per device: ``omnidraft device serve`` on its state directory and a few ``omnidraft device
   ask`` requests with the owner's token (the prompts it will train on), then ``omnidraft device
   join --service`` (the rounds run in the serving process, on its models; with
   ``--models-per-message`` each Flower message loads the models in its own process instead);
4. a third device whose key was never registered tries to join and must be refused; a stranger
   holding ``ca.crt`` tries Flower's Control API at the devices' address (``flwr supernode
   register`` of its own key, ``flwr run`` of an app bundle) and must be refused both;
5. ``omnidraft fleet run --rounds R``; then each device answers one more request, with the
   state the rounds left in its state directory.

Writes ``<out>/summary.json``: wall times, the registry's version before and after, the
rounds' records (bytes per device, acceptance, seconds), whether the unregistered device and the
stranger were refused, what each device holds, and each device's peak resident memory during the
rounds (its service and SuperNode process trees together, and each alone, sampled every 0.2 s; MB). Every process is stopped at the end. Default models: the tiny
test models (built on first use); ``--drafter/--target`` take catalog names.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from omnidraft.shared.util.processes import PeakMemory

PROMPTS = [
    "def add(a, b):\n",
    "def scale(x, k):\n    return",
    "for item in items:\n",
    "def fetch(url, timeout):\n",
    "class Reader:\n    def __init__(self, path):\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with status {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f} s")


class Processes:
    """Background processes with their logs under ``logs``; all stopped by ``stop``."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs = logs
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def omnidraft(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omnidraft", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def checked(result: subprocess.CompletedProcess) -> str:
    if result.returncode:
        raise RuntimeError(f"{' '.join(result.args[2:5])}... failed: {result.stderr.strip().splitlines()[-1:]}")
    return result.stdout


def stranger_tries_the_control_api(out: Path, coord: Path, port: int, key: Path) -> dict:
    """Someone who holds ``ca.crt`` (every device does) points Flower's CLI at the devices'
    address and tries to register their own SuperNode key and to start a run of an app bundle:
    ``{"register": {"exit", "error"}, "run": {...}}`` (both must fail)."""
    home = out / "stranger-flwr"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "s"\n\n[superlink.s]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{(coord / "pki" / "ca.crt").resolve()}"\n'
    )
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    flwr = str(Path(sys.executable).with_name("flwr"))
    app = Path(__file__).resolve().parent.parent / "coordinator" / "flower_app"
    tries = {"register": [flwr, "supernode", "register", f"{key}.pub", "s"], "run": [flwr, "run", str(app), "s"]}
    results = {}
    for name, cmd in tries.items():
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        text = " ".join(
            line.strip(" │╭╮╰╯─") for line in (done.stdout + done.stderr).splitlines()
        )  # Flower's boxed error
        results[name] = {"exit": done.returncode, "error": " ".join(text.split())[-200:]}
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="catalog name (default: the tiny test drafter)")
    ap.add_argument("--target", default=None, help="catalog name (default: a tiny test target)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--models-per-message",
        action="store_true",
        help="join without --service: every Flower message loads the models in its own process",
    )
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    if args.drafter and args.target:
        drafter, target, weights = args.drafter, args.target, "int8"
    else:
        from omnidraft.benchmarks.tiny_models import ensure_tiny_fleet

        models = ensure_tiny_fleet(os.environ.get("OMNIDRAFT_TINY_DIR", out / "models"))
        drafter, target, weights = str(models["tiny-drafter"]), str(models["tiny-target-a"]), "fp32"
    coord = out / "coordinator"
    port = free_port()
    env = {**os.environ, "OMNIDRAFT_FLEET_DIR": str(coord), "PYTHONWARNINGS": "ignore"}
    summary: dict = {"superlink": f"127.0.0.1:{port}", "drafter": drafter, "target": target}
    t0 = time.perf_counter()
    procs = Processes(logs, env)
    try:
        checked(
            omnidraft(
                "fleet", "register-target", "t", "--model", target, "--drafter", drafter, "--lora-rank", "8", env=env
            )
        )
        control_port = free_port()
        checked(
            omnidraft("fleet", "init", "--superlink", f"127.0.0.1:{port}", "--control-port", str(control_port), env=env)
        )
        keys = {}  # each device makes its own key pair; the coordinator gets the public halves only
        for name in ("device0", "device1", "stranger"):
            keys[name] = out / name / "node.key"
            checked(omnidraft("device", "keygen", "--key", str(keys[name]), "--name", name, env=env))
        fleet_key = checked(omnidraft("fleet", "public-key", env=env)).strip()
        summary["version-before"] = json.loads(checked(omnidraft("fleet", "status", "--json", env=env)))["targets"][0][
            "version"
        ]

        superlink = procs.start("superlink", [sys.executable, "-m", "omnidraft", "fleet", "superlink"])
        wait_port(control_port, 60, superlink)
        wait_port(port, 60, superlink)
        for i in (0, 1):
            checked(
                omnidraft("fleet", "register-node", f"node{i}", "--public-key", f"{keys[f'device{i}']}.pub", env=env)
            )
        summary["infrastructure-s"] = round(time.perf_counter() - t0, 1)

        pair = [
            "--drafter",
            drafter,
            "--target",
            target,
            "--dtype",
            args.dtype,
            "--drafter-weights",
            weights,
            "--max-new-tokens",
            str(args.max_new_tokens),
        ]
        services = {}
        for i in (0, 1):
            state = str(out / f"device{i}")
            grpc_port = free_port()
            serve = procs.start(
                f"serve{i}",
                [
                    sys.executable,
                    "-m",
                    "omnidraft",
                    "device",
                    "serve",
                    *pair,
                    "--state-dir",
                    state,
                    "--listen",
                    f"127.0.0.1:{grpc_port}",
                ],
            )
            services[i] = (grpc_port, serve)
        for i, (grpc_port, serve) in services.items():
            wait_port(grpc_port, 300, serve)
            for prompt in PROMPTS[i : i + 4]:
                checked(
                    omnidraft(
                        "device",
                        "ask",
                        prompt,
                        "--server",
                        f"127.0.0.1:{grpc_port}",
                        "--json",
                        "--owner-token",
                        str(out / f"device{i}" / "owner.token"),
                        env=env,
                    )
                )
        joins = {}
        for i, (grpc_port, _) in services.items():
            own = [] if args.models_per_message else ["--service", f"127.0.0.1:{grpc_port}"]
            joins[i] = procs.start(
                f"join{i}",
                [
                    sys.executable,
                    "-m",
                    "omnidraft",
                    "device",
                    "join",
                    *pair,
                    *own,
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--cert",
                    str(coord / "pki" / "ca.crt"),
                    "--key",
                    str(keys[f"device{i}"]),
                    "--fleet-key",
                    fleet_key,
                    "--target-name",
                    "t",
                    "--state-dir",
                    str(out / f"device{i}"),
                    "--prompts-per-round",
                    "2",
                    "--runtime-port",
                    str(free_port()),
                ],
            )
        summary["models-per-message"] = args.models_per_message
        stranger = omnidraft(
            "device",
            "join",
            *pair,
            "--superlink",
            f"127.0.0.1:{port}",
            "--cert",
            str(coord / "pki" / "ca.crt"),
            "--key",
            str(keys["stranger"]),
            "--fleet-key",
            fleet_key,
            "--target-name",
            "t",
            "--state-dir",
            str(out / "device2"),
            "--runtime-port",
            str(free_port()),
            "--max-retries",
            "1",
            env=env,
            timeout=120,
        )
        summary["unregistered"] = {
            "exit": stranger.returncode,
            "error": (stranger.stderr.strip().splitlines() or [""])[-1],
        }
        summary["stranger"] = stranger_tries_the_control_api(out, coord, port, keys["stranger"])
        summary["coordinator-holds-private-keys"] = any(p.suffix != ".pub" for p in (coord / "pki" / "nodes").iterdir())

        t1 = time.perf_counter()
        memory = PeakMemory(
            {
                f"device{i}{part}": pids
                for i, (_, serve) in services.items()
                for part, pids in (
                    ("", [serve.pid, joins[i].pid]),
                    ("-service", [serve.pid]),
                    ("-supernode", [joins[i].pid]),
                )
            },
            interval_s=0.2,
            field="rss",
        )
        try:
            run = omnidraft(
                "fleet",
                "run",
                "--rounds",
                str(args.rounds),
                "--min-devices",
                "2",
                "--k",
                "1",
                "--wait-s",
                "120",
                env=env,
                timeout=1500,
            )
        finally:
            summary["peak-rss-mb"] = memory.stop()
        (logs / "fleet-run.log").write_text(run.stdout + run.stderr)
        checked(run)
        summary["rounds-s"] = round(time.perf_counter() - t1, 1)
        summary["version-after"] = json.loads(checked(omnidraft("fleet", "status", "--json", env=env)))["targets"][0][
            "version"
        ]
        summary["rounds"] = [json.loads(line) for line in (coord / "rounds.jsonl").read_text().splitlines()]
        if summary["version-after"] != summary["version-before"] + args.rounds:
            raise RuntimeError(
                f"{args.rounds} rounds asked, the registry went from version "
                f"{summary['version-before']} to {summary['version-after']} (see {logs})"
            )
        after = {}
        for i, (grpc_port, _) in services.items():  # the services answer with the rounds' state
            reply = json.loads(
                checked(omnidraft("device", "ask", PROMPTS[4], "--server", f"127.0.0.1:{grpc_port}", "--json", env=env))
            )
            fleet = json.loads((out / f"device{i}" / "fleet.json").read_text())
            after[f"device{i}"] = {
                "round": fleet.get("round"),
                "next-prompt": fleet.get("next-prompt"),
                "new_tokens": reply["stats"].get("new_tokens", 0),
            }
        summary["devices"] = after
    finally:
        procs.stop()
    for i in (0, 1):
        log = (logs / f"serve{i}.log").read_text()
        summary["devices"][f"device{i}"].update(
            {
                "reloaded-round-state": "updated on disk" in log,  # a round run in another process saved it
                "rounds-served": log.count("fleet train (round"),
                "evaluations-served": log.count("fleet evaluate (round"),
            }
        )
    summary["wall-s"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
