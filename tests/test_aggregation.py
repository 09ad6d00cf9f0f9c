"""Aggregating a target's round: weighted FedAvg and the robust methods (median, clipping to a
fixed norm or to twice the round's median norm), FFA-LoRA's exact averaging, the checks that
reject a bad reply alone (NaN, shapes, keys, stale or unknown target, oversized payload,
metrics outside the coordinator's schema, an inflated weight), DP-FedAvg on the updates with
its privacy ledger, and the server optimizers that apply the aggregate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from omnidraft.benchmarks.tiny_models import ensure_tiny_fleet
from omnidraft.coordinator.aggregation import TRAIN_METRICS, AggregationConfig, aggregate_target, check_reply
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import NgramRelease, ReleaseConfig
from omnidraft.shared.learning.adapters import LoraSpec

pytestmark = pytest.mark.usefixtures("flower_task")  # hand-made Messages need a task identity


def metrics_of(weight: float, **override) -> dict:
    """A training reply's metrics as a device sends them (``aggregation.TRAIN_METRICS``)."""
    out = {k: float(lo) for k, (lo, _) in TRAIN_METRICS.items()}
    out.update({"trained-tokens": weight, "acceptance": 0.5, **override})
    return out


def reply(
    arrays: dict[str, np.ndarray],
    weight: float,
    *,
    target="t",
    version=0,
    node=1,
    stats=b"",
    metrics: dict | None = None,
) -> Message:
    msg = Message(
        RecordDict(
            {
                "adapter": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                "metrics": MetricRecord(metrics if metrics is not None else metrics_of(weight)),
                "fleet": ConfigRecord({"target": target, "state-version": version, "ngram-stats": stats}),
            }
        ),
        dst_node_id=node,
        message_type="train",
    )
    return msg


GLOBAL = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}


# -- aggregation ----------------------------------------------------------------------------------


def test_weighted_fedavg_and_robust_methods():
    ups = [
        ({"a": np.full((2, 3), v, np.float32), "b": np.full(4, v, np.float32)}, w)
        for v, w in ((1.0, 1), (2.0, 3), (10.0, 1))
    ]
    avg, metrics = aggregate_target(1, [reply(a, w) for a, w in ups], GLOBAL, AggregationConfig(clip_median_factor=0))
    assert np.allclose(avg["a"], (1 + 6 + 10) / 5) and avg["a"].dtype == np.float32
    assert metrics["acceptance"] == pytest.approx(0.5)
    med, _ = aggregate_target(
        1, [reply(a, w) for a, w in ups], GLOBAL, AggregationConfig(method="median", clip_median_factor=0)
    )
    assert np.allclose(med["b"], 2.0)  # the outlier 10 does not move the median
    clipped, _ = aggregate_target(1, [reply(a, 1) for a, _ in ups], GLOBAL, AggregationConfig(clip_norm=1.0))
    # each update is clipped to norm 1 around the zero global: 10 elements of 1/sqrt(10)
    assert np.allclose(clipped["a"], 1 / math.sqrt(10), atol=1e-6)
    # by default each update is clipped to twice the round's median norm: the outlier (norm
    # 10 sqrt(10)) counts as 2 * 2 sqrt(10), so the mean of 1, 2 and 4 (weights 1, 3, 1)
    default, _ = aggregate_target(1, [reply(a, w) for a, w in ups], GLOBAL, AggregationConfig())
    assert np.allclose(default["a"], (1 + 6 + 4) / 5, atol=1e-5)


