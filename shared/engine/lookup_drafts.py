"""Model-free drafts: continuations looked up in text the device already has.

Prompt lookup decoding and SuffixDecoding draft without a model: when the last few committed
tokens occurred before, the tokens that followed them then are a free guess at what follows
now. Code repeats itself (names, signatures, imports, a docstring's examples), so such guesses
are often right, and they cost no drafter step.

Lookups run on **target token ids**, so a model-free draft needs no translation and is
verified exactly like a drafter's (the point-mass rule is exact for any proposal: greedy
output stays the target's own, sampling keeps the target's distribution).

- ``NgramLookup`` indexes one token sequence: for every ``n`` in ``[min_n, max_n]`` the n-gram
  maps to the position right after its most recent occurrence (only occurrences that have a
  continuation are indexed).
- ``LookupDrafter`` holds two of them: the current generation's (prompt + output so far,
  rebuilt per generation) and the device's history (its recent prompts and outputs for this
  target: at most ``capacity`` tokens, oldest dropped first; persisted with the device state as
  ``lookup_history.safetensors`` and never sent anywhere). ``propose`` returns the continuation
  of the longest match; at equal length the current generation's beats the history's.

Costs: ``extend`` does ``max_n - min_n + 1`` dict updates per token; ``propose`` at most
``2 * (max_n - min_n + 1)`` dict lookups. Memory: about 100 bytes per indexed n-gram, i.e.
``capacity * (max_n - min_n + 1) * 100`` bytes for the history (10 MB at the default 32,768
tokens and n = 2..4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOOKUP_MODES = ("history", "context", "off")
SEPARATOR = -1  # between generations in the history: no n-gram spans it, no continuation crosses it
_BITS = 20  # token ids < 2**20 pack into one int key per n-gram


@dataclass(frozen=True)
class LookupDraft:
    """A model-free proposal: target ``ids`` that followed the last ``match`` committed tokens
    somewhere in ``source`` (``"context"``: this generation; ``"history"``: earlier ones)."""

    ids: list[int]
    match: int
    source: str


class NgramLookup:
    """Most recent continuation of every ``n``-gram (``min_n <= n <= max_n``) of one sequence."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("lookup n-gram sizes need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[int, int] = {}  # packed n-gram -> index of the token that followed it

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, ids: list[int]) -> None:
        """Append ``ids`` (``SEPARATOR`` allowed) and index the n-grams they complete."""
        tokens, index, lo, hi = self.tokens, self._next, self.min_n, self.max_n
        for t in ids:
            end = len(tokens)  # the n-grams ending just before this token now have a continuation
            if t != SEPARATOR:
                key = 0
                for n in range(1, min(hi, end) + 1):
                    prev = tokens[end - n]
                    if prev == SEPARATOR:
                        break
                    key = key | (prev << (_BITS * (n - 1)))
                    if n >= lo:
                        index[key | (n << (_BITS * n))] = end
            tokens.append(t)

    def lookup(self, tail: list[int], k: int) -> tuple[int, list[int]]:
        """The continuation (at most ``k`` tokens, never across a separator) of the longest
        suffix of ``tail`` indexed here, with that suffix's length; ``(0, [])`` if none."""
        if k < 1:
            return 0, []
        tokens, index = self.tokens, self._next
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            key = 0
            for i, t in enumerate(reversed(tail[-n:])):
                key |= t << (_BITS * i)
            start = index.get(key | (n << (_BITS * n)))
            if start is not None:
                out = tokens[start : start + k]
                if SEPARATOR in out:
                    out = out[: out.index(SEPARATOR)]
                if out:
                    return n, out
        return 0, []


