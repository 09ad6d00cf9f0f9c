"""Per-target LoRA adapters on the one shared drafter (peft).

``DrafterAdapters`` wraps the drafter once with peft and holds one named LoRA adapter per
target; ``activate(target)`` switches between them without reloading the drafter. Only the
active adapter's LoRA matrices require gradients (the base weights and the LM head stay frozen).

Drafting runs on ``FastLlamaRunner`` kernels, which need plain weight matrices: ``runner()``
merges the active adapter into the base weights (peft ``merge_adapter``), packs them, and
restores the exact base weights, so the HF model always holds the base weights plus unmerged
adapters. Packed runners are cached per adapter until the adapter changes (``invalidate``), and
the last ``PACKED_KEEP`` packed runners are also kept by the adapter's *contents*: a simulation
worker that runs many devices starting from the same global adapter (or the untrained one)
packs it once (0.8 s for SmolLM2-135M on one core) instead of once per device.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer

from omnidraft.shared.fast_drafter import FastLlamaRunner
from omnidraft.shared.model_runner import ModelRunner

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
PACKED_KEEP = 2  # packed runners kept by adapter contents (each ~0.5 GB for SmolLM2-135M with bf16 prefill)
MODULE_SETS = {"attn": ATTENTION_MODULES, "mlp": MLP_MODULES, "all": ATTENTION_MODULES + MLP_MODULES,
               "qv": ("q_proj", "v_proj")}


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyperparameters shared by every target's adapter.

    ``modules``: a key of ``MODULE_SETS`` (which Linear layers get an adapter); ``alpha``
    defaults to ``2 * rank``. ``ffa`` (FFA-LoRA): ``A`` stays frozen at its initialization and
    only ``B`` trains, so averaging adapters that share ``A`` averages ``B·A`` exactly.
    """

    rank: int = 32
    alpha: float | None = None
    modules: str = "all"
    ffa: bool = False

    def __post_init__(self) -> None:
        # the default alpha is stored, so a spec read back from the wire (alpha given) equals
        # the one built with the default
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2.0 * self.rank)

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError("LoRA rank must be >= 1")
        if self.modules not in MODULE_SETS:
            raise ValueError(f"unknown LoRA module set {self.modules!r}: choose one of {', '.join(MODULE_SETS)}")

    def peft_config(self) -> LoraConfig:
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0,
                          target_modules=list(MODULE_SETS[self.modules]), bias="none")

    def as_dict(self) -> dict:
        out = {"rank": self.rank, "alpha": self.alpha, "modules": self.modules}
        return {**out, "ffa": True} if self.ffa else out


def adapter_name(target: str) -> str:
    """A peft adapter name for a target name or path (peft names cannot contain dots)."""
    return "t_" + "".join(c if c.isalnum() else "_" for c in target)


