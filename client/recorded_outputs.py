"""The target's greedy outputs of a simulated device's prompts, kept in the recording store
(``shared.engine.recordings``) so that later decodes of the same prompts replay them.

A greedy decode commits the target's greedy output whatever is drafted, so any live greedy
decode of a prompt (the target alone's, or a speculative one at any draft length) yields its
recording. The prompts a round or an evaluation needs are looked up first and the missing ones
recorded together by the target alone (``record_missing``) where the target's kernels decode
several sequences in one call; elsewhere the first pass that decodes a prompt live records it.

Simulated devices share one process and one store, and each asks for only a few prompts at a
time (a training device its 4), too few to fill the kernels' rows. Before a round, each device
the coordinator sampled names the prompts the round will ask of it (``announce``); the first
``record_missing`` of that store records them all together, whichever device it runs for.
"""

from __future__ import annotations

import logging

from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.recording_decodes import record_together
from omnidraft.shared.engine.recordings import Recording, RecordingStore
from omnidraft.shared.runtime.batched_steps import batchable

log = logging.getLogger("omnidraft.device")

# prompts named ahead (``announce``), per store (root, identity digest): [(prompt, generation, with signal)]
_announced: dict[tuple[str, str], list[tuple[str, GenerationConfig, bool]]] = {}


def announce(store: RecordingStore, prompts: list[str], config: GenerationConfig, *, signal: bool = False) -> int:
    """Name prompts this process will soon ask ``store`` for (with the training signal where
    ``signal``), so that the next ``record_missing`` on ``store`` records those it lacks beside
    its own; returns how many of ``prompts`` the store lacks now."""
    lacking = [prompt for prompt in prompts if store.get(prompt, config, signal=signal) is None]
    _announced.setdefault((str(store.root), store.digest), []).extend((p, config, signal) for p in lacking)
    return len(lacking)


def _take_announced(store: RecordingStore, config: GenerationConfig) -> list[str]:
    """The prompts announced for ``store`` under ``config`` that it still lacks (taken off the list)."""
    key = (str(store.root), store.digest)
    named = _announced.pop(key, [])
    rest = [entry for entry in named if entry[1] != config]
    if rest:
        _announced[key] = rest
    return [prompt for prompt, c, signal in named if c == config and store.get(prompt, c, signal=signal) is None]


def output(generated: list[int]) -> dict:
    """A prompt's target output as an evaluation uses it: {"ids", "tokens", "s"} (not timed: 0 s)."""
    return {"ids": list(generated), "tokens": len(generated), "s": 0.0}


def keep(store: RecordingStore, prompt: str, config: GenerationConfig, recording: Recording) -> None:
    """Keep a recording; a store that cannot be written (a full or read-only disk) only costs
    later decodes their replay, never this one."""
    try:
        store.put(prompt, config, recording)
    except OSError as exc:
        log.warning("recording not kept (%s): later decodes of this prompt run the target", exc)


def stored_outputs(
    store: RecordingStore, session: DeviceSession, prompts: list[str], config: GenerationConfig
) -> list[dict | None]:
    """Each prompt's recorded output (``output``; ``record_missing``), None where there is none yet."""
    found = record_missing(store, session, prompts, config)
    return [None if recording is None else output(recording.generated) for recording in found]


def record_missing(
    store: RecordingStore, session: DeviceSession, prompts: list[str], config: GenerationConfig, *, signal: bool = False
) -> list[Recording | None]:
    """Each prompt's recording in ``store`` (with its training signal when ``signal``); two or
    more that it lacks, with those announced for it (``announce``), are first decoded by the
    target alone side by side and kept (``recording_decodes.record_together``: their training
    signal too), where the target's kernels run several sequences in one call. None for a prompt
    still without one (the caller's live decode records it: ``keep``, ``record``)."""
    found = [store.get(prompt, config, signal=signal) for prompt in prompts]
    own = [prompt for prompt, recording in zip(prompts, found) if recording is None]
    engine = session.engine
    if not batchable(engine.target_runner):
        return found
    missing = list(dict.fromkeys(own + (_take_announced(store, config) if own else [])))
    if len(missing) < 2:
        return found
    ids = [engine.prompt_ids(prompt)[1] for prompt in missing]
    decoded = dict(zip(missing, record_together(engine.target_runner, engine.bridge, session.inter, ids, config)))
    for prompt, recording in decoded.items():
        keep(store, prompt, config, recording)
    return [decoded.get(prompt, recording) for prompt, recording in zip(prompts, found)]


def record(
    store: RecordingStore, session: DeviceSession, prompt: str, config: GenerationConfig, generated: list[int]
) -> dict:
    """Keep ``generated``, the target's greedy output for ``prompt`` under ``config`` (a live
    greedy decode's ``token_ids``); returns it as ``output`` gives it."""
    _, ids = session.engine.prompt_ids(prompt)
    keep(store, prompt, config, Recording(ids + generated, len(ids)))
    return output(generated)
