"""``omnidraft device join``: this device as a Flower SuperNode of a real fleet.

Writes the device's ``profile.json`` into its state directory (the directory ``omnidraft device
serve`` uses: one adapter, head, cache and request log, shared under file locks), then runs
Flower's own ``flower-supernode`` with TLS (trusting the fleet's CA) and SuperNode
authentication (the device's private key; the coordinator registers the public one). The
SuperNode runs ``omnidraft.client.supernode_app`` for each message. ``FLWR_HOME`` is
``<state_dir>/flwr``, so several devices can share one host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from omnidraft.client.device_profile import PROFILE_FILE, DeviceProfile
from omnidraft.shared.util.processes import toml_pairs

REFUSED_LOG = "Exit Code: 305"  # what flower-supernode logs when the SuperLink does not accept its key


@dataclass
class JoinSettings:
    """How the SuperNode reaches the SuperLink and which device it runs."""

    superlink: str  # host:port
    state_dir: Path
    root_certificates: Path | None  # the fleet's CA certificate; None: no TLS (--insecure)
    private_key: Path | None  # the node's EC private key (OpenSSH); None: no node authentication
    runtime_port: int = 9094  # the SuperNode's local Runtime API (one per SuperNode on a host)
    dtype: str = "auto"
    drafter_weights: str = "int8"
    max_retries: int | None = None
    service: str = ""  # the device's generation service (host:port on loopback): it runs the rounds
    service_token: str = ""  # its owner token file

    def node_config(self) -> str:
        config = {
            "state-dir": str(self.state_dir.resolve()),
            "dtype": self.dtype,
            "drafter-weights": self.drafter_weights,
        }
        if self.service:
            config.update({"service": self.service, "service-token": self.service_token})
        return toml_pairs(config)

    def command(self) -> list[str]:
        cmd = [
            "flower-supernode",
            "--superlink",
            self.superlink,
            "--node-config",
            self.node_config(),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.runtime_port),
        ]
        if self.root_certificates is None:
            cmd.append("--insecure")
        else:
            cmd += ["--root-certificates", str(self.root_certificates)]
        if self.private_key is not None:
            cmd += ["--auth-supernode-private-key", str(self.private_key)]
        if self.max_retries is not None:
            cmd += ["--max-retries", str(self.max_retries)]
        return cmd

    def env(self) -> dict[str, str]:
        return {**os.environ, "FLWR_HOME": str((self.state_dir / "flwr").resolve())}


def write_profile(profile: DeviceProfile) -> Path:
    """Save the device's profile, keeping what an earlier join recorded that this one does not
    set (its round counters live in ``fleet.json`` and are untouched)."""
    path = Path(profile.state_dir) / PROFILE_FILE
    if path.exists():
        try:
            old = DeviceProfile.load(profile.state_dir)
            profile = replace(profile, fleet_key=profile.fleet_key or old.fleet_key)
        except (OSError, ValueError, TypeError, KeyError):
            pass  # an unreadable profile is replaced
    return profile.save()
