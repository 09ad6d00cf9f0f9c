"""Decoders: the target alone (``ar``) and cross-vocabulary speculative decoding (``omnidraft``).

One round of ``CrossVocabDecoder``:
  0. the throughput rule (``omnidraft.shared.engine.draft_policy.ThroughputRule``: the machine's
     cached costs and the measured acceptance) picks what the round verifies: a plain target
     step, a model-free draft looked up in the text the device already has
     (``omnidraft.shared.engine.lookup_drafts``: already target tokens, steps 1-2 skipped), or a
     drafter draft;
  1. the drafter proposes up to ``k_max`` of its own tokens (its argmax, with KV cache),
     stopping early when one more token no longer raises the expected tokens per second
     (the rule; its acceptance estimate comes from the drafter's confidence or, when the
     device's acceptance head is given, from the head), or with ``draft_stop="confidence"``
     when its confidence falls under ``config.confidence``; with token healing
     (``omnidraft.shared.vocab.token_healing``, on by default) it may first re-spell the last token
     of its context, when the committed text ended inside what it would write as one token;
  2. the drafted block is translated into target tokens (``omnidraft.shared.vocab.translation``:
     the target tokenizer on the drafted text, or the paper's n-gram-cache merge with the
     direct map); the cache is frozen during the round;
  3. one target forward scores the pending token plus the proposal;
  4. verification commits the accepted prefix plus one correction/bonus token (greedy:
     argmax matching; sampling: the point-mass rule of ``omnidraft.shared.engine.sampling``, exact
     for any proposal), so the output is the target's own;
  5. the committed text is re-tokenized for the drafter (``DraftContext``), the drafter KV
     cache is cropped to the longest common prefix, and committed target tokens whose drafter
     tokenization spans >= 2 whole drafter tokens become n-gram cache entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from omnidraft.shared.engine.draft_policy import DRAFTER, LOOKUP, ThroughputRule
from omnidraft.shared.engine.generation import (
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    StopChecker,
)
from omnidraft.shared.engine.lookup_drafts import LookupDrafter
from omnidraft.shared.engine.model_runner import ModelRunner, Runner, prefill
from omnidraft.shared.engine.profiling import StepTimings
from omnidraft.shared.engine.sampling import sample, verify_sampled, warp
from omnidraft.shared.vocab.draft_context import DraftContext, common_prefix_len, text_encoder
from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.vocab.translation import TRANSLATORS, NgramTranslator, TextTranslator, Translator
from omnidraft.shared.vocab.vocab_bridge import VocabBridge


@dataclass
class Draft:
    """One round's drafted block: drafter ``ids``, of which the first ``healing`` only re-spell
    committed text and the first ``overlap`` bytes are committed text (token healing; 0 without
    it). The drafted tokens proper (stop rules, acceptance) are ``ids[healing:]``; ``refeed``
    counts the committed tokens the drafter was fed first, and ``read`` the tokens its first
    forward read (the same, or the prompt at a decode's first drafter round). The round's
    drafter forwards are that one and a step for each drafted token but the last."""

    ids: list[int]
    overlap: int = 0
    healing: int = 0
    refeed: int = 0  # committed drafter tokens fed before drafting (the prompt's prefill not counted)
    read: int = 0  # drafter tokens the round's first forward read, the prompt's prefill included

    @property
    def steps(self) -> int:
        """The round's one-token drafter forwards (the last drafted token is never fed)."""
        return max(len(self.ids) - 1, 0)


LOOKUP_TOKENS = 16  # longest model-free draft looked up per round (the rule may verify fewer)


def _agreement(draft: list[int], committed: list[int]) -> tuple[int, int]:
    """How a draft of target tokens fares against the tokens a round committed: ``(proposed,
    accepted)``, ``proposed`` the draft's tokens that ``committed`` can judge and ``accepted`` its
    leading ones equal to them. The target commits its greedy token, or under sampling one drawn
    from its distribution, at each position, so an equal token is exactly what verification
    would have accepted (under sampling: with the probability verification accepts it)."""
    proposed = min(len(draft), len(committed))
    accepted = 0
    while accepted < proposed and draft[accepted] == committed[accepted]:
        accepted += 1
    return proposed, accepted


def _decode_bytes(token_bytes, ids: list[int]) -> str:
    return b"".join(token_bytes[i] or b"" for i in ids).decode("utf-8", errors="replace")


class _TargetSide:
    """Target runner plus the masking and token selection both decoders share."""

    def __init__(
        self, target: torch.nn.Module | Runner, bridge: VocabBridge, timings: StepTimings | None = None
    ) -> None:
        # a runner (ModelRunner, FastLlamaRunner) is used as given; a bare model gets a ModelRunner
        self.runner: Runner = ModelRunner(target) if isinstance(target, torch.nn.Module) else target
        # the ids no token has (a padded vocabulary's tail): masked by index, since a boolean mask
        # over the whole vocabulary costs 0.15-0.5 ms a forward (blocks of 1-8 tokens)
        self.invalid_ids = bridge.target_invalid_mask.nonzero()[:, 0]
        self.token_bytes = bridge.target_bytes
        self.stop_ids = bridge.target_stop_ids
        self.timings = timings  # forwards timed in use, to check the cost profile (no decisions)
        self.prefill_s = 0.0  # the last prompt's prefill (s)
        self.prefill_reused = False  # the last prompt's prefill was the runner's (``start``)
        self.prompt_cached = 0  # of the last prompt, positions its prefill found in the cache
        self.forward_s = 0.0  # this decode's target forwards, the prefill excluded (timed only)

    def logits(self, ids: list[int]) -> torch.Tensor:
        if self.timings is None:
            logits = self.runner.forward(ids)
        else:
            t0 = time.perf_counter()
            logits = self.runner.forward(ids)
            seconds = time.perf_counter() - t0
            self.forward_s += seconds
            self.timings.record_target(len(ids), seconds * 1000)
        invalid = self.invalid_ids
        if invalid.numel() and invalid[-1] >= logits.shape[-1]:  # logits narrower than the vocabulary
            invalid = invalid[invalid < logits.shape[-1]]
        return logits.index_fill_(-1, invalid, float("-inf"))

    def start(self, prompt_ids: list[int], config: GenerationConfig, on_tokens=None):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        config.validate()
        prefix = prompt_ids[:-1]
        held = getattr(self.runner, "prefilled", None)
        self.prefill_reused = bool(prefix) and held is not None and held.ids == tuple(prefix)
        self.prefill_s = 0.0
        self.prompt_cached = 0
        self.forward_s = 0.0
        if self.prefill_reused:
            # the runner still holds this very prompt's prefill (the same prompt decoded just
            # before on this runner, e.g. the target alone before speculation): start from it,
            # counting the seconds it took when it ran (``GenerationStats.prefills_reused``)
            self.runner.crop(len(prefix))
            self.prefill_s, self.prompt_cached = held.seconds, held.cached
        elif prefix:  # keeps what the cache holds of it where that is exact (``prefill``)
            held = prefill(self.runner, prefix)
            self.prefill_s, self.prompt_cached = held.seconds, held.cached
            if self.timings is not None:
                self.timings.record(self.prefill_s * 1000)
        else:
            self.runner.reset()
        generator = torch.Generator()
        generator.manual_seed(config.seed if config.seed is not None else torch.seed())
        return StopChecker(config, self.stop_ids, self.token_bytes, on_tokens), generator

    def finish(self, stop: StopChecker, stats: GenerationStats, t0: float) -> GenerationResult:
        stats.new_tokens = len(stop.generated)
        stats.wall_s = time.perf_counter() - t0 + (self.prefill_s if self.prefill_reused else 0.0)
        stats.prefill_s = self.prefill_s
        stats.prefills_reused = int(self.prefill_reused)
        stats.prompt_tokens_cached = self.prompt_cached
        stats.target_forward_s = self.forward_s
        text = _decode_bytes(self.token_bytes, stop.generated)
        return GenerationResult(text, list(stop.generated), stop.finish_reason or "length", stats)


class TargetOnlyDecoder:
    """Plain autoregressive decoding with the target: one forward pass per token."""

    def __init__(
        self, target: torch.nn.Module | Runner, bridge: VocabBridge, timings: StepTimings | None = None
    ) -> None:
        self.side = _TargetSide(target, bridge, timings)

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], config: GenerationConfig, on_tokens=None, recorder=None
    ) -> GenerationResult:
        """``on_tokens(ids)`` is called with each step's committed ids (see ``StopChecker``).
        ``recorder`` (``training_signal.SignalRecorder``): each step's row, as a speculative
        decode's verification records the rows of the tokens it commits."""
        t0 = time.perf_counter()
        stop, generator = self.side.start(prompt_ids, config, on_tokens)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        pending = prompt_ids[-1]
        while not stop.done:
            logits = self.side.logits([pending])
            stats.target_calls += 1
            if config.greedy:
                pending = int(logits[-1].argmax())
            else:
                pending = sample(warp(logits[-1:], config.temperature, config.top_p)[0], generator)
            if recorder is not None:
                recorder.record(logits[-1:], [pending])
            stop.extend([pending])
        return self.side.finish(stop, stats, t0)


