"""The device as a Flower ``ClientApp`` (Message API).

Messages and their records (``omnidraft.v1`` payloads ride as bytes in ConfigRecords):

Every message carries the round (``"fleet"`` or ``"query"`` ConfigRecord, key ``round``): a
device's target and traffic may change with the round (``DeviceProfile.at_round``).

* ``query.status`` → reply ``"status"`` ConfigRecord: target, the targets it can switch to
  (``can-serve``), held global version and checksums, tokenizer digest. No local text.
* ``query.switch`` ← ``"query"`` ConfigRecord with ``target``: serve that target from now on (a
  staged rollout chose this device) → reply the new status.
* ``train`` ← ``"fleet"`` ConfigRecord: ``round``, ``spec`` (TargetSpec), ``manifest``
  (StateManifest), ``manifest-sig`` (Ed25519 over the manifest bytes), and ``adapter`` /
  ``cache`` bytes only when the device does not hold them.
  → reply ``"adapter"`` ArrayRecord (the trained adapter), ``"metrics"`` MetricRecord (with
  ``trained-tokens``, the aggregation weight) and ``"fleet"`` ConfigRecord (``target``,
  ``state-version``, ``ngram-stats`` = NgramStats bytes).
* ``evaluate`` ← the same ``"fleet"`` record plus ``use-global`` → reply ``"metrics"``.

``make_client_app(device_for)`` takes a function from the node's ``Context`` to its
``FleetDevice``; simulations map ``partition-id`` to a device, a deployed device builds it from
its node config. Exceptions become Flower error replies, which the coordinator counts as
failures without stopping the round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from omnidraft.client.fleet_device import FleetDevice
from omnidraft.shared.fleet_wire import encode_stats
from omnidraft.proto import fleet_pb2


def receive_state(device: FleetDevice, fleet: ConfigRecord) -> fleet_pb2.StateManifest:
    """Check and store the global state carried by a train/evaluate message (``FleetDevice.receive``);
    returns its manifest."""
    spec = fleet_pb2.TargetSpec()
    spec.ParseFromString(fleet["spec"])
    return device.receive(spec, fleet["manifest"], fleet.get("adapter"), fleet.get("cache"),
                          fleet.get("manifest-sig", b""))


def make_client_app(device_for: Callable[[Context], FleetDevice], mods: Sequence = ()) -> ClientApp:
    """A ClientApp whose handlers act on ``device_for(context)`` (see the module docstring)."""
    app = ClientApp(mods=list(mods))

    def device_at(msg: Message, context: Context) -> FleetDevice:
        config = msg.content.config_records.get("fleet") or msg.content.config_records.get("query")
        rnd = int(config.get("round", 1)) if config is not None else 1
        return device_for(context).at_round(rnd)

    @app.query("status")
    def status(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"status": ConfigRecord(device_at(msg, context).status())}), reply_to=msg)

    @app.query("switch")
    def switch(msg: Message, context: Context) -> Message:
        device = device_at(msg, context).switch(str(msg.content["query"]["target"]))
        return Message(RecordDict({"status": ConfigRecord(device.status())}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        device = device_at(msg, context)
        fleet = msg.content["fleet"]
        manifest = receive_state(device, fleet)
        tensors, learned, metrics = device.train_round(int(fleet["round"]))
        stats = encode_stats(device.profile.target, learned, device.engine.bridge.target_vocab_size,
                             manifest.version)
        adapter = ArrayRecord({k: v.float() for k, v in tensors.items()})
        metrics["uplink-bytes"] = adapter.count_bytes() + len(stats)
        device.record_uplink(int(metrics["uplink-bytes"]))
        return Message(RecordDict({
            "adapter": adapter,
            "metrics": MetricRecord(metrics),
            "fleet": ConfigRecord({"target": device.profile.target, "state-version": int(manifest.version),
                                   "ngram-stats": stats}),
        }), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        device = device_at(msg, context)
        fleet = msg.content["fleet"]
        use_global = bool(fleet.get("use-global", True))
        if use_global:
            receive_state(device, fleet)
        metrics = device.evaluate(use_global=use_global, measure_ar=bool(fleet.get("measure-ar", False)))
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app