class LookupDrafter:
    """Model-free drafting for one target (see the module docstring)."""

    def __init__(self, capacity: int = 32768, min_n: int = 2, max_n: int = 4) -> None:
        if capacity < 0:
            raise ValueError("the lookup history's capacity must be >= 0 tokens")
        self.capacity = capacity
        self.min_n, self.max_n = min_n, max_n
        self.history = NgramLookup(min_n, max_n)
        self.context = NgramLookup(min_n, max_n)
        self._read_history = True  # this generation may draft from the history (``start``)

    # -- one generation ------------------------------------------------------------------------
    def start(self, prompt_ids: list[int], history: bool = True) -> None:
        """A new generation over ``prompt_ids``; ``history``: whether its drafts may come from the
        device's history (False for a caller who is not the device's owner: how fast a draft
        from it is accepted would tell the caller what the owner wrote)."""
        self.context = NgramLookup(self.min_n, self.max_n)
        self.context.extend(list(prompt_ids))
        self._read_history = history

    def commit(self, ids: list[int]) -> None:
        """Tokens the target committed in this generation."""
        self.context.extend(ids)

    def propose(self, k: int, after: list[int] | tuple[int, ...] = ()) -> LookupDraft | None:
        """The best model-free continuation (at most ``k`` tokens) of the current generation,
        or of the generation followed by ``after`` (target ids not committed yet: a drafter's
        draft that the continuation would extend)."""
        tail = (self.context.tokens[-self.max_n :] + list(after))[-self.max_n :]
        n_ctx, ctx = self.context.lookup(tail, k)
        n_hist, hist = self.history.lookup(tail, k) if self._read_history and len(self.history) else (0, [])
        if n_ctx and n_ctx >= n_hist:
            return LookupDraft(ctx, n_ctx, "context")
        if n_hist:
            return LookupDraft(hist, n_hist, "history")
        return None

    def finish(self) -> None:
        """The generation ended: its prompt and output join the device's history."""
        if self.capacity and self.context.tokens:
            self.remember(self.context.tokens)

    # -- the device's history ------------------------------------------------------------------
    def remember(self, ids: list[int]) -> None:
        """Add one earlier generation (prompt + output ids) to the history, dropping the oldest
        generations beyond ``capacity`` tokens."""
        ids = list(ids[-self.capacity :]) if self.capacity else []
        if not ids:
            return
        if len(self.history) + len(ids) + 1 > self.capacity:
            kept = self.history.tokens[len(self.history) + len(ids) + 1 - self.capacity :]
            if SEPARATOR in kept:  # restart at a generation boundary
                kept = kept[kept.index(SEPARATOR) + 1 :]
            else:
                kept = []
            self.history = NgramLookup(self.min_n, self.max_n)
            self.history.extend(kept)
        if len(self.history):
            self.history.extend([SEPARATOR])
        self.history.extend(ids)

    def history_tensor(self) -> torch.Tensor:
        """The history as int32 ids (``SEPARATOR`` between generations), to persist."""
        return torch.tensor(self.history.tokens, dtype=torch.int32)

    def load_history(self, ids: torch.Tensor, vocab_size: int) -> None:
        """Replace the history with saved ids; raises ValueError when they do not fit."""
        if ids.dim() != 1 or ids.dtype != torch.int32:
            raise ValueError("the lookup history must be one row of int32 ids")
        values = ids.tolist()
        if any(t != SEPARATOR and not 0 <= t < vocab_size for t in values):
            raise ValueError(f"the lookup history has ids outside [0, {vocab_size})")
        self.history = NgramLookup(self.min_n, self.max_n)
        self.history.extend(values[-self.capacity :] if self.capacity else [])


def lookup_drafter(mode: str) -> LookupDrafter | None:
    """The drafter of a ``--lookup`` mode: ``history`` (this generation and the device's
    history), ``context`` (this generation only) or ``off`` (None: no model-free drafts)."""
    if mode not in LOOKUP_MODES:
        raise ValueError(f"unknown lookup mode {mode!r}: choose one of {', '.join(LOOKUP_MODES)}")
    if mode == "off":
        return None
    return LookupDrafter(capacity=0) if mode == "context" else LookupDrafter()
