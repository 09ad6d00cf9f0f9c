"""Checking device replies and aggregating one target's adapters with Flower's strategies.

Flower's FedAvg (and FedMedian / FedTrimmedAvg, which reuse its checks) ends the whole ServerApp
on one inconsistent reply, so every reply is checked here first and a bad one is dropped with a
logged reason: Flower errors, missing records, wrong target or stale state version, wrong
adapter keys / shapes / dtypes, NaN or Inf, an oversized payload, and metrics outside the
coordinator's own schema (``TRAIN_METRICS``: exactly these keys, each a finite number in its
range). A device never decides what the others are checked against: one bad reply is dropped
alone. The survivors' updates are clipped in L2 norm around the global adapter (server-side
clipping: by default to ``CLIP_MEDIAN_FACTOR`` times the round's median update norm, or to a
fixed ``clip_norm``), then handed to the chosen strategy's ``aggregate_train``.

Weighting is by ``trained-tokens`` (target tokens the device trained on), which the device
reports itself: it is capped at ``max_trained_tokens`` (what a round asks of one device), so no
device outweighs more than its share however large a number it sends. Averaging LoRA's A and
B separately is not the average of ``B·A``; with FFA-LoRA (A frozen at registration, the same on
every device) it is exact, since only B differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg

from omnidraft.shared.update_codec import BITS, UpdateCodecError, decode, from_record
from omnidraft.shared.wire import FleetKey, MetricKey, Record

WEIGHT_KEY = MetricKey.TRAINED_TOKENS  # the FedAvg weight
ADAPTER_KEY = "adapter"  # the ArrayRecord a device's update becomes once expanded (what the strategies read)
METHODS = ("fedavg", "median", "trimmed")
CLIP_MEDIAN_FACTOR = 2.0  # default clipping bound: this many times the round's median update norm
MAX_TOKENS = float(1 << 40)  # any token count beyond this is not a count (target tokens)

# The metrics a training reply carries: key -> (lowest, highest) value. The coordinator owns this
# schema; a reply with a key missing or unknown, or a value that is not a finite number in range,
# is dropped alone.
TRAIN_METRICS: dict[str, tuple[float, float]] = {
    WEIGHT_KEY: (1.0, MAX_TOKENS),
    MetricKey.GENERATED_TOKENS: (0.0, MAX_TOKENS),
    MetricKey.ACCEPTANCE: (0.0, 1.0),
    MetricKey.ACCEPTANCE_FIRST: (0.0, 1.0),
    MetricKey.TOKENS_PER_CALL: (0.0, 4096.0),
    MetricKey.TOKENS_PER_CALL_FIRST: (0.0, 4096.0),
    MetricKey.REPLAYED: (0.0, 1.0),
    MetricKey.MODELLED_SPEEDUP: (0.0, 4096.0),
    MetricKey.UPDATE_S: (0.0, 1e7),
    MetricKey.CACHE_ENTRIES: (0.0, 1e9),
    MetricKey.UPLINK_BYTES: (0.0, float(1 << 40)),
}


@dataclass(frozen=True)
class AggregationConfig:
    """How one target's adapters are combined."""

    method: str = "fedavg"  # fedavg | median | trimmed (Flower's FedAvg / FedMedian / FedTrimmedAvg)
    trim_beta: float = 0.2  # fraction cut at each end by the trimmed mean
    clip_norm: float | None = None  # fixed L2 bound on each device's update (adapter minus global); None: ...
    clip_median_factor: float = CLIP_MEDIAN_FACTOR  # ... this many times the round's median norm (0: no clipping)
    max_trained_tokens: float = 4096.0  # the FedAvg weight of one reply is capped here (target tokens)
    max_payload_bytes: int = 256 << 20  # bigger replies are rejected (bytes)
    update_bits: int = 8  # devices send their update quantized to 4 or 8 bits (32: float32); shared.update_codec
    # central differential privacy on the updates (DP-FedAvg with Flower's DP helpers; see
    # aggregate_target): Gaussian noise of std dp_noise * clip_norm / devices
    # on the mean of the updates, each clipped to the fixed clip_norm, every device weighted equally
    # (0: off). The privacy ledger composes one event per committed round (ngram_release).
    dp_noise: float = 0.0

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown aggregation {self.method!r}: choose one of {', '.join(METHODS)}")
        if not 0 <= self.trim_beta < 0.5:
            raise ValueError("trim beta must be in [0, 0.5)")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError("the clipping norm must be > 0")
        if not (self.clip_median_factor >= 0 and math.isfinite(self.clip_median_factor)):
            raise ValueError("the median clipping factor must be a finite number >= 0 (0: off)")
        if not 1 <= self.max_trained_tokens <= MAX_TOKENS:
            raise ValueError("the weight cap (max trained tokens) must be >= 1")
        if self.update_bits not in BITS:
            raise ValueError(f"update bits must be one of {', '.join(map(str, BITS))}")
        if self.dp_noise < 0 or not math.isfinite(self.dp_noise):
            raise ValueError("the update noise multiplier must be a finite number >= 0 (0: off)")
        if self.dp_noise > 0 and (self.method != "fedavg" or self.clip_norm is None):
            raise ValueError(
                "differential privacy on the updates needs the fedavg aggregation and a fixed "
                "clipping norm (a median-based bound depends on the devices' data)"
            )

    def strategy(self) -> FedAvg:
        kw = {"weighted_by_key": WEIGHT_KEY, "arrayrecord_key": ADAPTER_KEY}
        if self.method == "median":
            return FedMedian(**kw)
        if self.method == "trimmed":
            return FedTrimmedAvg(beta=self.trim_beta, **kw)
        return FedAvg(**kw)


