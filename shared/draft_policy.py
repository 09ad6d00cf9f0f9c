"""When to stop drafting: maximize expected committed tokens per unit of time.

``CostAwareStop`` replaces a fixed confidence threshold with the machine's measured costs
(``omnidraft.shared.profiling.CostProfile``) and the acceptance measured online.

After the drafter has proposed ``n`` tokens with confidences ``c_1..c_n`` (its top
probability), with ``a(c)`` the calibrated probability that a drafted token is accepted given
that the ones before it were, ``P_i = a(c_1)...a(c_i)`` and ``r`` the target tokens per drafter
token (measured), a verification now commits in expectation

    E_n = 1 + r * (P_1 + ... + P_n)  target tokens   in   t_n = n * d + T(1 + r * n)  ms

(``d`` the drafter's ms per token, ``T(b)`` the target's ms for a block of ``b`` tokens). One
more drafter token, expected to be accepted with ``a(c_n)`` (the next confidence is not known
before paying for it), gives ``E_{n+1} = E_n + r * P_n * a(c_n)`` in ``t_{n+1} = t_n + d +
T(1 + r(n+1)) - T(1 + r n)``; drafting continues while ``E_{n+1} / t_{n+1} > E_n / t_n``.
On a machine where verifying 16 tokens costs what one does, it drafts long; where the block
cost grows steeply (bf16 emulated on AVX2), it drafts short.

``a(c)`` is calibrated per confidence bucket (10 buckets on [0, 1]) from what verification
accepted, starting from the prior ``a(c) = c`` worth ``PRIOR_WEIGHT`` observations. A drafted
token counts as accepted when the target accepted every byte of its text; tokens after the first
rejection are not observed (their conditional acceptance is unknown).
"""

from __future__ import annotations

from omnidraft.shared.profiling import CostProfile

BUCKETS = 10
PRIOR_WEIGHT = 4.0


class CostAwareStop:
    """Cost-aware stopping for one drafter/target pair (keeps its calibration across calls)."""

    def __init__(self, profile: CostProfile, max_block: int = 64) -> None:
        self.profile = profile
        self.drafter_ms = profile.drafter_ms_per_token
        self.accepted = [PRIOR_WEIGHT * (b + 0.5) / BUCKETS for b in range(BUCKETS)]
        self.seen = [PRIOR_WEIGHT] * BUCKETS
        self.target_per_draft = 1.0  # measured ratio r (target tokens per drafter token)
        self._drafted = 0
        self._proposed = 0
        # T(1 + r n) is looked up per drafted token: precompute on a grid of block sizes
        self._cost = [profile.target_cost(1 + 0.25 * i) for i in range(4 * max_block + 1)]
        self._max = len(self._cost) - 1
        self.begin()

    # -- per round ---------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a new drafting round."""
        self._n = 0
        self._p = 1.0       # P_n
        self._e = 1.0       # E_n
        self.confidences: list[float] = []

    def _target_ms(self, block: float) -> float:
        i = min(int(round((block - 1) * 4)), self._max)
        return self._cost[i]

    def calibrated(self, confidence: float) -> float:
        """``a(c)``: the measured acceptance of tokens drafted with confidence ``c``."""
        b = min(int(confidence * BUCKETS), BUCKETS - 1)
        return self.accepted[b] / self.seen[b]

    def keep_drafting(self, confidence: float) -> bool:
        """Record the token just drafted with ``confidence``; True to draft another one."""
        self.confidences.append(confidence)
        a = self.calibrated(confidence)
        r = self.target_per_draft
        n = self._n = self._n + 1
        self._p *= a
        self._e += r * self._p
        t_now = n * self.drafter_ms + self._target_ms(1 + r * n)
        e_next = self._e + r * self._p * a
        t_next = (n + 1) * self.drafter_ms + self._target_ms(1 + r * (n + 1))
        return e_next * t_now > self._e * t_next

    def observe(self, accepted_drafts: int, drafted: int, proposed: int) -> None:
        """After verification: the first ``accepted_drafts`` drafted tokens of the round were
        accepted; ``drafted`` drafter tokens became ``proposed`` target tokens."""
        for i, c in enumerate(self.confidences[: accepted_drafts + 1]):
            b = min(int(c * BUCKETS), BUCKETS - 1)
            self.seen[b] += 1.0
            self.accepted[b] += 1.0 if i < accepted_drafts else 0.0
        self._drafted += drafted
        self._proposed += proposed
        if self._drafted:
            self.target_per_draft = max(self._proposed / self._drafted, 0.25)

    def state(self) -> dict:
        """The calibration as JSON-able numbers (for reports)."""
        return {"acceptance_by_confidence": [round(a / s, 4) for a, s in zip(self.accepted, self.seen)],
                "observations": [round(s - PRIOR_WEIGHT) for s in self.seen],
                "target_per_draft": round(self.target_per_draft, 4)}
