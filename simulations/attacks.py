"""Hostile devices for fault-injection runs: ``python simulations/run.py --attack KIND:FRACTION``.

The scenario's ``attacks`` map a kind to the share of the training devices (late joiners and
probes excluded) that behave that way in every round; each device has at most one kind, drawn by
a seeded shuffle so a run is repeatable. The behaviour is a Flower client mod (``attack_mod``)
around the honest device: the device does its real work and the mod spoils what it sends, the
way a compromised device would. What the coordinator did with each spoiled reply is in the round
records' ``rejected`` reasons and the report.
"""

from __future__ import annotations

import math
import pickle
import random
from pathlib import Path

import numpy as np
from flwr.app import Context, Message

from omnidraft.shared.update_codec import from_record, to_record
from omnidraft.shared.util.atomic_io import write_bytes_atomic
from omnidraft.shared.wire import FleetKey, MetricKey, Record, StatusKey

# kind -> what the device sends
KINDS: dict[str, str] = {
    "nan": "its update's values replaced by NaN",
    "inf": "its update's values replaced by +Inf",
    "huge-norm": "its update scaled by 1e4 (finite)",
    "wrong-shape": "one tensor of its update with the wrong shape",
    "extra-metric": "one metric the coordinator's schema does not know",
    "huge-weight": "trained-tokens = 1e12 (to outweigh every other device)",
    "tokens-overflow": "trained-tokens = 1e20 (beyond the registry's uint64 counter)",
    "garbage-status": "a status whose join round and target are not what they must be",
    "sign-flip": "its update negated and scaled by 4 (model poisoning)",
    "replay": "the first update it ever sent, again each round (a stale state version)",
    "crash": "nothing: the device process raises in the middle of training",
}


def parse_attacks(specs: list[str] | None) -> dict[str, float]:
    """``["nan:0.1", "all:0.05"]`` -> ``{kind: fraction}`` (``all``: every kind at that share);
    ValueError with one line for a bad spec."""
    out: dict[str, float] = {}
    for spec in specs or []:
        kind, sep, share = spec.partition(":")
        kinds = list(KINDS) if kind == "all" else [kind]
        if not sep or any(k not in KINDS for k in kinds):
            raise ValueError(f"--attack {spec!r}: expected KIND:FRACTION with KIND one of all, {', '.join(KINDS)}")
        try:
            fraction = float(share)
        except ValueError:
            fraction = math.nan
        if not 0 < fraction < 1:
            raise ValueError(f"--attack {spec!r}: the fraction must be in (0, 1)")
        out.update({k: fraction for k in kinds})
    return out


def assign(attacks: dict[str, float], veterans: int, seed: int) -> dict[int, str]:
    """Partition id -> attack kind. Each kind takes ``round(fraction * veterans)`` devices (at
    least one) from a seeded shuffle of the ``veterans`` (partitions ``0..veterans-1``: the
    members that are not late joiners); ValueError when there are not enough of them."""
    order = list(range(veterans))
    random.Random(f"attacks:{seed}").shuffle(order)
    out: dict[int, str] = {}
    for kind, fraction in sorted(attacks.items()):
        n = max(1, round(fraction * veterans))
        if len(out) + n > veterans:
            raise ValueError(
                f"the attacks need {len(out) + n} devices, the fleet has {veterans} that are not late joiners"
            )
        out.update({p: kind for p in order[len(out) : len(out) + n]})
    return out


def _update_arrays(reply: Message) -> dict[str, np.ndarray]:
    """The arrays packed in the reply's compressed update (``shared.update_codec``)."""
    return from_record(reply.content[Record.UPDATE])


def _set_update(reply: Message, arrays: dict[str, np.ndarray]) -> None:
    reply.content[Record.UPDATE] = to_record(arrays)


def _scale_update(reply: Message, factor: float | None = None, fill: float | None = None) -> None:
    """Scale (or fill) every float array of the reply's compressed update: the per-block scales,
    or the values themselves at 32 bits."""
    _set_update(
        reply,
        {
            k: (np.full(a.shape, fill, np.float32) if fill is not None else a * np.float32(factor)).astype(np.float32)
            if a.dtype == np.float32
            else a
            for k, a in _update_arrays(reply).items()
        },
    )


def _replay_file(context: Context, partition: int) -> Path:
    """Where a replaying device keeps its first update: in the run's directory (it goes with the
    run, not into the machine's temporary directory)."""
    from omnidraft.simulations.flower_app import run_dir

    return run_dir(context) / "attacks" / f"replay-{partition}.pkl"


def spoil_train_reply(kind: str, reply: Message, context: Context, partition: int) -> Message:
    """What a device of ``kind`` sends instead of the honest training ``reply``."""
    if kind in ("nan", "inf"):
        _scale_update(reply, fill=math.nan if kind == "nan" else math.inf)
    elif kind == "huge-norm":
        _scale_update(reply, factor=1e4)
    elif kind == "sign-flip":
        _scale_update(reply, factor=-4.0)
    elif kind == "wrong-shape":
        arrays = _update_arrays(reply)
        first = sorted(arrays)[0]
        arrays[first] = np.zeros(arrays[first].size + 1, np.float32)
        _set_update(reply, arrays)
    elif kind == "extra-metric":
        reply.content[Record.METRICS]["favourite-number"] = 7.0
    elif kind in ("huge-weight", "tokens-overflow"):
        reply.content[Record.METRICS][MetricKey.TRAINED_TOKENS] = 1e12 if kind == "huge-weight" else 1e20
    elif kind == "replay":
        path = _replay_file(context, partition)
        if path.exists():  # the first reply's update and state version, again
            old = pickle.loads(path.read_bytes())
            _set_update(reply, old["update"])
            reply.content[Record.FLEET][FleetKey.STATE_VERSION] = old["state-version"]
        else:
            write_bytes_atomic(
                path,
                pickle.dumps(
                    {
                        "update": _update_arrays(reply),
                        "state-version": reply.content[Record.FLEET][FleetKey.STATE_VERSION],
                    }
                ),
            )
    return reply


def attack_mod(msg: Message, context: Context, call_next) -> Message:
    """The Flower client mod of ``--attack``: honest devices pass through untouched."""
    from omnidraft.simulations.flower_app import run_dir, saved_scenario

    scenario = saved_scenario(run_dir(context))
    attacks = scenario.get("attacks") or {}
    partition = int(context.node_config["partition-id"])
    kind = (
        assign(attacks, scenario["devices"] - scenario["late_joiners"], scenario["seed"]).get(partition)
        if attacks
        else None
    )
    kind_of_message = msg.metadata.message_type
    if kind == "crash" and kind_of_message == "train":
        raise RuntimeError("simulated device crash (--attack crash)")
    reply = call_next(msg, context)
    if kind is None or reply.has_error():
        return reply
    if kind == "garbage-status" and kind_of_message == "query.status":
        status = reply.content[Record.STATUS]
        status[StatusKey.JOINS_AT] = "soon"
        status[StatusKey.TARGET] = 42
    elif kind_of_message == "train" and Record.UPDATE in reply.content.array_records:
        reply = spoil_train_reply(kind, reply, context, partition)
    return reply
