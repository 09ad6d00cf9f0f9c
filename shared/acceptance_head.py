"""Learned adaptive drafting (SpecDec++-style), across vocabularies.

``AcceptanceHead`` reads the drafter's last hidden state (after the final norm) at the step
that produced a drafted token and predicts the probability that the target accepts it. The
drafter stops when ``P(any rejection so far) = 1 - prod_i sigmoid(f(e_i))`` exceeds ``gamma``.

Labels are soft: ``min(1, p(t) / q'(t))`` for the drafter's argmax token ``d`` at a position
whose target-space token ``t = d2t[d]`` is direct-mapped, with ``p`` and ``q'`` at temperature 1
(``p(t)`` from the kept top-k of the target's distribution, 0 outside it). The drafted token of
a position whose argmax has no identical target token gets no label.

``GammaTuner`` picks ``gamma`` online from measured tokens per second instead of a constant
chosen per task by hand: an epsilon-greedy bandit over a few thresholds, scored on the mean
throughput of its recent generations. One arm (``None``) is the drafter's own confidence rule
without the head, so a head that does not pay off loses to it and stops being used.
"""

from __future__ import annotations

import random
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


def soft_labels(draft_logits: torch.Tensor, index_of_draft: torch.Tensor, top_idx: torch.Tensor,
                top_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class GammaTuner:
    """Epsilon-greedy choice of the stopping threshold from measured tokens per second."""

    def __init__(self, candidates: tuple[float | None, ...] = (None, 0.3, 0.5, 0.7, 0.9), epsilon: float = 0.15,
                 window: int = 16, seed: int = 0) -> None:
        self.candidates = tuple(candidates)
        self.epsilon = epsilon
        self.history: dict[float, deque[float]] = {g: deque(maxlen=window) for g in self.candidates}
        self.rng = random.Random(seed)

    def best(self) -> float | None:
        """The threshold with the highest mean recent throughput (untried ones count as 0)."""
        return max(self.candidates, key=lambda g: (sum(self.history[g]) / len(self.history[g]))
                   if self.history[g] else 0.0)

    def choose(self) -> float | None:
        """The threshold for the next generation: each untried one first, then epsilon-greedy."""
        for g in self.candidates:
            if not self.history[g]:
                return g
        if self.rng.random() < self.epsilon:
            return self.rng.choice(self.candidates)
        return self.best()

    def record(self, gamma: float | None, tokens_per_s: float) -> None:
        self.history[gamma].append(float(tokens_per_s))

    def state(self) -> dict:
        return {str(g): list(h) for g, h in self.history.items()}

    def load_state(self, state: dict) -> None:
        for key, values in state.items():
            g = None if key == "None" else float(key)
            if g in self.history:
                self.history[g].extend(float(v) for v in values)
