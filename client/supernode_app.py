"""The device's ``ClientApp`` on a real SuperNode (``omnidraft device join`` starts one).

The same handlers as in the simulation (``client_app.make_client_app``); the device is the one
described by ``<state-dir>/profile.json``, where ``state-dir`` comes from the SuperNode's node
config (``--node-config 'state-dir="/var/lib/omnidraft"'``), with the models loaded at the
precision named there (``dtype``, ``drafter-weights``). Flower starts a fresh process for every
message, so everything that must last is on disk. With ``service`` in the node config (``device
join --service HOST:PORT``) the models stay in the device's running ``omnidraft device serve``,
which does the work (``client.served_device``); without it each message loads the models anew.
"""

from __future__ import annotations

from flwr.app import Context

from omnidraft.client.client_app import make_client_app
from omnidraft.client.device_profile import cached_profile
from omnidraft.client.engine_pool import shared_pool
from omnidraft.client.fleet_device import FleetDevice


def device_from_node_config(context: Context) -> FleetDevice:
    """The device a SuperNode's node config points at."""
    config = context.node_config
    if "state-dir" not in config:
        raise ValueError("node config: set state-dir to the device's state directory (omnidraft device join)")
    if config.get("service"):
        from omnidraft.client.served_device import served_device

        return served_device(str(config["state-dir"]), str(config["service"]), config.get("service-token") or None)
    profile = cached_profile(str(config["state-dir"]))
    return FleetDevice(
        profile, shared_pool(str(config.get("dtype", "fp32")), str(config.get("drafter-weights", "int8")))
    )


app = make_client_app(device_from_node_config)
