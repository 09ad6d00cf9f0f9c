"""The target's greedy outputs of a simulated device's prompts, kept in the recording store
(``shared.engine.recordings``) so that later decodes of the same prompts replay them.

A greedy decode commits the target's greedy output whatever is drafted, so any live greedy
decode of a prompt (the target alone's, or a speculative one at any draft length) yields its
recording; an evaluation records a prompt from the first pass that decodes it live.
"""

from __future__ import annotations

import logging

from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.recordings import Recording, RecordingStore

log = logging.getLogger("omnidraft.device")


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


def stored_outputs(store: RecordingStore, prompts: list[str], config: GenerationConfig) -> list[dict | None]:
    """Each prompt's recorded output (``output``), None where the store has none yet."""
    found = (store.get(prompt, config) for prompt in prompts)
    return [None if recording is None else output(recording.generated) for recording in found]


def record(
    store: RecordingStore, session: DeviceSession, prompt: str, config: GenerationConfig, generated: list[int]
) -> dict:
    """Keep ``generated``, the target's greedy output for ``prompt`` under ``config`` (a live
    greedy decode's ``token_ids``); returns it as ``output`` gives it."""
    _, ids = session.engine.prompt_ids(prompt)
    keep(store, prompt, config, Recording(ids + generated, len(ids)))
    return output(generated)
