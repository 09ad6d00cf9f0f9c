"""What the adaptation tests (test_online_learner.py, test_recordings.py, test_device_state.py,
test_adapt_commands.py) share: loading the tiny drafter/target pair that conftest's ``pair_dir``
builds once per session, and the prompts and generation settings they run it on."""

from __future__ import annotations

from omnidraft.benchmarks.tiny_models import corpus
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine


def _engine(pair_dir):
    return Engine.load(
        str(pair_dir / "drafter"), str(pair_dir / "target"), "fp64", drafter_weights="fp32", progress=False
    )


PROMPTS = [t[:28] for t in corpus(24, seed=11)]
CONFIG = GenerationConfig(max_new_tokens=24)
