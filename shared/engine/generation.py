"""What a generation request asks for, what it returns, and when it stops.

Shared by the target-only (``ar``) decoder and the cross-vocabulary speculative decoder so
both honour EOS, stop strings and ``max_new_tokens`` in exactly the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

DRAFT_STOPS = ("auto", "cost", "confidence")


MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string


@dataclass
class GenerationConfig:
    """Decoding parameters.

    ``temperature`` 0 means greedy. ``k_max`` bounds drafter tokens per round. ``draft_stop``
    decides what a round drafts: ``cost`` is the throughput rule (``omnidraft.shared.engine.draft_policy``:
    a plain target step, a model-free draft or a drafter draft, whichever is expected to commit
    the most tokens per second from the machine's cached costs and the counted acceptance; the
    drafter stops by the same measure); ``confidence`` always drafts with the drafter and stops
    when its probability of its own token falls below ``confidence``; ``auto`` is ``cost`` where
    the decoder has a cost profile, else ``confidence``.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    k_max: int = 10
    confidence: float = 0.4
    draft_stop: str = "auto"

    def validate(self) -> None:
        """Raise ValueError with a one-line message for out-of-range parameters."""
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.k_max < 1:
            raise ValueError("k_max must be >= 1")
        if not 0 <= self.confidence <= 1:
            raise ValueError("confidence must be in [0, 1]")
        if self.draft_stop not in DRAFT_STOPS:
            raise ValueError(f"draft_stop must be one of {', '.join(DRAFT_STOPS)}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop_strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop_strings):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


PARTS = ("target", "drafter", "rest")  # where a decode's time goes: the two models' forwards, the rest


@dataclass
class GenerationStats:
    """Per-call counters. Token counts are target tokens unless named ``drafter``."""

    target_calls: int = 0
    drafter_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    ngram_hits: int = 0
    healed_rounds: int = 0  # rounds that began by re-spelling the context's last drafter token
    lookup_rounds: int = 0  # rounds that verified a model-free draft
    lookup_proposed: int = 0  # target tokens those drafts proposed
    lookup_accepted: int = 0  # and how many of them were accepted
    plain_rounds: int = 0  # rounds that verified no draft (one target step)
    # model-free tokens verified after a drafter's draft in the same block, and how many of them
    # were accepted (``ThroughputRule.extend_draft``; after a rejected draft, none)
    tail_proposed: int = 0
    tail_accepted: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    # seconds from the call to its return; a decode that started from its prompt's prefill still
    # in the target's cache (``prefills_reused``) counts that prefill at the seconds it took when
    # it ran, so decodes of one prompt compare like for like, never a cache hit against a prefill
    wall_s: float = 0.0
    # of wall_s, the target's forward over the prompt (s): the same for every decoder of a prompt,
    # so decode speed (``decode_tokens_per_s``) leaves it out; the drafter's own prompt forward
    # stays in the decode time (it belongs to speculation)
    prefill_s: float = 0.0
    prefills_reused: int = 0  # decodes that started from the prefill the decode before left in the cache
    # prompt tokens the prefill did not read: the target's cache held them from the sequence
    # before (a prompt that begins like the previous one; ``model_runner.prefill``)
    prompt_tokens_cached: int = 0
    # decoding time modelled from the machine's cached cost profile (prompt prefill excluded, s):
    # the rounds this generation ran (each drafter forward as it ran, the drafter's read of the
    # prompt included, as in the live decode time), and the target alone's one step per new
    # token; 0 when the decoder had no profile (the target alone, or a fixed draft rule)
    modelled_s: float = 0.0
    modelled_target_alone_s: float = 0.0
    # of modelled_s, the target's forwards and the drafter's (as target_forward_s and
    # drafter_forward_s are of the live decode)
    modelled_target_s: float = 0.0
    modelled_drafter_s: float = 0.0
    # of the decode (prompt prefill excluded), the seconds in the target's forwards and in the
    # drafter's (its steps, its catch-up on committed tokens, its read of the prompt); the rest
    # is the work of a round outside them. 0 when the decoder did not time its forwards
    target_forward_s: float = 0.0
    drafter_forward_s: float = 0.0

    def add(self, other: GenerationStats) -> None:
        """Accumulate ``other``'s counters and time into this one (totals over many calls)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def tokens_per_target_call(self) -> float | None:
        return self.new_tokens / self.target_calls if self.target_calls else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """New tokens per second after the target's prompt prefill (live; ``prefill_s``)."""
        decode_s = self.wall_s - self.prefill_s
        return self.new_tokens / decode_s if decode_s > 0 else None

    @property
    def decode_time_shares(self) -> dict[str, float] | None:
        """Where the decode's time went (prompt prefill excluded): the shares of the target's
        forwards, the drafter's, and the rest (a round's work outside them); None when the
        forwards were not timed."""
        live = self._live_parts_s()
        if live is None:
            return None
        decode_s = sum(live)
        return {part: s / decode_s for part, s in zip(PARTS, live)}

    def _live_parts_s(self) -> tuple[float, float, float] | None:
        """The decode's seconds (prompt prefill excluded) in the target's forwards, the drafter's
        and the rest; None when the forwards were not timed."""
        decode_s = self.wall_s - self.prefill_s
        if decode_s <= 0 or not self.target_forward_s:
            return None
        return self.target_forward_s, self.drafter_forward_s, decode_s - self.target_forward_s - self.drafter_forward_s

    @property
    def ms_per_target_call(self) -> dict[str, dict[str, float]] | None:
        """Where a target call's decode time went (ms, prompt prefill excluded), live and under
        the cost profile, by part (the target's forwards, the drafter's, the rest): where the two
        part, the profile misprices that part. None unless the forwards were timed and modelled."""
        live = self._live_parts_s()
        if live is None or not self.target_calls or not self.modelled_s:
            return None
        per_call = 1000 / self.target_calls
        modelled = (
            self.modelled_target_s,
            self.modelled_drafter_s,
            self.modelled_s - self.modelled_target_s - self.modelled_drafter_s,
        )
        return {
            name: {part: round(s * per_call, 2) for part, s in zip(PARTS, parts)}
            for name, parts in (("live", live), ("modelled", modelled))
        }

    @property
    def modelled_speedup(self) -> float | None:
        """Modelled speed over the target alone (decoding only; see ``modelled_s``)."""
        return self.modelled_target_alone_s / self.modelled_s if self.modelled_s > 0 else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_target_call=self.tokens_per_target_call,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            decode_time_shares=self.decode_time_shares,
            ms_per_target_call=self.ms_per_target_call,
            modelled_speedup=self.modelled_speedup,
        )
        return out


