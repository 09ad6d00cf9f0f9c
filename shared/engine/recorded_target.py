"""A target that replays its own recorded greedy output, for measuring greedy acceptance cheaply.

Greedy speculative decoding is lossless: whatever the drafter proposes, the committed text is
the target's greedy continuation of the prompt. Which proposals are accepted therefore depends
only on the drafter and on that continuation, and once the continuation is recorded (one run of
the target alone) any number of drafter states can be scored against it without running the
target again: ``RecordedTarget`` stands in for the target runner and answers every position
with the recorded next token. A probe device that measures every round's global adapter on
the same held-out prompts pays for the target once instead of every round.

The replayed figures equal a live decode's as long as the target's greedy choice at a position
does not depend on how many positions one forward pass scores (batched verification against
one-token steps); the project's kernels keep the rows of a block bit-identical to one-token
steps (``tests/test_precision.py``), and ``tests/test_decoding.py`` checks replayed against live
acceptance.
"""

from __future__ import annotations

import torch


class RecordedTarget:
    """A target runner (``forward``/``crop``/``reset``/``length``, as ``ModelRunner``) over one
    recorded sequence ``ids`` (prompt ids + the target's greedy continuation).

    ``forward`` returns, for each fed position p, logits that put all mass on ``ids[p + 1]``;
    positions past the recording's end repeat its last token (a decode stops there, so those
    rows are never committed). Rows do not depend on the ids fed: with greedy verification a
    row matters only while every earlier proposal matched the recording."""

    def __init__(self, ids: list[int], vocab_size: int) -> None:
        if len(ids) < 2:
            raise ValueError("a recording needs the prompt and at least one generated token")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise ValueError(f"recorded ids must lie in [0, {vocab_size})")
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.vocab_size = vocab_size
        self.length = 0
        self.forward_calls = 0
        self.prefilled = None  # nothing to reuse: a recording's forwards cost nothing

    def reset(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def forward(self, ids: list[int], logits_to_keep: int = 0) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab]`` (the last ``logits_to_keep`` rows when > 0):
        0 on the recorded next token, -inf elsewhere."""
        positions = torch.arange(self.length + 1, self.length + len(ids) + 1)
        if logits_to_keep > 0:
            positions = positions[-logits_to_keep:]
        self.length += len(ids)
        self.forward_calls += 1
        nxt = self.ids[positions.clamp(max=len(self.ids) - 1)]
        logits = torch.full((len(positions), self.vocab_size), float("-inf"))
        return logits.scatter_(1, nxt[:, None], 0.0)