def test_ffa_lora_averaging_is_exact_and_plain_lora_is_not():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(4, 8)).astype(np.float32)
    Bs = [rng.normal(size=(8, 4)).astype(np.float32) for _ in range(3)]
    weights = [1, 2, 5]
    want = sum(w * B @ A for w, B in zip(weights, Bs)) / sum(weights)  # the average of the updates B·A
    g = {"A": np.zeros_like(A), "B": np.zeros_like(Bs[0])}
    ffa, _ = aggregate_target(
        1, [reply({"A": A, "B": B}, w) for B, w in zip(Bs, weights)], g, AggregationConfig(clip_median_factor=0)
    )
    assert np.allclose(ffa["B"] @ ffa["A"], want, atol=1e-5)
    As = [rng.normal(size=(4, 8)).astype(np.float32) for _ in range(3)]
    plain, _ = aggregate_target(
        1, [reply({"A": a, "B": B}, w) for a, B, w in zip(As, Bs, weights)], g, AggregationConfig()
    )
    want_plain = sum(w * B @ a for w, B, a in zip(weights, Bs, As)) / sum(weights)
    assert not np.allclose(plain["B"] @ plain["A"], want_plain, atol=1e-2)


def test_ffa_trains_only_b(tmp_path):
    from transformers import AutoModelForCausalLM

    from omnidraft.shared.learning.adapters import DrafterAdapters

    dirs = ensure_tiny_fleet(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(dirs["tiny-drafter"])
    adapters = DrafterAdapters(model, LoraSpec(rank=2, ffa=True), drafter_weights="hf")
    adapters.add("x")
    names = [n for n, p in adapters.peft.named_parameters() if p.requires_grad]
    assert names and all(".lora_B." in n for n in names)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda a: {**a, "a": np.full((2, 3), np.nan, np.float32)}, "NaN"),
        (lambda a: {**a, "a": np.zeros((3, 2), np.float32)}, "expected"),
        (lambda a: {**a, "a": np.zeros((2, 3), np.float64)}, "expected"),
        (lambda a: {"a": a["a"]}, "keys differ"),
        (lambda a: {**a, "x": np.zeros(1, np.float32)}, "keys differ"),
    ],
)
def test_bad_adapters_are_rejected_with_a_reason(mutate, reason):
    good = {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}
    assert check_reply(reply(good, 1), "t", 0, GLOBAL, AggregationConfig()) is None
    why = check_reply(reply(mutate(good), 1), "t", 0, GLOBAL, AggregationConfig())
    assert why is not None and reason in why


def test_stale_unknown_oversized_and_weightless_replies_are_rejected():
    good = {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}
    cfg = AggregationConfig()
    assert "stale" in check_reply(reply(good, 1, version=1), "t", 2, GLOBAL, cfg)
    assert "target" in check_reply(reply(good, 1, target="other"), "t", 0, GLOBAL, cfg)
    assert "exceeds" in check_reply(reply(good, 1), "t", 0, GLOBAL, AggregationConfig(max_payload_bytes=16))
    assert "trained-tokens" in check_reply(reply(good, 0), "t", 0, GLOBAL, cfg)
    assert "trained-tokens" in check_reply(reply(good, float("inf")), "t", 0, GLOBAL, cfg)


@pytest.mark.parametrize(
    "metrics, reason",
    [
        (metrics_of(10, extra=1.0), "unknown ['extra']"),  # an extra metric: this reply alone is dropped
        ({k: v for k, v in metrics_of(10).items() if k != "generated-tokens"}, "missing ['generated-tokens']"),
        (metrics_of(1e20), "trained-tokens"),  # beyond any count (it would overflow the registry's uint64)
        (metrics_of(10, acceptance=1.5), "acceptance"),
        (metrics_of(10, **{"update-s": float("nan")}), "non-finite"),
        (metrics_of(10, replayed=1.5), "replayed"),
        (metrics_of(10, **{"cache-entries": [1, 2]}), "not a number"),
    ],
)
def test_metrics_outside_the_coordinators_schema_drop_that_reply_alone(metrics, reason):
    good = {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}
    cfg = AggregationConfig()
    why = check_reply(reply(good, 1, metrics=metrics), "t", 0, GLOBAL, cfg)
    assert why is not None and reason in why
    # the order replies come in changes nothing: an honest reply after it still passes
    assert check_reply(reply(good, 1), "t", 0, GLOBAL, cfg) is None


