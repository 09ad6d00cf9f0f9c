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

Jobs come in two lanes. A foreground job (a decode someone waits for) runs before every queued
background job (learning between requests), so a request never queues behind learning; one that
arrives while a background job runs waits for that job only, which is why the service learns
one optimizer step per job (``client.service``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class EngineThread:
    """One long-lived worker thread; ``run`` executes a job on it and returns its result (or
    raises its exception) to the caller. One job at a time: foreground jobs in the order
    submitted, background jobs (``background=True``) in theirs, only while no foreground job
    waits."""

    def __init__(self, name: str = "omnidraft-engine") -> None:
        self._lanes: tuple[deque, deque] = (deque(), deque())  # foreground, background
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.ident: int = self._thread.ident  # type: ignore[assignment]

    def run(self, job: Callable[..., T], /, *args, background: bool = False, **kwargs) -> T:
        """``job(*args, **kwargs)`` on the engine thread (directly when called from it: a job
        may run another without waiting for itself). ``background``: after every foreground
        job queued meanwhile."""
        if threading.get_ident() == self.ident:
            return job(*args, **kwargs)
        future: Future = Future()
        with self._wake:
            if self._closing:
                raise RuntimeError("the engine thread is closed")
            self._lanes[1 if background else 0].append((future, job, args, kwargs))
            self._wake.notify()
        return future.result()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not any(self._lanes) and not self._closing:
                    self._wake.wait()
                lane = next((q for q in self._lanes if q), None)
                if lane is None:  # closing, nothing left
                    return
                future, job, args, kwargs = lane.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job(*args, **kwargs))
                except BaseException as exc:  # returned to the caller, as an executor does
                    future.set_exception(exc)

    def close(self) -> None:
        """Finish the jobs submitted and stop the thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if threading.get_ident() != self.ident:
            self._thread.join()
