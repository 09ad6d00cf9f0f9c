"""``EngineThread``: every job on one long-lived thread, in order, results and exceptions
returned to the caller, a job that runs another does not wait for itself."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from omnidraft.shared.runtime.engine_thread import EngineThread


def test_jobs_from_many_threads_run_on_one_thread_in_turn():
    engine = EngineThread()
    seen, running = [], []

    def job(i: int) -> int:
        running.append(i)
        assert len(running) == 1  # one job at a time
        seen.append(threading.get_ident())
        running.pop()
        return i * i

    try:
        with ThreadPoolExecutor(max_workers=4) as callers:
            squares = list(callers.map(engine.run, [job] * 20, range(20)))
        assert squares == [i * i for i in range(20)]
        assert set(seen) == {engine.ident} and engine.ident != threading.get_ident()
        assert engine.run(lambda: engine.run(threading.get_ident)) == engine.ident  # nested: no deadlock
        with pytest.raises(KeyError, match="missing"):
            engine.run(lambda: {}["missing"])
        assert engine.run(lambda x, y=0: x + y, 2, y=3) == 5  # still serving after a failed job
    finally:
        engine.close()
    with pytest.raises(RuntimeError):
        engine.run(job, 0)  # closed


def test_a_foreground_job_runs_before_queued_background_jobs():
    """Learning queued between requests never delays a request by more than the job running."""
    engine = EngineThread()
    order: list[str] = []
    gate = threading.Event()
    try:
        with ThreadPoolExecutor(max_workers=4) as callers:
            blocker = callers.submit(engine.run, gate.wait, background=True)  # a background job running
            steps = [callers.submit(engine.run, order.append, f"step{i}", background=True) for i in range(2)]
            while len(engine._lanes[1]) < 2:  # both steps queued behind the running one
                threading.Event().wait(0.001)
            request = callers.submit(engine.run, order.append, "request")
            while not engine._lanes[0]:
                threading.Event().wait(0.001)
            gate.set()
            for f in (blocker, request, *steps):
                f.result(timeout=10)
        assert order == ["request", "step0", "step1"]
    finally:
        engine.close()
