"""Federation: aggregation math, the private n-gram release, the registry, reply checks, and an
end-to-end federation on Flower's Simulation Engine with tiny models (bad updates, privacy
audit, restart and resume)."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from omnidraft.benchmarks.tiny_models import ensure_tiny_fleet
from omnidraft.client.device_state import slug
from omnidraft.coordinator.aggregation import TRAIN_METRICS, AggregationConfig, aggregate_target, check_reply
from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import NgramRelease, ReleaseConfig, StatsError, decode_stats, encode_stats
from omnidraft.coordinator.registry import RegistryError, TargetRegistry
from omnidraft.shared.learning.adapters import LoraSpec

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


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


# -- n-gram release -------------------------------------------------------------------------------


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


def test_stats_round_trip_and_errors():
    blob = encode_stats("t", {0, 5, 99}, 100, 3)
    bits = decode_stats(blob, "t", 100)
    assert set(np.flatnonzero(bits)) == {0, 5, 99}
    with pytest.raises(StatsError):
        decode_stats(blob, "other", 100)
    with pytest.raises(StatsError):
        decode_stats(blob, "t", 101)
    with pytest.raises(StatsError):
        decode_stats(b"\xff\xff\xff", "t", 100)
    with pytest.raises(ValueError):
        encode_stats("t", {100}, 100)


def _bitmaps(holders: dict[int, int], devices: int, vocab: int = 50) -> list[np.ndarray]:
    maps = [np.zeros(vocab, bool) for _ in range(devices)]
    for token, n in holders.items():
        for d in range(n):
            maps[d][token] = True
    return maps


def test_k_threshold_releases_only_entries_enough_devices_hold():
    rel = NgramRelease(ReleaseConfig(k=5, noise_multiplier=0))
    released, report = rel.release(_bitmaps({1: 5, 2: 4, 3: 9}, 10), np.random.default_rng(0))
    assert set(released) == {1, 3} and released[3] == 9
    assert report.reported_ids == 3 and report.released == 2 and math.isinf(report.epsilon)


def test_contribution_is_bounded_per_device():
    rel = NgramRelease(ReleaseConfig(k=1, max_entries_per_device=3, noise_multiplier=0))
    bits = np.ones(40, bool)
    released, _ = rel.release([bits], np.random.default_rng(0))
    assert len(released) == 3


def test_noise_scale_and_privacy_ledger(tmp_path):
    cfg = ReleaseConfig(k=1, noise_multiplier=0.5, max_entries_per_device=100)
    rel = NgramRelease(cfg)
    assert rel.sensitivity == 10.0
    maps = [np.zeros(250, bool) for _ in range(200)]
    for d, m in enumerate(maps):  # each device holds 100 of 250 tokens: about 80 devices per token
        m[(np.arange(100) + d * 37) % 250] = True
    counts = np.sum(maps, axis=0)
    released, report = rel.release(maps, np.random.default_rng(1))
    assert report.noise_std == pytest.approx(5.0)
    ids = np.flatnonzero(counts)
    assert counts[ids].min() > rel.threshold + 6 * 5.0 and len(released) == len(ids)  # far above it: all released
    noisy = np.array([released[int(t)] for t in ids])
    assert np.std(noisy - counts[ids]) == pytest.approx(5.0, rel=0.15)
    eps1 = report.epsilon
    assert 0 < eps1 < math.inf
    again = NgramRelease(cfg, json.loads(json.dumps(rel.ledger())))  # the ledger as the registry keeps it
    assert again.epsilon() == pytest.approx(eps1)
    _, report2 = again.release(maps, np.random.default_rng(2))
    assert report2.epsilon > eps1
    assert report2.delta == pytest.approx(cfg.delta + 2 * cfg.selection_delta)  # each round's selection delta


def test_an_id_one_device_alone_holds_is_almost_never_released():
    """The attack on k-thresholding with noise on reported ids only: one holder among 100
    devices at k = 5 was released 31-40 % of the time. The default mechanism's threshold bounds it
    by the selection delta."""
    rel = NgramRelease(ReleaseConfig(k=5))  # the product's defaults: noise on
    maps = [np.zeros(64, bool) for _ in range(100)]
    maps[0][7] = True  # the secret: only device 0 holds id 7
    for m in maps[1:]:
        m[10:14] = True  # everyone holds ids 10-13
    secret = sum(7 in rel.release(maps)[0] for _ in range(2000))
    assert secret <= 2  # <= 0.1 % of 2,000 trials
    assert rel.threshold > 5 and math.isfinite(rel.epsilon())


def test_release_noise_does_not_follow_any_seed():
    """The same fleet, round and scenario seed twice: the noise differs (OS entropy), so knowing
    the seed does not let anyone subtract it."""
    maps = [np.ones(8, bool) for _ in range(60)]
    first, _ = NgramRelease(ReleaseConfig(k=1, max_entries_per_device=8)).release(maps)
    second, _ = NgramRelease(ReleaseConfig(k=1, max_entries_per_device=8)).release(maps)
    assert first and second and first != second


# -- registry -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_fleet(tmp_path_factory.mktemp("tiny"))


def test_registry_versions_checksums_and_errors(tmp_path, tiny):
    reg = TargetRegistry(tmp_path / "coord")
    m0 = reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    assert m0.version == 0 and reg.names() == ["tiny-target-a"]
    state = reg.load("tiny-target-a")
    assert all(torch.count_nonzero(v) == 0 for k, v in state.adapter.items() if "lora_B" in k)
    assert len(state.cache()) == len(reg.candidates("tiny-target-a")) > 0  # seeded from the tokenizers
    m1 = reg.commit("tiny-target-a", state.adapter, state.cache(), round_=1, devices=3, tokens=90)
    assert (m1.version, m1.devices_total, m1.tokens_total) == (1, 3, 90)
    files = sorted(p.name for p in (tmp_path / "coord" / "targets" / "tiny-target-a").iterdir())
    assert {"adapter-v0.safetensors", "adapter-v1.safetensors", "manifest-v1.pb", "manifest-v1.sig"} <= set(files)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]))
    with pytest.raises(RegistryError, match="unknown target"):
        reg.load("nope")
    with pytest.raises(RegistryError, match="bad target name"):
        reg.register("a b", "x", "y")
    (tmp_path / "coord" / "targets" / "tiny-target-a" / "adapter-v1.safetensors").write_bytes(b"garbage")
    with pytest.raises(RegistryError, match="checksum"):
        reg.load("tiny-target-a")


def test_concurrent_commits_and_rollbacks_never_write_a_version_twice(tmp_path, tiny):
    """A `fleet rollback` (another process) while a round commits: each takes the target's lock,
    so the versions written are 1..N with no number written twice."""
    import multiprocessing as mp

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    reg.commit("tiny-target-a", state.adapter, state.cache(), round_=1, devices=1, tokens=1)
    ctx = mp.get_context("spawn")
    rollbacks = ctx.Process(target=_rollback_many, args=(str(tmp_path / "coord"), 6))
    rollbacks.start()
    for rnd in range(2, 8):
        reg.commit("tiny-target-a", state.adapter, state.cache(), round_=rnd, devices=1, tokens=1)
    rollbacks.join(120)
    assert rollbacks.exitcode == 0
    assert reg.manifest("tiny-target-a").version == 1 + 6 + 6  # every commit and every rollback got its own version
    from omnidraft.proto import fleet_pb2

    kept = reg.versions("tiny-target-a")
    for v in kept:  # each kept version's files match its own manifest
        m = fleet_pb2.StateManifest()
        m.ParseFromString((tmp_path / "coord" / "targets" / "tiny-target-a" / f"manifest-v{v}.pb").read_bytes())
        assert m.version == v and m.parent_version == v - 1


def test_privacy_is_charged_once_per_committed_round_and_never_rolled_back(tmp_path, tiny):
    """The ledger is written with the version it accounts for: a coordinator killed after a
    release and before the commit reruns the round from the last committed ledger (charged once),
    and a rollback carries the ledger forward."""
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    cfg = ReleaseConfig(k=1)
    maps = [np.ones(8, bool) for _ in range(3)]

    def one_round(rnd: int, commit: bool) -> None:
        release = NgramRelease(cfg, reg.privacy_ledger("tiny-target-a"))
        release.release(maps)
        if commit:
            reg.commit(
                "tiny-target-a",
                state.adapter,
                state.cache(),
                round_=rnd,
                devices=3,
                tokens=3,
                privacy_ledger=release.ledger(),
            )

    assert reg.privacy_ledger("tiny-target-a") is None
    one_round(1, commit=True)
    eps1 = NgramRelease(cfg, reg.privacy_ledger("tiny-target-a")).epsilon()
    one_round(2, commit=False)  # killed after the release, before the commit
    assert NgramRelease(cfg, reg.privacy_ledger("tiny-target-a")).epsilon() == pytest.approx(eps1)
    one_round(2, commit=True)  # the rerun
    ledger = NgramRelease(cfg, reg.privacy_ledger("tiny-target-a"))
    assert ledger.accountant.num_releases == 2 and ledger.epsilon() > eps1
    reg.rollback("tiny-target-a")  # the state goes back; the privacy spent does not
    assert NgramRelease(cfg, reg.privacy_ledger("tiny-target-a")).epsilon() == pytest.approx(ledger.epsilon())


def _rollback_many(root: str, n: int) -> None:
    reg = TargetRegistry(Path(root))
    for _ in range(n):
        reg.rollback("tiny-target-a")


def test_rollback_republishes_an_earlier_state_as_a_new_version(tmp_path, tiny):
    from omnidraft.cli import main
    from omnidraft.coordinator.registry import KEEP_VERSIONS

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    shas = [reg.manifest("tiny-target-a").adapter_sha256]
    for v in range(1, 4):
        adapter = {k: t + v for k, t in state.adapter.items()}
        shas.append(
            reg.commit(
                "tiny-target-a",
                adapter,
                state.cache(),
                round_=v,
                devices=1,
                tokens=10,
                server_state={"step": torch.tensor(float(v))},
            ).adapter_sha256
        )
    assert float(reg.server_state("tiny-target-a")["step"]) == 3  # the server optimizer's, with version 3
    m = reg.rollback("tiny-target-a")  # to version 2
    assert (m.version, m.parent_version, m.restored_from, m.adapter_sha256) == (4, 3, 2, shas[2])
    assert reg.server_state("tiny-target-a") == {}  # a restored state starts the server optimizer afresh
    assert reg.load("tiny-target-a").adapter_blob and reg.load("tiny-target-a").signature
    root = str(tmp_path / "coord")
    assert main(["fleet", "rollback", "tiny-target-a", "--to", "0", "--root", root]) == 0
    assert reg.manifest("tiny-target-a").adapter_sha256 == shas[0] and reg.manifest("tiny-target-a").version == 5
    assert reg.versions("tiny-target-a") == list(range(6 - KEEP_VERSIONS, 6))
    assert main(["fleet", "rollback", "tiny-target-a", "--to", "0", "--root", root]) == 2  # no longer kept
    assert main(["fleet", "rollback", "tiny-target-a", "--to", "9", "--root", root]) == 2
    with pytest.raises(RegistryError, match="roll back to"):
        reg.rollback("tiny-target-a", to=5)


def test_a_scheduled_rollback_is_not_repeated_when_its_round_is_resumed(tmp_path, tiny):
    """A scenario's rollback before round 3, replayed by a coordinator that resumes round 3
    (killed after the rollback, before or after the round's commit), publishes nothing more."""
    from omnidraft.simulations.scenario import Rollback, Scenario, operator_actions

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    state = reg.load("tiny-target-a")
    for v in (1, 2):
        reg.commit(
            "tiny-target-a", {k: t + v for k, t in state.adapter.items()}, state.cache(), round_=v, devices=1, tokens=10
        )
    actions = operator_actions(Scenario(rollback=Rollback("tiny-target-a", 3)))
    actions(3, reg)
    rolled = reg.manifest("tiny-target-a")
    assert (rolled.version, rolled.restored_from, rolled.scheduled_before_round) == (3, 1, 3)
    actions(3, reg)  # resumed before the round's commit
    assert reg.manifest("tiny-target-a") == rolled
    reg.commit("tiny-target-a", state.adapter, state.cache(), round_=3, devices=1, tokens=10)
    actions(3, reg)  # resumed after the round's commit: the rollback is found among the kept versions
    assert reg.manifest("tiny-target-a").version == 4 and not reg.manifest("tiny-target-a").HasField("restored_from")
    actions(2, reg), actions(4, reg)  # other rounds: nothing scheduled
    assert reg.versions("tiny-target-a")[-1] == 4
    assert reg.rollback("tiny-target-a").version == 5  # an operator's own rollback is never deduplicated


def test_device_checks_signature_hashes_and_version_before_storing(tmp_path, tiny):
    """A device that pins the coordinator's Ed25519 key stores a state only if the manifest's
    signature verifies, every part matches its hash and the version is not older than the one
    it holds; otherwise it keeps what it had."""
    from dataclasses import replace

    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice, StateMismatch
    from omnidraft.proto import fleet_pb2

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    v0 = reg.load("tiny-target-a")
    reg.commit("tiny-target-a", v0.adapter, v0.cache(), round_=1, devices=1, tokens=1)
    v1 = reg.load("tiny-target-a")
    assert v0.signature and v1.signature and v1.manifest.parent_version == 0
    key_file = tmp_path / "coord" / "keys" / "manifest-ed25519.pem"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and oct(key_file.parent.stat().st_mode & 0o777) == "0o700"
    profile = DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=["x"],
        heldout=["y"],
        state_dir=tmp_path / "dev",
        fleet_key=reg.public_key(),
    )
    pool = EnginePool("fp32", "fp32")
    device = FleetDevice(profile, pool)
    assert device.receive(v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, v1.signature).version == 1
    forged = fleet_pb2.StateManifest()
    forged.ParseFromString(v1.manifest_blob)
    forged.version = 9
    bad = [
        ((v1.spec, forged.SerializeToString(), v1.adapter_blob, v1.cache_blob, v1.signature), "signature"),
        ((v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, b""), "signature"),
        ((v1.spec, v1.manifest_blob, v1.adapter_blob[:-1] + b"!", v1.cache_blob, v1.signature), "checksum"),
        ((v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob[:-1] + b"!", v1.signature), "checksum"),
        ((v0.spec, v0.manifest_blob, v0.adapter_blob, v0.cache_blob, v0.signature), "older"),
    ]  # a replay
    for args, reason in bad:
        with pytest.raises(StateMismatch, match=reason):
            device.receive(*args)
        assert device.held_manifest().version == 1  # the previous state is kept, intact
    # the coordinator itself signs a NaN adapter (a bug, or a poisoned aggregate): the device refuses it
    nan = {k: torch.full_like(v, float("nan")) for k, v in v1.adapter.items()}
    reg.commit("tiny-target-a", nan, v1.cache(), round_=2, devices=1, tokens=1)
    v2 = reg.load("tiny-target-a")
    with pytest.raises(StateMismatch, match="NaN or Inf"):
        device.receive(v2.spec, v2.manifest_blob, v2.adapter_blob, v2.cache_blob, v2.signature)
    assert device.held_manifest().version == 1
    stranger = FleetDevice(
        replace(profile, fleet_key=TargetRegistry(tmp_path / "other").public_key(), state_dir=tmp_path / "dev2"), pool
    )
    with pytest.raises(StateMismatch, match="signature"):
        stranger.receive(v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, v1.signature)
    assert stranger.held_manifest() is None
    # a session starts from the same random draws whatever the worker process ran before it
    heads = []
    for noise in (0, 1000):
        torch.rand(noise)
        heads.append({k: v.clone() for k, v in device.session().head.state_dict().items()})
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_a_cold_first_session_then_the_global_state_in_one_process(tmp_path, tiny):
    """A worker whose first session is a cold one (no global state: the default LoRA shape)
    then serves the global state (the same shape, read from the wire) and evaluates at a
    fixed draft length only."""
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    assert LoraSpec(rank=8) == LoraSpec(rank=8, alpha=16.0)
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=8))
    state = reg.load("tiny-target-a")
    profile = DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=["x"],
        heldout=["def f(x):"],
        state_dir=tmp_path / "dev",
    )
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    cold = device.evaluate(use_global=False, fixed_k=2, adaptive=False)
    device.receive(state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature)
    warm = device.evaluate(fixed_k=2, adaptive=False)
    for metrics in (cold, warm):
        assert 0 <= metrics["fixed-k-acceptance"] <= 1 and metrics["generated-tokens"] > 0
        assert "acceptance" not in metrics and "tokens-per-s" not in metrics
    with pytest.raises(ValueError, match="fixed draft length"):
        device.evaluate(adaptive=False)