class CrossVocabDecoder:
    """Cross-vocabulary speculative decoding of a target with a drafter of another vocabulary.

    ``rule``: the throughput rule (``config.draft_stop`` ``cost``/``auto``); without one,
    drafting stops on the confidence threshold and every round drafts. ``lookup``: model-free
    drafts from the device's text (used under the rule only). ``head``: a trained acceptance
    head whose predicted acceptance feeds the rule instead of the drafter's confidence.
    ``timings``: forwards timed in use (profile check; never read by a decision).
    ``lookup_tails``: a drafter's draft carries the lookup's continuation of it when the rule
    finds it worth its rows (``ThroughputRule.extend_draft``; False only to measure what that adds)."""

    def __init__(
        self,
        drafter: torch.nn.Module | Runner,
        draft_tokenizer,
        target: torch.nn.Module | Runner,
        bridge: VocabBridge,
        cache: NgramCache,
        *,
        expand_map: dict[int, tuple[int, ...]] | None = None,
        translate: str = "text",
        target_tokenizer=None,
        head: torch.nn.Module | None = None,
        grow_cache: bool = True,
        rule: ThroughputRule | None = None,
        lookup: LookupDrafter | None = None,
        heal: bool = True,
        timings: StepTimings | None = None,
        lookup_tails: bool = True,
    ) -> None:
        # a runner (ModelRunner, FastLlamaRunner) is used as given; a bare model gets a ModelRunner
        self.drafter: Runner = ModelRunner(drafter) if isinstance(drafter, torch.nn.Module) else drafter
        self.side = _TargetSide(target, bridge, timings)
        self.timings = timings
        self.bridge = bridge
        self.cache = cache
        self._encode = text_encoder(draft_tokenizer)
        encode_target = text_encoder(target_tokenizer) if target_tokenizer is not None else None
        self.translate: Translator
        if translate == "ngram":
            self.translate = NgramTranslator(bridge, cache, expand_map or {}, encode_target)
        elif translate == "text":
            if target_tokenizer is None:
                raise ValueError("the text translator needs the target tokenizer")
            self.translate = TextTranslator(bridge, encode_target)
        else:
            raise ValueError(f"unknown translator {translate!r}: choose one of {', '.join(TRANSLATORS)}")
        self.head = head
        self.grow_cache = grow_cache  # False: committed tokens never become cache entries
        self.rule = rule
        self.lookup = lookup
        self.healer = bridge.draft_healer if heal else None  # token healing (None: off)
        self.lookup_tails = lookup_tails  # a draft may carry the lookup's continuation of it

    def _active_rule(self, config: GenerationConfig) -> ThroughputRule | None:
        """The throughput rule when this request uses it."""
        if config.draft_stop == "confidence":
            return None
        if self.rule is None and config.draft_stop == "cost":
            raise ValueError("draft_stop 'cost' needs a decoder with a cost profile (Engine.omnidraft)")
        return self.rule

    # -- drafting --------------------------------------------------------------------------
    def _draft(
        self,
        context_ids: list[int],
        fed: list[int],
        config: GenerationConfig,
        stats: GenerationStats,
        rule: ThroughputRule | None,
        heal: bool,
        prefill: bool = False,
    ) -> tuple[Draft, list[int]]:
        """Propose up to ``k_max`` drafter tokens after ``context_ids`` (healing tokens aside).

        ``fed`` lists the ids whose keys/values sit in the drafter KV cache; ``heal``: whether
        the last context token may be re-spelled; ``prefill``: the drafter's first round in this
        sequence, whose context forward is the prompt's prefill (not a cost of the round). Returns the drafted
        block and the new ``fed`` list.
        """
        heal = heal and self.healer is not None and len(context_ids) >= 2
        rows = 2 if heal else 1  # with healing, also the logits that predicted the last token
        keep = min(common_prefix_len(fed, context_ids), len(context_ids) - rows)
        self.drafter.crop(keep)
        fed = context_ids[:]
        t0 = time.perf_counter()
        out = self.drafter.forward(context_ids[keep:], logits_to_keep=rows)
        if self.timings is not None:
            seconds = time.perf_counter() - t0
            stats.drafter_forward_s += seconds
            self.timings.record(seconds * 1000)
        logits = out[-1]
        pending = b""  # committed bytes the next drafted token must re-spell
        if heal:
            last = context_ids[-1]
            allowed = self.healer.candidates(self.bridge.draft_bytes[last] or b"")
            if allowed.numel() > 1 and int(allowed[out[0].index_select(0, allowed).argmax()]) != last:
                self.drafter.crop(len(context_ids) - 1)  # re-draft the last token
                fed.pop()
                logits, pending = out[0], self.bridge.draft_bytes[last]
                stats.healed_rounds += 1
        # what the drafter was fed first counts as a fixed cost of this round (not the prompt:
        # that is a prefill)
        draft = Draft([], refeed=len(context_ids) - keep if keep and not prefill else 0, read=len(context_ids) - keep)
        # the head feeds the rule only, and runs where the rule asks (``wants_head``)
        head = self.head if rule is not None and self.head is not None and rule.wants_head() else None
        head_current = not pending  # the runner's last hidden state is the one that predicts `logits`
        if rule is not None:
            rule.begin(config.k_max, draft.refeed, head=head is not None)
        timings = self.timings
        while True:
            stats.drafter_steps += 1
            if pending:
                # first the last context token's candidates, then what completes a dropped space
                allowed = self.healer.extensions(pending) if draft.ids else self.healer.candidates(pending)
                logits = torch.full_like(logits, float("-inf")).index_copy_(0, allowed, logits.index_select(0, allowed))
            conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)
            tok = int(tok)
            draft.ids.append(tok)
            healing_only = False
            if pending:  # healing: the token (one of `allowed`) covers committed bytes first
                size = len(self.bridge.draft_bytes[tok])
                used = min(size, len(pending))
                draft.overlap += used
                pending = pending[used:]
                healing_only = used == size
            if healing_only:
                draft.healing += 1
            else:
                if rule is not None:
                    predicted = None  # the head's predicted acceptance of this token
                    if head is not None:
                        predicted = float(torch.sigmoid(head(self.drafter.last_hidden()))) if head_current else 1.0
                    stop = not rule.keep_drafting(float(conf), predicted)
                else:
                    stop = float(conf) < config.confidence
                if stop or len(draft.ids) - draft.healing >= config.k_max:
                    return draft, fed
            if timings is None:
                logits = self.drafter.forward([tok], logits_to_keep=1)[-1]
            else:
                t0 = time.perf_counter()
                logits = self.drafter.forward([tok], logits_to_keep=1)[-1]
                seconds = time.perf_counter() - t0
                stats.drafter_forward_s += seconds
                timings.record_drafter_step(seconds * 1000)
            fed.append(tok)
            head_current = True

    # -- the loop --------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_text: str,
        prompt_ids: list[int],
        config: GenerationConfig,
        recorder=None,
        on_tokens=None,
        remember: bool = True,
        history: bool = True,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt_text`` (tokenized for the target as ``prompt_ids``).

        With a ``recorder`` (``training_signal.SignalRecorder``) the verification rows of every
        committed token are kept and the result carries a ``training_sample``. ``on_tokens(ids)``
        is called with each round's committed ids (streaming; an exception it raises aborts).
        ``remember``: the prompt and output join the lookup history afterwards (False for an
        evaluation that must not see its own earlier outputs); ``history``: model-free drafts
        may come from the lookup history (False for a caller who is not the device's owner).
        """
        t0 = time.perf_counter()
        stop, generator = self.side.start(prompt_ids, config, on_tokens)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        context = DraftContext(self._encode, self.bridge.draft_bytes, prompt_text)
        if not context.ids:
            raise ValueError("the prompt has no complete drafter token")
        # what the drafter's cache holds from the previous sequence (a runner that tracks it):
        # the new prompt's first round forwards only what it does not share with it
        held = getattr(self.drafter, "held", None)
        if held is None:
            self.drafter.reset()
        if self.head is not None:
            self.drafter.track_hidden()
        fed: list[int] = list(held) if held is not None else []
        prefilled = False  # the drafter has been given this prompt (its first round forwards it)
        pending = prompt_ids[-1]
        target_bytes = self.bridge.target_bytes
        rule = self._active_rule(config)
        lookup = self.lookup if rule is not None else None
        if lookup is not None:
            lookup.start(prompt_ids, history)
        draft = Draft([])
        # this decode under the cost profile (GenerationStats.modelled_s), by part (ms)
        modelled_target = modelled_drafter = modelled_rest = 0.0
        while not stop.done:
            budget = config.max_new_tokens - len(stop.generated)
            kind, n = DRAFTER, 0
            found = tail = None
            extended = 0  # model-free tokens verified after the drafter's draft (``extend_draft``)
            if rule is not None:
                found = lookup.propose(min(LOOKUP_TOKENS, budget - 1)) if lookup is not None and budget > 1 else None
                kind, n = rule.plan(found)
            units = []
            if kind == DRAFTER:
                # the prompt's end is a boundary both models were given: heal from the first commit on
                draft, fed = self._draft(
                    context.ids, fed, config, stats, rule, heal=bool(stop.generated), prefill=not prefilled
                )
                prefilled = True
                units = self.translate(draft.ids, draft.overlap)[: max(0, budget - 1)]
                proposal = [u.target_id for u in units]
                if self.lookup_tails and lookup is not None and proposal and len(proposal) < budget - 1:
                    # the device's own text may continue the draft: verified after it, same block
                    tail = lookup.propose(min(LOOKUP_TOKENS, budget - 1 - len(proposal)), after=proposal)
                    extended = rule.extend_draft(tail, len(proposal))
                    proposal += tail.ids[:extended] if extended else []
            elif kind == LOOKUP:
                proposal = found.ids[:n]
                stats.lookup_rounds += 1
            else:
                proposal = []
                stats.plain_rounds += 1
            base = self.side.runner.length
            logits = self.side.logits([pending] + proposal)
            stats.target_calls += 1
            if config.greedy:
                best = logits.argmax(dim=-1).tolist()
                accepted = 0
                while accepted < len(proposal) and proposal[accepted] == best[accepted]:
                    accepted += 1
                nxt = best[accepted]
            else:
                accepted, nxt = verify_sampled(warp(logits, config.temperature, config.top_p), proposal, generator)
            stats.proposed_tokens += len(proposal)
            stats.accepted_tokens += accepted
            if rule is not None:  # (a plain or model-free round's cost does not read the draft)
                # the drafter's forwards as they ran, its prompt read included (``observe`` differs)
                t_ms, d_ms, r_ms = rule.round_parts(kind, len(proposal), draft.steps, draft.read)
                modelled_target += t_ms
                modelled_drafter += d_ms
                modelled_rest += r_ms
            verified = proposal[:accepted] + [nxt]
            if kind == DRAFTER:
                drafted = len(proposal) - extended  # target tokens the drafter's draft became
                if rule is not None:
                    rule.observe(
                        self._accepted_drafts(draft, proposal[: min(accepted, drafted)]),
                        len(draft.ids) - draft.healing,
                        drafted,
                        accepted + 1,
                        extended,
                    )
                    if tail is not None and accepted >= drafted:  # the draft was accepted whole
                        rule.observe_lookup(tail.source, tail.match, *_agreement(tail.ids, verified[drafted:]))
                stats.tail_proposed += extended
                stats.tail_accepted += max(0, accepted - drafted)
                for unit in units[:accepted]:
                    if unit.ngram:
                        stats.ngram_hits += 1
                        self.cache.record_hit(draft.ids[unit.draft_start : unit.draft_start + unit.draft_len])
            elif kind == LOOKUP:
                stats.lookup_proposed += len(proposal)
                stats.lookup_accepted += accepted
            if found is not None and found.ids:
                # the model-free candidate is scored against what the target committed, whichever
                # round ran: its acceptance is measured even while drafter rounds win every plan
                rule.observe_lookup(found.source, found.match, *_agreement(found.ids, verified))
            committed = stop.extend(verified)
            if recorder is not None:
                recorder.record(logits, committed)
            # the target cache keeps the pending token and the accepted proposal; the last
            # committed token becomes the new pending one
            self.side.runner.crop(base + 1 + accepted)
            pending = committed[-1]
            if lookup is not None:
                lookup.commit(committed)
            if stop.done:
                break
            for index, draft_span in context.commit([target_bytes[t] or b"" for t in committed]):
                if self.grow_cache:
                    self.cache.add(draft_span, committed[index])
        if lookup is not None and remember:
            lookup.finish()
        result = self.side.finish(stop, stats, t0)
        if rule is not None:
            stats.modelled_s = (modelled_target + modelled_drafter + modelled_rest) / 1000
            stats.modelled_target_s, stats.modelled_drafter_s = modelled_target / 1000, modelled_drafter / 1000
            stats.modelled_target_alone_s = stats.new_tokens * rule.target_step_ms() / 1000
        if recorder is not None:
            context.commit([target_bytes[t] or b"" for t in committed])
            result.training_sample = recorder.finish(context, len(prompt_text.encode("utf-8")), target_bytes)
        return result

    def _accepted_drafts(self, draft: Draft, accepted: list[int]) -> int:
        """How many drafted tokens proper (healing tokens aside) the accepted target tokens
        spell in full (bytes)."""
        budget = draft.overlap + sum(len(self.bridge.target_bytes[t] or b"") for t in accepted)
        draft_bytes, n = self.bridge.draft_bytes, 0
        for j, d in enumerate(draft.ids):
            budget -= len(draft_bytes[d] or b"") if d < len(draft_bytes) else 0
            if budget < 0:
                break
            n += j >= draft.healing
        return n
