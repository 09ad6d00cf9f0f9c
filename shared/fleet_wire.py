"""What devices and the coordinator must agree on, used by both sides: the n-gram statistics a
device reports (``omnidraft.v1.NgramStats``), the digest that names a target vocabulary, and the
LoRA settings a ``TargetSpec`` prescribes. Kept in the engine so a device install needs no
coordinator code."""

from __future__ import annotations

import hashlib

import numpy as np

from omnidraft.proto import fleet_pb2
from omnidraft.shared.adapters import LoraSpec
from omnidraft.shared.vocab_bridge import VocabBridge


class StatsError(ValueError):
    """A device's n-gram statistics that cannot be used (one line, for the round log)."""


def encode_stats(target: str, target_ids: set[int] | list[int], vocab_size: int, state_version: int = 0) -> bytes:
    """A device's ``NgramStats`` for the ids it learned (ids outside the vocabulary raise)."""
    bits = np.zeros(vocab_size, dtype=bool)
    ids = np.fromiter(target_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError("target id outside the target vocabulary")
    bits[ids] = True
    return fleet_pb2.NgramStats(
        target=target,
        target_vocab_size=vocab_size,
        state_version=state_version,
        present=np.packbits(bits, bitorder="little").tobytes(),
    ).SerializeToString()


def decode_stats(blob: bytes, target: str, vocab_size: int) -> np.ndarray:
    """The presence bitmap (bool, ``vocab_size``) of a device's stats; StatsError if it does
    not parse or is not for ``target``'s vocabulary."""
    msg = fleet_pb2.NgramStats()
    try:
        msg.ParseFromString(blob)
    except Exception:  # google.protobuf.message.DecodeError
        raise StatsError("n-gram stats do not parse") from None
    if msg.target != target:
        raise StatsError(f"n-gram stats are for target {msg.target!r}, not {target!r}")
    if msg.target_vocab_size != vocab_size or len(msg.present) != (vocab_size + 7) // 8:
        raise StatsError(f"n-gram stats cover {msg.target_vocab_size} ids, the target has {vocab_size}")
    return np.unpackbits(np.frombuffer(msg.present, dtype=np.uint8), count=vocab_size, bitorder="little").astype(bool)


def tokenizer_digest(bridge: VocabBridge) -> str:
    """sha256 over the target's token byte table: devices and coordinator compare it to agree
    that they mean the same target vocabulary."""
    h = hashlib.sha256()
    for raw in bridge.target_bytes[: bridge.target_vocab_size]:
        h.update(b"\xff" if raw is None else len(raw).to_bytes(2, "little") + raw)
    return h.hexdigest()


def lora_spec(spec: fleet_pb2.TargetSpec) -> LoraSpec:
    return LoraSpec(rank=spec.lora_rank, alpha=spec.lora_alpha, modules=spec.lora_modules, ffa=spec.lora_ffa)
