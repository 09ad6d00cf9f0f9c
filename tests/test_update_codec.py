"""The compressed update a device sends (``shared.update_codec``), its error feedback on the
device (``client.update_residual``) and its expansion at the coordinator
(``aggregation.expand_update``): sizes, error bounds, and updates built to break the decoder."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from omnidraft.client.update_residual import ErrorFeedback
from omnidraft.coordinator.aggregation import TRAIN_METRICS, AggregationConfig, check_reply, expand_update
from omnidraft.shared.update_codec import BLOCK, PACKED, decode, encode, pack, to_record, unpack

pytestmark = pytest.mark.usefixtures("flower_task")  # hand-made Messages need a task identity
RNG = np.random.default_rng(0)
SHAPES = {"layer.lora_A.weight": (8, 577), "layer.lora_B.weight": (576, 8), "bias": (5,)}


def _delta(scale: float = 1e-3) -> dict[str, np.ndarray]:
    return {k: (RNG.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("bits, rel", [(32, 0.0), (8, 1 / 127), (4, 1 / 7)])
def test_round_trip_error_is_within_half_a_step_per_block(bits, rel):
    delta = _delta()
    back = decode(encode(delta, bits), SHAPES)
    for k, d in delta.items():
        flat = np.concatenate([d.ravel(), np.zeros(-d.size % BLOCK, np.float32)]).reshape(-1, BLOCK)
        step = np.abs(flat).max(axis=1, keepdims=True) * rel
        got = np.concatenate([back[k].ravel(), np.zeros(-d.size % BLOCK, np.float32)]).reshape(-1, BLOCK)
        assert back[k].dtype == np.float32 and back[k].shape == d.shape
        assert (np.abs(got - flat) <= step / 2 + 1e-9).all()


def test_sizes_and_frozen_tensors_are_not_sent():
    delta = _delta()
    raw = sum(d.nbytes for d in delta.values())
    size = {bits: sum(a.nbytes for a in encode(delta, bits).values()) for bits in (32, 8, 4)}
    assert size[32] == raw and size[8] < raw / 3.4 and size[4] < raw / 6
    frozen = {**delta, "layer.lora_A.weight": np.zeros(SHAPES["layer.lora_A.weight"], np.float32)}  # FFA-LoRA
    arrays = encode(frozen, 4)
    assert not any(k.startswith("layer.lora_A") for k in arrays)
    assert not decode(arrays, SHAPES)["layer.lora_A.weight"].any()


def test_error_feedback_sends_the_sum_of_the_updates(tmp_path):
    """Over rounds the sent updates add up to the true ones within one quantization step: the
    residual carries what each round dropped (it stays on the device)."""
    feedback = ErrorFeedback(tmp_path, "qwen2.5-coder-1.5b")
    true_sum = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    sent_sum = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    plain_sum = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    for _ in range(20):
        delta = _delta()
        for k, v in decode(feedback.compress(delta, 4), SHAPES).items():
            sent_sum[k] += v
        for k, v in decode(encode(delta, 4), SHAPES).items():
            plain_sum[k] += v
        for k, v in delta.items():
            true_sum[k] += v
    key = "layer.lora_B.weight"
    with_feedback = np.abs(sent_sum[key] - true_sum[key]).max()
    without = np.abs(plain_sum[key] - true_sum[key]).max()
    assert with_feedback < 1e-3 * 3 / 7 and with_feedback < without / 2
    assert feedback.path.exists() and feedback.path.parent == tmp_path


def _reply(arrays: dict[str, np.ndarray], record: ArrayRecord | None = None) -> Message:
    return Message(
        RecordDict(
            {
                "update": record if record is not None else to_record(arrays),
                "metrics": MetricRecord({**{k: lo for k, (lo, _) in TRAIN_METRICS.items()}, "trained-tokens": 10.0}),
                "fleet": ConfigRecord({"target": "t", "state-version": 0, "ngram-stats": b""}),
            }
        ),
        dst_node_id=1,
        message_type="train",
    )


GLOBAL = {k: (RNG.standard_normal(s) * 0.01).astype(np.float32) for k, s in SHAPES.items()}


def test_the_coordinator_expands_an_update_into_the_adapter_it_stands_for():
    delta = _delta()
    msg = _reply(encode(delta, 8))
    assert expand_update(msg, GLOBAL) is None
    assert check_reply(msg, "t", 0, GLOBAL, AggregationConfig()) is None
    adapter = msg.content["adapter"]
    for k, g in GLOBAL.items():
        assert np.allclose(adapter[k].numpy(), g + delta[k], atol=np.abs(delta[k]).max() / 127)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda a: {**a, "other::q": a["bias::q"]}, "not in the adapter"),
        (lambda a: {**a, "bias::junk": a["bias::q"]}, "not in the adapter"),
        (lambda a: {**a, "bias::q": a["bias::q"][:, :3]}, "fit no bit width"),
        (lambda a: {**a, "bias::q": a["bias::q"].astype(np.int16)}, "fit no bit width"),
        (lambda a: {**a, "bias::scale": a["bias::scale"].astype(np.float64)}, "scales"),
        (lambda a: {**a, "layer.lora_B.weight::scale": a["layer.lora_B.weight::scale"][:2]}, "scales"),
        (lambda a: {**a, "layer.lora_B.weight::q": np.zeros((72, 64), np.float32)}, "fit no bit width"),
    ],
)
def test_updates_built_to_break_the_decoder_are_rejected_with_a_reason(mutate, reason):
    why = expand_update(_reply(mutate(encode(_delta(), 8))), GLOBAL)
    assert why is not None and reason in why


def test_a_non_finite_update_is_caught_after_expansion():
    arrays = encode(_delta(), 8)
    arrays["bias::scale"] = np.full_like(arrays["bias::scale"], np.nan)
    msg = _reply(arrays)
    assert expand_update(msg, GLOBAL) is None
    assert "NaN" in check_reply(msg, "t", 0, GLOBAL, AggregationConfig())


def test_an_update_travels_as_one_array_whatever_the_adapter_holds():
    """Flower moves each Array of a message as its own request: a rank-8 update of 210 tensors
    (420 codes and scales) must still be one array, and unpack to the same codes."""
    shapes = {f"layers.{i}.{p}.lora_B.weight": (576, 8) for i in range(30) for p in "qkvo"}
    delta = {k: (RNG.standard_normal(s) * 1e-3).astype(np.float32) for k, s in shapes.items()}
    arrays = encode(delta, 4)
    msg = _reply(arrays)
    assert list(msg.content["update"]) == [PACKED] and len(arrays) == 240
    back = unpack(msg.content["update"][PACKED].numpy())
    assert back.keys() == arrays.keys() and all(np.array_equal(back[k], arrays[k]) for k in arrays)
    header = msg.content["update"].count_bytes() - sum(a.nbytes for a in arrays.values())
    assert 0 < header < 160 * len(arrays)  # the file's names and shapes


@pytest.mark.parametrize(
    "record, reason",
    [
        (ArrayRecord({PACKED: Array(np.zeros(64, np.uint8))}), "not a safetensors file"),
        (
            ArrayRecord({PACKED: Array(np.frombuffer((10**9).to_bytes(8, "little") + b"{}", np.uint8))}),
            "not a safetensors file",
        ),
        (ArrayRecord({PACKED: Array(np.zeros(64, np.float32))}), "expected uint8"),
        (ArrayRecord({"bias::q": Array(np.zeros((1, 64), np.int8))}), "expected one array"),
        (
            ArrayRecord(
                {PACKED: Array(pack({"bias::q": np.zeros((1, 64), np.int8)})), "more": Array(np.zeros(1, np.uint8))}
            ),
            "expected one array",
        ),
    ],
)
def test_update_records_that_are_not_one_packed_file_are_rejected(record, reason):
    why = expand_update(_reply({}, record), GLOBAL)
    assert why is not None and reason in why
