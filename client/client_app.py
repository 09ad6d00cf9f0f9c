"""The device as a Flower ``ClientApp`` (Message API).

Messages and their records (``omnidraft.v1`` payloads ride as bytes in ConfigRecords):

Every message carries the round (``"fleet"`` or ``"query"`` ConfigRecord, key ``round``): a
device's target and traffic may change with the round (``DeviceProfile.at_round``).

* ``query.status`` → reply ``"status"`` ConfigRecord: target, the targets it can switch to
  (``can-serve``), held global version and checksums, tokenizer digest. No local text.
* ``query.switch`` ← ``"query"`` ConfigRecord with ``target``: serve that target from now on (a
  staged rollout chose this device) → reply the new status.
* ``query.announce`` ← ``"query"`` ConfigRecord with ``announce`` (``train``, ``heldout``): a
  simulation's round names ahead what it will ask (``FleetDevice.announce``; the recordings are
  then decoded together) → reply ``"metrics"`` with ``announced``, how many the store lacked.
* ``train`` ← ``"fleet"`` ConfigRecord: ``round``, ``spec`` (TargetSpec), ``manifest``
  (StateManifest), ``manifest-sig`` (Ed25519 over the manifest bytes), and ``adapter`` /
  ``cache`` bytes only when the device does not hold them.
  → reply ``"update"`` ArrayRecord (trained adapter minus the global one, quantized to the
  ``update-bits`` the message asks for and packed into one array: ``shared.update_codec``; what
  the quantization drops is added to the next round's update, ``client.update_residual``), ``"metrics"`` MetricRecord (with
  ``trained-tokens``, the aggregation weight) and ``"fleet"`` ConfigRecord (``target``,
  ``state-version``, ``ngram-stats`` = NgramStats bytes).
* ``evaluate`` ← the same ``"fleet"`` record plus ``use-global`` → reply ``"metrics"``.

With SecAgg+ (``secagg`` in the ``"fleet"`` record) the ``train`` reply has no ``"update"``:
the device keeps its update (``client.secure_update``) and Flower's ``secaggplus_mod`` sends it
masked in the secure-aggregation messages that follow (``train`` messages carrying
``secaggplus_configs``; the mod runs only on those, and hands the ``fitins.*`` request of its
masked-vector stage to the ``train`` handler, which answers with the legacy ``fitres.*`` keys).

``make_client_app(device_for)`` takes a function from the node's ``Context`` to its
``FleetDevice``; simulations map ``partition-id`` to a device, a deployed device builds it from
its node config. Exceptions become Flower error replies, which the coordinator counts as
failures without stopping the round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flwr.compat.common.recorddict_compat as compat
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from omnidraft.client.fleet_device import FleetDevice
from omnidraft.client.secure_update import keep_update, take_update, update_delta
from omnidraft.client.update_residual import ErrorFeedback
from omnidraft.proto import fleet_pb2
from omnidraft.shared.update_codec import to_record
from omnidraft.shared.wire import FleetKey, MetricKey, Record, encode_stats


def receive_state(device: FleetDevice, fleet: ConfigRecord) -> fleet_pb2.StateManifest:
    """Check and store the global state carried by a train/evaluate message (``FleetDevice.receive``);
    returns its manifest."""
    spec = fleet_pb2.TargetSpec()
    spec.ParseFromString(fleet[FleetKey.SPEC])
    return device.receive(
        spec,
        fleet[FleetKey.MANIFEST],
        fleet.get(FleetKey.ADAPTER),
        fleet.get(FleetKey.CACHE),
        fleet.get(FleetKey.MANIFEST_SIG, b""),
    )


def secagg_when_asked(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` for the secure-aggregation messages only (it would refuse
    any other ``train`` message)."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def make_client_app(device_for: Callable[[Context], FleetDevice], mods: Sequence = ()) -> ClientApp:
    """A ClientApp whose handlers act on ``device_for(context)`` (see the module docstring)."""
    app = ClientApp(mods=[*mods, secagg_when_asked])  # innermost: outer mods see what leaves the device

    def device_at(msg: Message, context: Context) -> FleetDevice:
        config = msg.content.config_records.get(Record.FLEET) or msg.content.config_records.get(Record.QUERY)
        rnd = int(config.get(FleetKey.ROUND, 1)) if config is not None else 1
        return device_for(context).at_round(rnd)

    @app.query("status")
    def status(msg: Message, context: Context) -> Message:
        return Message(RecordDict({Record.STATUS: ConfigRecord(device_at(msg, context).status())}), reply_to=msg)

    @app.query("announce")
    def announce(msg: Message, context: Context) -> Message:
        """A simulation's round names ahead what it will ask of this device (``FleetDevice.announce``)."""
        asked = str(msg.content[Record.QUERY][FleetKey.ANNOUNCE]).split(",")
        lacking = device_at(msg, context).announce(train="train" in asked, heldout="heldout" in asked)
        return Message(RecordDict({Record.METRICS: MetricRecord({MetricKey.ANNOUNCED: lacking})}), reply_to=msg)

    @app.query("switch")
    def switch(msg: Message, context: Context) -> Message:
        device = device_at(msg, context).switch(str(msg.content[Record.QUERY][FleetKey.TARGET]))
        return Message(RecordDict({Record.STATUS: ConfigRecord(device.status())}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if "fitins.config" in msg.content.config_records:  # SecAgg+: the masked-vector stage
            return masked_update(msg, context)
        device = device_at(msg, context)
        fleet = msg.content[Record.FLEET]
        manifest = receive_state(device, fleet)
        tensors, learned, metrics = device.train_round(int(fleet[FleetKey.ROUND]))
        stats = encode_stats(device.profile.target, learned, device.target_vocab_size, manifest.version)
        content = RecordDict()
        if fleet.get(FleetKey.SECAGG, False):  # the update leaves the device only masked, in the next messages
            clip = float(fleet.get(FleetKey.CLIP_NORM, 0.0)) or None
            keep_update(
                device.dir,
                tensors,
                device.global_adapter(),
                target=device.profile.target,
                round_=int(fleet[FleetKey.ROUND]),
                version=int(manifest.version),
                tokens=int(metrics[MetricKey.TRAINED_TOKENS]),
                clip_norm=clip,
            )
            metrics[MetricKey.UPLINK_BYTES] = len(stats)  # + the masked vector, counted by the coordinator
        else:  # the update, compressed as the coordinator asks (error feedback kept on the device)
            delta = {k: d.float().numpy() for k, d in update_delta(tensors, device.global_adapter()).items()}
            arrays = ErrorFeedback(device.dir, device.profile.target).compress(
                delta, int(fleet.get(FleetKey.UPDATE_BITS, 32))
            )
            content[Record.UPDATE] = to_record(arrays)
            metrics[MetricKey.UPLINK_BYTES] = content[Record.UPDATE].count_bytes() + len(stats)
        device.record_uplink(int(metrics[MetricKey.UPLINK_BYTES]))
        content[Record.METRICS] = MetricRecord(metrics)
        content[Record.FLEET] = ConfigRecord(
            {
                FleetKey.TARGET: device.profile.target,
                FleetKey.STATE_VERSION: int(manifest.version),
                FleetKey.NGRAM_STATS: stats,
            }
        )
        return Message(content, reply_to=msg)

    def masked_update(msg: Message, context: Context) -> Message:
        """The kept update as a legacy ``FitRes`` for ``secaggplus_mod`` to weight and mask."""
        config = compat.recorddict_to_fitins(msg.content, keep_input=True).config
        device = device_for(context)
        arrays, tokens = take_update(
            device.dir,
            target=str(config[FleetKey.TARGET]),
            round_=int(config[FleetKey.ROUND]),
            version=int(config[FleetKey.STATE_VERSION]),
        )
        device.record_uplink(sum(a.nbytes for a in arrays))
        fitres = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(arrays), tokens, {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        device = device_at(msg, context)
        fleet = msg.content[Record.FLEET]
        use_global = bool(fleet.get(FleetKey.USE_GLOBAL, True))
        if use_global:
            receive_state(device, fleet)
        metrics = device.evaluate(
            use_global=use_global,
            measure_ar=bool(fleet.get(FleetKey.MEASURE_AR, False)),
            fixed_k=int(fleet.get(FleetKey.FIXED_K, 0)),
            adaptive=bool(fleet.get(FleetKey.ADAPTIVE, True)),
            fresh=bool(fleet.get(FleetKey.FRESH, False)),
        )
        return Message(RecordDict({Record.METRICS: MetricRecord(metrics)}), reply_to=msg)

    return app