@dataclass
class GenerationResult:
    """Generated text, the target's generated token ids, why it stopped, and stats."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop_string"
    stats: GenerationStats = field(default_factory=GenerationStats)
    # what the drafter can learn from this generation (``training_signal.TrainingSample``),
    # when the decoder was asked to record it
    training_sample: object | None = None

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


class StopChecker:
    """Decides how many of the newly committed tokens to keep, and whether to stop.

    Semantics (the same as transformers' ``generate``): an EOS token is kept and ends the
    output; a stop string ends the output after the token that completes it; the output
    never exceeds ``max_new_tokens``.
    """

    def __init__(
        self,
        config: GenerationConfig,
        stop_ids: frozenset[int],
        token_bytes,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.on_tokens = on_tokens  # called with the kept ids of every commit (streaming); may raise to abort
        self.max_new_tokens = config.max_new_tokens
        self.stop_ids = stop_ids
        self.stop_bytes = [s.encode() for s in config.stop_strings]
        self.longest_stop = max((len(s) for s in self.stop_bytes), default=0)
        self.token_bytes = token_bytes  # id -> bytes | None
        self.generated: list[int] = []
        self.text = bytearray()
        self.finish_reason: str | None = None

    def extend(self, new_ids: list[int]) -> list[int]:
        """Add committed ids; return the ones kept. Sets ``finish_reason`` when done."""
        kept: list[int] = []
        for tid in new_ids:
            kept.append(tid)
            self.generated.append(tid)
            if tid in self.stop_ids:
                self.finish_reason = "eos"
                break
            if self.stop_bytes:
                start = max(0, len(self.text) - self.longest_stop + 1)
                self.text += self.token_bytes[tid] or b""
                window = bytes(self.text[start:])
                if any(s in window for s in self.stop_bytes):
                    self.finish_reason = "stop_string"
                    break
            if len(self.generated) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.on_tokens is not None and kept:
            self.on_tokens(kept)
        return kept

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
