"""Decodes that take turns, their drafter forwards run together (``batched_steps``).

``Lockstep(runners).run(jobs)`` runs job ``i`` (a whole decode, e.g. a ``CrossVocabDecoder.generate``
on ``Lockstep.runners[i]``) as a greenlet (a coroutine with a stack of its own, in the calling
thread): a job runs until its drafter asks for a forward, then the next job runs; once every
unfinished job waits on a forward, they all run in one ``forward_together`` and the jobs go on
in order. One job runs at a time in a fixed order, so a run is deterministic, and everything
runs on the caller's thread (its OpenMP team: threads would each start their own, and
oversubscribe a small machine). What a job computes does not depend on the others unless they
share mutable state (a decoder's n-gram cache, which the ``ngram`` translator reads).

Worth it where the drafter's steps dominate and each step reads all its weights: replaying a
target's recorded outputs (``RecordedTarget``) at a fixed draft length, whose decodes are
independent (``client.evaluation.FixedKPass``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from greenlet import greenlet

from omnidraft.shared.runtime.batched_steps import forward_together

T = TypeVar("T")


class _TurnRunner:
    """A runner whose ``forward`` waits for the other jobs' and runs with them; everything else
    is the wrapped runner's."""

    def __init__(self, runner) -> None:
        self._runner = runner

    def forward(self, ids: list[int], logits_to_keep: int = 0) -> torch.Tensor:
        # to the hub (``Lockstep.run``), which resumes this job with the logits (or an error)
        result = greenlet.getcurrent().parent.switch((list(ids), logits_to_keep))
        if isinstance(result, BaseException):
            raise result
        return result

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


class Lockstep:
    """Jobs that take turns on ``runners`` (one each, e.g. ``FastLlamaRunner.fork(current=True)``
    of one drafter); job ``i`` must draft on ``self.runners[i]`` (``runners[i]`` wrapped)."""

    def __init__(self, runners: Sequence) -> None:
        self._inner = list(runners)
        self.runners = [_TurnRunner(r) for r in self._inner]
        self.forward_calls = 0  # forward_together calls made (each: every waiting job's forward)

    def run(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``jobs`` (one per runner, in inference mode) to the end; their results in order.
        The first job that raised has its exception raised here, after every job has ended."""
        if len(jobs) != len(self._inner):
            raise ValueError(f"{len(jobs)} jobs for {len(self._inner)} runners")
        results: list = [None] * len(jobs)
        errors: dict[int, BaseException] = {}
        waiting: dict[int, tuple[list[int], int]] = {}
        # grad and inference modes are per thread, which the jobs share: one mode around them
        # all, so that a job leaving its own ``inference_mode`` cannot switch it off for another
        with torch.inference_mode():
            lets = [greenlet(job) for job in jobs]

            def resume(i: int, value=None) -> None:
                try:
                    out = lets[i].switch(value) if value is not None else lets[i].switch()
                except BaseException as exc:  # re-raised below, once every job has ended
                    errors[i] = exc
                    return
                if lets[i].dead:
                    results[i] = out
                else:
                    waiting[i] = out

            for i in range(len(jobs)):
                resume(i)
            while waiting:
                order = sorted(waiting)
                try:
                    outs = forward_together([(self._inner[j], *waiting[j]) for j in order])
                except Exception as exc:  # each waiting job raises it
                    outs = [exc] * len(order)
                self.forward_calls += 1
                waiting.clear()
                for j, out in zip(order, outs):
                    resume(j, out)
        if errors:
            raise errors[min(errors)]
        return results
