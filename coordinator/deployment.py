"""The coordinator side of a real deployment, run by Flower's own executables.

``omnidraft fleet init`` prepares a coordinator directory for a SuperLink at ``address``:

    <root>/pki/               CA, SuperLink certificate, one key pair per device (``fleet_pki``)
    <root>/flwr/config.toml   Flower's CLI connection ``fleet`` (TLS, trusting the fleet's CA)
    <root>/deployment.json    the devices' address and the operator's loopback control address

The other commands build the command lines of Flower's executables from it:
``fleet superlink`` (``flower-superlink`` with TLS and ``--enable-supernode-auth`` on loopback
only, behind ``fleet_gateway`` on the devices' address, which serves the Fleet API and nothing
else: a stranger holding ``ca.crt`` can neither register a SuperNode key nor push an app bundle),
``fleet register-node`` (``flwr supernode register``) and ``fleet run`` (``flwr run`` of the
app in ``flower_app/`` with the run config), both through the loopback address. ``FLWR_HOME``
points at ``<root>/flwr`` so the operator's own Flower configuration is left alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omnidraft.coordinator.fleet_pki import FleetPki, PkiError
from omnidraft.coordinator.fleet_pki import init as init_pki
from omnidraft.shared.util.atomic_io import write_bytes_atomic
from omnidraft.shared.util.processes import toml_pairs

CONNECTION = "fleet"
APP_DIR = Path(__file__).resolve().parent / "flower_app"


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port); PkiError for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PkiError(f"address {address!r}: give host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Deployment:
    """A coordinator directory prepared by ``init`` (see the module docstring)."""

    root: Path

    @property
    def pki(self) -> FleetPki:
        return FleetPki(self.root / "pki")

    @property
    def flwr_home(self) -> Path:
        return self.root / "flwr"

    def _field(self, key: str) -> str:
        try:
            return json.loads((self.root / "deployment.json").read_text())[key]
        except (OSError, ValueError, KeyError):
            raise PkiError(f"{self.root} is not prepared for a deployment: run omnidraft fleet init first") from None

    @property
    def address(self) -> str:
        """``host:port`` the devices connect to (the gateway)."""
        return self._field("superlink")

    @property
    def control_address(self) -> str:
        """``127.0.0.1:port`` of the SuperLink itself (the operator's CLI and the ServerApp)."""
        return self._field("control")

    def env(self) -> dict[str, str]:
        """The environment for Flower's CLI: this directory's connection, no runtime installs."""
        return {**os.environ, "FLWR_HOME": str(self.flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}

    def superlink_command(self, database: str | None = None) -> list[str]:
        """``flower-superlink`` with TLS and SuperNode authentication on the loopback control
        address (the devices reach it through the gateway). ``database``: a SQLite file that keeps
        registered nodes across restarts; default Flower's in-memory state (a file database
        locked up under multi-MB messages on a loaded 2-core machine, ending the ServerApp;
        measured)."""
        host, port = split_address(self.control_address)
        pki = self.pki
        cmd = [
            "flower-superlink",
            "--host",
            host,
            "--port",
            str(port),
            "--ssl-ca-certfile",
            str(pki.ca_cert),
            "--ssl-certfile",
            str(pki.server_cert),
            "--ssl-keyfile",
            str(pki.server_key),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
        ]
        return cmd + (["--database", database] if database else [])

    def register_node_command(self, name: str) -> list[str]:
        """``flwr supernode register`` of device ``name``'s public key."""
        key = self.pki.node_public_key(name)
        if not key.exists():
            raise PkiError(
                f"no key for node {name!r} in {self.pki.root}: give the device's own with --public-key "
                f"(omnidraft device keygen on the device)"
            )
        return ["flwr", "supernode", "register", str(key), CONNECTION, "--name", name]

    def run_command(self, run_config: dict[str, object]) -> list[str]:
        """``flwr run`` of the fleet app with ``run_config`` (keys of ``superlink_app``)."""
        config = {"fleet-dir": str(self.root.resolve()), **run_config}
        return ["flwr", "run", str(APP_DIR), CONNECTION, "--stream", "--run-config", toml_pairs(config)]


def init(
    root: str | os.PathLike[str],
    address: str,
    nodes: list[str],
    hosts: list[str] | None = None,
    control_port: int | None = None,
) -> tuple[Deployment, list[str]]:
    """Prepare ``root`` for devices connecting to ``address`` (see the module docstring), the
    SuperLink itself on ``127.0.0.1:control_port`` (default: the address's port + 1); the
    certificate is valid for ``hosts`` (default: the address's host, 127.0.0.1, localhost).
    Returns the deployment and the files created."""
    host, port = split_address(address)
    control_port = control_port or port + 1
    if not 0 < control_port < 65536 or control_port == port:
        raise PkiError(f"control port {control_port}: give --control-port, a port other than the devices' {port}")
    control = f"127.0.0.1:{control_port}"
    dep = Deployment(Path(root))
    _, created = init_pki(dep.pki.root, nodes, list(dict.fromkeys([host, *(hosts or []), "127.0.0.1", "localhost"])))
    write_bytes_atomic(dep.root / "deployment.json", json.dumps({"superlink": address, "control": control}).encode())
    config = (
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{control}"\nroot-certificates = "{dep.pki.ca_cert.resolve()}"\n'
    )
    write_bytes_atomic(dep.flwr_home / "config.toml", config.encode())
    return dep, [f"pki/{name}" for name in created]