def payload_bytes(msg: Message) -> int:
    """Bytes a message carries in arrays and bytes values (lists of bytes included, as SecAgg+
    sends its masked vectors and key shares)."""
    content = msg.content
    total = sum(rec.count_bytes() for rec in content.array_records.values())
    for rec in content.config_records.values():
        for v in rec.values():
            total += sum(len(b) for b in (v if isinstance(v, list) else [v]) if isinstance(b, bytes))
    return total


def expand_update(msg: Message, global_adapter: dict[str, np.ndarray]) -> str | None:
    """Replace the reply's compressed ``update`` record by the ``adapter`` it stands for (global
    plus update, in the global adapter's dtype) so the checks and Flower's strategies see
    adapters; returns why it cannot (None: done, or the reply has no update)."""
    if msg.has_error() or Record.UPDATE not in msg.content.array_records:
        return None
    record = msg.content.array_records[Record.UPDATE]
    try:
        delta = decode(from_record(record), {k: v.shape for k, v in global_adapter.items()})
    except UpdateCodecError as exc:
        return str(exc)
    except Exception as exc:  # an Array that does not deserialize
        return f"update does not decode: {type(exc).__name__}"
    del msg.content[Record.UPDATE]
    msg.content[ADAPTER_KEY] = ArrayRecord(
        {k: Array((v + delta[k]).astype(v.dtype)) for k, v in global_adapter.items()}
    )
    return None


def check_metrics(metrics: MetricRecord, schema: dict[str, tuple[float, float]]) -> str | None:
    """Why ``metrics`` do not fit ``schema`` (None: they do)."""
    if set(metrics) != set(schema):
        unknown, missing = sorted(set(metrics) - set(schema)), sorted(set(schema) - set(metrics))
        return f"metrics outside the schema (unknown {unknown[:3]}, missing {missing[:3]})"
    for key, (lo, hi) in schema.items():
        value = metrics[key]
        if isinstance(value, list) or isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metric {key} is not a number"
        if not math.isfinite(value):
            return f"non-finite metric {key}"
        if not lo <= value <= hi:
            return f"metric {key}={value!r} outside [{lo:g}, {hi:g}]"
    return None


def check_reply(
    msg: Message,
    target: str,
    version: int,
    global_adapter: dict[str, np.ndarray],
    config: AggregationConfig,
    expect_adapter: bool = True,
) -> str | None:
    """Why ``msg`` cannot be aggregated for ``target`` at state ``version`` (None: it can). A
    reply that passes has its weight capped at ``config.max_trained_tokens`` in place.
    ``expect_adapter`` False: a SecAgg+ round, whose replies carry no adapter (the device
    checks its own update)."""
    if msg.has_error():
        return f"device error: {msg.error.reason}"
    content = msg.content
    arrays_expected = {ADAPTER_KEY} if expect_adapter else set()
    if set(content.array_records) != arrays_expected or set(content.metric_records) != {Record.METRICS}:
        return "unexpected records"
    if Record.FLEET not in content.config_records:
        return "no fleet record"
    fleet = content.config_records[Record.FLEET]
    if fleet.get(FleetKey.TARGET) != target:
        return f"reply for target {fleet.get('target')!r}, expected {target!r}"
    if fleet.get(FleetKey.STATE_VERSION) != version:
        return f"stale state: trained from version {fleet.get('state-version')}, current is {version}"
    size = payload_bytes(msg)
    if size > config.max_payload_bytes:
        return f"payload of {size} bytes exceeds {config.max_payload_bytes}"
    metrics = content.metric_records[Record.METRICS]
    reason = check_metrics(metrics, TRAIN_METRICS)
    if reason is not None:
        return reason
    if expect_adapter:
        reason = _check_adapter(content.array_records[ADAPTER_KEY], global_adapter)
        if reason is not None:
            return reason
    metrics[WEIGHT_KEY] = min(float(metrics[WEIGHT_KEY]), config.max_trained_tokens)
    return None


