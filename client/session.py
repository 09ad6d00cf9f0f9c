"""A device serving one target with the shared drafter, learning from its own traffic.

``DeviceSession`` ties together the engine (drafter + target), the target's LoRA adapter
(``DrafterAdapters``: one per target on the same drafter; several sessions may share one),
the acceptance head, the n-gram cache, the model-free lookup history, the throughput rule, the
online learner and the state directory. ``generate`` decodes with the current adapter/head and,
when learning, hands the generation's training sample to the learner *after* the generation
returned (updates run between requests). Whenever the drafter changes (an update, a loaded
state) the throughput rule re-fits (``ThroughputRule.drafter_changed``). ``save``/``load``
persist everything (``DeviceState``).
"""

from __future__ import annotations

import copy as copy_module
import hashlib
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from omnidraft.client.device_state import DeviceState
from omnidraft.client.online_learner import OnlineConfig, OnlineLearner, UpdateReport
from omnidraft.shared.engine.decoding import CrossVocabDecoder
from omnidraft.shared.engine.draft_policy import ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig, GenerationResult
from omnidraft.shared.engine.lookup_drafts import lookup_drafter
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.engine.recorded_target import RecordedTarget
from omnidraft.shared.engine.recordings import Recording
from omnidraft.shared.learning.acceptance_head import AcceptanceHead
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.learning.training_signal import Intersection, ReplayedSignal, SignalRecorder
from omnidraft.shared.runtime.heap import release_freed_memory
from omnidraft.shared.util.steps import run_to_end


