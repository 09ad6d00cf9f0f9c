"""Checking device replies and aggregating one target's adapters with Flower's strategies.

Flower's FedAvg (and FedMedian / FedTrimmedAvg, which reuse its checks) ends the whole ServerApp
on one inconsistent reply, so every reply is checked here first and a bad one is dropped with a
logged reason: Flower errors, missing records, wrong target or stale state version, wrong
adapter keys / shapes / dtypes, NaN or Inf, a non-positive weight, an oversized payload. The
survivors' updates are optionally clipped in L2 norm around the global adapter (server-side
clipping), then handed to the chosen strategy's ``aggregate_train``.

Weighting is by ``trained-tokens`` (target tokens the device trained on). Averaging LoRA's A and
B separately is not the average of ``B·A``; with FFA-LoRA (A frozen at registration, the same on
every device) it is exact, since only B differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg

from omnidraft.shared.update_codec import BITS, UpdateCodecError, decode

WEIGHT_KEY = "trained-tokens"
ADAPTER_KEY = "adapter"
UPDATE_KEY = "update"  # what a device sends: its compressed update (shared.update_codec)
METRICS_KEY = "metrics"
FLEET_KEY = "fleet"
METHODS = ("fedavg", "median", "trimmed")


@dataclass(frozen=True)
class AggregationConfig:
    """How one target's adapters are combined."""

    method: str = "fedavg"  # fedavg | median | trimmed (Flower's FedAvg / FedMedian / FedTrimmedAvg)
    trim_beta: float = 0.2  # fraction cut at each end by the trimmed mean
    clip_norm: float | None = None  # L2 bound on each device's update (adapter minus global)
    max_payload_bytes: int = 256 << 20  # bigger replies are rejected (bytes)
    update_bits: int = 8  # devices send their update quantized to 4 or 8 bits (32: float32); shared.update_codec

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown aggregation {self.method!r}: choose one of {', '.join(METHODS)}")
        if not 0 <= self.trim_beta < 0.5:
            raise ValueError("trim beta must be in [0, 0.5)")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError("the clipping norm must be > 0")
        if self.update_bits not in BITS:
            raise ValueError(f"update bits must be one of {', '.join(map(str, BITS))}")

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
    if msg.has_error() or UPDATE_KEY not in msg.content.array_records:
        return None
    record = msg.content.array_records[UPDATE_KEY]
    try:
        delta = decode({k: record[k].numpy() for k in record}, {k: v.shape for k, v in global_adapter.items()})
    except UpdateCodecError as exc:
        return str(exc)
    except Exception as exc:  # an Array that does not deserialize
        return f"update does not decode: {type(exc).__name__}"
    del msg.content[UPDATE_KEY]
    msg.content[ADAPTER_KEY] = ArrayRecord({k: Array((v + delta[k]).astype(v.dtype)) for k, v in global_adapter.items()})
    return None


def check_reply(msg: Message, target: str, version: int, global_adapter: dict[str, np.ndarray],
                metric_keys: frozenset[str] | None, config: AggregationConfig,
                expect_adapter: bool = True) -> str | None:
    """Why ``msg`` cannot be aggregated for ``target`` at state ``version`` (None: it can).
    ``expect_adapter`` False: a SecAgg+ round, whose replies carry no adapter (the device
    checks its own update)."""
    if msg.has_error():
        return f"device error: {msg.error.reason}"
    content = msg.content
    arrays_expected = {ADAPTER_KEY} if expect_adapter else set()
    if set(content.array_records) != arrays_expected or set(content.metric_records) != {METRICS_KEY}:
        return "unexpected records"
    if FLEET_KEY not in content.config_records:
        return "no fleet record"
    fleet = content.config_records[FLEET_KEY]
    if fleet.get("target") != target:
        return f"reply for target {fleet.get('target')!r}, expected {target!r}"
    if fleet.get("state-version") != version:
        return f"stale state: trained from version {fleet.get('state-version')}, current is {version}"
    size = payload_bytes(msg)
    if size > config.max_payload_bytes:
        return f"payload of {size} bytes exceeds {config.max_payload_bytes}"
    metrics = content.metric_records[METRICS_KEY]
    if metric_keys is not None and set(metrics) != metric_keys:
        return "metrics keys differ from the other devices'"
    weight = metrics.get(WEIGHT_KEY)
    if isinstance(weight, list) or weight is None or not (math.isfinite(weight) and weight > 0):
        return f"bad weight {WEIGHT_KEY}={weight!r}"
    if any(isinstance(v, float) and not math.isfinite(v) for v in metrics.values() if not isinstance(v, list)):
        return "non-finite metric"
    if not expect_adapter:
        return None
    arrays = content.array_records[ADAPTER_KEY]
    if set(arrays) != set(global_adapter):
        return "adapter keys differ from the global adapter's"
    for key, ref in global_adapter.items():
        arr = arrays[key]
        if tuple(arr.shape) != ref.shape or arr.dtype != str(ref.dtype):
            return f"adapter tensor {key}: {arr.dtype}{list(arr.shape)}, expected {ref.dtype}{list(ref.shape)}"
        if not np.isfinite(arr.numpy()).all():
            return f"adapter tensor {key} holds NaN or Inf"
    return None


def clip_update(msg: Message, global_adapter: dict[str, np.ndarray], clip_norm: float) -> float:
    """Scale the reply's update (adapter minus global) to L2 norm <= ``clip_norm`` in place;
    returns the norm before clipping."""
    arrays = msg.content.array_records[ADAPTER_KEY]
    deltas = {k: arrays[k].numpy().astype(np.float64) - v for k, v in global_adapter.items()}
    norm = math.sqrt(sum(float((d * d).sum()) for d in deltas.values()))
    if norm > clip_norm:
        scale = clip_norm / norm
        msg.content[ADAPTER_KEY] = ArrayRecord({
            k: Array((global_adapter[k] + deltas[k] * scale).astype(global_adapter[k].dtype))
            for k in arrays})
    return norm


def aggregate_target(server_round: int, replies: list[Message], global_adapter: dict[str, np.ndarray],
                     config: AggregationConfig) -> tuple[dict[str, np.ndarray], MetricRecord]:
    """Aggregate checked replies of one target with the configured Flower strategy."""
    if config.clip_norm is not None:
        for msg in replies:
            clip_update(msg, global_adapter, config.clip_norm)
    arrays, metrics = config.strategy().aggregate_train(server_round, replies)
    return ({k: v.numpy().astype(global_adapter[k].dtype) for k, v in arrays.items()},
            metrics or MetricRecord())
