"""The one thread that runs a process's forwards and training steps.

The native kernels and torch share one OpenMP runtime (libgomp, which torch ships and the
kernels link by the same name). libgomp gives every thread that opens a parallel region a team
of workers of its own, kept for as long as that thread lives, and lets workers spin between
regions only while it manages no more threads than the process may use CPUs; past that, every
region in the process hands work to its workers through the kernel (a futex wake-up). A drafter
step opens a few parallel regions per layer, so the wake-ups decide its cost: SmolLM2-135M in
int8, one-token steps after a 160-token prompt, 2-core AMD EPYC with AVX-512 (Zen 4), median of
40 steps: 5.3 ms on the thread that loaded the models, 14.9 ms on a second thread of the same
process, 5.1 ms on the first again once the second had exited (the Qwen2.5-Coder-1.5B target's
one-token step: ~60 against ~66 ms). A process that takes requests on several threads (the gRPC
service, its learner) therefore runs every job that does torch work on one ``EngineThread``:
loading the models, opening the device session (it builds the drafter's adapters), decoding,
training. A single stray step elsewhere is enough: a session built on the main thread while the
models were loaded on this one left the drafter's steps on this one at 13.6 ms. An ``Engine``
remembers the thread that loaded it (``loaded_on``); the generation service warns when its engine
thread is another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class EngineThread:
    """One long-lived worker thread; ``run`` executes a job on it, one job at a time, in the
    order submitted, and returns its result (or raises its exception) to the caller."""

    def __init__(self, name: str = "omnidraft-engine") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ident = self._executor.submit(threading.get_ident).result()  # the worker, started now

    def run(self, job: Callable[..., T], /, *args, **kwargs) -> T:
        """``job(*args, **kwargs)`` on the engine thread (directly when called from it: a job
        may run another without waiting for itself)."""
        if threading.get_ident() == self.ident:
            return job(*args, **kwargs)
        return self._executor.submit(job, *args, **kwargs).result()

    def close(self) -> None:
        """Finish the jobs submitted and stop the thread."""
        self._executor.shutdown(wait=True)