def test_a_recording_store_that_cannot_be_written_costs_only_the_replay(tmp_path, tiny):
    """A simulated device whose recording store is unwritable (here: a file where the folder
    should be) still trains and evaluates, with the target running instead of a replay."""
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    blocked = tmp_path / "recordings"
    blocked.write_text("not a folder")
    profile = DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=["def add(a, b):", "import os\n"],
        heldout=["def f(x):"],
        state_dir=tmp_path / "dev",
        prompts_per_round=2,
        recordings=str(blocked),
    )
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=8))
    state = reg.load("tiny-target-a")
    device.receive(state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature)
    _, _, metrics = device.train_round(1)
    assert metrics["replayed"] == 0.0 and metrics["trained-tokens"] > 0
    cold = device.evaluate(use_global=False, fixed_k=2)  # held-out outputs: the target alone, not the store
    assert 0 <= cold["fixed-k-acceptance"] <= 1 and cold["modelled-speedup"] > 0 and "tokens-per-s" not in cold
    assert blocked.read_text() == "not a folder"


def test_a_probe_with_a_recording_store_runs_the_target_alone_only_on_its_speed_prompts(tmp_path, tiny, monkeypatch):
    """With a recording store, a probe runs the target alone live (timed: the speed baseline)
    on its ``speed_prompts`` only; its other held-out outputs come from the store, recorded live
    the first time, so a fresh probe later runs only its speed prompts. The fixed-k figures are
    the store-less probe's."""
    from omnidraft.client import evaluation, fleet_device
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    heldout = ["def f(x):", "def alpha_3(beta, gamma):\n", "x = 1\n", "    return "]
    pool = EnginePool("fp32", "fp32")

    def probe(name: str, recordings: str) -> FleetDevice:
        return FleetDevice(
            DeviceProfile(
                device_id=name,
                target="tiny-target-a",
                target_model=str(tiny["tiny-target-a"]),
                drafter=str(tiny["tiny-drafter"]),
                prompts=[],
                heldout=heldout,
                state_dir=tmp_path / name,
                speed_prompts=1,
                probe=True,
                recordings=recordings,
            ),
            pool,
        )

    runs = []
    real_alone = evaluation.target_alone
    monkeypatch.setattr(fleet_device, "target_alone", lambda *a: runs.append(a[1]) or real_alone(*a))
    store = str(tmp_path / "recordings")
    first = probe("p1", store).evaluate(use_global=False, measure_ar=True, fixed_k=3)
    assert runs == [heldout[:1]] + [[p] for p in heldout[1:]] and first["speedup"] > 0
    runs.clear()
    second = probe("p2", store).evaluate(use_global=False, measure_ar=True, fixed_k=3)
    assert runs == [heldout[:1]]  # the timed baseline only: the rest is in the store
    plain = probe("p3", "").evaluate(use_global=False, measure_ar=True, fixed_k=3)
    for key in ("fixed-k-acceptance", "fixed-k-tokens-per-call"):
        assert first[key] == second[key] == plain[key]


