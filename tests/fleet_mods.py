"""Flower client mods for the federation tests. They run inside Ray worker processes, so they
live in an importable module (the tests put this folder on PYTHONPATH) and talk to the test
through files under ``$OMNIDRAFT_TEST_CAPTURE``."""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import numpy as np
from flwr.app import Message

from omnidraft.shared.update_codec import from_record, to_record


def payload_bytes(msg: Message) -> list[bytes]:
    """Every value a message carries, as bytes (arrays raw, strings UTF-8, numbers repr)."""
    out = []
    if msg.has_error():
        return [msg.error.reason.encode()]
    for rec in msg.content.array_records.values():
        out.extend(a.data for a in rec.values())
    for rec in msg.content.config_records.values():
        for key, v in rec.items():
            out.append(key.encode())
            for item in v if isinstance(v, list) else [v]:
                out.append(item if isinstance(item, bytes) else str(item).encode())
    for rec in msg.content.metric_records.values():
        out.extend(f"{k}={v}".encode() for k, v in rec.items())
    return out


def capture_mod(msg: Message, context, call_next) -> Message:
    """Record every reply a device sends (with its partition id)."""
    reply = call_next(msg, context)
    folder = Path(os.environ["OMNIDRAFT_TEST_CAPTURE"])
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "partition": int(context.node_config["partition-id"]),
        "type": msg.metadata.message_type,
        "payload": payload_bytes(reply),
    }
    (folder / f"{uuid.uuid4().hex}.pkl").write_bytes(pickle.dumps(record))
    return reply


def poison_mod(msg: Message, context, call_next) -> Message:
    """Device 0 sends NaN updates (every float array of its compressed update: the per-row scales,
    or the values themselves at 32 bits); device 1 crashes in training (a drop-out)."""
    partition = int(context.node_config["partition-id"])
    if partition == 1 and msg.metadata.message_type == "train":
        raise RuntimeError("simulated device crash")
    reply = call_next(msg, context)
    if partition == 0 and msg.metadata.message_type == "train" and not reply.has_error():
        arrays = from_record(reply.content["update"])
        reply.content["update"] = to_record(
            {k: np.full(a.shape, np.nan, dtype=np.float32) if a.dtype == np.float32 else a for k, a in arrays.items()}
        )
    return reply


def wire_mod(msg: Message, context, call_next) -> Message:
    """Record, for every reply a device sends, its type and which records it carries (outermost
    mod: what leaves the device, after SecAgg+ masking)."""
    reply = call_next(msg, context)
    folder = Path(os.environ["OMNIDRAFT_TEST_CAPTURE"])
    folder.mkdir(parents=True, exist_ok=True)
    content = None if reply.has_error() else reply.content
    record = {
        "type": msg.metadata.message_type,
        "arrays": sorted(content.array_records) if content else [],
        "configs": sorted(content.config_records) if content else [],
        "array-bytes": sum(r.count_bytes() for r in content.array_records.values()) if content else 0,
    }
    (folder / f"{uuid.uuid4().hex}.pkl").write_bytes(pickle.dumps(record))
    return reply


class SimulatedCrash(BaseException):
    """Raised by ``crash_hook`` where the coordinator is made to stop (nothing catches it below
    the ServerApp, as nothing would run after a kill)."""


CRASH_POINTS = ("before-send", "mid-replies", "after-ledger", "after-commit", "after-records")


def crash_hook(coordinator) -> None:
    """Stop the coordinator at ``$OMNIDRAFT_TEST_CRASH`` = ``POINT@ROUND`` (``CRASH_POINTS``): before
    the round's train messages go out, after its first train replies came in, after the first
    target's privacy ledger was written (before its manifest), after the first target's commit,
    or after the round's records were written (before ``coordinator.json``)."""
    from omnidraft.coordinator import round_log

    point, _, when = os.environ["OMNIDRAFT_TEST_CRASH"].partition("@")
    rnd = int(when)
    now = lambda: coordinator._progress[0]  # noqa: E731 (the round the coordinator is in)

    def crash(where: str):
        raise SimulatedCrash(f"simulated crash {where} in round {rnd}")

    send, registry = coordinator._send, coordinator.registry
    write_ledger, commit, write = registry._write_ledger, registry._commit, round_log.write_bytes_atomic

    class PullsThenCrashes:
        def __init__(self, grid):
            self.grid = grid

        def __getattr__(self, name):
            return getattr(self.grid, name)

        def pull_messages(self, ids):
            got = list(self.grid.pull_messages(ids))
            if got:
                crash("mid-replies")
            return got

    def _send(grid, nodes, message_type, content, r):
        if r == rnd and message_type == "train":
            if point == "before-send":
                crash(point)
            if point == "mid-replies":
                grid = PullsThenCrashes(grid)
        return send(grid, nodes, message_type, content, r)

    def _write_ledger(*args, **kw):
        write_ledger(*args, **kw)
        if point == "after-ledger" and now() == rnd:
            crash(point)

    def _commit(*args, **kw):
        out = commit(*args, **kw)
        if point == "after-commit" and now() == rnd:
            crash(point)
        return out

    def _write(path, data):
        if point == "after-records" and now() == rnd and Path(path).name == round_log.STATE_FILE:
            crash(point)
        return write(path, data)

    coordinator._send = _send
    registry._write_ledger, registry._commit = _write_ledger, _commit
    round_log.write_bytes_atomic = _write