def test_a_huge_self_reported_weight_is_capped_at_what_a_round_asks():
    cfg = AggregationConfig(max_trained_tokens=100, clip_median_factor=0)
    honest = [({"a": np.full((2, 3), 1.0, np.float32), "b": np.full(4, 1.0, np.float32)}, 100) for _ in range(3)]
    liar = ({"a": np.full((2, 3), 9.0, np.float32), "b": np.full(4, 9.0, np.float32)}, 1e12)
    msgs = [reply(a, w) for a, w in honest + [liar]]
    assert all(check_reply(m, "t", 0, GLOBAL, cfg) is None for m in msgs)
    assert msgs[-1].content["metrics"]["trained-tokens"] == 100
    avg, _ = aggregate_target(1, msgs, GLOBAL, cfg)
    assert np.allclose(avg["a"], (3 * 1.0 + 9.0) / 4)  # one device's share, not all of it


def test_an_attacker_among_two_replies_is_clipped_to_the_honest_norm():
    """With an even count the bound is twice the lower middle norm: of two replies, one scaled
    by 10^4, the attacker is clipped to twice the honest update's norm (the mean of the two middle
    norms would have let it through at half its size)."""
    cfg = AggregationConfig(clip_median_factor=2.0)
    honest = {"a": np.full((2, 3), 0.1, np.float32), "b": np.full(4, 0.1, np.float32)}
    attacker = {k: v * 1e4 for k, v in honest.items()}
    avg, _ = aggregate_target(1, [reply(honest, 10), reply(attacker, 10)], GLOBAL, cfg)
    assert np.allclose(avg["a"], (0.1 + 2 * 0.1) / 2) and np.allclose(avg["b"], (0.1 + 2 * 0.1) / 2)


def test_private_updates_are_clipped_equally_weighted_and_noised(monkeypatch):
    """DP-FedAvg: each update clipped to the fixed norm (an update of exactly zero included), every
    device weighing the same whatever it reports, Gaussian noise of std noise * clip / devices
    on the mean, fresh each round; the settings it needs are checked, and each committed round is
    charged to the privacy ledger."""
    big = {"a": np.full((2, 3), 100.0, np.float32), "b": np.full(4, 100.0, np.float32)}  # norm 316
    small = {"a": np.full((2, 3), 0.1, np.float32), "b": np.zeros(4, np.float32)}
    cfg = AggregationConfig(clip_norm=1.0, dp_noise=1e-9)  # noise negligible: the clipped mean shows
    msgs = [reply(big, 1e6), reply(small, 1)]
    avg, _ = aggregate_target(1, msgs, GLOBAL, cfg)
    clipped_big = 100.0 / math.sqrt(10 * 100.0**2)  # each coordinate of the clipped update (norm 1)
    assert np.allclose(avg["a"], (clipped_big + 0.1) / 2, atol=1e-6)  # equal weights, not 1e6 : 1
    assert np.allclose(avg["b"], clipped_big / 2, atol=1e-6)
    noisy = AggregationConfig(clip_norm=2.0, dp_noise=3.0)
    zeros = {"a": np.zeros((40, 50), np.float32), "b": np.zeros(1000, np.float32)}
    flat = [
        np.concatenate(
            [
                v.ravel()
                for v in aggregate_target(
                    1, [reply(zeros, 1) for _ in range(4)], {"a": zeros["a"], "b": zeros["b"]}, noisy
                )[0].values()
            ]
        )
        for _ in range(2)
    ]
    assert np.std(flat[0]) == pytest.approx(3.0 * 2.0 / 4, rel=0.05)
    assert not np.array_equal(flat[0], flat[1])  # fresh noise each round
    for bad in (
        AggregationConfig(dp_noise=1.0),
        AggregationConfig(dp_noise=1.0, clip_norm=1.0, method="median"),
        AggregationConfig(dp_noise=-1.0),
    ):
        with pytest.raises(ValueError):
            bad.validate()
    with pytest.raises(ValueError, match="SecAgg"):
        from omnidraft.coordinator.secure_aggregation import SecAggConfig

        FleetConfig(
            aggregation=AggregationConfig(dp_noise=1.0, clip_norm=1.0), secagg=SecAggConfig(enabled=True)
        ).validate()
    # the ledger: an update round composes into the same accountant as the n-gram release
    plain = NgramRelease(ReleaseConfig())
    plain.release([np.ones(8, bool)] * 10)
    private = NgramRelease(ReleaseConfig(), private_updates=True)
    private.account_updates(1.0)
    private.release([np.ones(8, bool)] * 10)
    assert math.isfinite(private.epsilon()) and private.epsilon() > plain.epsilon()
    resumed = NgramRelease(ReleaseConfig(), json.loads(json.dumps(private.ledger())), private_updates=True)
    assert resumed.epsilon() == pytest.approx(private.epsilon())
    with pytest.raises(ValueError, match="private updates"):
        NgramRelease(ReleaseConfig(noise_multiplier=0)).account_updates(1.0)
    assert (
        NgramRelease(ReleaseConfig(noise_multiplier=0), private_updates=True).epsilon() == math.inf
    )  # k-anonymous n-grams


