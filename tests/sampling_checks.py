"""A statistical check shared by the sampling tests."""

from __future__ import annotations

import collections

import torch


def assert_follows(counts: collections.Counter, exact: torch.Tensor) -> None:
    """The empirical distribution of ``counts`` (token id -> draws) is within sampling noise of
    ``exact`` in total variation, and never outside its support. The expected TV of an
    n-sample empirical distribution is about sqrt(support / (2 pi n)); the bound allows a
    generous margin but stays far below what a biased rule produces."""
    n = sum(counts.values())
    emp = torch.zeros_like(exact)
    for t, c in counts.items():
        emp[t] = c / n
    tv = 0.5 * float((emp - exact).abs().sum())
    support = int((exact > 0).sum())
    bound = 1.5 * (support / (2 * torch.pi * n)) ** 0.5 + 0.01
    assert tv < bound, (tv, bound)
    assert all(exact[t] > 0 for t in counts)  # nothing outside the (top-p) support
