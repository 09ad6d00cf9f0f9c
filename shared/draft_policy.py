"""When to stop drafting: maximize expected committed tokens per unit of time.

``CostAwareStop`` replaces a fixed confidence threshold with the machine's measured costs
(``omnidraft.shared.profiling.CostProfile``) and the acceptance measured online.

After the drafter has proposed ``n`` tokens with confidences ``c_1..c_n`` (its top
probability), with ``a(c)`` the calibrated probability that a drafted token is accepted given
that the ones before it were, ``P_i = a(c_1)...a(c_i)`` and ``r`` the target tokens per drafter
token (measured), a verification now commits in expectation

    E_n = 1 + r * (P_1 + ... + P_n)  target tokens   in   t_n = o + n * d + T(1 + r * n)  ms

(``d`` the drafter's ms per token, ``T(b)`` the target's ms for a block of ``b`` tokens). The
next tokens are expected to be accepted with ``a(c_n)`` each (their confidences are not known
before paying for them): ``j`` more give ``E_{n+j} = E_n + r * P_n * (a + ... + a^j)`` in
``t_{n+j} = t_n + j d + T(1 + r(n+j)) - T(1 + r n)``. Drafting continues while some
``j <= k_max - n`` gives ``E_{n+j} / t_{n+j} > E_n / t_n`` (looking further than one token
keeps a bump in the measured block costs from stopping a draft that would pay two tokens on).
On a machine where verifying 16 tokens costs what one does, it drafts long; where the block
cost grows steeply (bf16 emulated on AVX2), it drafts short.

A round also pays fixed work outside those two forwards (re-feeding the drafter the committed
tokens, translation, logits masking, bookkeeping): its cost ``o`` is learned as the measured
round time minus the modelled one (an exponential average) and added to every ``t_n``; a fixed
cost per round favours longer drafts. ``d`` starts at the profile's drafter step and follows the drafter steps timed during decoding
(an exponential average: a step in the decoder also pays Python and logits work the profile's
bare forward does not). ``a(c)`` is calibrated per confidence bucket (10 buckets on [0, 1]) from what verification
accepted, starting from the prior ``a(c) = c`` worth ``PRIOR_WEIGHT`` observations. A drafted
token counts as accepted when the target accepted every byte of its text; tokens after the first
rejection are not observed (their conditional acceptance is unknown).
"""

from __future__ import annotations

import time

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
        self.overhead_ms = 0.0  # measured fixed cost per round o
        self._last_round: float | None = None
        self._drafted = 0
        self._proposed = 0
        # T(1 + r n) is looked up per drafted token: precompute on a grid of block sizes
        self._cost = [profile.target_cost(1 + 0.25 * i) for i in range(4 * max_block + 1)]
        self._max = len(self._cost) - 1
        self.begin()

    # -- per round ---------------------------------------------------------------------------
    def begin(self, k_max: int = 16) -> None:
        """Start a new drafting round of at most ``k_max`` drafter tokens."""
        self._k_max = k_max
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
        r, d = self.target_per_draft, self.drafter_ms
        n = self._n = self._n + 1
        self._p *= a
        self._e += r * self._p
        o = self.overhead_ms
        t_now = o + n * d + self._target_ms(1 + r * n)
        e_more, p_more = self._e, self._p
        for j in range(1, self._k_max - n + 1):
            p_more *= a
            e_more += r * p_more
            if e_more * t_now > self._e * (o + (n + j) * d + self._target_ms(1 + r * (n + j))):
                return True
        return False

    def time_step(self, ms: float) -> None:
        """Record the measured wall time of one drafter step (ms)."""
        self.drafter_ms += 0.05 * (ms - self.drafter_ms)

    def start_sequence(self) -> None:
        """A new generation starts (its prompt prefill is no round: not timed)."""
        self._last_round = None

    def observe(self, accepted_drafts: int, drafted: int, proposed: int) -> None:
        """After verification: the first ``accepted_drafts`` drafted tokens of the round were
        accepted; ``drafted`` drafter tokens became ``proposed`` target tokens. Rounds are
        timed from one ``observe`` to the next."""
        now = time.perf_counter()
        if self._last_round is not None:
            modelled = drafted * self.drafter_ms + self._target_ms(1 + proposed)
            self.overhead_ms = max(0.0, self.overhead_ms + 0.1 * ((now - self._last_round) * 1000
                                                                  - modelled - self.overhead_ms))
        self._last_round = now
        for i, c in enumerate(self.confidences[: accepted_drafts + 1]):
            b = min(int(c * BUCKETS), BUCKETS - 1)
            self.seen[b] += 1.0
            self.accepted[b] += 1.0 if i < accepted_drafts else 0.0
        self._drafted += drafted
        self._proposed += proposed
        if self._drafted:
            self.target_per_draft = max(self._proposed / self._drafted, 0.25)

    def calibration(self) -> dict:
        """What this stopper learned, to persist with a device's state (JSON-able)."""
        return {"accepted": self.accepted, "seen": self.seen, "drafted": self._drafted,
                "proposed": self._proposed, "target_per_draft": self.target_per_draft,
                "drafter_ms": self.drafter_ms, "overhead_ms": self.overhead_ms}

    def load_calibration(self, saved: dict) -> None:
        """Restore :meth:`calibration`; raises ValueError when it does not fit."""
        try:
            accepted = [float(x) for x in saved["accepted"]]
            seen = [float(x) for x in saved["seen"]]
            values = {k: float(saved[k]) for k in ("drafted", "proposed", "target_per_draft",
                                                    "drafter_ms", "overhead_ms")}
        except (KeyError, TypeError, ValueError):
            raise ValueError("saved draft-stop calibration is malformed") from None
        if len(accepted) != BUCKETS or len(seen) != BUCKETS or min(seen) <= 0:
            raise ValueError("saved draft-stop calibration does not fit")
        self.accepted, self.seen = accepted, seen
        self._drafted, self._proposed = values["drafted"], values["proposed"]
        self.target_per_draft = values["target_per_draft"]
        self.drafter_ms, self.overhead_ms = values["drafter_ms"], values["overhead_ms"]

    def state(self) -> dict:
        """The calibration as JSON-able numbers (for reports)."""
        return {"acceptance_by_confidence": [round(a / s, 4) for a, s in zip(self.accepted, self.seen)],
                "observations": [round(s - PRIOR_WEIGHT) for s in self.seen],
                "target_per_draft": round(self.target_per_draft, 4),
                "drafter_ms": round(self.drafter_ms, 3), "overhead_ms": round(self.overhead_ms, 3)}
