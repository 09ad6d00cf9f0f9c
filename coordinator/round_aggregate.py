"""One target's replies in a round, checked and aggregated (the round's fourth phase).

Every reply is expanded against the global adapter it was computed from and checked
(``aggregation.check_reply``: schema, ranges, finiteness, norm); its n-gram statistics are
decoded. The accepted ones are aggregated with the configured Flower strategy, or, with
SecAgg+, by summing the devices' masked updates (the coordinator never sees one device's
adapter), and ``round_commit.commit_aggregate`` turns the aggregate into the target's next
version. The result is the round's metrics record for the target.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from omnidraft.coordinator.aggregation import aggregate_target, check_reply, expand_update, payload_bytes
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import StatsError, decode_stats
from omnidraft.coordinator.registry import GlobalState, TargetRegistry
from omnidraft.coordinator.round_commit import commit_aggregate
from omnidraft.coordinator.secure_aggregation import secure_mean_update
from omnidraft.shared.wire import FleetKey, MetricKey, Record

log = logging.getLogger("omnidraft.coordinator")


def aggregate_replies(
    grid: Grid,
    context: Context | None,
    registry: TargetRegistry,
    cfg: FleetConfig,
    rnd: int,
    target: str,
    state: GlobalState,
    group: dict[int, ConfigRecord],
    replies: dict[int, Message],
    downlink: dict[int, int],
) -> dict:
    """Check, aggregate and commit the replies of ``group`` (the nodes sampled to train for
    ``target``; ``downlink``: bytes sent to each) to round ``rnd``; returns the round's record
    for the target (sampled, aggregated, rejected with reasons, bytes per device, and the
    aggregate's training metrics prefixed ``train-``). ``context``: the ServerApp's, for
    SecAgg+."""
    secure = cfg.secagg.enabled
    global_adapter = {k: v.numpy() for k, v in state.adapter.items()}
    version = int(state.manifest.version)
    good: list[tuple[Message, object]] = []
    rejected: list[str] = []
    received: dict[int, int] = {}  # bytes each device sent (before its update is expanded)
    for node in group:
        msg = replies.get(node)
        if msg is None:
            rejected.append(f"node {node}: no reply (dropped out or timed out)")
            continue
        received[id(msg)] = 0 if msg.has_error() else payload_bytes(msg)
        reason = expand_update(msg, global_adapter) or check_reply(
            msg, target, version, global_adapter, cfg.aggregation, expect_adapter=not secure
        )
        if reason is None:
            try:
                bits = decode_stats(
                    msg.content[Record.FLEET][FleetKey.NGRAM_STATS], target, state.spec.target_vocab_size
                )
            except (StatsError, KeyError) as exc:
                reason = str(exc)
        if reason is not None:
            rejected.append(f"node {node}: {reason}")
            continue
        good.append((msg, bits))
    for reason in rejected:
        log.warning("round %d, %s: update rejected: %s", rnd, target, reason)

    record = {
        "round": rnd,
        "target": target,
        "sampled": len(group),
        "aggregated": len(good),
        "rejected": rejected,
        "version": version,
        "downlink-bytes-per-device": float(np.mean([downlink[n] for n in group])) if group else 0.0,
    }
    if secure and 0 < len(good) < cfg.secagg.min_devices:
        record["rejected"] += [f"SecAgg+ needs {cfg.secagg.min_devices} devices, {len(good)} replied"]
        record["aggregated"] = 0
        good = []
    if not good:
        return record
    msgs = [m for m, _ in good]
    uplink = [received[id(m)] for m in msgs]
    tokens = int(sum(m.content[Record.METRICS][MetricKey.TRAINED_TOKENS] for m in msgs))
    if secure:
        adapter, metrics, up, down = _secure_aggregate(grid, context, cfg, rnd, target, version, msgs, global_adapter)
        if adapter is None:
            record["rejected"] += ["SecAgg+ halted (too few devices completed the protocol)"]
            record["aggregated"] = 0
            return record
        uplink = [u + up.get(m.metadata.src_node_id, 0) for u, m in zip(uplink, msgs)]
        record["downlink-bytes-per-device"] += float(np.mean(list(down.values()) or [0]))
    else:
        adapter, metrics = aggregate_target(rnd, msgs, global_adapter, cfg.aggregation)
    problem = commit_aggregate(
        registry, cfg, rnd, target, state, global_adapter, adapter, [b for _, b in good], len(msgs), tokens, record
    )
    if problem is not None:
        record["rejected"] += [problem]
        record["aggregated"] = 0
        return record
    record.update({f"train-{k}": float(v) for k, v in metrics.items() if not isinstance(v, list)})
    record["uplink-bytes-per-device"] = float(np.mean(uplink))
    return record


def _secure_aggregate(
    grid: Grid,
    context: Context | None,
    cfg: FleetConfig,
    rnd: int,
    target: str,
    version: int,
    msgs: list[Message],
    global_adapter: dict[str, np.ndarray],
):
    """SecAgg+ over the devices of ``msgs``: (new adapter or None, metrics, bytes each node sent
    and received in the protocol)."""
    weights = {m.metadata.src_node_id: float(m.content[Record.METRICS][MetricKey.TRAINED_TOKENS]) for m in msgs}
    shapes = {k: global_adapter[k].shape for k in sorted(global_adapter)}
    mean, down, up = secure_mean_update(grid, context, rnd, target, version, weights, shapes, cfg.secagg)
    metrics = aggregate_metricrecords([m.content for m in msgs], MetricKey.TRAINED_TOKENS)
    if mean is None:
        return None, metrics, up, down
    adapter = {k: (global_adapter[k] + mean[k]).astype(global_adapter[k].dtype) for k in global_adapter}
    return adapter, metrics, up, down
