"""Model-free drafts from the device's own text (``shared/engine/lookup_drafts.py``): the n-gram
index, the two sources and their order, the bounded history, and a lookup keyed on a draft not
committed yet."""

from __future__ import annotations

import pytest

from omnidraft.shared.engine.lookup_drafts import SEPARATOR, LookupDraft, LookupDrafter, NgramLookup


def test_ngram_lookup_finds_the_most_recent_continuation_of_the_longest_match():
    index = NgramLookup(min_n=2, max_n=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # the suffix (1, 2, 3) occurred before, followed by 4 9 2 ...; (2, 3) most recently by 5 6
    assert index.lookup([1, 2, 3], 3) == (3, [4, 9, 2])
    assert index.lookup([7, 2, 3], 2) == (2, [5, 6])
    assert index.lookup([7, 8], 4) == (0, [])
    assert index.lookup([2, 3], 0) == (0, [])
    index.extend([SEPARATOR, 7, 7])
    assert index.lookup([5, 6], 5) == (2, [1, 2, 3])  # never across a separator
    assert index.lookup([3, 7], 2) == (0, [])  # no n-gram spans a separator


def test_lookup_drafter_prefers_this_generation_and_keeps_a_bounded_history():
    lookup = LookupDrafter(capacity=12, min_n=2, max_n=3)
    lookup.start([1, 2, 3, 4])
    lookup.commit([5, 1, 2])
    assert lookup.propose(4) == LookupDraft([3, 4, 5, 1], 2, "context")
    lookup.finish()
    assert lookup.history.tokens == [1, 2, 3, 4, 5, 1, 2]
    lookup.start([8, 9, 1, 2])
    assert lookup.propose(2) == LookupDraft([3, 4], 2, "history")
    lookup.start([1, 2, 7, 1, 2])  # both know (1, 2): this generation's continuation wins
    assert lookup.propose(3) == LookupDraft([7, 1, 2], 2, "context")
    lookup.start([8, 4, 5])  # only the history knows what followed (4, 5)
    assert lookup.propose(3) == LookupDraft([1, 2], 2, "history")
    lookup.start([8, 4, 5], history=False)  # a caller who is not the device's owner
    assert lookup.propose(3) is None
    lookup.start([8, 4, 5])
    lookup.commit([6, 6])
    lookup.finish()  # 7 + 1 + 5 > 12: the oldest generation goes
    assert lookup.history.tokens == [8, 4, 5, 6, 6]
    lookup.remember(list(range(30)))  # a generation longer than the capacity keeps its end
    assert lookup.history.tokens == list(range(18, 30))
    saved = lookup.history_tensor()
    fresh = LookupDrafter(capacity=12, min_n=2, max_n=3)
    fresh.load_history(saved, vocab_size=64)
    assert fresh.history.tokens == lookup.history.tokens
    with pytest.raises(ValueError, match="outside"):
        fresh.load_history(saved, vocab_size=10)
    with pytest.raises(ValueError, match="int32"):
        fresh.load_history(saved.long(), vocab_size=64)


def test_a_lookup_after_a_draft_is_keyed_on_the_draft_s_last_tokens():
    """``propose(k, after=draft)``: the continuation of the generation followed by ``draft``
    (not committed), keyed on the last ``max_n`` tokens of both; the sources and their order
    as for a committed tail, the history only for the device's owner."""
    lookup = LookupDrafter(capacity=64, min_n=2, max_n=3)
    lookup.remember([20, 21, 22, 23, 24])
    lookup.start([1, 2, 3, 4, 5, 6])
    assert lookup.propose(2, after=[2, 3]) == LookupDraft([4, 5], 2, "context")
    assert lookup.propose(3, after=[9, 9, 9, 9, 1, 2]) == LookupDraft([3, 4, 5], 2, "context")  # only its end
    assert lookup.propose(2, after=[6]) == lookup.propose(2) is None  # (5, 6) has no continuation
    assert lookup.propose(2, after=[21, 22]) == LookupDraft([23, 24], 2, "history")
    lookup.start([1, 2, 3], history=False)
    assert lookup.propose(2, after=[21, 22]) is None
    assert lookup.context.tokens == [1, 2, 3]  # a lookup commits nothing
