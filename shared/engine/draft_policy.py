"""One throughput rule: what each round drafts, chosen for the most committed tokens per second.

Every round of speculative decoding picks one of three things (``ThroughputRule.plan``):

- **a plain target step** (draft length zero): 1 token for ``T(1) + s`` ms;
- **a model-free draft** of ``j`` target tokens (``omnidraft.shared.engine.lookup_drafts``):
  ``1 + a + a^2 + ... + a^j`` tokens expected for ``T(1 + j) + s`` ms, with ``a`` the measured
  acceptance of lookups from that source (this generation / the device's history) and of that
  match length; ``j`` is the best prefix of the looked-up continuation. That acceptance is
  counted every round, whichever kind ran: the round's candidate is scored against the tokens
  the target committed (``decoding._agreement``), so a source is measured even while drafter
  rounds win every plan (counted only from its own rounds, a source whose prior undersold it
  was never tried again: a learned state's fast drafter rounds kept the device's history unused);
- **a drafter draft**: expected at the rate of recent drafter rounds (a decayed ratio of the
  tokens they committed to their modelled cost). Feeding the drafter the ``b`` tokens committed
  since it last ran (``D(b)``) is not charged to the choice: it is paid once for all the drafter
  rounds that follow (and the prompt is a prefill, like the target's). Once drafting, the
  drafter stops token by token
  (``keep_drafting``): after ``n`` tokens with acceptance estimates ``a_1..a_n`` and
  ``P_i = a_1...a_i``, with ``r`` target tokens per drafter token (measured), a verification
  commits in expectation ``E_n = 1 + r (P_1 + ... + P_n)`` tokens in
  ``t_n = o + D(b) + n d + T(1 + r n)`` ms; drafting goes on while some ``j <= k_max - n`` more
  tokens raise ``E/t``, each expected at ``a'_n``: the measured acceptance of the token *after*
  one drafted in ``a_n``'s bucket (a second table, counted from the same verifications). A
  learned drafter's hesitant token is often followed by confident ones (a name chosen, the rest
  of the line follows), which ``a_n`` itself would not foresee. When the drafter stops, the
  device's text may continue its draft (a model-free lookup keyed on the draft's last tokens):
  ``extend_draft`` verifies ``j`` of those tokens after the draft in the same block while the
  ``P_n (a + ... + a^j)`` tokens they add are worth their extra rows (a few more rows of a
  block cost little on the native kernels), and the lookup's acceptance is counted from them.

``T(block)``, ``d`` (a drafter step), ``D(block)``, ``o`` and ``s`` (the fixed work of a drafter
round, and of a plain or model-free round, outside the forward passes) come from the machine's
cached ``CostProfile``; acceptance comes from counts.
No wall-clock time taken while decoding enters a decision, so a run is reproducible given its
inputs and the profile.

The per-token acceptance estimate ``a`` of a drafted token is calibrated per bucket of a
feature: the drafter's confidence (its top probability), or, once the device's acceptance head
has trained, the head's predicted acceptance (a separate table; the head feeds this rule and no
fixed threshold overrides it). The confidence is counted on every verified token, the head on
those of the rounds that run it, and a round uses the head only while its calibrated predictions
have had the lower squared error (Brier score) over recent tokens: a head trained on little data
can rank tokens worse than the drafter's own confidence, and then it must not decide; it then
runs in one drafter round of ``HEAD_SCORE_EVERY`` only, to keep being scored (``wants_head``).
Buckets start from the prior ``a(f) = f`` worth ``PRIOR_WEIGHT`` observations. A drafted token
counts as accepted when the target accepted every byte of its text; tokens after the first
rejection are not observed.

**Never slower than the target alone.** The plain step is always a candidate, so when drafter
rounds stop paying (their measured rate falls below ``1 / (T(1) + s)``) they stop being chosen:
speculation pauses. After ``RETRY_ROUNDS`` plain rounds in a row one drafter round is tried
again, so a pause costs at most one unpaid drafter round in ``RETRY_ROUNDS``.

**Following the drafter as it learns.** ``drafter_changed()`` (a local update, a global state
received, another adapter) keeps only ``REFIT_KEEP`` of the drafter's evidence (acceptance per
bucket, at most ``REFIT_CAP`` observations each; the rate of its rounds) and retries it at the next plain round, so the rule re-fits within a
few rounds instead of averaging over drafters that no longer exist. Model-free acceptance does
not depend on the drafter and is kept (an adapter is merged into the drafter's weights, so its
costs do not change). Even without a change, a bucket keeps at most
``MAX_EVIDENCE`` observations' worth (older ones fade), so a slow drift is followed too.
"""

