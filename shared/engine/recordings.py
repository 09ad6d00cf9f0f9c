"""The target's greedy output per prompt, kept on disk with what verification read from it, so
that a later decode of the same prompt can replay it instead of running the target.

A greedy decode commits the target's greedy continuation whatever the drafter proposes, and the
training signal it leaves (``training_signal.SignalRecorder``: per committed token, the target's
log-probabilities over the vocabularies' intersection) depends on that continuation alone. One
live learning decode of a prompt therefore yields a ``Recording`` that every later learning
decode of the same prompt, by any drafter state, can replay (``RecordedTarget`` answers the
verifications, ``ReplayedSignal`` the recorder): its drafting decisions, acceptance and
training sample are the live ones, at the drafter's cost. Only the wall-clock speed is not
real; a replayed decode's speed is the modelled one (``GenerationStats.modelled_s``).

``RecordingStore`` keeps recordings under ``$OMNIDRAFT_HOME/recordings/``, one safetensors file
per (pair, precision, kernels, machine, prompt, generation settings): a target on another
kernel path or machine may round differently and choose another token at a near tie, so its
recordings are never shared. Files are written atomically; a damaged one is ignored (and
recorded again).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from omnidraft.shared.engine import catalog
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.learning.training_signal import SIGNAL_KEYS
from omnidraft.shared.util.atomic_io import write_bytes_atomic

RECORDING_VERSION = 1


@dataclass
class Recording:
    """One prompt's greedy decode: ``ids`` = prompt ids + generated ids (target vocabulary),
    ``prompt_tokens`` of them the prompt's. ``signal`` (None: not kept): the recorder's rows for
    the generated tokens, ``top_idx`` [n, k] int32 and ``top_logp`` [n, k] (the k most likely
    intersection tokens), ``mass`` [n] (log intersection mass), ``logp_t`` [n] (log p of the
    committed token), temperature 1."""

    ids: list[int]
    prompt_tokens: int
    signal: dict[str, torch.Tensor] | None = None

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_tokens :]

    def to_bytes(self, key: dict) -> bytes:
        tensors = {"ids": torch.tensor(self.ids, dtype=torch.int64)}
        if self.signal is not None:
            tensors.update({k: self.signal[k].contiguous() for k in SIGNAL_KEYS})
        return st_save(
            tensors, metadata={"key": json.dumps(key, sort_keys=True), "prompt_tokens": str(self.prompt_tokens)}
        )

    @classmethod
    def load(cls, path: Path, key: dict) -> Recording | None:
        """The recording in ``path`` if it was written under ``key`` (else None)."""
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if json.loads(meta.get("key", "null")) != key:
                return None
            names = set(f.keys())
            signal = {k: f.get_tensor(k) for k in SIGNAL_KEYS} if names >= set(SIGNAL_KEYS) else None
            return cls(f.get_tensor("ids").tolist(), int(meta["prompt_tokens"]), signal)


class RecordingStore:
    """Recordings of one engine identity (``identity``: the pair's model fingerprints, the
    target's precision and kernels, the machine), one file per prompt and generation setting."""

    def __init__(self, identity: dict, root: str | Path | None = None) -> None:
        self.identity = {"version": RECORDING_VERSION, **identity}
        self.root = Path(root) if root is not None else catalog.omnidraft_home() / "recordings"
        self.digest = _digest(self.identity)

    def _key(self, prompt: str, config: GenerationConfig) -> dict:
        if not config.greedy:
            raise ValueError("only a greedy decode can be recorded and replayed")
        return {
            "engine": self.digest,
            "prompt": _digest(prompt),
            "generation": [config.max_new_tokens, list(config.stop_strings)],
        }

    def _path(self, key: dict) -> Path:
        return self.root / self.digest[:16] / f"{_digest(key)[:32]}.safetensors"

    def get(self, prompt: str, config: GenerationConfig, *, signal: bool = False) -> Recording | None:
        """The recording of ``prompt`` under ``config`` (with its training signal when
        ``signal``), or None when there is none (or it is damaged, or lacks the signal)."""
        key = self._key(prompt, config)
        path = self._path(key)
        try:
            recording = Recording.load(path, key)
        except (OSError, ValueError, KeyError, SafetensorError):
            return None
        return None if recording is None or (signal and recording.signal is None) else recording

    def put(self, prompt: str, config: GenerationConfig, recording: Recording) -> Path:
        """Keep ``recording`` (atomically; replaces an older one of the same prompt)."""
        key = self._key(prompt, config)
        path = self._path(key)
        write_bytes_atomic(path, recording.to_bytes(key))
        return path


def _digest(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
