"""Base models loaded once per process: ``EnginePool`` holds one engine per (drafter, target)
with one drafter model shared by every target's engine and one LoRA adapter per target on it;
``shared_pool`` is the pool of a simulation worker process."""

from __future__ import annotations

import torch

from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.wire import tokenizer_digest


class EnginePool:
    """Base models loaded once per process: one drafter shared by every target's engine (with
    one LoRA adapter per target on it), so a worker holds one copy of each model whatever the
    number of devices it runs."""

    def __init__(self, dtype: str | torch.dtype = "fp32", drafter_weights: str = "int8") -> None:
        self.dtype = dtype
        self.drafter_weights = drafter_weights
        self._engines: dict[tuple[str, str], Engine] = {}
        self._adapters: dict[str, DrafterAdapters] = {}
        self._digests: dict[tuple[str, str], str] = {}
        self._adopted = False  # holds a serving session's models: adopts a round's LoRA settings

    @classmethod
    def holding(
        cls, engine: Engine, target: str, adapters: DrafterAdapters, dtype: str | torch.dtype = "fp32"
    ) -> EnginePool:
        """A pool around models another owner already loaded (the generation service's engine for
        ``target`` and its drafter adapters), so fleet rounds run on them instead of a second copy.
        Adapters take the LoRA settings a round asks for instead of refusing them; a target not
        held yet loads at ``dtype``, sharing the drafter."""
        pool = cls(dtype, engine.drafter_weights)
        pool._engines[(engine.drafter_name, target)] = engine
        pool._adapters[engine.drafter_name] = adapters
        pool._adopted = True
        return pool

    def drop(self, drafter: str, target: str) -> None:
        """Forget the engine of (``drafter``, ``target``) (a switched-away target): its target
        model is freed once nothing else holds it."""
        self._engines.pop((drafter, target), None)
        self._digests.pop((drafter, target), None)

    def engine(self, drafter: str, target: str) -> Engine:
        if (drafter, target) not in self._engines:
            shared = next((e.drafter for (d, _), e in self._engines.items() if d == drafter), None)
            self._engines[(drafter, target)] = Engine.load(
                drafter, target, self.dtype, drafter_weights=self.drafter_weights, progress=False, drafter_model=shared
            )
        return self._engines[(drafter, target)]

    def tokenizer_digest(self, drafter: str, target: str) -> str:
        """The target vocabulary's digest (``registry.tokenizer_digest``), computed once."""
        if (drafter, target) not in self._digests:
            self._digests[(drafter, target)] = tokenizer_digest(self.engine(drafter, target).bridge)
        return self._digests[(drafter, target)]

    def adapters(self, drafter: str, lora: LoraSpec | None = None) -> DrafterAdapters:
        """The drafter's adapters (every target's on one peft model); one LoRA setting per
        drafter and process (``None``: the one in use, else rank 8)."""
        engine = next(e for (d, _), e in self._engines.items() if d == drafter)
        if lora is None:
            lora = self._adapters[drafter].spec if drafter in self._adapters else LoraSpec(rank=8)
        if drafter not in self._adapters:
            self._adapters[drafter] = DrafterAdapters(engine.drafter.model, lora, drafter_weights=self.drafter_weights)
        adapters = self._adapters[drafter]
        if adapters.spec != lora and self._adopted:
            adapters.respec(lora)
        if adapters.spec != lora:
            raise ValueError(f"this process already runs drafter adapters with {adapters.spec}, not {lora}")
        return adapters


_POOLS: dict[tuple[str, str], EnginePool] = {}


def shared_pool(dtype: str = "fp32", drafter_weights: str = "int8") -> EnginePool:
    """This process's ``EnginePool`` for (``dtype``, ``drafter_weights``), created on first use.

    Simulation workers receive the ClientApp pickled anew with every message, so a pool held in
    a closure would be rebuilt (and every model reloaded) per message; this module-level cache
    lives as long as the worker process."""
    key = (str(dtype), drafter_weights)
    if key not in _POOLS:
        _POOLS[key] = EnginePool(dtype, drafter_weights)
    return _POOLS[key]