# -- server optimizers ----------------------------------------------------------------------------


def test_server_optimizers():
    from omnidraft.coordinator.server_opt import ServerOptConfig, ServerOptimizer

    cur = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}
    agg = {"a": np.full((2, 3), 0.01, np.float32), "b": np.full(4, 0.98, np.float32)}
    plain = ServerOptimizer().step(cur, agg)  # FedAvg: the aggregate itself, no state
    assert all(np.array_equal(plain[k], agg[k]) for k in cur) and ServerOptimizer().state() == {}
    sgd = ServerOptimizer(ServerOptConfig("momentum", lr=1.0, beta1=0.0)).step(cur, agg)
    assert all(np.allclose(sgd[k], agg[k]) for k in cur)
    m = ServerOptimizer(ServerOptConfig("momentum", lr=0.5, beta1=0.5))
    once = m.step(cur, agg)
    twice = m.step(once, agg)  # buffer = 0.5 * g1 + g2
    g1 = {k: cur[k] - agg[k] for k in cur}
    g2 = {k: once[k] - agg[k] for k in cur}
    assert all(np.allclose(twice[k], once[k] - 0.5 * (0.5 * g1[k] + g2[k])) for k in cur)
    adam = ServerOptimizer(ServerOptConfig("adam", lr=0.1))
    first = adam.step(cur, agg)  # bias-corrected first step: lr in the direction of the aggregate
    assert np.allclose(first["a"], 0.1, atol=1e-5) and np.allclose(first["b"], 0.9, atol=1e-5)
    state = adam.state()
    assert float(state["step"]) == 1 and set(state) == {
        "step",
        "a/exp_avg",
        "a/exp_avg_sq",
        "b/exp_avg",
        "b/exp_avg_sq",
    }
    resumed = ServerOptimizer(ServerOptConfig("adam", lr=0.1), state).step(first, agg)
    continued = adam.step(first, agg)
    assert all(np.array_equal(resumed[k], continued[k]) for k in cur)  # a saved state continues exactly
    other = {"a": np.zeros((3, 3), np.float32)}  # another adapter shape: fresh moments, no error
    fresh = ServerOptimizer(ServerOptConfig("adam", lr=0.1), state).step(other, {"a": other["a"] + 1})
    assert np.allclose(fresh["a"], 0.1, atol=1e-5)
    for bad in (ServerOptConfig("sgd"), ServerOptConfig("adam", lr=0.0), ServerOptConfig("adam", beta1=1.0)):
        with pytest.raises(ValueError):
            bad.validate()
    assert ServerOptConfig("adam").rate == 1e-3 and ServerOptConfig("momentum").rate == 1.0
