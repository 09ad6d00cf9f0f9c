"""What devices and the coordinator must agree on, used by both sides (a device install needs no
coordinator code): the names of a fleet message's records and of their keys, the n-gram
statistics a device reports (``omnidraft.v1.NgramStats``), the digest that names a target
vocabulary, and the LoRA settings a ``TargetSpec`` prescribes.

A message's ``RecordDict`` holds records named in ``Record``; ``FleetKey`` names the keys of the
``fleet`` and ``query`` ConfigRecords, ``StatusKey`` those of a device's ``status`` reply and
``MetricKey`` those of the ``metrics`` MetricRecords (``client.client_app`` describes which
message carries what).
"""

from __future__ import annotations

import hashlib

import numpy as np

from omnidraft.proto import fleet_pb2
from omnidraft.shared.learning.adapters import LoraSpec
from omnidraft.shared.vocab.vocab_bridge import VocabBridge


class Record:
    """The records of a fleet message's ``RecordDict``."""

    FLEET = "fleet"  # ConfigRecord: a round's state to a device (train, evaluate); a train reply's target and stats
    QUERY = "query"  # ConfigRecord of the query.status and query.switch messages
    STATUS = "status"  # ConfigRecord: a device's status (its reply to a query)
    UPDATE = "update"  # ArrayRecord: a device's packed adapter update (shared.update_codec)
    METRICS = "metrics"  # MetricRecord of train and evaluate replies


class FleetKey:
    """Keys of the ``fleet`` and ``query`` ConfigRecords."""

    ROUND = "round"  # the round number (every message)
    TARGET = "target"  # query.switch: serve this target; train reply: the target trained
    SPEC = "spec"  # TargetSpec bytes
    MANIFEST = "manifest"  # StateManifest bytes
    MANIFEST_SIG = "manifest-sig"  # Ed25519 signature over the manifest bytes
    ADAPTER = "adapter"  # the global adapter's bytes, only to a device that does not hold them
    CACHE = "cache"  # the global n-gram cache's bytes, likewise
    UPDATE_BITS = "update-bits"  # bits per value of the update the coordinator asks for
    SECAGG = "secagg"  # the update leaves the device only masked (SecAgg+)
    CLIP_NORM = "clip-norm"  # L2 bound of an update under SecAgg+ (0: none)
    USE_GLOBAL = "use-global"  # evaluate: with the global state (else the device's own)
    FRESH = "fresh"  # evaluate: with nothing the device holds (no global, no local state)
    MEASURE_AR = "measure-ar"  # evaluate: time the target alone too
    FIXED_K = "fixed-k"  # evaluate: also draft a fixed number of drafter tokens (0: not)
    ADAPTIVE = "adaptive"  # evaluate: the device's draft-length rule (else a fixed length)
    STATE_VERSION = "state-version"  # train reply: the global version the update starts from
    ANNOUNCE = "announce"  # query.announce: what this round will ask ("train", "heldout"; comma-separated)
    NGRAM_STATS = "ngram-stats"  # train reply: NgramStats bytes


class StatusKey:
    """Keys of a device's ``status`` ConfigRecord (no local text)."""

    DEVICE = "device"
    TARGET = "target"
    CAN_SERVE = "can-serve"  # the targets it can switch to, comma-separated
    BUSY = "busy"  # why it sits this round out ("" or False: it does not)
    JOINS_AT = "joins-at"  # the first round it takes part in
    PROBE = "probe"  # an evaluation-only device
    TRAINED = "trained"  # it has trained for its target before
    STATE_VERSION = "state-version"  # the global version it holds (-1: none)
    ADAPTER_SHA256 = "adapter-sha256"
    CACHE_SHA256 = "cache-sha256"
    TOKENIZER_SHA256 = "tokenizer-sha256"


class MetricKey:
    """Keys of the ``metrics`` MetricRecords of train and evaluate replies."""

    TRAINED_TOKENS = "trained-tokens"  # target tokens trained on: the aggregation weight
    GENERATED_TOKENS = "generated-tokens"
    ACCEPTANCE = "acceptance"
    ACCEPTANCE_FIRST = "acceptance-first"  # of the round's first prompt
    TOKENS_PER_CALL = "tokens-per-call"  # committed tokens per target call
    TOKENS_PER_CALL_FIRST = "tokens-per-call-first"
    REPLAYED = "replayed"  # share of prompts decoded against recorded target outputs
    MODELLED_SPEEDUP = "modelled-speedup"
    MODELLED_TOKENS_PER_S = "modelled-tokens-per-s"
    TOKENS_PER_S = "tokens-per-s"  # timed
    SPEEDUP = "speedup"  # timed, over the target alone
    DECODE_SPEEDUP = "decode-speedup"  # the same after the prompt's prefill (one prefill, both sides)
    FIXED_K_ACCEPTANCE = "fixed-k-acceptance"
    FIXED_K_TOKENS_PER_CALL = "fixed-k-tokens-per-call"
    UPDATE_S = "update-s"  # seconds of adapter updates
    EVAL_S = "eval-s"  # seconds of the evaluation
    # a live evaluation's check of the cached cost profile (``StepTimings.check``): one-token target
    # steps timed in use over the profile's figure, and the drafter step's ratio over that one
    PROFILE_TARGET_STEP = "profile-target-step"
    PROFILE_DRAFTER_VS_TARGET = "profile-drafter-vs-target"
    CACHE_ENTRIES = "cache-entries"
    ANNOUNCED = "announced"  # query.announce reply: prompts named ahead that the recording store lacked
    UPLINK_BYTES = "uplink-bytes"


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


def spec_digest(spec: fleet_pb2.TargetSpec) -> str:
    """sha256 (hex) of ``spec``'s deterministic serialization: what a state's signed manifest
    records (``StateManifest.spec_sha256``), so that a device applies no spec the coordinator did
    not sign (its LoRA settings, its tokenizer digest)."""
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()


def lora_spec(spec: fleet_pb2.TargetSpec) -> LoraSpec:
    return LoraSpec(rank=spec.lora_rank, alpha=spec.lora_alpha, modules=spec.lora_modules, ffa=spec.lora_ffa)
