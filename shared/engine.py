"""Assemble a drafter/target pair into ready-to-use decoders.

``Engine.load("smollm2-135m", "qwen2.5-coder-1.5b", dtype)`` loads both models (catalog names
or local HF directories), builds the vocabulary bridge, the one-to-many expansion map and an
n-gram cache, and hands out the ``ar`` and ``omnidraft`` decoders over the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from omnidraft.shared import model_runner
from omnidraft.shared.decoding import CrossVocabDecoder, TargetOnlyDecoder, build_expand_map
from omnidraft.shared.generation import GenerationConfig, GenerationResult
from omnidraft.shared.fast_drafter import FastLlamaRunner
from omnidraft.shared.model_runner import LoadedModel, ModelRunner
from omnidraft.shared.ngram_cache import NgramCache, seed_from_tokenizers
from omnidraft.shared.vocab_bridge import VocabBridge


DRAFTER_WEIGHTS = ("int8", "bf16", "fp32", "hf")


def seed_cache_from_bridge(cache: NgramCache, bridge: VocabBridge, drafter_tokenizer) -> int:
    """Add to ``cache`` every target token that the drafter spells with >= 2 tokens (its text
    tokenized by the drafter alone); returns the entries created."""
    tok = drafter_tokenizer
    return seed_from_tokenizers(
        cache, bridge.target_bytes[: bridge.target_vocab_size],
        lambda text: tok.encode(text, add_special_tokens=False),
        frozenset(t for t in bridge.d2t if t >= 0),
        encode_draft_batch=lambda texts: tok(texts, add_special_tokens=False)["input_ids"],
    )


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

    @classmethod
    def load(cls, drafter: str, target: str, dtype: torch.dtype = torch.float32, *,
             drafter_weights: str = "int8", cache: NgramCache | None = None,
             seed_cache: bool = False, progress: bool = True,
             drafter_model: LoadedModel | None = None) -> "Engine":
        """Load a pair. ``dtype`` is the target's; ``drafter_weights`` picks the drafter's
        kernels (``int8``/``bf16``/``fp32`` through ``FastLlamaRunner`` for Llama-architecture
        drafters, ``hf`` for the plain transformers forward in ``dtype``). The drafter's
        precision never changes the output, only what it proposes. ``drafter_model`` reuses an
        already loaded drafter (one drafter serving several targets)."""
        if drafter_weights not in DRAFTER_WEIGHTS:
            raise ValueError(f"unknown drafter weights {drafter_weights!r}: choose one of {', '.join(DRAFTER_WEIGHTS)}")
        model_runner.set_threads()
        fast = drafter_weights != "hf"  # the fast runners pack from float32 weights
        d = drafter_model or model_runner.load(drafter, torch.float32 if fast else dtype, progress=progress)
        t = model_runner.load(target, dtype, progress=progress)
        bridge = VocabBridge.from_tokenizers(d.tokenizer, t.tokenizer, d.logit_rows, t.logit_rows)
        engine = cls(d, t, bridge, cache if cache is not None else NgramCache(),
                     build_expand_map(bridge, t.tokenizer), drafter, target, drafter_weights)
        if seed_cache:
            engine.seed_cache()
        return engine

    @cached_property
    def drafter_runner(self) -> ModelRunner | FastLlamaRunner:
        """The base drafter's runner (packed on first use: a device session drafts with its
        adapter's runner instead and never needs this one)."""
        model = self.drafter.model
        if self.drafter_weights != "hf" and model.config.model_type == "llama":
            return FastLlamaRunner(model, weights=self.drafter_weights)
        return ModelRunner(model)

    def seed_cache(self) -> int:
        """Warm-start the n-gram cache from the two tokenizers alone; returns entries added."""
        return seed_cache_from_bridge(self.cache, self.bridge, self.drafter.tokenizer)

    def prompt_ids(self, prompt: str, chat: bool = False) -> tuple[str, list[int]]:
        """The prompt as text and as target ids; ``chat`` applies the target's chat template."""
        tok = self.target.tokenizer
        if chat:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
            return prompt, tok.encode(prompt, add_special_tokens=False)
        return prompt, tok.encode(prompt)

    def ar(self) -> TargetOnlyDecoder:
        return TargetOnlyDecoder(self.target.model, self.bridge)

    def omnidraft(self, translate: str = "text") -> CrossVocabDecoder:
        return CrossVocabDecoder(self.drafter_runner, self.drafter.tokenizer, self.target.model,
                                 self.bridge, self.cache, expand_map=self.expand_map,
                                 translate=translate, target_tokenizer=self.target.tokenizer)

    def generate(self, prompt: str, config: GenerationConfig, method: str = "omnidraft",
                 chat: bool = False, translate: str = "text") -> GenerationResult:
        text, ids = self.prompt_ids(prompt, chat)
        if method == "ar":
            return self.ar().generate(ids, config)
        if method == "omnidraft":
            return self.omnidraft(translate).generate(text, ids, config)
        raise ValueError(f"unknown method {method!r}: choose omnidraft or ar")