def _check_adapter(arrays: ArrayRecord, global_adapter: dict[str, np.ndarray]) -> str | None:
    if set(arrays) != set(global_adapter):
        return "adapter keys differ from the global adapter's"
    for key, ref in global_adapter.items():
        arr = arrays[key]
        if tuple(arr.shape) != ref.shape or arr.dtype != str(ref.dtype):
            return f"adapter tensor {key}: {arr.dtype}{list(arr.shape)}, expected {ref.dtype}{list(ref.shape)}"
        if not np.isfinite(arr.numpy()).all():
            return f"adapter tensor {key} holds NaN or Inf"
    return None


def update_norm(msg: Message, global_adapter: dict[str, np.ndarray]) -> float:
    """L2 norm of the reply's update (adapter minus global)."""
    arrays = msg.content.array_records[ADAPTER_KEY]
    return math.sqrt(
        sum(float(np.square(arrays[k].numpy().astype(np.float64) - v).sum()) for k, v in global_adapter.items())
    )


def clip_bound(norms: list[float], config: AggregationConfig) -> float | None:
    """This round's L2 bound on one update: the fixed ``clip_norm``, else ``clip_median_factor``
    times the lower median of ``norms`` (the middle one, the smaller of the two middle ones for an
    even count: with two replies, one of them an attacker's, the bound is then the other's, not
    half the attacker's; None: no clipping)."""
    if config.clip_norm is not None:
        return config.clip_norm
    if config.clip_median_factor > 0 and norms:
        return config.clip_median_factor * sorted(norms)[(len(norms) - 1) // 2] or None
    return None


def scale_update(msg: Message, global_adapter: dict[str, np.ndarray], scale: float) -> None:
    """Multiply the reply's update (adapter minus global) by ``scale`` in place."""
    arrays = msg.content.array_records[ADAPTER_KEY]
    msg.content[ADAPTER_KEY] = ArrayRecord(
        {
            k: Array((v + (arrays[k].numpy().astype(np.float64) - v) * scale).astype(v.dtype))
            for k, v in global_adapter.items()
        }
    )


def aggregate_target(
    server_round: int, replies: list[Message], global_adapter: dict[str, np.ndarray], config: AggregationConfig
) -> tuple[dict[str, np.ndarray], MetricRecord]:
    """Aggregate checked replies of one target with the configured Flower strategy (each update
    clipped to this round's ``clip_bound`` first). With ``dp_noise`` (DP-FedAvg) every reply
    weighs the same (a device's own weight would be its say in the sensitivity) and the mean gets
    Gaussian noise of std ``dp_noise * clip_norm / devices`` (Flower's ``compute_stdv`` and
    ``add_gaussian_noise_inplace``; its ``DifferentialPrivacyServerSideFixedClipping`` wrapper
    is not used because its clipping divides by the norm of an update that is exactly zero)."""
    norms = [update_norm(m, global_adapter) for m in replies]  # once per reply
    bound = clip_bound(norms, config)
    if bound is not None:
        for msg, norm in zip(replies, norms):
            if norm > bound:
                scale_update(msg, global_adapter, bound / norm)
    if config.dp_noise > 0:
        for msg in replies:
            msg.content[Record.METRICS][WEIGHT_KEY] = 1.0
    arrays, metrics = config.strategy().aggregate_train(server_round, replies)
    out = [v.numpy().astype(global_adapter[k].dtype) for k, v in arrays.items()]
    if config.dp_noise > 0:
        from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_stdv

        add_gaussian_noise_inplace(out, compute_stdv(config.dp_noise, config.clip_norm, len(replies)))
    return dict(zip(arrays.keys(), out)), metrics or MetricRecord()
