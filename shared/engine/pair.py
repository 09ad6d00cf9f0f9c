"""Assemble a drafter/target pair into ready-to-use decoders.

``Engine.load("smollm2-135m", "qwen2.5-coder-1.5b", "int8")`` loads both models (catalog names
or local HF directories), runs the target in the given precision (``omnidraft.shared.engine.precision``;
``auto`` measures), builds the vocabulary bridge, the one-to-many expansion map and an n-gram
cache, and hands out the ``ar`` and ``omnidraft`` decoders over one target runner. The
machine's measured costs (``cost_profile``) drive the ``omnidraft`` decoder's throughput rule;
the forwards it times while decoding check that profile (``check_profile``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from omnidraft.shared.engine import auto_precision, catalog, model_runner, profiling
from omnidraft.shared.engine.decoding import CrossVocabDecoder, TargetOnlyDecoder
from omnidraft.shared.engine.draft_policy import ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig, GenerationResult
from omnidraft.shared.engine.lookup_drafts import LookupDrafter
from omnidraft.shared.engine.model_runner import LoadedModel, ModelRunner, Runner
from omnidraft.shared.engine.precision import (
    build_drafter_runner,
    build_target_runner,
    drafter_template,
    drafts_on_packing,
    load_dtype,
    precision_name,
    quantize_linear_int8,
    runner_backend,
)
from omnidraft.shared.engine.profiling import CostProfile, StepTimings
from omnidraft.shared.engine.recordings import RecordingStore
from omnidraft.shared.runtime.held_weights import hold_frozen_weights
from omnidraft.shared.vocab.ngram_cache import NgramCache, seed_from_tokenizers
from omnidraft.shared.vocab.translation import build_expand_map
from omnidraft.shared.vocab.vocab_bridge import VocabBridge

DRAFTER_WEIGHTS = ("int8", "bf16", "fp32", "hf")
# what the per-round overhead is measured on: ordinary code, decoded for OVERHEAD_TOKENS tokens
OVERHEAD_PROMPT = (
    "import os\n\n\ndef list_files(root: str, suffix: str) -> list[str]:\n"
    '    """Return the paths under root that end with suffix, sorted."""\n'
)
OVERHEAD_TOKENS = 48


def seed_cache_from_bridge(cache: NgramCache, bridge: VocabBridge, drafter_tokenizer) -> int:
    """Add to ``cache`` every target token that the drafter spells with >= 2 tokens (its text
    tokenized by the drafter alone); returns the entries created."""
    tok = drafter_tokenizer
    return seed_from_tokenizers(
        cache,
        bridge.target_bytes[: bridge.target_vocab_size],
        lambda text: tok.encode(text, add_special_tokens=False),
        frozenset(t for t in bridge.d2t if t >= 0),
        encode_draft_batch=_batch_encoder(tok),
    )


def _batch_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """Texts -> their ids without special tokens, in one call of the Rust tokenizer behind
    ``tokenizer`` (a ``VocabBridge``'s tokenizers have one: the bridge requires it): the same ids
    as calling the tokenizer, without its per-text Python conversion (2.1 s -> 0.6 s for
    Qwen2.5's 150,000 token texts, AMD EPYC)."""
    backend = tokenizer.backend_tokenizer
    return lambda texts: [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]


@dataclass
class Engine:
    """A loaded drafter/target pair and the state cross-vocabulary decoding keeps between calls."""

    drafter: LoadedModel
    target: LoadedModel
    bridge: VocabBridge
    cache: NgramCache
    expand_map: dict[int, tuple[int, ...]]
    drafter_name: str = ""
    target_name: str = ""
    drafter_weights: str = "int8"
    precision: str = "fp32"
    _profile: CostProfile | None = field(default=None, repr=False)
    _profiled_drafter: object = field(default=None, repr=False)  # the runner the profile timed
    _rule: ThroughputRule | None = field(default=None, repr=False)
    # model-free drafts over this engine's generations (None: off; a device session keeps its own)
    lookup: LookupDrafter | None = field(default_factory=LookupDrafter, repr=False)
    # the forwards timed while decoding (profile check; no decision reads them)
    timings: StepTimings = field(default_factory=StepTimings, repr=False)
    _hf_target: torch.nn.Module | None = field(default=None, repr=False)
    # the thread that loaded the models (``threading.get_ident``): their forwards are fastest on
    # it (``shared/runtime/engine_thread``)
    loaded_on: int = field(default_factory=threading.get_ident, repr=False)

    @classmethod
    def load(
        cls,
        drafter: str,
        target: str,
        precision: str | torch.dtype = "fp32",
        *,
        drafter_weights: str = "int8",
        cache: NgramCache | None = None,
        seed_cache: bool = False,
        progress: bool = True,
        drafter_model: LoadedModel | None = None,
    ) -> Engine:
        """Load a pair. ``precision`` is the target's (``auto``/``fp32``/``bf16``/``int8`` or a
        torch float dtype); ``drafter_weights`` picks the drafter's kernels (``int8``/``bf16``/
        ``fp32`` through ``FastLlamaRunner`` for Llama-architecture drafters, ``hf`` for the plain
        transformers forward in the target's float dtype). The drafter's precision never changes
        the output, only what it proposes. ``drafter_model`` reuses an already loaded drafter
        (one drafter serving several targets)."""
        if drafter_weights not in DRAFTER_WEIGHTS:
            raise ValueError(f"unknown drafter weights {drafter_weights!r}: choose one of {', '.join(DRAFTER_WEIGHTS)}")
        precision = precision_name(precision)
        model_runner.set_threads()
        if drafter_model is None:
            catalog.resolve(drafter, progress=progress)  # a bad name fails before any measuring
        if precision == "auto":
            precision, _ = auto_precision.choose_precision(target, progress=progress)
        fast = drafter_weights != "hf"  # the fast runners pack from float32 weights
        d = drafter_model or model_runner.load(
            drafter, torch.float32 if fast else load_dtype(precision), progress=progress, embeddings_in_file=fast
        )
        if drafts_on_packing(d.model, drafter_weights):
            # the base packed from the float32 weights, which are then held in bf16 (what training
            # and merges read): 0.2 GB less for SmolLM2-135M before the target is loaded beside it
            drafter_template(d.model, drafter_weights)
            hold_frozen_weights(d.model)
        # an int8 target is packed from its file layer by layer (no float copy in memory)
        t = model_runner.load(target, load_dtype(precision), progress=progress, stream=precision == "int8")
        bridge = VocabBridge.from_tokenizers(d.tokenizer, t.tokenizer, d.logit_rows, t.logit_rows)
        engine = cls(
            d,
            t,
            bridge,
            cache if cache is not None else NgramCache(),
            build_expand_map(bridge, t.tokenizer),
            drafter,
            target,
            drafter_weights,
            precision,
        )
        engine.target_runner  # noqa: B018  (quantize / pack the target now, not in the first request)
        engine._release_float_target()
        if seed_cache:
            engine.seed_cache()
        return engine

    @cached_property
    def target_runner(self):
        """The one runner both decoders verify / decode with (``precision``'s kernels)."""
        return build_target_runner(self.target.model, self.precision, self.target.checkpoint)

    def _release_float_target(self) -> None:
        """Free the target's float weights once the native int8 kernels hold their packed copy
        (the runner keeps its own copy of the input embeddings): nothing reads them again, and
        they are 4 bytes per parameter (6 GB of a 1.5B target, mapped from its checkpoint)
        beside the kernels' 1. The model object stays, on the meta device (config, shapes).
        ``hf_target_model`` loads the float model again when transformers' own ``generate`` is
        asked for."""
        runner = self.target_runner
        if getattr(runner, "native_isa", None) is not None:
            runner.own_weights()
            self.target.model.to("meta")

    def hf_target_model(self) -> torch.nn.Module:
        """The transformers target in this engine's precision, for transformers' own
        ``generate`` (``uag``/``pld`` in the benchmark): with int8 its Linear layers are
        quantized in place (fbgemm) on first use."""
        runner = self.target_runner  # a fast runner packs from the float weights first
        model = self.target.model
        if model.device.type == "meta":  # freed once packed (_release_float_target): load a float copy for transformers
            if self._hf_target is None:
                self._hf_target = model_runner.load(
                    str(self.target.path), load_dtype(self.precision), progress=False
                ).model
            model = self._hf_target
        if self.precision == "int8":
            return quantize_linear_int8(model)
        return getattr(runner, "model", model)

    def cost_profile(self, drafter_runner=None, refresh: bool = False) -> CostProfile:
        """This machine's measured costs for the pair (cached on disk per machine, model and
        precision; measured on first use, or again with ``refresh``). ``drafter_runner`` is the
        runner that drafts (default: the one profiled last, else the base drafter's); an adapter
        is merged into its runner's weights, so one drafter cost holds for every adapter."""
        runner = drafter_runner if drafter_runner is not None else (self._profiled_drafter or self.drafter_runner)
        if self._profile is None or refresh:
            target_ms, drafter_ms = profiling.pair_costs(
                self._pair_key(runner), self.target_runner, runner, refresh=refresh
            )
            profile = CostProfile(target_ms, drafter_ms[1], drafter_ms)
            overhead = profiling.cached(
                self._overhead_key(runner), lambda: self._measure_overheads(runner, profile), refresh
            )
            profile.round_overhead_ms = float(overhead["round_ms"])
            profile.step_overhead_ms = float(overhead["step_ms"])
            self._profile, self._profiled_drafter = profile, runner
        return self._profile

    def _pair_key(self, runner) -> dict:
        return profiling.pair_key(
            self.target.path,
            self.precision,
            runner_backend(self.target_runner),
            self.drafter.path,
            runner_backend(runner),
        )

    def _overhead_key(self, runner) -> dict:
        return {
            "role": "round-overhead",
            "drafter": profiling.model_fingerprint(self.drafter.path),
            "target": profiling.model_fingerprint(self.target.path),
            "precision": self.precision,
            "backends": [runner_backend(runner), runner_backend(self.target_runner)],
            "tokens": OVERHEAD_TOKENS,
        }

    def _measure_overheads(self, runner, profile: CostProfile) -> dict:
        """The work of a round outside its timed forwards (ms): decode ``OVERHEAD_PROMPT`` with 4
        drafted tokens per round, then with the target alone, timing every forward; the rest of
        the wall time, per round, is the overhead (the median of 3 runs each). The runs after
        the first start from the target's prefill of the prompt, which their ``wall_s`` counts
        without a forward run here: it is left out (it was 0.17 s of the rest, and made a round's
        overhead 9.6 ms where it is 2.9 ms on a Zen 4 EPYC)."""
        text, ids = self.prompt_ids(OVERHEAD_PROMPT)
        fixed = GenerationConfig(max_new_tokens=OVERHEAD_TOKENS, draft_stop="confidence", confidence=0.0, k_max=4)

        def per_round(decode) -> float:
            timings = StepTimings()
            result = decode(timings)
            stats = result.stats
            reused_ms = stats.prefill_s * 1000 if stats.prefills_reused else 0.0
            rest = stats.wall_s * 1000 - reused_ms - timings.total_ms
            return max(0.0, rest / max(stats.target_calls, 1))

        def spd(timings):
            return CrossVocabDecoder(
                runner,
                self.drafter.tokenizer,
                self.target_runner,
                self.bridge,
                NgramCache(),
                expand_map=self.expand_map,
                translate="text",
                target_tokenizer=self.target.tokenizer,
                timings=timings,
            ).generate(text, ids, fixed, remember=False)

        def ar(timings):
            return TargetOnlyDecoder(self.target_runner, self.bridge, timings).generate(ids, fixed)

        spd(None)  # warm-up
        rounds = sorted(per_round(spd) for _ in range(3))[1]
        steps = sorted(per_round(ar) for _ in range(3))[1]
        return {"round_ms": rounds, "step_ms": steps}

    def check_profile(self, forget_stale: bool = True) -> dict:
        """The cached profile against the forwards timed in use so far (``StepTimings.check``);
        when they contradict it and ``forget_stale``, its cached measurements are dropped, so the
        next process measures again (this one keeps deciding with the profile it has). A
        simulation keeps them: its runs with one seed decide alike."""
        if self._profile is None:
            return {"steps": {}, "stale": False}
        report = self.timings.check(self._profile)
        if report["stale"] and forget_stale:
            drafter = self._profiled_drafter
            for key in (self._pair_key(drafter), self._overhead_key(drafter)):
                profiling.forget(key)
        return report

    @cached_property
    def drafter_runner(self) -> Runner:
        """The base drafter's runner (packed on first use: a device session drafts with its
        adapter's runner instead and never needs this one)."""
        model = self.drafter.model
        if drafts_on_packing(model, self.drafter_weights):
            return build_drafter_runner(model, self.drafter_weights)
        return ModelRunner(model)

    def recordings(self, root=None) -> RecordingStore:
        """The store of this engine's recorded greedy decodes (``recordings``): keyed by both
        models, the target's precision and kernels and the machine, which decide its output."""
        return RecordingStore(
            {
                "drafter": profiling.model_fingerprint(self.drafter.path),
                "target": profiling.model_fingerprint(self.target.path),
                "precision": self.precision,
                "backend": runner_backend(self.target_runner),
                "machine": profiling.machine_fingerprint(),
            },
            root,
        )

    def seed_cache(self, cache: NgramCache | None = None) -> int:
        """Warm-start ``cache`` (default: the engine's n-gram cache) from the two tokenizers
        alone; returns the entries added. The entries are computed once per engine (tokenizing
        the target's whole vocabulary with the drafter's tokenizer) and added from there."""
        return (self.cache if cache is None else cache).merge(self._tokenizer_seed)

    @cached_property
    def _tokenizer_seed(self) -> NgramCache:
        seed = NgramCache(drafter=self.drafter_name, target=self.target_name)
        seed_cache_from_bridge(seed, self.bridge, self.drafter.tokenizer)
        return seed

    def prompt_ids(self, prompt: str, chat: bool = False) -> tuple[str, list[int]]:
        """The prompt as text and as target ids; ``chat`` applies the target's chat template."""
        tok = self.target.tokenizer
        if chat:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return prompt, tok.encode(prompt, add_special_tokens=False)
        return prompt, tok.encode(prompt)

    def ar(self) -> TargetOnlyDecoder:
        return TargetOnlyDecoder(self.target_runner, self.bridge, self.timings)

    def rule(self) -> ThroughputRule:
        """The base drafter's throughput rule (kept between calls: what it measured stays)."""
        if self._rule is None:
            self._rule = ThroughputRule(self.cost_profile())
        return self._rule

    def omnidraft(self, translate: str = "text", rule: bool = True) -> CrossVocabDecoder:
        """The speculative decoder; ``rule=False`` leaves out the throughput rule, so nothing is
        measured (``draft_stop="confidence"`` decodes without it)."""
        return CrossVocabDecoder(
            self.drafter_runner,
            self.drafter.tokenizer,
            self.target_runner,
            self.bridge,
            self.cache,
            expand_map=self.expand_map,
            translate=translate,
            target_tokenizer=self.target.tokenizer,
            rule=self.rule() if rule else None,
            lookup=self.lookup,
            timings=self.timings,
        )

    def generate(
        self,
        prompt: str,
        config: GenerationConfig,
        method: str = "omnidraft",
        chat: bool = False,
        translate: str = "text",
    ) -> GenerationResult:
        text, ids = self.prompt_ids(prompt, chat)
        if method == "ar":
            return self.ar().generate(ids, config)
        if method == "omnidraft":
            return self.omnidraft(translate, rule=config.draft_stop != "confidence").generate(text, ids, config)
        raise ValueError(f"unknown method {method!r}: choose omnidraft or ar")
