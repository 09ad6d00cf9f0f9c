"""The point-mass verification rule is exact for any proposal; warping matches transformers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from omnidraft.shared.engine.sampling import verify_sampled, warp


def _empirical(draw, vocab: int, n: int) -> torch.Tensor:
    counts = torch.zeros(vocab)
    for _ in range(n):
        counts[draw()] += 1
    return counts / n


@pytest.mark.parametrize("proposed", [0, 2, 5])
def test_first_position_output_follows_target(proposed):
    """Whatever token is proposed (likely, unlikely or impossible), the output follows p."""
    torch.manual_seed(0)
    vocab = 6
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1, 0.0])
    probs = torch.stack([p, torch.full((vocab,), 1 / vocab)])
    gen = torch.Generator().manual_seed(1)

    def draw():
        accepted, nxt = verify_sampled(probs, [proposed], gen)
        return proposed if accepted == 1 else nxt

    n = 20000
    emp = _empirical(draw, vocab, n)
    tv = 0.5 * float((emp - p).abs().sum())
    assert tv < 0.015, tv
    assert emp[5] == 0  # a zero-probability token is never output, even when proposed


def test_random_proposals_over_two_positions_follow_joint_distribution():
    """A proposal drawn from an arbitrary distribution Q over two positions: the emitted
    pair (first token, second token) follows p1(x) * p2(y) exactly, within noise."""
    vocab = 4
    p1 = torch.tensor([0.5, 0.3, 0.2, 0.0])
    p2 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.05, 0.05, 0.1, 0.8])  # badly mismatched proposal
    probs = torch.stack([p1, p2, torch.full((vocab,), 1 / vocab)])
    gen = torch.Generator().manual_seed(7)
    n = 30000
    counts = torch.zeros(vocab, vocab)
    for _ in range(n):
        prop = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        accepted, nxt = verify_sampled(probs, prop, gen)
        first = prop[0] if accepted >= 1 else nxt
        if accepted == 0:
            second = int(torch.multinomial(p2, 1, generator=gen))  # next round samples it fresh
        elif accepted == 1:
            second = nxt
        else:
            second = prop[1]
        counts[first, second] += 1
    emp = counts / n
    exact = p1[:, None] * p2[None, :]
    tv = 0.5 * float((emp - exact).abs().sum())
    assert tv < 0.02, tv


def test_all_accepted_gives_bonus_from_last_row():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    assert verify_sampled(probs, [1, 2], gen) == (2, 0)
    assert verify_sampled(probs[2:], [], gen) == (0, 0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.2, 0.95)])
def test_warp_matches_transformers_warpers(temperature, top_p):
    torch.manual_seed(3)
    logits = torch.randn(3, 50) * 3
    ours = warp(logits, temperature, top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    theirs = torch.softmax(scores, dim=-1)
    assert torch.allclose(ours, theirs, atol=1e-6)
