"""Work written as a generator of steps: each ``yield`` is a point where the caller may run
something else (a service's requests between a training update's optimizer steps), and the
generator's return value is the work's result."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def advance(steps: Generator[None, None, T]) -> tuple[bool, T | None]:
    """Run the next step of ``steps``: ``(False, None)``, or ``(True, its return value)`` once
    it has ended."""
    try:
        next(steps)
    except StopIteration as done:
        return True, done.value
    return False, None


def run_to_end(steps: Generator[None, None, T]) -> T:
    """Run every step of ``steps`` without pausing; its return value."""
    while True:
        done, value = advance(steps)
        if done:
            return value  # type: ignore[return-value]
