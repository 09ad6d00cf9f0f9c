"""Checks on what devices send the coordinator outside their updates: a status reply (which
target a device serves, whether it joined, what it holds) and an evaluation reply's metrics.
The coordinator never trusts a field it did not check; the updates themselves are checked in
``aggregation.check_reply``."""

from __future__ import annotations

import math

from flwr.app import ConfigRecord

from omnidraft.shared.wire import MetricKey, StatusKey

# what a device's status must hold, by type
STATUS_FIELDS: dict[str, tuple[type, ...]] = {
    StatusKey.TARGET: (str,),
    StatusKey.TOKENIZER_SHA256: (str,),
    StatusKey.DEVICE: (str,),
    StatusKey.JOINS_AT: (int,),
    StatusKey.PROBE: (bool,),
    StatusKey.TRAINED: (bool,),
    StatusKey.BUSY: (str, bool),
    StatusKey.CAN_SERVE: (str,),
}
REQUIRED_STATUS = (StatusKey.TARGET, StatusKey.TOKENIZER_SHA256)

# the evaluation metrics a panel averages over its devices (weighted by tokens generated)
EVAL_KEYS = (
    MetricKey.ACCEPTANCE,
    MetricKey.TOKENS_PER_CALL,
    MetricKey.TOKENS_PER_S,
    MetricKey.SPEEDUP,
    MetricKey.DECODE_SPEEDUP,
    MetricKey.MODELLED_SPEEDUP,
    MetricKey.MODELLED_TOKENS_PER_S,
    MetricKey.FIXED_K_ACCEPTANCE,
    MetricKey.FIXED_K_TOKENS_PER_CALL,
    MetricKey.PROFILE_TARGET_STEP,
    MetricKey.PROFILE_DRAFTER_VS_TARGET,
)


def status_problem(status: ConfigRecord) -> str | None:
    """Why a device's status cannot be used (None: it can): a required field missing, or a
    field of the wrong type or out of range."""
    for key in REQUIRED_STATUS:
        if key not in status:
            return f"status without {key!r}"
    for key, types in STATUS_FIELDS.items():
        value = status.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            return f"status field {key!r} is not a {types[0].__name__}"
    if not 0 <= status.get(StatusKey.JOINS_AT, 1) < 1 << 31:
        return "status field 'joins-at' out of range"
    return None


def eval_metrics_usable(metrics) -> bool:
    """Whether an evaluation reply can enter a panel's average: a finite, non-negative
    ``generated-tokens`` weight and a finite number for every averaged key it carries."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    weight = metrics.get(MetricKey.GENERATED_TOKENS)
    return number(weight) and 0 <= weight < 1 << 40 and all(number(metrics[k]) for k in EVAL_KEYS if k in metrics)