from __future__ import annotations

from omnidraft.shared.engine.profiling import CostProfile

BUCKETS = 10
PRIOR_WEIGHT = 4.0
RATE_DECAY = 0.97  # weight of the previous drafter rounds in the drafter's rate, per round
REFIT_KEEP = 0.25  # share of the drafter's evidence kept when the drafter changes ...
REFIT_CAP = 8.0  # ... and at most this many observations per bucket
MAX_EVIDENCE = 256.0  # observations per bucket beyond which older ones fade (a slow drift is followed)
RETRY_ROUNDS = 16  # plain rounds in a row after which the drafter is tried again
PRIOR_ROUNDS = 4.0  # the drafter's rate starts from this many rounds' worth of a prior (docs/findings.md)
LOOKUP_MATCH_MAX = 8  # match lengths above this share one acceptance cell
MIN_SCORED = 64.0  # drafted tokens a feature is scored on before the head may replace the confidence
HEAD_SCORE_EVERY = 4  # while the confidence decides, the head is run (and scored) in one drafter round of this many
SCORE_DECAY = 0.998  # weight of the previous squared errors, per scored token
CALIBRATION_VERSION = 3  # 3 added the next-token tables (a version 2 calibration loads without them)
PLAIN, LOOKUP, DRAFTER = "target", "lookup", "drafter"


class AcceptanceTable:
    """``P(accepted | bucket)`` as counts on top of a prior worth ``weight`` observations."""

    def __init__(self, prior: list[float], weight: float = PRIOR_WEIGHT) -> None:
        self.prior = list(prior)
        self.weight = weight
        self.accepted = [0.0] * len(prior)
        self.seen = [0.0] * len(prior)

    def rate(self, bucket: int) -> float:
        return (self.weight * self.prior[bucket] + self.accepted[bucket]) / (self.weight + self.seen[bucket])

    def count(self, bucket: int, accepted: bool) -> None:
        if self.seen[bucket] >= MAX_EVIDENCE:
            keep = (MAX_EVIDENCE - 1.0) / self.seen[bucket]
            self.seen[bucket] *= keep
            self.accepted[bucket] *= keep
        self.seen[bucket] += 1.0
        self.accepted[bucket] += 1.0 if accepted else 0.0

    def decay(self, keep: float, cap: float = float("inf")) -> None:
        """Keep ``keep`` of each bucket's evidence, and at most ``cap`` observations of it (the
        prior stays whole)."""
        for b, seen in enumerate(self.seen):
            scale = min(keep, cap / seen) if seen > 0 else 0.0
            self.seen[b] *= scale
            self.accepted[b] *= scale

    def observations(self) -> float:
        return sum(self.seen)

    def to_dict(self) -> dict:
        return {"accepted": self.accepted, "seen": self.seen}

    def load(self, saved: dict) -> None:
        accepted = [float(x) for x in saved["accepted"]]
        seen = [float(x) for x in saved["seen"]]
        if len(accepted) != len(self.prior) or len(seen) != len(self.prior) or min(seen, default=0) < 0:
            raise ValueError("saved acceptance table does not fit")
        self.accepted, self.seen = accepted, seen


def _confidence_prior() -> list[float]:
    return [(b + 0.5) / BUCKETS for b in range(BUCKETS)]


def bucket_of(feature: float) -> int:
    """The calibration bucket of a confidence or predicted acceptance in [0, 1]."""
    return min(max(int(feature * BUCKETS), 0), BUCKETS - 1)


