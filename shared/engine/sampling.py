"""Target-side token selection: logits warping and the lossless verification rule.

Verification uses a rule that is exact for ANY proposal, including the deterministic,
cache-merged proposals of cross-vocabulary drafting whose true proposal probability is
unknown (the paper's Eq. 2 approximates it; see README, "Why sampling is lossless"):

    a proposed token t at a position whose target distribution is p is accepted with
    probability p(t); on rejection the output is drawn from p with t removed, renormalized.

P(output = x) = Q(x)·p(x) + Σ_{t≠x} Q(t)·(1 − p(t))·p(x)/(1 − p(t)) = p(x) for every proposal
distribution Q, so each committed token follows the target's (warped) distribution exactly.
With greedy decoding (temperature 0) p is a point mass on the argmax and the rule reduces to
argmax matching. Under this rule the acceptance probability of t is p(t), which is largest
when t is the target's most likely token, so the drafter always proposes its own argmax.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering, row-wise.

    ``logits``: ``[rows, vocab]`` float. Columns set to ``-inf`` stay at probability 0.
    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``.
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def verify_sampled(probs: torch.Tensor, proposal: list[int], generator: torch.Generator) -> tuple[int, int]:
    """Apply the point-mass rule along a proposal.

    ``probs``: ``[len(proposal) + 1, vocab]`` warped target distributions, row i for the
    position of ``proposal[i]`` and the last row for the bonus position.
    Returns ``(accepted, next_token)``: how many proposed tokens were accepted, and the token
    that follows them (the resampled correction or the bonus token).
    """
    m = len(proposal)
    if m:
        index = torch.arange(m)
        p_proposed = probs[index, torch.tensor(proposal)]
        uniforms = torch.rand(m, generator=generator, dtype=p_proposed.dtype)
        rejected = (uniforms >= p_proposed).nonzero()
        if len(rejected):
            i = int(rejected[0])
            residual = probs[i].clone()
            residual[proposal[i]] = 0.0
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return m, int(torch.multinomial(probs[m], 1, generator=generator))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a ``[vocab]`` probability row."""
    return int(torch.multinomial(probs, 1, generator=generator))