class DrafterAdapters:
    """One drafter model, one LoRA adapter per target (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec = LoraSpec(), *,
                 drafter_weights: str = "int8") -> None:
        spec.validate()
        self.spec = spec
        self.drafter_weights = drafter_weights
        self.model = model
        self.peft = None
        self.active: str | None = None
        self._runners: dict[str, object] = {}
        self._packed: OrderedDict[str, object] = OrderedDict()  # adapter-contents digest -> runner
        self.last_pack_s = 0.0  # seconds the last runner build took (0 when a packed one was reused)

    @property
    def names(self) -> list[str]:
        return [] if self.peft is None else list(self.peft.peft_config)

    def add(self, target: str) -> str:
        """Add a fresh adapter for ``target`` (B = 0: the drafter is unchanged); returns its name."""
        name = adapter_name(target)
        if name in self.names:
            return name
        config = self.spec.peft_config()
        if self.peft is None:
            self.peft = get_peft_model(self.model, config, adapter_name=name)
        else:
            self.peft.add_adapter(name, config)
        self.activate(target)
        return name

    def activate(self, target: str) -> None:
        """Make ``target``'s adapter the one drafting and training uses."""
        name = adapter_name(target)
        if name not in self.names:
            raise KeyError(f"no adapter for target {target!r}")
        self.peft.set_adapter(name)
        self._activate_name(name)

    def _activate_name(self, name: str) -> None:
        trained = ("lora_B",) if self.spec.ffa else ("lora_A", "lora_B")
        for n, p in self.peft.named_parameters():
            p.requires_grad_(f".{name}." in n and any(part in n for part in trained))
        self.active = name

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.peft.parameters() if p.requires_grad]

    def state_dict(self, target: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors (keys without the adapter name), detached, on CPU."""
        sd = get_peft_model_state_dict(self.peft, adapter_name=adapter_name(target))
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def load_state_dict(self, target: str, tensors: dict[str, torch.Tensor]) -> None:
        """Replace ``target``'s adapter tensors (the adapter must exist); raises ValueError on
        missing or mis-shaped tensors."""
        current = self.state_dict(target)
        if set(current) != set(tensors):
            raise ValueError("adapter tensors do not match the LoRA configuration")
        for k, v in current.items():
            if tuple(tensors[k].shape) != tuple(v.shape):
                raise ValueError(f"adapter tensor {k} has shape {tuple(tensors[k].shape)}, expected {tuple(v.shape)}")
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=adapter_name(target))
        if getattr(result, "unexpected_keys", None):
            raise ValueError("adapter tensors do not match the LoRA configuration")
        self.invalidate(target)

    def respec(self, spec: LoraSpec) -> None:
        """Rebuild every adapter with the LoRA settings ``spec`` (each starts untrained): a
        device adopting the shape its fleet chose. Optimizers over the old parameters must be
        rebuilt by their owners."""
        spec.validate()
        if spec == self.spec:
            return
        targets = {name: self.active == name for name in self.names}
        self.spec = spec
        if not targets:
            return
        self.peft.add_adapter("respec_swap", spec.peft_config())  # peft keeps one adapter at least
        self.peft.set_adapter("respec_swap")
        for name in targets:
            self.peft.delete_adapter(name)
            self.peft.add_adapter(name, spec.peft_config())
        active = next((n for n, was in targets.items() if was), next(iter(targets)))
        self.peft.set_adapter(active)
        self.peft.delete_adapter("respec_swap")
        self._runners.clear()
        self._packed.clear()
        self._activate_name(active)

    @torch.no_grad()
    def reset(self, target: str) -> None:
        """Return ``target``'s adapter to the untrained state (B = 0, A kept): the drafter
        drafts as without an adapter."""
        name = adapter_name(target)
        for n, p in self.peft.named_parameters():
            if f".lora_B.{name}." in n:
                p.zero_()
        self.invalidate(target)

    def invalidate(self, target: str | None = None) -> None:
        """Forget packed runners (of ``target``, or all) after their adapter changed."""
        if target is None:
            self._runners.clear()
            self._packed.clear()
        else:
            self._runners.pop(adapter_name(target), None)

    @contextmanager
    def merged(self):
        """The base HF model with the active adapter merged into its weights. On exit the
        adapter is unmerged and the base weights are restored bit for bit (``W + BA - BA`` is
        not exactly ``W`` in floating point, and repeated merges would otherwise drift)."""
        bases = [m.get_base_layer() for m in self.peft.modules() if isinstance(m, LoraLayer)]
        saved = [b.weight.detach().clone() for b in bases]
        self.peft.merge_adapter()
        try:
            yield self.peft.get_base_model()
        finally:
            self.peft.unmerge_adapter()
            with torch.no_grad():
                for b, w in zip(bases, saved):
                    b.weight.copy_(w)

    def _digest(self, name: str) -> str:
        """sha256 of adapter ``name``'s tensors (what a packed runner depends on); "untrained"
        when every B is zero (the drafter itself, whatever A is)."""
        tensors = get_peft_model_state_dict(self.peft, adapter_name=name)
        if all(not bool(t.any()) for k, t in tensors.items() if "lora_B" in k):
            return "untrained"
        h = hashlib.sha256()
        for key, tensor in sorted(tensors.items()):
            h.update(key.encode())
            h.update(tensor.detach().contiguous().view(torch.uint8).numpy())
        return h.hexdigest()

    @torch.no_grad()
    def runner(self):
        """The drafting runner for the active adapter (built once per adapter version)."""
        name = self.active
        if name not in self._runners:
            if self.drafter_weights == "hf" or self.model.config.model_type != "llama":
                self._runners[name] = ModelRunner(self.peft)  # plain transformers forward applies the adapter
                return self._runners[name]
            digest = self._digest(name)
            runner = self._packed.pop(digest, None)
            self.last_pack_s = 0.0
            if runner is None:
                t0 = time.perf_counter()
                with self.merged() as model:
                    runner = FastLlamaRunner(model, weights=self.drafter_weights)
                self.last_pack_s = time.perf_counter() - t0
            runner.reset()
            self._packed[digest] = runner
            while len(self._packed) > PACKED_KEEP:
                self._packed.popitem(last=False)
            self._runners[name] = runner
        return self._runners[name]

    def decoder_and_head(self):
        """The HF decoder (``last_hidden_state`` after the final norm) and the LM head, with the
        active adapter applied (for teacher-forced training forwards)."""
        base = self.peft.get_base_model()
        return base.get_decoder(), base.get_output_embeddings()
