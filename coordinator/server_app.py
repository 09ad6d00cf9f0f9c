"""The coordinator as a Flower ``ServerApp``: rounds of per-target federated learning.

One round:

1. wait (bounded by ``wait_s``) until ``min_devices`` are connected;
2. ask every connected device which target it serves, whether it has joined, whether it is a
   probe (evaluates only) and which global state it holds (``query.status``, a few hundred
   bytes); a device with an unknown target or a different tokenizer is skipped with a logged
   reason; staged rollouts move their share of capable devices to a new target
   (``query.switch``); a seeded ``fraction`` of the devices that joined is sampled to train;
   where no device answered at all, the round is not held (nor recorded: a restart holds it);
3. send each device its target's global state (only the parts it lacks) in a ``train``
   message; wait at most ``round_timeout_s``: devices that drop out or time out are left out
   (a simulation that replays recorded target outputs first tells the sampled devices what
   the round will ask of them, ``query.announce``, so what they lack is recorded together);
4. per target: check every reply (``aggregation.check_reply``), aggregate the adapters with the
   configured Flower strategy (or, with SecAgg+, sum the devices' masked updates with
   ``secure_aggregation``: the coordinator never sees one device's adapter), move the global
   adapter towards the aggregate with the server optimizer (``server_opt``: plain FedAvg by
   default, or server momentum / Adam with state kept per version), release frequent
   n-grams privately (``ngram_release``) into the global cache, and commit a new version of the
   target's state atomically;
5. evaluate: the probe devices of each target (else the round's devices) decode held-out prompts
   with the new global state; in round 1 the probes also measure the starting state (round 0);
   up to ``newcomer_evals`` sampled devices that never trained for the target get a first
   session with and without the global state (the fleet's benefit to a new device);
6. record the round (``rounds.jsonl`` gets one metrics line per target; ``coordinator.json``
   holds the last finished round, so a restarted coordinator resumes after it) and report one
   metrics dict per target to ``on_round``.

The ServerApps that run it read their configuration from Flower's run config:
``superlink_app`` (a deployment) and ``simulations.flower_app`` (the simulated fleet).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from omnidraft.coordinator.device_replies import EVAL_KEYS, eval_metrics_usable, status_problem
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.panels import Panel, first_session_panels
from omnidraft.coordinator.registry import GlobalState, TargetRegistry, rollout_rank
from omnidraft.coordinator.round_aggregate import aggregate_replies
from omnidraft.coordinator.round_log import PhaseClock, finish_round, forget_unfinished, last_round
from omnidraft.shared.wire import FleetKey, MetricKey, Record, StatusKey

log = logging.getLogger("omnidraft.coordinator")
POLL_S = (0.05, 1.0)  # first and longest pause between polls for replies (seconds)


def wait_for_devices(grid: Grid, minimum: int, wait_s: float) -> list[int]:
    """Connected node ids once ``minimum`` are connected; after ``wait_s`` whatever is there."""
    deadline = time.monotonic() + wait_s
    while len(nodes := list(grid.get_node_ids())) < minimum and time.monotonic() < deadline:
        time.sleep(0.5)
    return nodes


def state_record(state: GlobalState, status: ConfigRecord | None, round_: int, **extra) -> ConfigRecord:
    """The ``fleet`` record carrying ``state`` to a device that reported ``status``: adapter and
    cache bytes only when the device does not hold them."""
    record = ConfigRecord(
        {
            FleetKey.ROUND: round_,
            FleetKey.SPEC: state.spec.SerializeToString(),
            FleetKey.MANIFEST: state.manifest_blob or state.manifest.SerializeToString(),
            FleetKey.MANIFEST_SIG: state.signature,
            **extra,
        }
    )
    if status is None or status.get(StatusKey.ADAPTER_SHA256) != state.manifest.adapter_sha256:
        record[FleetKey.ADAPTER] = state.adapter_blob
    if status is None or status.get(StatusKey.CACHE_SHA256) != state.manifest.cache_sha256:
        record[FleetKey.CACHE] = state.cache_blob
    return record


class Coordinator:
    """The round loop over a registry (see the module docstring)."""

    def __init__(
        self,
        root: str | Path,
        config: FleetConfig,
        on_round: Callable[[dict], None] | None = None,
        progress: Callable[[int, int, int], None] | None = None,
        before_round: Callable[[int, TargetRegistry], None] | None = None,
    ) -> None:
        """``before_round(round, registry)``: operator actions scheduled by a simulation
        (a rollout or a rollback at a round), run before the round starts."""
        config.validate()
        self.root = Path(root)
        self.registry = TargetRegistry(self.root)
        self.config = config
        self.on_round = on_round or (lambda record: None)
        self.progress = progress or (lambda rnd, done, sent: None)  # (round, replies, messages sent)
        self.before_round = before_round or (lambda rnd, registry: None)
        self._progress = [0, 0, 0]  # the current round's (round, replies, messages sent)
        self.context: Context | None = None  # the ServerApp's (``run``), for SecAgg+

    def run(self, grid: Grid, context: Context | None = None) -> None:
        """Run the rounds left; ``context`` (the ServerApp's) is needed for SecAgg+."""
        if self.config.secagg.enabled and context is None:
            raise ValueError("SecAgg+ needs the ServerApp's Context")
        self.context = context
        start = last_round(self.root) + 1
        forget_unfinished(self.root, start)
        for rnd in range(start, self.config.rounds + 1):
            self.round(grid, rnd)

    # -- one round ------------------------------------------------------------------------------
    def round(self, grid: Grid, rnd: int) -> list[dict]:
        cfg = self.config
        t0 = time.perf_counter()
        nodes = wait_for_devices(grid, cfg.min_devices, cfg.wait_s)
        if not nodes:
            log.warning("round %d: no device connected after %.0f s; round skipped", rnd, cfg.wait_s)
            return []
        self._progress = [rnd, 0, 0]
        phases = PhaseClock()
        self.before_round(rnd, self.registry)
        members, probes, skipped, states = self._census(grid, rnd, nodes)
        if not states and skipped:
            # every connected device failed to answer (its ClientApp crashed, the fleet is going
            # down): nothing can be trained or measured, and a round recorded as finished here
            # would be skipped by a restart; a round held later runs it again
            log.warning("round %d: no device answered (%d; %s); round not held", rnd, len(skipped), skipped[0])
            return []
        switched = self._roll_out(grid, rnd, members, states, skipped)
        phases.lap("census")
        records = []
        if rnd == 1 and cfg.evaluate:  # the starting point: every target's state before any round
            if cfg.announce_recordings:
                self._announce(grid, rnd, {node: "heldout" for group in probes.values() for node in group})
            start = self.evaluate_panels(grid, 0, {t: Panel(list(probes[t]), states[t], probes[t]) for t in probes})
            records += [
                {"round": 0, "target": t, "version": int(states[t].manifest.version), **start[t]}
                for t in sorted(probes)
            ]
            phases.lap("start-eval")
        # sampled in the order of the devices' own ids (Flower's node ids change between runs)
        eligible = sorted(
            (node for group in members.values() for node in group),
            key=lambda n: str(next(g[n] for g in members.values() if n in g).get(StatusKey.DEVICE, n)),
        )
        size = max(1, round(len(eligible) * cfg.fraction)) if eligible else 0
        sampled = set(random.Random(cfg.seed * 100_003 + rnd).sample(eligible, size))
        by_target = {t: {n: s for n, s in group.items() if n in sampled} for t, group in members.items()}
        by_target = {t: g for t, g in by_target.items() if g}
        # a target whose state this round already committed (the coordinator stopped after that commit,
        # before the round was recorded) does not train again: no version twice, privacy charged once
        recovered = sorted(t for t in by_target if self._committed_in(states[t], rnd))
        round_devices = by_target  # who evaluates a target's new state where it has no probes
        by_target = {t: g for t, g in by_target.items() if t not in recovered}
        cold, warm = first_session_panels(cfg, states, by_target)
        if cfg.announce_recordings:  # what this round's sampled devices (and panels) will be asked
            panel = {node for p in cold.values() for node in p.nodes}
            asks = {node: "train,heldout" if node in panel else "train" for g in by_target.values() for node in g}
            self._announce(grid, rnd, asks)
        newcomers = self._first_sessions(grid, rnd, cold, warm)
        phases.lap("newcomers")

        secure = {FleetKey.UPDATE_BITS: cfg.aggregation.update_bits}
        if cfg.secagg.enabled:  # devices keep their update for the secure aggregation
            secure = {FleetKey.SECAGG: True, FleetKey.CLIP_NORM: float(cfg.aggregation.clip_norm or 0.0)}
        messages = {
            node: RecordDict({Record.FLEET: state_record(states[t], status, rnd, **secure)})
            for t, group in by_target.items()
            for node, status in group.items()
        }
        downlink = {
            node: sum(len(v) for v in rec[Record.FLEET].values() if isinstance(v, bytes))
            for node, rec in messages.items()
        }
        replies = self._send(grid, list(messages), MessageType.TRAIN, messages.__getitem__, rnd)
        phases.lap("train")

        trained = []
        # reasons that name no target (a garbage status, no status at all) go to the round's first record
        fleet_wide = [r for r in skipped if not any(repr(t) in r or f"({t})" in r for t in self.registry.names())]
        for target, group in sorted(by_target.items()):
            record = aggregate_replies(
                grid, self.context, self.registry, cfg, rnd, target, states[target], group, replies, downlink
            )
            record.update({"devices": len(members[target]), "switched": switched.get(target, 0)})
            start = states[target].manifest
            if start.HasField("restored_from"):  # the round trained from a rolled-back state
                record["started-from"] = {"version": int(start.version), "restores": int(start.restored_from)}
            record.update(newcomers.get(target, {}))
            record["skipped"] = [r for r in skipped if repr(target) in r or f"({target})" in r] + (
                fleet_wide if not trained else []
            )
            trained.append(record)
        for target in recovered:
            log.warning(
                "round %d, %s: version %d was committed by this round before a restart; not trained again",
                rnd,
                target,
                states[target].manifest.version,
            )
            trained.append(
                {
                    "round": rnd,
                    "target": target,
                    "aggregated": 0,
                    "recovered": True,
                    "version": int(states[target].manifest.version),
                    "devices": len(members[target]),
                    "switched": switched.get(target, 0),
                    "rejected": [],
                    "skipped": [],
                }
            )
        phases.lap("aggregate")
        if cfg.evaluate:  # the probe panels (else the round's devices) measure the new states, all at once
            panels = {
                r["target"]: Panel(
                    list(probes.get(r["target"]) or round_devices[r["target"]]),
                    self.registry.load(r["target"]),
                    probes.get(r["target"]),
                )
                for r in trained
                if r["aggregated"] or r.get("recovered")
            }
            measured = self.evaluate_panels(grid, rnd, panels)
            for record in trained:
                record.update(measured.get(record["target"], {}))
            phases.lap("eval")
        for record in trained:
            record["round-s"] = time.perf_counter() - t0
            record["phase-s"] = dict(phases.seconds)
        records += trained
        finish_round(self.root, rnd, records)
        for record in records:
            self.on_round(record)
        return records

    @staticmethod
    def _committed_in(state: GlobalState, rnd: int) -> bool:
        """Whether ``state`` is what round ``rnd``'s aggregation committed (not a rollback)."""
        m = state.manifest
        return m.version > 0 and m.round == rnd and not m.HasField("restored_from")

    def _census(self, grid: Grid, rnd: int, nodes: list[int]):
        """Ask every connected device for its status; returns (members, probes, skipped, states):
        devices that may train this round and probe devices, both as {target: {node: status}},
        reasons for the devices left out, and the global state of each target in use."""
        statuses = self._send(
            grid,
            nodes,
            "query.status",
            lambda node: RecordDict({Record.QUERY: ConfigRecord({FleetKey.ROUND: rnd})}),
            rnd,
        )
        members: dict[str, dict[int, ConfigRecord]] = defaultdict(dict)
        probes: dict[str, dict[int, ConfigRecord]] = defaultdict(dict)
        skipped: list[str] = []
        states: dict[str, GlobalState] = {}

        def device_order(item: tuple[int, Message]) -> tuple[str, int]:
            """By the device's own id: aggregation sums and the release's random draws then
            run in the same order every run (Flower's node ids change between runs)."""
            reply = item[1]
            ok = not reply.has_error() and Record.STATUS in reply.content.config_records
            return (str(reply.content.config_records[Record.STATUS].get(StatusKey.DEVICE, "")) if ok else "", item[0])

        for node, reply in sorted(statuses.items(), key=device_order):
            if reply.has_error() or Record.STATUS not in reply.content.config_records:
                skipped.append(f"node {node}: no status ({reply.error.reason if reply.has_error() else 'empty reply'})")
                continue
            status = reply.content.config_records[Record.STATUS]
            problem = status_problem(status)
            if problem is not None:
                skipped.append(f"node {node}: {problem}")
                continue
            target = status[StatusKey.TARGET]
            if int(status.get(StatusKey.JOINS_AT, 1)) > rnd and not status.get(StatusKey.PROBE):
                continue  # a device that joins the fleet later
            if target not in self.registry:
                skipped.append(f"node {node}: unknown target {target!r}")
                continue
            if target not in states:
                states[target] = self.registry.load(target)
            if status.get(StatusKey.TOKENIZER_SHA256) != states[target].spec.tokenizer_sha256:
                skipped.append(f"node {node}: tokenizer of {target!r} differs from the registered one")
                continue
            if status.get(StatusKey.BUSY) and not status.get(StatusKey.PROBE):
                skipped.append(f"node {node} ({target}): busy: {status['busy']}")
                continue
            (probes if status.get(StatusKey.PROBE) else members)[target][node] = status
        for reason in skipped:
            log.warning("round %d: %s", rnd, reason)
        return members, probes, skipped, states

    def _roll_out(
        self,
        grid: Grid,
        rnd: int,
        members: dict[str, dict[int, ConfigRecord]],
        states: dict[str, GlobalState],
        skipped: list[str],
    ) -> dict[str, int]:
        """Staged rollouts (``registry.rollout``): of the devices that serve or offer a target
        being rolled out, the first ``fraction`` in ``rollout_rank`` order serve it; the ones
        not there yet are told to switch (``query.switch``) and count as its members from this
        round on. Returns the number switched per target."""
        switched: dict[str, int] = {}
        for target, fraction in sorted(self.registry.rollouts().items()):
            capable = [
                (node, status)
                for group in members.values()
                for node, status in group.items()
                if status.get(StatusKey.TARGET) == target
                or target in str(status.get(StatusKey.CAN_SERVE, "")).split(",")
            ]
            capable.sort(key=lambda item: rollout_rank(target, str(item[1].get(StatusKey.DEVICE, item[0]))))
            chosen = [
                node
                for node, status in capable[: round(fraction * len(capable))]
                if status.get(StatusKey.TARGET) != target
            ]
            if not chosen:
                continue
            replies = self._send(
                grid,
                chosen,
                "query.switch",
                lambda node, target=target: RecordDict(
                    {Record.QUERY: ConfigRecord({FleetKey.ROUND: rnd, FleetKey.TARGET: target})}
                ),
                rnd,
            )
            if target not in states:
                states[target] = self.registry.load(target)
            for node in chosen:
                reply = replies.get(node)
                if reply is None or reply.has_error() or Record.STATUS not in reply.content.config_records:
                    skipped.append(f"node {node}: did not switch to {target!r}")
                    continue
                status = reply.content.config_records[Record.STATUS]
                for group in members.values():
                    group.pop(node, None)
                if status.get(StatusKey.TOKENIZER_SHA256) != states[target].spec.tokenizer_sha256:
                    skipped.append(f"node {node}: tokenizer of {target!r} differs from the registered one")
                    continue
                members[target][node] = status
                switched[target] = switched.get(target, 0) + 1
            log.info(
                "round %d: %d device(s) switched to %s (rollout %.0f%%)",
                rnd,
                switched.get(target, 0),
                target,
                100 * fraction,
            )
        return switched

    def _first_sessions(self, grid: Grid, rnd: int, cold: dict, warm: dict) -> dict[str, dict]:
        """Per target, the first-session panels' metrics (``panels.first_session_panels``): every
        target's devices measured in the same two exchanges, without the global state, then with it."""
        if not cold:
            return {}
        out: dict[str, dict] = defaultdict(dict)
        for measured in (self.evaluate_panels(grid, rnd, cold), self.evaluate_panels(grid, rnd, warm)):
            for (target, _), metrics in measured.items():
                out[target].update(metrics)
        return dict(out)

    def _announce(self, grid: Grid, rnd: int, asks: dict[int, str]) -> None:
        """Simulations (``announce_recordings``): tell each device in ``asks`` what this round will
        ask of it (``query.announce``: ``train``, ``heldout``), so the target's outputs they need
        are recorded together; a device that fails to answer only records its own later."""
        replies = self._send(
            grid,
            list(asks),
            "query.announce",
            lambda node: RecordDict({Record.QUERY: ConfigRecord({FleetKey.ROUND: rnd, FleetKey.ANNOUNCE: asks[node]})}),
            rnd,
        )
        failed = sum(reply.has_error() for reply in replies.values()) + len(asks) - len(replies)
        if failed:
            log.info("round %d: %d of %d devices did not take the announcement", rnd, failed, len(asks))

    def _send(
        self, grid: Grid, nodes: list[int], message_type: str, content: Callable[[int], RecordDict], rnd: int
    ) -> dict[int, Message]:
        """Send one message per node, collect replies until all came or ``round_timeout_s``
        passed (reporting progress as they come); returns the replies by node."""
        if not nodes:
            return {}
        progress = self._progress
        progress[2] += len(nodes)
        self.progress(*progress)
        pending = set(
            grid.push_messages(
                [  # a list: the deployed grid iterates it twice
                    Message(content(node), dst_node_id=node, message_type=message_type, group_id=str(rnd))
                    for node in nodes
                ]
            )
        )
        by_node: dict[int, Message] = {}
        deadline = time.monotonic() + self.config.round_timeout_s
        wait = POLL_S[0]
        while pending and time.monotonic() < deadline:
            got = list(grid.pull_messages(pending))
            for m in got:
                by_node[m.metadata.src_node_id] = m
                pending.discard(m.metadata.reply_to_message_id)
            if got:
                progress[1] += len(got)
                self.progress(*progress)
                wait = POLL_S[0]
            else:  # back off: each pull is a database query on a deployed SuperLink
                time.sleep(wait)
                wait = min(POLL_S[1], wait * 2)
        missing = set(nodes) - set(by_node)
        if missing:
            log.warning("round %d: %d device(s) did not answer %s in time", rnd, len(missing), message_type)
        return by_node

    def evaluate_panels(self, grid: Grid, rnd: int, panels: dict) -> dict:
        """``{key: Panel}`` with disjoint nodes: each panel's devices decode their held-out prompts
        without learning, with the panel's global state (sent without the parts their status in
        ``held`` says they hold) or with their local state alone (``state=None``). One exchange
        for all panels (the workers stay busy until the last reply); returns ``{key: metrics
        named with the panel's prefix}``, averaged over its devices weighted by tokens decoded."""
        records = {}
        for panel in panels.values():
            extra = {
                FleetKey.USE_GLOBAL: panel.state is not None,
                FleetKey.MEASURE_AR: self.config.measure_ar and panel.adaptive and panel.timed,
                FleetKey.FIXED_K: self.config.fixed_k,
                FleetKey.ADAPTIVE: panel.adaptive,
                FleetKey.FRESH: panel.fresh,
            }
            for node in panel.nodes:
                records[node] = (
                    ConfigRecord({FleetKey.ROUND: rnd, **extra})
                    if panel.state is None
                    else state_record(panel.state, (panel.held or {}).get(node), rnd, **extra)
                )
        replies = self._send(
            grid, list(records), MessageType.EVALUATE, lambda node: RecordDict({Record.FLEET: records[node]}), rnd
        )
        out = {}
        for key, panel in panels.items():
            prefix, nodes = panel.prefix, panel.nodes
            metrics = [
                replies[n].content[Record.METRICS]
                for n in nodes  # in the order asked, not of arrival
                if n in replies
                and not replies[n].has_error()
                and Record.METRICS in replies[n].content.metric_records
                and eval_metrics_usable(replies[n].content[Record.METRICS])
            ]
            if not metrics:
                out[key] = {f"{prefix}devices": 0}
                continue
            keys = [k for k in EVAL_KEYS if all(k in m for m in metrics)]
            weights = np.array([float(m[MetricKey.GENERATED_TOKENS]) for m in metrics]) + 1e-9
            sent = [sum(len(v) for v in records[n].values() if isinstance(v, bytes)) for n in nodes]
            out[key] = {
                f"{prefix}devices": len(metrics),
                f"{prefix}downlink-bytes-per-device": float(np.mean(sent)),
                **{f"{prefix}{k}": float(np.average([float(m[k]) for m in metrics], weights=weights)) for k in keys},
            }
        return out