class ThroughputRule:
    """The throughput rule of one (drafter, target) pair on one machine (module docstring)."""

    def __init__(self, profile: CostProfile, max_block: int = 64) -> None:
        self._max_block = max_block
        self.use_profile(profile)
        # per-token acceptance of drafted tokens, by the drafter's confidence or the head's output
        self.tables = {"confidence": AcceptanceTable(_confidence_prior()), "head": AcceptanceTable(_confidence_prior())}
        # acceptance of the token drafted after one in each bucket (from the same prior: until
        # counted, the next token is expected like the current one)
        self.next_tables = {name: AcceptanceTable(_confidence_prior()) for name in self.tables}
        # each feature's decayed squared error of its calibrated predictions, and its weight
        self.scores = {name: [0.0, 0.0] for name in self.tables}
        # model-free drafts: per source, by match length (1..LOOKUP_MATCH_MAX); flat prior 0.5
        self.lookup = {
            source: AcceptanceTable([0.5] * LOOKUP_MATCH_MAX, weight=2.0) for source in ("context", "history")
        }
        self.target_per_draft = 1.0  # r: target tokens per drafter token (measured)
        self._head_skips = HEAD_SCORE_EVERY - 1  # drafter rounds since the head last ran (its first round runs it)
        self._drafted = 0.0
        self._proposed = 0.0
        # the drafter's rate: decayed committed tokens and modelled ms (catch-up feeding excluded)
        # of drafter rounds, starting from PRIOR_ROUNDS rounds of 2 drafted tokens accepted at
        # even odds (a few unlucky first rounds do not pause the drafter for RETRY_ROUNDS steps;
        # one that never gets a token accepted is paused after two)
        prior_tokens = 1.0 + 0.5 + 0.25
        prior_ms = self.overhead_ms + 2 * self.drafter_ms + profile.target_cost(3)
        self._rate_tokens = PRIOR_ROUNDS * prior_tokens
        self._rate_ms = PRIOR_ROUNDS * prior_ms
        self.plain_streak = 0  # plain rounds since the drafter last ran
        self.rounds = {PLAIN: 0, LOOKUP: 0, DRAFTER: 0}
        self.begin()

    def use_profile(self, profile: CostProfile) -> None:
        """Decide from ``profile``'s costs from now on (a re-measured profile). The counted
        evidence is kept."""
        self.profile = profile
        self.drafter_ms = profile.drafter_ms_per_token
        self.overhead_ms = profile.round_overhead_ms  # o of a drafter round
        self.step_overhead_ms = profile.step_overhead_ms  # o of a plain or model-free round
        # T(block) is looked up per drafted token: precompute on a grid of block sizes
        self._cost = [profile.target_cost(1 + 0.25 * i) for i in range(4 * self._max_block + 1)]
        self._max = len(self._cost) - 1

    # -- costs -----------------------------------------------------------------------------------
    def _target_ms(self, block: float) -> float:
        i = min(int(round((block - 1) * 4)), self._max)
        return self._cost[i]

    def round_ms(self, kind: str, proposed: int, drafted: int = 0) -> float:
        """Modelled cost (ms) of one round of ``kind`` that verified ``proposed`` target tokens,
        as the rule weighs it: a drafter round also pays its fixed work and ``drafted`` drafter
        steps; a plain or model-free round its fixed work."""
        return sum(self.round_parts(kind, proposed, drafted))

    def round_parts(self, kind: str, proposed: int, steps: int = 0, feed: int = 0) -> tuple[float, float, float]:
        """Modelled cost (ms) of one round by part: the target's forward of the pending token and
        ``proposed`` ones; the drafter's forwards (a drafter round's: one of ``feed`` tokens and
        ``steps`` one-token steps; none for a plain or model-free round); the round's work
        outside them."""
        target = self._target_ms(1 + proposed)
        if kind == DRAFTER:
            return target, self.profile.drafter_block_cost(feed) + steps * self.drafter_ms, self.overhead_ms
        return target, 0.0, self.step_overhead_ms

    def target_step_ms(self) -> float:
        """Modelled cost (ms) of one token of the target alone (one forward, no drafting)."""
        return self._target_ms(1)

    def plain_rate(self) -> float:
        """Tokens per ms of the target alone, one step per token (the floor every plan beats)."""
        return 1.0 / (self._target_ms(1) + self.step_overhead_ms)

    def drafter_rate(self) -> float:
        """Expected tokens per ms of a drafter round: the decayed ratio of what recent drafter
        rounds committed to their modelled cost (from a prior of ``PRIOR_ROUNDS`` rounds)."""
        return self._rate_tokens / self._rate_ms

    def lookup_acceptance(self, source: str, match: int) -> float:
        return self.lookup[source].rate(min(match, LOOKUP_MATCH_MAX) - 1)

    # -- the choice of a round -------------------------------------------------------------------
    def plan(self, lookup=None, drafter: bool = True) -> tuple[str, int]:
        """What this round drafts: ``("target", 0)`` (a plain step), ``("lookup", j)`` (the first
        ``j`` tokens of ``lookup``, a ``LookupDraft``) or ``("drafter", 0)``. ``drafter``:
        whether a drafter is usable."""
        kind, n, best = PLAIN, 0, self.plain_rate()
        if lookup is not None and lookup.ids:
            n, best = self._best_lookup_prefix(lookup, 1.0, 1.0, self.step_overhead_ms, 1, best)
            kind = LOOKUP if n else PLAIN
        if drafter:
            rate = self.drafter_rate()
            if rate > best or (kind == PLAIN and self.plain_streak >= RETRY_ROUNDS):
                kind, n = DRAFTER, 0
        self.rounds[kind] += 1
        self.plain_streak = 0 if kind == DRAFTER else self.plain_streak + (kind == PLAIN)
        return kind, n

    # -- a drafter round, token by token -----------------------------------------------------------
    def begin(self, k_max: int = 16, refeed: int = 0, head: bool = False) -> None:
        """Start a drafter round of at most ``k_max`` drafter tokens, after feeding ``refeed``
        tokens; ``head``: the acceptance head scores each drafted token too. Its acceptance is
        estimated from the head's output only while the head predicts acceptance better than the
        drafter's confidence (``feature_in_use``)."""
        self._k_max = k_max
        self.feature = self.feature_in_use() if head else "confidence"
        self._table = self.tables[self.feature]
        self._next_table = self.next_tables[self.feature]
        self._fixed_ms = self.overhead_ms + self.profile.drafter_block_cost(refeed)
        self._n = 0
        self._p = 1.0  # P_n
        self._e = 1.0  # E_n
        self.features: dict[str, list[float]] = {"confidence": [], "head": []}

    def wants_head(self) -> bool:
        """Whether the next drafter round runs the acceptance head: every round while it decides
        (``feature_in_use``), else one round in ``HEAD_SCORE_EVERY``, which keeps scoring it (on a
        uniform sample of rounds, so its error stays comparable with the confidence's) at a
        fraction of its cost: its forward was ~1 % of a learned state's decode where it decided
        nothing (SmolLM2-135M drafting, AVX-512 EPYC)."""
        if self.feature_in_use() == "head":
            return True
        self._head_skips += 1
        if self._head_skips < HEAD_SCORE_EVERY:
            return False
        self._head_skips = 0
        return True

    def feature_in_use(self) -> str:
        """``head`` when its calibrated predictions have had a lower squared error than the
        confidence's over at least ``MIN_SCORED`` recent drafted tokens, else ``confidence``."""
        (c_err, c_n), (h_err, h_n) = self.scores["confidence"], self.scores["head"]
        if h_n >= MIN_SCORED and c_n >= MIN_SCORED and h_err / h_n < c_err / c_n:
            return "head"
        return "confidence"

    def calibrated(self, feature: float, table: str = "confidence") -> float:
        """``a(f)``: the measured acceptance of tokens drafted with feature value ``f``."""
        return self.tables[table].rate(bucket_of(feature))

    def keep_drafting(self, confidence: float, head: float | None = None) -> bool:
        """Record the token just drafted (the drafter's top probability and, when the round
        began with ``head``, the head's predicted acceptance); True to draft another one."""
        self.features["confidence"].append(confidence)
        if head is not None:
            self.features["head"].append(head)
        bucket = bucket_of(head if self.feature == "head" else confidence)
        a, a_next = self._table.rate(bucket), self._next_table.rate(bucket)
        r, d, fixed = self.target_per_draft, self.drafter_ms, self._fixed_ms
        n = self._n = self._n + 1
        self._p *= a
        self._e += r * self._p
        t_now = fixed + n * d + self._target_ms(1 + r * n)
        e_more, p_more = self._e, self._p
        for j in range(1, self._k_max - n + 1):
            p_more *= a_next
            e_more += r * p_more
            if e_more * t_now > self._e * (fixed + (n + j) * d + self._target_ms(1 + r * (n + j))):
                return True
        return False

    def extend_draft(self, lookup, proposed: int) -> int:
        """How many tokens of ``lookup`` (a ``LookupDraft`` continuing the draft just ended, which
        became ``proposed`` target tokens) to verify after the draft in the same block.

        They can commit only when the whole draft is accepted (``P_n``), each then at the
        measured acceptance ``a`` of lookups from that source and match length, so ``j`` of them
        add ``P_n (a + ... + a^j)`` expected tokens for ``T(1 + proposed + j) - T(1 + proposed)``
        ms: taken while they raise the round's expected tokens per ms. A verification block
        costs little more for a few more rows (``CostProfile``), so a draft that is likely
        accepted carries the device's own text after it almost for free."""
        if lookup is None or not lookup.ids or self._n == 0:
            return 0
        drafting_ms = self._fixed_ms + self._n * self.drafter_ms
        now = self._e / (drafting_ms + self._target_ms(1 + proposed))
        return self._best_lookup_prefix(lookup, self._e, self._p, drafting_ms, 1 + proposed, now)[0]

    def _best_lookup_prefix(
        self, lookup, expected: float, p: float, fixed_ms: float, block: int, best: float
    ) -> tuple[int, float]:
        """The prefix length ``j`` of ``lookup`` whose round commits the most tokens per ms, and
        that rate: ``expected`` tokens are expected without it and reached with probability ``p``
        (each looked-up token then kept at the lookup's measured acceptance ``a``), in
        ``fixed_ms + T(block + j)`` ms; ``(0, best)`` when no prefix beats ``best``."""
        a = self.lookup_acceptance(lookup.source, lookup.match)
        n = 0
        for j in range(1, len(lookup.ids) + 1):
            p *= a
            expected += p
            rate = expected / (fixed_ms + self._target_ms(block + j))
            if rate > best:
                n, best = j, rate
        return n, best

    # -- what verification said --------------------------------------------------------------------
    def observe(self, accepted_drafts: int, drafted: int, proposed: int, committed: int, extended: int = 0) -> None:
        """After verifying a drafter round: its first ``accepted_drafts`` drafted tokens were
        accepted; ``drafted`` drafter tokens became ``proposed`` target tokens, verified with
        ``extended`` model-free tokens after them (``extend_draft``); ``committed`` tokens were
        committed (accepted + the correction or bonus token)."""
        for name, values in self.features.items():
            table, following, score = self.tables[name], self.next_tables[name], self.scores[name]
            buckets = [bucket_of(f) for f in values[: accepted_drafts + 1]]
            for i, bucket in enumerate(buckets):
                accepted = i < accepted_drafts
                score[0] = score[0] * SCORE_DECAY + (table.rate(bucket) - accepted) ** 2
                score[1] = score[1] * SCORE_DECAY + 1.0
                table.count(bucket, accepted)
                if i:  # the token after one drafted in that bucket
                    following.count(buckets[i - 1], accepted)
        self._drafted += drafted
        self._proposed += proposed
        if self._drafted:
            self.target_per_draft = max(self._proposed / self._drafted, 0.25)
        # catch-up feeding excluded (module docstring): a step per drafted token, though the last
        # is fed at the next round, stands in for the feed of the few tokens a drafter round
        # commits (D(2..4) costs about one step)
        cost = self.round_ms(DRAFTER, proposed + extended, drafted)
        self._rate_tokens = self._rate_tokens * RATE_DECAY + committed
        self._rate_ms = self._rate_ms * RATE_DECAY + cost

    def observe_lookup(self, source: str, match: int, proposed: int, accepted: int) -> None:
        """A model-free draft scored after a round: of its first ``proposed`` tokens (those the
        round could judge), the first ``accepted`` would be (or were) kept."""
        table, cell = self.lookup[source], min(match, LOOKUP_MATCH_MAX) - 1
        for i in range(min(accepted + 1, proposed)):
            table.count(cell, i < accepted)

    def drafter_changed(self) -> None:
        """The drafter's weights changed: keep ``REFIT_KEEP`` of its evidence, retry it soon."""
        for table in (*self.tables.values(), *self.next_tables.values()):
            table.decay(REFIT_KEEP, REFIT_CAP)
        for score in self.scores.values():
            score[0] *= REFIT_KEEP
            score[1] *= REFIT_KEEP
        self._rate_tokens *= REFIT_KEEP
        self._rate_ms *= REFIT_KEEP
        self.plain_streak = RETRY_ROUNDS

    # -- persistence and reports -------------------------------------------------------------------
    def calibration(self) -> dict:
        """What this rule learned, to persist with a device's state (JSON-able)."""
        return {
            "version": CALIBRATION_VERSION,
            "tables": {k: t.to_dict() for k, t in self.tables.items()},
            "next_tables": {k: t.to_dict() for k, t in self.next_tables.items()},
            "scores": {k: list(v) for k, v in self.scores.items()},
            "lookup": {k: t.to_dict() for k, t in self.lookup.items()},
            "drafted": self._drafted,
            "proposed": self._proposed,
            "rate": [self._rate_tokens, self._rate_ms],
        }

    def load_calibration(self, saved: dict) -> None:
        """Restore :meth:`calibration`; raises ValueError when it does not fit."""
        try:
            if saved.get("version") not in (2, CALIBRATION_VERSION):
                raise ValueError
            for name, table in self.tables.items():
                table.load(saved["tables"][name])
            for name, table in self.next_tables.items():
                if "next_tables" in saved:
                    table.load(saved["next_tables"][name])
            scores = {name: [float(x) for x in saved.get("scores", {}).get(name, (0.0, 0.0))] for name in self.tables}
            if any(len(v) != 2 or min(v) < 0 for v in scores.values()):
                raise ValueError
            for name, table in self.lookup.items():
                table.load(saved["lookup"][name])
            drafted, proposed = float(saved["drafted"]), float(saved["proposed"])
            tokens, ms = (float(x) for x in saved["rate"])
            if not (tokens > 0 and ms > 0):
                raise ValueError
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ValueError("saved draft-rule calibration does not fit") from None
        self._drafted, self._proposed = drafted, proposed
        self.scores = scores
        if drafted:
            self.target_per_draft = max(proposed / drafted, 0.25)
        self._rate_tokens, self._rate_ms = tokens, ms

    def state(self) -> dict:
        """The calibration as rounded numbers (for reports)."""

        def rates(t: AcceptanceTable) -> list[float]:
            return [round(t.rate(b), 4) for b in range(len(t.prior))]

        rate = self.drafter_rate()
        return {
            "acceptance_by_confidence": rates(self.tables["confidence"]),
            "acceptance_by_head": rates(self.tables["head"]),
            "next_acceptance_by_confidence": rates(self.next_tables["confidence"]),
            "next_acceptance_by_head": rates(self.next_tables["head"]),
            "squared_error": {k: round(e / n, 4) if n else None for k, (e, n) in self.scores.items()},
            "feature_in_use": self.feature_in_use(),
            "lookup_acceptance_by_match": {k: rates(t) for k, t in self.lookup.items()},
            "observations": {
                k: round(t.observations())
                for k, t in {**self.tables, **{f"lookup-{s}": t for s, t in self.lookup.items()}}.items()
            },
            "target_per_draft": round(self.target_per_draft, 4),
            "drafter_tokens_per_s": round(rate * 1000, 2),
            "target_alone_tokens_per_s": round(self.plain_rate() * 1000, 2),
            "rounds": dict(self.rounds),
        }