def name_seed(name: str) -> int:
    """A 64-bit seed for torch's generator from a name (the first 8 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


@contextmanager
def seeded(seed: int):
    """Inside, torch's global generator starts from ``seed``; afterwards it is as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class DeviceSession:
    """One (drafter, target) pair on a device (see the module docstring).

    ``learn``: train the adapter online; ``adaptive``: train the acceptance head and, once it
    has trained, feed its predicted acceptance to the throughput rule; ``translate``: the
    proposal translator; ``heal``: token healing when drafting (``omnidraft.shared.vocab.token_healing``);
    ``grow_cache``: add committed n-grams to the cache (off: the cache stays as loaded);
    ``lookup``: model-free drafts from this generation and the device's history (``history``),
    this generation only (``context``) or none (``off``);
    ``state_key``: a key file (created if missing, outside ``state_dir``) that encrypts the
    state at rest (``client.state_key``).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        target_name: str | None = None,
        state_dir=None,
        adapters: DrafterAdapters | None = None,
        lora: LoraSpec = LoraSpec(),
        online: OnlineConfig | None = None,
        translate: str = "text",
        learn: bool = True,
        adaptive: bool = True,
        grow_cache: bool = True,
        state_key=None,
        heal: bool = True,
        lookup: str = "history",
    ) -> None:
        self._settings = dict(
            state_dir=state_dir,
            online=online,
            translate=translate,
            learn=learn,
            adaptive=adaptive,
            grow_cache=grow_cache,
            state_key=state_key,
            heal=heal,
            lookup=lookup,
        )
        self.engine = engine
        self.target = target_name or str(engine.target.path)
        self.drafter_name = engine.drafter_name
        self.translate = translate
        self.heal = heal
        self.learn = learn
        self.adaptive = adaptive
        self.grow_cache = grow_cache
        # the adapters peft injected into this drafter model (another session's on the same
        # engine) are shared, as handed-in ones are: a second wrap would reset them
        if adapters is None and (carried := DrafterAdapters.of(engine.drafter.model)) is not None:
            if carried.spec != lora:
                raise ValueError(f"this engine's drafter already carries adapters with {carried.spec}, not {lora}")
            adapters = carried
        self._owns_adapters = adapters is None  # its own: it may rebuild them with saved LoRA settings
        # a session that builds its own adapters starts a new adapter's LoRA A and a new head from
        # a seed of the drafter and target names (two runs of one command start alike); a caller
        # that hands in the adapters (client.fleet_device) seeds torch's generator itself
        start = seeded(name_seed(f"{self.drafter_name}/{self.target}")) if self._owns_adapters else nullcontext()
        with start:
            self.adapters = adapters or DrafterAdapters(
                engine.drafter.model, lora, drafter_weights=engine.drafter_weights
            )
            self.adapters.add(self.target)
            hidden = engine.drafter.model.config.hidden_size
            self.head = AcceptanceHead(hidden) if adaptive else None
        self.inter = Intersection(engine.bridge, engine.drafter.logit_rows)
        self.lookup = lookup_drafter(lookup)
        self._owner_before = True  # the decode before was the owner's (``generate``)
        config = online or OnlineConfig()
        if not adaptive:
            config = replace(config, head=False)
        self.learner = OnlineLearner(self.adapters, self.target, self.inter, self.head, config)
        cipher = None
        if state_key is not None and state_dir is not None:
            from omnidraft.client.state_key import StateCipher

            cipher = StateCipher(state_key)
        self.state = DeviceState(state_dir, self.drafter_name, self.target, cipher) if state_dir is not None else None
        self.problems: list[str] = []
        self.last_update: UpdateReport | None = None  # set when a generation triggered an update
        self.last_recording: Recording | None = None  # the last live greedy learning decode's (``generate``)
        self.rule: ThroughputRule | None = None  # this device's throughput rule (built on first use)
        self._saved_rule: dict | None = None  # its saved calibration, applied when it is built
        self._refit_pending = False  # the drafter changed after that calibration was saved
        self._cache = None  # a snapshot's own n-gram cache (None: the engine's)
        if self.state is not None:
            self.load()

    @property
    def cache(self):
        """The n-gram cache this session drafts with: the engine's, or a snapshot's own copy."""
        return self._cache if self._cache is not None else self.engine.cache

    def switched(self, engine: Engine, target_name: str) -> DeviceSession:
        """A session for another target (``engine``, sharing this drafter) with this one's
        settings, state directory and drafter adapters, which it takes over: this session is
        not used after (a rollout moved the device)."""
        session = DeviceSession(
            engine, target_name=target_name, adapters=self.adapters, lora=self.adapters.spec, **self._settings
        )
        session._owns_adapters = self._owns_adapters
        return session

    def snapshot(self, label: str) -> DeviceSession:
        """A session over the same engine that decodes with a copy of this one's state as it is
        now, and never learns or saves: the adapter (in its own slot, ``<target>@<label>``), the
        acceptance head, the throughput rule's calibration, the lookup history and the n-gram
        cache. Later changes to either session leave the other as it was; ``omnidraft adapt``
        decodes the state from before training beside the learned one."""
        copy = DeviceSession(
            self.engine,
            target_name=f"{self.target}@{label}",
            adapters=self.adapters,
            lora=self.adapters.spec,
            **{**self._settings, "state_dir": None, "state_key": None, "learn": False},
        )
        copy.adapters.load_state_dict(copy.target, self.adapters.state_dict(self.target))
        self.adapters.activate(self.target)  # adding the copy's slot activated it
        if self.head is not None and copy.head is not None and self.head.ready:
            copy.head.load_state_dict(self.head.state_dict())
            copy.head.trained_steps = self.head.trained_steps
        if self.rule is not None:  # all of it (a saved calibration leaves out a pending retry), on the same profile
            copy.rule = copy_module.deepcopy(self.rule, {id(self.rule.profile): self.rule.profile})
        copy._saved_rule, copy._refit_pending = self._saved_rule, self._refit_pending
        if self.lookup is not None and copy.lookup is not None:
            copy.lookup.load_history(self.lookup.history_tensor(), self.engine.target.logit_rows)
        copy._cache = copy_module.deepcopy(self.cache)
        return copy

    # -- decoding -------------------------------------------------------------------------------
    def drafting_runner(self):
        """The runner the current adapter drafts on (``decoder``'s)."""
        self.adapters.activate(self.target)
        return self.adapters.runner()

    def decoder(self, target=None, rule: bool = True, drafter=None) -> CrossVocabDecoder:
        """A decoder with the current adapter (merged into the drafting runner), the device's
        throughput rule (fed by the acceptance head once it has trained) and its model-free
        lookups. ``target``: a runner that stands in for the engine's target
        (``RecordedTarget``); ``rule=False``: no throughput rule, so no cost profile is read or
        measured (``draft_stop="confidence"`` decodes without it); ``drafter``: a runner on the
        drafting runner's weights to draft on instead (``lockstep``)."""
        runner = self.drafting_runner()
        e = self.engine
        head = self.head if self.head is not None and self.head.ready else None
        if rule:
            self._prepare_rule(runner)
        return CrossVocabDecoder(
            drafter or runner,
            e.drafter.tokenizer,
            target or e.target_runner,
            e.bridge,
            self.cache,
            expand_map=e.expand_map,
            translate=self.translate,
            target_tokenizer=e.target.tokenizer,
            head=head,
            grow_cache=self.grow_cache,
            rule=self.rule if rule else None,
            lookup=self.lookup,
            heal=self.heal,
            timings=e.timings if target is None else None,
        )

    def _prepare_rule(self, runner) -> None:
        """Build the throughput rule on the cost profile of ``runner`` (measured on first use),
        or move the existing one onto it; a saved calibration and a pending re-fit apply here."""
        profile = self.engine.cost_profile(runner)
        if self.rule is not None and self.rule.profile is not profile:
            self.rule.use_profile(profile)
        elif self.rule is None:
            self.rule = ThroughputRule(profile)
            if self._saved_rule:
                try:
                    self.rule.load_calibration(self._saved_rule)
                except ValueError as exc:
                    self.problems.append(f"{exc}: the throughput rule starts uncalibrated")
            if self._refit_pending:
                self.rule.drafter_changed()
                self._refit_pending = False

    @torch.inference_mode(False)
    def generate(
        self,
        prompt: str,
        config: GenerationConfig,
        *,
        chat: bool = False,
        learn: bool | None = None,
        observe: bool = True,
        on_tokens=None,
        replay: Recording | None = None,
        owner: bool = True,
    ) -> GenerationResult:
        """Decode ``prompt``; when learning, feed the learner afterwards (``last_update`` says
        whether that triggered a drafter update) and add the prompt and output to the lookup
        history, unless ``observe`` is False: then the result carries the training sample for a
        later ``learn_from``. Without learning the generation leaves no trace (an evaluation).
        ``on_tokens(ids)`` streams the committed ids.

        ``owner=False``: the caller is not the device's owner (``client.service``). Its decode
        does not learn, drafts nothing from the lookup history, and neither finds the positions
        an owner's decode left in the runners' caches nor leaves its own for the owner's (the
        runners start empty between the two): how fast a prompt is read or a draft accepted
        would tell one of the other's text.

        ``replay`` (greedy ``config``; a learning decode needs the recording's signal): the
        target's recorded decode of this prompt (``recordings``), replayed instead of running
        the target; the decisions, acceptance and training sample are the live ones, the
        wall-clock speed is not (``stats.modelled_s`` is). A live greedy learning decode
        returns its own recording in ``last_recording``."""
        learn = (self.learn if learn is None else learn) and owner
        if not (owner and self._owner_before):  # between a stranger and the owner
            self.engine.target_runner.reset()
            self.drafting_runner().reset()
        self._owner_before = owner
        text, ids = self.engine.prompt_ids(prompt, chat)
        target, recorder = None, SignalRecorder(self.inter) if learn else None
        if replay is not None:
            if not config.greedy or replay.ids[: replay.prompt_tokens] != ids:
                raise ValueError("a replayed decode needs greedy decoding and the recording of this prompt")
            target = RecordedTarget(replay.ids, self.engine.target.logit_rows)
            if learn:
                if replay.signal is None:
                    raise ValueError("a replayed learning decode needs the recording's training signal")
                recorder = ReplayedSignal(self.inter, replay.generated, replay.signal)
        result = self.decoder(target, rule=config.draft_stop != "confidence").generate(
            text, ids, config, recorder=recorder, on_tokens=on_tokens, remember=learn, history=owner
        )
        self.last_recording = None
        if replay is None and recorder is not None and config.greedy and recorder.tokens == result.token_ids:
            self.last_recording = Recording(ids + result.token_ids, len(ids), recorder.signal())
        self.last_update = self.learn_from(result) if learn and observe else None
        return result

    def learn_from(self, result: GenerationResult) -> UpdateReport | None:
        """Feed a learning generation's sample to the learner (which updates the adapter every
        ``interval`` samples); returns the update's report, if one ran."""
        return run_to_end(self.learn_steps(result))

    def learn_steps(self, result: GenerationResult) -> Generator[None, None, UpdateReport | None]:
        """``learn_from``, pausing after each optimizer step of an update
        (``OnlineLearner.update_steps``): a service decodes its requests in the pauses."""
        if result.training_sample is None:
            return None
        report = yield from self.learner.observe_steps(result.training_sample)
        if report is not None:
            self.drafter_changed()
            release_freed_memory()  # the update's activations and gradients: ~0.4 GB kept by glibc otherwise
        return report

    def drafter_changed(self) -> None:
        """The adapter changed (an update, a received global state, another process's save):
        the rule re-fits (now, or when it is built from a calibration saved before the change)."""
        if self.rule is not None:
            self.rule.drafter_changed()
        else:
            self._refit_pending = True

    # -- persistence ----------------------------------------------------------------------------
    def save(self, *, if_unchanged: bool = False) -> bool:
        """Write the state; with ``if_unchanged``, only if no other process saved it since this
        session loaded or saved (returns False then, writing nothing: ``refresh`` adopts it)."""
        if self.state is None:
            raise ValueError("this session has no state directory")
        head = self.head.state_dict() if self.head is not None and self.head.ready else None
        meta = {
            "lora": self.adapters.spec.as_dict(),
            "updates": self.learner.updates,
            "prompts_seen": self.learner.prompts_seen,
            "head_steps": self.head.trained_steps if self.head is not None else 0,
            "throughput_rule": self.rule.calibration() if self.rule is not None else self._saved_rule,
        }
        lookup = self.lookup.history_tensor() if self.lookup is not None else None
        return self.state.save(
            self.adapters.state_dict(self.target),
            head,
            self.engine.cache,
            meta,
            lookup=lookup,
            if_unchanged=if_unchanged,
        )

    def refresh(self) -> bool:
        """Load the state again if another process (a federated round on this device) saved it
        since this session last loaded or saved; True when it did."""
        if self.state is None or not self.state.changed_on_disk():
            return False
        self.load()
        return True

    def load(self) -> None:
        """Restore the saved parts that are valid; fresh ones replace the rest."""
        cache = self.engine.cache
        loaded = self.state.load(max_entries=cache.max_entries, max_bytes=cache.max_bytes, policy=cache.policy)
        self.problems = loaded.problems
        meta = loaded.meta
        if meta and meta.get("lora") not in (None, self.adapters.spec.as_dict()):
            if self._owns_adapters:  # adopt the saved shape (e.g. the one a federated round chose)
                try:
                    self.adapters.respec(LoraSpec(**meta["lora"]))
                    self.learner.new_optimizer()
                except (TypeError, ValueError) as exc:
                    self.problems.append(
                        f"saved LoRA settings {meta['lora']} unusable ({exc}): the adapter starts fresh"
                    )
                    loaded.adapter = None
            else:
                self.problems.append(
                    f"saved adapter has LoRA settings {meta['lora']}, this session "
                    f"{self.adapters.spec.as_dict()}: the adapter starts fresh"
                )
                loaded.adapter = None
        if loaded.adapter is not None:
            try:
                self.adapters.load_state_dict(self.target, loaded.adapter)
                if self.rule is not None:  # a running session adopts another process's adapter
                    self.rule.drafter_changed()
            except ValueError as exc:
                self.problems.append(f"saved adapter ignored: {exc}")
        if loaded.lookup is not None and self.lookup is not None:
            try:
                self.lookup.load_history(loaded.lookup, self.engine.target.logit_rows)
            except ValueError as exc:
                self.problems.append(f"saved lookup history ignored: {exc}")
        if loaded.head is not None and self.head is not None:
            try:
                self.head.load_state_dict(loaded.head)
                self.head.trained_steps = int(meta.get("head_steps", 1)) or 1
            except RuntimeError:
                self.problems.append("saved acceptance head does not fit this drafter: it starts fresh")
        if loaded.cache is not None:
            self.engine.cache = loaded.cache
        if meta:
            self.learner.updates = int(meta.get("updates", 0))
            self.learner.prompts_seen = int(meta.get("prompts_seen", 0))
            self._saved_rule = meta.get("throughput_rule")  # applied when the rule is built
