"""What a runner's KV cache holds, and which of it a new sequence may take over exactly.

A position's keys and values are the bits a forward wrote there. On the native int8 kernels a
forward computes every token row alone (rows never mix), so those bits depend only on the
weights, the ids up to that position and the row kind the forward used: its activation width
(a drafter prefills more than ``prefill_min_tokens`` tokens with 8-bit activations and steps
with 16-bit ones; a target uses one width for both). ``CachedPositions`` records, beside the
ids (``held``), how many leading positions one row kind wrote (``alike``); ``exact_prefix``
says how many of them a forward of a new sequence into an empty cache may take instead of
computing them and still write the bits that forward would. Kernels whose rows mix (oneDNN's
bf16, fbgemm, torch) record no row kind: nothing is taken from their caches.

Both callers use it: ``model_runner.prefill`` (the target keeps what a new prompt shares with
the sequence before) and ``batched_steps`` (a drafter's prefill copies what another sequence
on the same weights holds).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from omnidraft.shared.vocab.draft_context import common_prefix_len


@dataclass(frozen=True)
class Prefill:
    """A sequence's first forward into a runner's empty cache: the ids it fed and the seconds
    it took (from ``prefill``: the forward of the ids a kept prefix did not cover).

    A runner keeps it (``Runner.prefilled``) while its cache still holds those positions as they
    were written, and drops it on ``reset``, on a ``crop`` into them and on a change of weights.
    A later decode whose prompt starts with exactly these ids can then start from the cache
    (``decoding._TargetSide``): the keys and values are the bits a fresh prefill would write,
    being that forward's (and, for positions ``prefill`` kept, the same bits: ``exact_prefix``)."""

    ids: tuple[int, ...]
    seconds: float
    # of ``ids``, the leading positions the cache already held from the sequence before and kept
    # (``prefill``): the forward read only the rest
    cached: int = 0


class CachedPositions:
    """The bookkeeping of a runner's cache: ``held`` (the ids at the cached positions, in
    order; ``length`` is their count), ``prefilled`` (the first forward into the empty cache,
    while the cache holds it as written) and ``alike`` (how many leading positions one row kind
    ``alike_kind`` wrote). A runner calls ``_wrote`` after each forward and says, in
    ``row_kind``, how a forward of ``m`` tokens computes its rows."""

    held: list[int]
    prefilled: Prefill | None
    alike: int
    alike_kind: Hashable | None

    def _empty_positions(self) -> None:
        self.held, self.prefilled, self.alike, self.alike_kind = [], None, 0, None

    def row_kind(self, m: int) -> Hashable | None:
        """How a forward of ``m`` tokens computes each row; ``None`` where its rows mix."""
        return None

    @property
    def length(self) -> int:
        """Token positions held in the cache."""
        return len(self.held)

    def reset(self) -> None:
        self._empty_positions()

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds only the first ``length`` positions."""
        if length < 0:
            raise ValueError("length must be >= 0")
        del self.held[length:]
        self.alike = min(self.alike, length)
        if self.prefilled is not None and length < len(self.prefilled.ids):
            self.prefilled = None

    def _took(self, source: CachedPositions, ids: list[int]) -> None:
        """The empty cache was given ``source``'s first ``len(ids)`` positions (``ids``) as
        ``source`` holds them: written by its row kind (``exact_prefix``)."""
        if self.held:
            raise ValueError("positions are taken into an empty cache only")
        self.held.extend(ids)
        self.alike, self.alike_kind = len(ids), source.alike_kind

    def _wrote(self, ids: list[int], kind: Hashable | None, seconds: float) -> None:
        """A forward appended ``ids``, computing their rows as ``kind``; ``seconds``: its time
        (kept as ``prefilled`` where the cache was empty)."""
        if not self.held:
            self.prefilled = Prefill(tuple(ids), seconds)
            self.alike_kind = kind
        if kind is not None and kind == self.alike_kind and self.alike == len(self.held):
            self.alike += len(ids)
        self.held.extend(ids)


def exact_prefix(source: CachedPositions, runner, ids: Sequence[int], same_weights: bool, rest: int = 0) -> int:
    """How many leading positions of ``ids`` ``runner`` may take from ``source``'s cache
    (``runner`` itself, or another runner: ``same_weights`` says whether it computes with the
    same weights) so that, the rest forwarded after them, its cache and logits are bit for bit
    those of one forward of ``ids`` into an empty cache: positions ``source`` holds for the same
    ids, written by the row kind that forward would use, with a rest long enough to be computed
    by that row kind too (a short rest runs as a step does) and of at least ``rest`` tokens (1:
    the caller needs the last position's logits). 0 for a runner of another kind."""
    if not same_weights or not isinstance(runner, CachedPositions):
        return 0
    m = len(ids)
    kind = runner.row_kind(m)
    if kind is None or source.alike_kind != kind:
        return 0
    n = min(common_prefix_len(source.held, ids), source.alike, m - rest)
    while n and n < m and runner.row_kind(m - n) != kind:
        n -= 1
    return n
