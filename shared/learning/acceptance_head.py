"""Learned adaptive drafting (SpecDec++-style), across vocabularies.

``AcceptanceHead`` reads the drafter's last hidden state (after the final norm) at the step
that produced a drafted token and predicts the probability that the target accepts it. That prediction is the acceptance
estimate of the throughput rule (``omnidraft.shared.engine.draft_policy``), calibrated there against
what verification accepted: no fixed threshold decides when drafting stops.

Labels are soft: ``min(1, p(t) / q'(t))`` for the drafter's argmax token ``d`` at a position
whose target-space token ``t = d2t[d]`` is direct-mapped, with ``p`` and ``q'`` at temperature 1
(``p(t)`` from the kept top-k of the target's distribution, 0 outside it). The drafted token of
a position whose argmax has no identical target token gets no label.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn


class AcceptanceHead(nn.Module):
    """A residual MLP ``hidden -> logit`` of acceptance (``hidden_size`` floats in, one out)."""

    def __init__(self, hidden_size: int, width: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.inp = nn.Linear(hidden_size, width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)
        self.trained_steps = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.silu(self.inp(self.norm(hidden)))
        x = x + torch.nn.functional.silu(self.mid(x))
        return self.out(x).squeeze(-1)

    @property
    def ready(self) -> bool:
        """Whether the head has been trained at all (an untrained head must not stop drafts)."""
        return self.trained_steps > 0


class ReplayBuffer:
    """The most recent ``capacity`` (hidden state, label) rows for interleaved head training."""

    def __init__(self, capacity: int = 8192, seed: int = 0) -> None:
        self.hidden: deque[torch.Tensor] = deque()
        self.labels: deque[torch.Tensor] = deque()
        self.size = 0
        self.capacity = capacity
        self.generator = torch.Generator().manual_seed(seed)

    def push(self, hidden: torch.Tensor, labels: torch.Tensor) -> None:
        if labels.numel() == 0:
            return
        self.hidden.append(hidden.detach().float())
        self.labels.append(labels.detach().float())
        self.size += labels.numel()
        while self.size - self.labels[0].numel() >= self.capacity:
            self.size -= self.labels.popleft().numel()
            self.hidden.popleft()

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.cat(list(self.hidden))
        labels = torch.cat(list(self.labels))
        idx = torch.randint(0, labels.numel(), (min(batch, labels.numel()),), generator=self.generator)
        return hidden[idx], labels[idx]


def soft_labels(
    draft_logits: torch.Tensor, index_of_draft: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, keep)``: ``min(1, p(t)/q'(t))`` for each row's drafter argmax (see module doc).

    ``draft_logits`` [n, drafter vocab]; ``index_of_draft`` maps drafter ids to intersection
    indices (-1 outside); ``top_idx``/``top_logp`` [n, k]: the target's top-k intersection
    indices and full-vocabulary log-probs at each row. ``keep`` marks rows with a label.
    """
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    logq_max, arg = logq.max(dim=-1)
    inter = index_of_draft[arg]
    keep = inter >= 0
    hit = top_idx == inter[:, None]
    logp = torch.where(hit.any(dim=-1), (top_logp * hit).sum(dim=-1), torch.full_like(logq_max, float("-inf")))
    return (logp - logq_max).exp().clamp(max=1.0), keep