def test_fleet_cli_register_and_status(tmp_path, tiny, capsys):
    from omnidraft.cli import main

    root = str(tmp_path / "c")
    args = [
        "fleet",
        "register-target",
        "tiny-target-b",
        "--model",
        str(tiny["tiny-target-b"]),
        "--drafter",
        str(tiny["tiny-drafter"]),
        "--lora-rank",
        "2",
        "--root",
        root,
    ]
    assert main(args) == 0
    assert main(args) == 2  # already registered: one-line error
    assert main(["fleet", "status", "--root", root, "--json"]) == 0
    assert main(["fleet", "register-target", "x y", "--model", "m", "--root", root]) == 2
    capsys.readouterr()
    assert main(["fleet", "public-key", "--root", root]) == 0
    assert (
        capsys.readouterr().out.strip() == TargetRegistry(root).public_key()
        and len(TargetRegistry(root).public_key()) == 64
    )
    # an operator's view after two rounds, a staged rollout and a rollback
    registry = TargetRegistry(root)
    state = registry.load("tiny-target-b")
    for rnd in (1, 2):
        registry.commit("tiny-target-b", state.adapter, state.cache(), round_=rnd, devices=3, tokens=100)
    rounds = [
        {"round": 0, "target": "tiny-target-b", "eval-acceptance": 0.2},
        {
            "round": 1,
            "target": "tiny-target-b",
            "sampled": 3,
            "aggregated": 2,
            "devices": 7,
            "uplink-bytes-per-device": 1000.0,
            "downlink-bytes-per-device": 500.0,
            "eval-acceptance": 0.25,
            "cache-entries": 40,
        },
        {
            "round": 2,
            "target": "tiny-target-b",
            "sampled": 3,
            "aggregated": 3,
            "devices": 8,
            "uplink-bytes-per-device": 1000.0,
            "downlink-bytes-per-device": 100.0,
            "eval-acceptance": 0.3,
            "cache-entries": 44,
        },
    ]
    (tmp_path / "c" / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    assert main(["fleet", "rollout", "tiny-target-b", "--fraction", "0.25", "--root", root]) == 0
    assert main(["fleet", "rollback", "tiny-target-b", "--root", root]) == 0
    assert main(["fleet", "rollout", "tiny-target-b", "--fraction", "1.5", "--root", root]) == 2
    capsys.readouterr()
    assert main(["fleet", "status", "--root", root, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["targets"][0]
    assert row["version"] == 3 and row["restored_from"] == 1 and row["rollout_fraction"] == 0.25
    assert row["rounds"] == 2 and row["devices"] == 8 and row["cache_entries"] == 44
    assert row["acceptance_trend"] == [0.2, 0.25, 0.3]
    assert row["bytes_moved"] == 2 * 1000 + 3 * 500 + 3 * 1000 + 3 * 100
    assert main(["fleet", "status", "--root", root]) == 0
    table = capsys.readouterr().out
    assert "v3<-v1" in table and "25%" in table and "0.20 0.25 0.30" in table


# -- end to end on Flower's Simulation Engine -------------------------------------------------------


def _scenario(**kw):
    from omnidraft.simulations.scenario import Scenario

    base = dict(
        models="tiny",
        devices=6,
        rounds=3,
        prompts_per_device=6,
        heldout_per_device=2,
        prompts_per_round=3,
        max_new_tokens=12,
        late_joiners=1,
        lora_rank=2,
        lr=1e-2,
        probes=0,
        newcomer_evals=0,
        measure_ar=False,
        release=ReleaseConfig(k=2),
    )
    base.update(kw)
    return Scenario(**base)


def _run_with(out: Path, tiny, scenario, mods, hooks=()) -> tuple[list, list[dict], list[dict]]:
    """Run ``scenario`` under ``out`` with client ``mods`` (from ``fleet_mods``, which run in the
    Ray workers and write to ``$OMNIDRAFT_TEST_CAPTURE``); returns (device profiles, round
    records, captured records)."""
    from omnidraft.simulations.scenario import run

    capture = out / "capture"
    env = {
        "OMNIDRAFT_TEST_CAPTURE": str(capture),
        "OMNIDRAFT_HOME": str(tiny["tiny-drafter"].parents[2]),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    records = []
    try:
        profiles = run(scenario, out / "run", records.append, mods=mods, coordinator_hooks=hooks)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return profiles, records, [pickle.loads(p.read_bytes()) for p in capture.glob("*.pkl")]


@pytest.fixture(scope="module")
def federation(tmp_path_factory, tiny):
    """A 6-device, 3-round federation on two tiny targets; device 0 sends NaN adapters, device 1
    crashes in training, and every reply a device sends is captured."""
    import fleet_mods

    out = tmp_path_factory.mktemp("fed")
    profiles, records, captured = _run_with(out, tiny, _scenario(), [fleet_mods.capture_mod, fleet_mods.poison_mod])
    return out / "run", profiles, records, captured


def test_federation_rounds_versions_and_bad_updates(federation):
    out, profiles, records, _ = federation
    assert sorted({(r["round"], r["target"]) for r in records}) == [
        (rnd, t) for rnd in (1, 2, 3) for t in ("tiny-target-a", "tiny-target-b")
    ]
    reasons = " | ".join(x for r in records for x in r["rejected"])
    assert "NaN" in reasons and "device error" in reasons  # poisoned and crashed devices
    assert all(r["aggregated"] >= 1 for r in records)  # every round completed with the rest
    reg = TargetRegistry(out / "coordinator")
    for t in ("tiny-target-a", "tiny-target-b"):
        m = reg.manifest(t)
        assert m.version == 3 and m.round == 3
        assert np.isfinite(np.concatenate([v.numpy().ravel() for v in reg.load(t).adapter.values()])).all()
    # devices that never trained (the late joiner at round 3; the crashing device 1 every round)
    # get a first session with and without the global state, once a trained state exists
    late = [r for r in records if r.get("new-warm-devices")]
    assert any(r["round"] == 3 for r in late) and all(r["round"] > 1 for r in late)
    assert all(r["new-cold-devices"] == r["new-warm-devices"] >= 1 for r in late)
    # devices that trained before decode their held-out prompts with the same state (the reference)
    assert any(r.get("veteran-devices", 0) >= 1 and 0 <= r["veteran-fixed-k-acceptance"] <= 1 for r in late)
    assert records[-1]["downlink-bytes-per-device"] > 0
    assert json.loads((out / "coordinator" / "coordinator.json").read_text())["round"] == 3


def test_privacy_audit_no_local_text_or_token_runs_in_any_payload(federation):
    out, profiles, _, captured = federation
    from transformers import AutoTokenizer

    assert captured and {c["type"] for c in captured} >= {"train", "evaluate", "query.status"}
    payloads = [b for c in captured for b in c["payload"]]
    blob = b"\x00".join(payloads)
    texts = []
    for p in profiles:
        texts += p.prompts + p.heldout
        texts += (
            [
                h["output"]
                for h in json.loads(
                    "[" + ",".join((Path(p.state_dir) / "history.jsonl").read_text().splitlines()) + "]"
                )
            ]
            if (Path(p.state_dir) / "history.jsonl").exists()
            else []
        )
    assert any(len(t) >= 8 for t in texts)
    grams = {t[i : i + 8].encode() for t in texts for i in range(len(t) - 7)}
    leaked = [g for g in grams if g in blob]
    assert not leaked, leaked[:3]
    planted = blob + texts[0][:8].encode()  # the check itself catches a planted leak
    assert any(g in planted for g in grams)
    # no run of 4 consecutive local token ids (drafter or target tokenization), in any integer encoding
    toks = [AutoTokenizer.from_pretrained(profiles[0].drafter)] + [
        AutoTokenizer.from_pretrained(m) for m in {p.target_model for p in profiles}
    ]
    runs = set()
    for tok in toks:
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False)
            for i in range(len(ids) - 3):
                run = ids[i : i + 4]
                if len(set(run)) > 1:  # a repeated id (e.g. spaces) is not a run of text
                    for dt in ("<u2", "<i4", "<i8", "<f4"):
                        runs.add(np.array(run, dtype=dt).tobytes())
                    runs.add(bytes(run) if max(run) < 128 else b"")  # protobuf packed varints
    runs.discard(b"")
    hits = [r for r in runs if r in blob]
    assert not hits, len(hits)
    ids = toks[0].encode(texts[0], add_special_tokens=False)[:4]
    assert np.array(ids, dtype="<i8").tobytes() in runs or len(set(ids)) == 1


def test_device_state_stays_on_the_device(federation):
    out, profiles, _, _ = federation
    for p in profiles[2:5]:
        d = Path(p.state_dir)
        assert (d / "history.jsonl").is_file() and (d / "global").is_dir()
        pair = d / f"{slug(p.drafter)}--{slug(p.target_model)}"  # where `device serve` keeps it too
        assert (pair / "state.json").is_file() and (pair / "adapter.safetensors").is_file()
        # the lookup history (the device's own prompts and outputs as target ids) exists, so the
        # privacy audit above ran with it present: none of its runs reached any payload
        assert (pair / "lookup_history.safetensors").is_file()


def test_restart_resumes_after_the_last_finished_round(tmp_path, tiny):
    """Kill the coordinator's process (with its Ray workers) after round 1, start again: it runs
    rounds 2..3 only, from the committed round-1 state."""
    script = tmp_path / "fed.py"
    script.write_text(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from omnidraft.simulations.scenario import Scenario, run\n"
        "from omnidraft.coordinator.ngram_release import ReleaseConfig\n"
        "from omnidraft.coordinator.server_opt import ServerOptConfig\n"
        "out = Path(sys.argv[1])\n"
        "s = Scenario(models='tiny', devices=2, rounds=3, prompts_per_device=2, heldout_per_device=1,\n"
        "             prompts_per_round=2, max_new_tokens=8, lora_rank=2, probes=0, release=ReleaseConfig(k=1),\n"
        "             server_opt=ServerOptConfig('adam', lr=1e-2))\n"
        "def on_round(r):\n"
        "    with open(out / 'rounds.jsonl', 'a') as f: f.write(json.dumps([r['round'], r['target'], r['version']]) + '\\n')\n"
        "run(s, out / 'run', on_round)\n"
    )
    env = {**os.environ, "OMNIDRAFT_HOME": str(tiny["tiny-drafter"].parents[2])}
    state = tmp_path / "run" / "coordinator" / "coordinator.json"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if state.exists() and json.loads(state.read_text())["round"] >= 1:
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_after = json.loads(state.read_text())["round"]
    assert 1 <= killed_after < 3, "the coordinator was not killed between rounds"
    recorded = tmp_path / "rounds.jsonl"  # what on_round saw before the kill (it follows the coordinator)
    seen = [json.loads(line) for line in recorded.read_text().splitlines()] if recorded.exists() else []
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    after = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()][len(seen) :]
    assert sorted({r for r, _, _ in after}) == list(range(killed_after + 1, 4))  # finished rounds not rerun
    reg = TargetRegistry(tmp_path / "run" / "coordinator")
    assert all(reg.manifest(t).version == 3 for t in reg.names())
    # the server optimizer's state was saved with each version and taken up after the restart
    assert all(float(reg.server_state(t)["step"]) == 3 for t in reg.names())


@pytest.mark.parametrize("point", ["before-send", "mid-replies", "after-ledger", "after-commit", "after-records"])
def test_a_coordinator_stopped_anywhere_in_a_round_resumes_without_losing_or_repeating_anything(tmp_path, tiny, point):
    """The coordinator stops at ``point`` of its last round (tests/fleet_mods.crash_hook) and runs again
    on the same directory: every target ends at one version per round, each committed round is
    charged to the privacy ledger once, and each round is recorded once."""
    import fleet_mods

    from omnidraft.coordinator.round_log import ROUNDS_FILE
    from omnidraft.simulations.flower_runner import FlowerRunError

    scenario = _scenario(
        devices=4,
        rounds=2,
        late_joiners=0,
        prompts_per_device=3,
        prompts_per_round=3,
        max_new_tokens=8,
        release=ReleaseConfig(k=1),
    )
    os.environ["OMNIDRAFT_TEST_CRASH"] = f"{point}@2"
    try:
        with pytest.raises(FlowerRunError):
            _run_with(tmp_path, tiny, scenario, [], hooks=[fleet_mods.crash_hook])
    finally:
        del os.environ["OMNIDRAFT_TEST_CRASH"]
    _run_with(tmp_path, tiny, scenario, [])  # the same run directory: it resumes
    coord = tmp_path / "run" / "coordinator"
    reg = TargetRegistry(coord)
    records = [json.loads(line) for line in (coord / ROUNDS_FILE).read_text().splitlines()]
    assert sorted((r["round"], r["target"]) for r in records) == [
        (rnd, t) for rnd in (1, 2) for t in ("tiny-target-a", "tiny-target-b")
    ]  # each round once
    for t in ("tiny-target-a", "tiny-target-b"):
        m = reg.manifest(t)
        assert (m.version, m.round) == (2, 2) and reg.versions(t) == [0, 1, 2], (point, t)
        ledger = NgramRelease(ReleaseConfig(k=1), reg.privacy_ledger(t))
        assert ledger.accountant.num_releases == 2, (point, t)  # charged once per committed round
    if point == "after-commit":  # the first target's round-2 commit survived: the rerun did not train it again
        assert any(r.get("recovered") for r in records if r["round"] == 2)


def test_secagg_sums_adapters_without_the_coordinator_seeing_one(tmp_path, tiny):
    """With SecAgg+ no train reply carries an adapter (devices send only masked vectors), and
    the unmasked weighted mean equals plain FedAvg of the same devices' updates."""
    import fleet_mods

    kw = dict(rounds=1, late_joiners=0, newcomer_evals=0)
    # float32 updates in the clear: the reference is the same updates' exact FedAvg
    _, plain, _ = _run_with(
        tmp_path / "plain", tiny, _scenario(aggregation=AggregationConfig(update_bits=32), **kw), []
    )
    _, secure, wire = _run_with(tmp_path / "secure", tiny, _scenario(secagg=True, **kw), [fleet_mods.wire_mod])
    assert (
        [(r["target"], r["aggregated"], r["rejected"]) for r in secure]
        == [(r["target"], r["aggregated"], []) for r in plain]
        == [("tiny-target-a", 3, []), ("tiny-target-b", 3, [])]
    )
    trains = [w for w in wire if w["type"] == "train"]
    assert trains and not any({"adapter", "update"} & set(w["arrays"]) for w in trains)  # nothing in the clear
    masked = [w for w in trains if "secaggplus_configs" in w["configs"]]
    assert len(masked) == 6 * 4 and any(w["array-bytes"] == 0 for w in masked)  # 4 protocol stages per device
    a = TargetRegistry(tmp_path / "plain" / "run" / "coordinator")
    b = TargetRegistry(tmp_path / "secure" / "run" / "coordinator")
    for t in ("tiny-target-a", "tiny-target-b"):
        from safetensors.torch import load_file

        start = load_file(a._dir(t) / TargetRegistry._file("adapter", 0))  # version 0: before the round
        for key, value in a.load(t).adapter.items():
            moved = (value - start[key]).abs().max().item()
            err = (b.load(t).adapter[key] - value).abs().max().item()
            assert err <= 1e-5 + 1e-3 * moved, (t, key, err, moved)
        assert any((v - start[k]).abs().max() > 0 for k, v in a.load(t).adapter.items())  # it learned
    assert all(r["uplink-bytes-per-device"] > 0 for r in secure)


def test_secagg_settings_are_checked():
    from omnidraft.coordinator.secure_aggregation import SecAggConfig

    with pytest.raises(ValueError, match="weighted mean"):
        FleetConfig(aggregation=AggregationConfig(method="median"), secagg=SecAggConfig(enabled=True)).validate()
    with pytest.raises(ValueError, match="at least 2"):
        SecAggConfig(min_devices=1).validate()
    with pytest.raises(ValueError, match="weighted mean"):
        _scenario(secagg=True, aggregation=AggregationConfig(method="trimmed")).validate()


def test_probe_evaluation_replays_the_recorded_target(tmp_path, tiny, monkeypatch):
    """A probe's fixed-k pass scores the drafter against the target's greedy output, recorded
    once per prompt set and kept in fleet.json: the figures equal a live decode's, later
    evaluations run the target only on the timed speed prompts (the speed baseline is timed in
    every evaluation), and the adaptive pass decodes only ``speed_prompts``."""
    from omnidraft.client import evaluation, fleet_device
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    heldout = ["def f(x):", "def alpha_3(beta, gamma):\n", "x = 1\n", "    return "]
    profile = DeviceProfile(
        device_id="p",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=[],
        heldout=heldout,
        state_dir=tmp_path / "probe",
        speed_prompts=1,
        probe=True,
    )
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    runs = []
    real_alone = evaluation.target_alone
    monkeypatch.setattr(fleet_device, "target_alone", lambda *a: runs.append(a[1]) or real_alone(*a))
    first = device.evaluate(use_global=False, measure_ar=True, fixed_k=3)
    again = device.evaluate(use_global=False, measure_ar=True, fixed_k=3)
    assert runs == [heldout[:1], heldout[1:], heldout[:1]]  # outputs once; the timed baseline each time
    assert first["fixed-k-acceptance"] == again["fixed-k-acceptance"] and first["speedup"] > 0
    session = device.session(use_global=False)
    live = evaluation.evaluate_fixed_k(session, heldout, profile.generation, 3)
    assert first["fixed-k-acceptance"] == live["acceptance_rate"]
    assert first["fixed-k-tokens-per-call"] == live["tokens_per_target_call"]
    assert first["generated-tokens"] <= profile.generation.max_new_tokens < live["new_tokens"]  # adaptive: 1 prompt
    device.profile = replace(profile, heldout=heldout[:2])  # another prompt set: recorded anew
    device.evaluate(use_global=False, fixed_k=3, adaptive=False)
    assert runs == [heldout[:1], heldout[1:], heldout[:1], heldout[:2]]
