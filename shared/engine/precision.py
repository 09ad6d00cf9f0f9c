"""Numeric precision of a target model and the runner that executes it.

``--dtype`` accepts ``auto`` or one of :data:`PRECISIONS`:

- ``fp32`` / ``bf16``: the transformers model in that dtype, run by ``ModelRunner``.
- ``int8``: the Linear layers, LM head included, with int8 weights. Llama and Qwen2 targets run
  on ``FastLlamaRunner``'s native int8 kernels (AVX-512 VNNI or AVX2): weights with one scale per output
  row and 64 inputs, activations quantized to 8 bits with one scale per token and 64 inputs
  (like llama.cpp's Q8 activations; half the arithmetic of the drafter's 16-bit activations,
  which matters for prompt prefill and multi-token verification), exact int32 sums. Every
  token's row is computed independently of the others in its block, so a block verification
  gives bit-identical logits to one-token steps and greedy speculative decoding equals ``ar``
  exactly. Where the native
  kernels are unavailable (not x86-64 with AVX2, no compiler) those targets run torch's fbgemm dynamic
  quantization inside the same runner, and other architectures (e.g. Gemma-3) get
  ``torch.ao.quantization.quantize_dynamic`` on the transformers model. fbgemm quantizes
  activations per tensor, so there a block's rows depend on each other slightly, as bf16 rounding
  does.
- ``fp64``: the reference for checking losslessness: float64 rounding is so fine that a block
  forward and one-token steps never flip a near-tie, whatever the CPU's kernels (fp32 and bf16
  blocks may, since their matmul kernels change with the block size). Slow; meant for tests.
- ``auto``: resolved by ``omnidraft.shared.engine.auto_precision.choose_precision`` from measured costs.

A quantized target is a different target: "identical to the target alone" means identical to
that target run autoregressively in the same precision, which is what ``ar`` does.
"""

from __future__ import annotations

import warnings

import torch

from omnidraft.shared.engine.model_runner import ModelRunner, Runner
from omnidraft.shared.runtime.fast_drafter import SUPPORTED_MODEL_TYPES, FastLlamaRunner

PRECISIONS = ("fp32", "bf16", "int8", "fp64")
# 8-bit grouped activations for int8 targets: on Qwen2.5-Coder-1.5B (AMD EPYC, 2 threads) prompt
# prefill 1.6 s instead of 3.0 s for 256 tokens and a 4-token verification 48 instead of 69 ms,
# at KL(fp32 || int8) 0.004 instead of 0.0007 per token (BENCHMARKS.md)
TARGET_ACTIVATION_BITS = 8
# drafters keep 16-bit activations in their steps (8-bit ones lose far more acceptance on
# SmolLM2) but prefill prompts with 8-bit ones: 110 tokens 129-156 ms instead of 230 ms on an
# AVX2 EPYC (2 threads); a prefill only fills the drafter's KV cache
DRAFTER_PREFILL_ACTIVATION_BITS = 8
CHOICES = ("auto",) + PRECISIONS
_TORCH_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}


def precision_name(value: str | torch.dtype) -> str:
    """Normalize a precision given as a name (``auto`` included) or a torch float dtype."""
    if isinstance(value, torch.dtype):
        try:
            return _TORCH_NAMES[value]
        except KeyError:
            raise ValueError(f"unsupported dtype {value}: choose one of {', '.join(CHOICES)}") from None
    if value not in CHOICES:
        raise ValueError(f"unknown dtype {value!r}: choose one of {', '.join(CHOICES)}")
    return value


def load_dtype(precision: str) -> torch.dtype:
    """The dtype to load the transformers weights in (int8 quantizes from float32)."""
    return {"bf16": torch.bfloat16, "fp64": torch.float64}.get(precision, torch.float32)


def fast_runner_supports(config) -> bool:
    """True when ``FastLlamaRunner`` runs a model with this transformers config (Llama / Qwen2,
    every layer full attention)."""
    return getattr(config, "model_type", "") in SUPPORTED_MODEL_TYPES and all(
        t == "full_attention" for t in getattr(config, "layer_types", None) or ()
    )


def build_target_runner(model: torch.nn.Module, precision: str, checkpoint=None) -> Runner:
    """The runner that executes ``model`` (loaded with :func:`load_dtype`) in ``precision``.

    For ``int8`` on an architecture without a fast runner the model's Linear layers are
    quantized in place. ``checkpoint`` is the GGUF of a model loaded with ``stream`` (its
    layers on the meta device): the fast runner packs from it layer by layer; any other runner
    gets the model filled first.
    """
    if precision == "int8" and fast_runner_supports(model.config):
        # prompt prefill on the int8 kernels too: every call of a sequence runs one kernel path,
        # and on this project's machines int8 prefill is faster than bf16 (BENCHMARKS.md)
        return FastLlamaRunner(
            model, weights="int8", prefill_weights=None, activation_bits=TARGET_ACTIVATION_BITS, checkpoint=checkpoint
        )
    if checkpoint is not None:
        checkpoint.load(model)
    if precision != "int8":
        return ModelRunner(model)
    return ModelRunner(quantize_linear_int8(model))


def drafts_on_packing(model: torch.nn.Module, weights: str) -> bool:
    """Whether a drafter drafts on ``FastLlamaRunner`` packings (``drafter_template``) with
    ``weights`` ("int8" | "bf16" | "fp32": Llama drafters) rather than through transformers
    (``hf``, or another architecture)."""
    return weights != "hf" and model.config.model_type == "llama"


def drafter_template(model: torch.nn.Module, weights: str) -> FastLlamaRunner:
    """The base packing of a Llama-architecture drafter on ``weights``' kernels ("int8" |
    "bf16" | "fp32"; 8-bit activations for prompt prefill on the native int8 kernels), packed
    once per model and kind from the weights as they are then, kept as a template
    (``as_template``: no KV cache of its own). Every drafting runner of the model is a fork of
    it: the engine's and each adapter's."""
    templates = model.__dict__.setdefault("_omnidraft_templates", {})
    if weights not in templates:
        runner = FastLlamaRunner(model, weights=weights, prefill_activation_bits=DRAFTER_PREFILL_ACTIVATION_BITS)
        runner.as_template()
        templates[weights] = runner
    return templates[weights]


def build_drafter_runner(model: torch.nn.Module, weights: str) -> FastLlamaRunner:
    """A drafting runner of a Llama-architecture drafter: a fork of its ``drafter_template``
    (the base packing, its own KV cache)."""
    return drafter_template(model, weights).fork()


def quantize_linear_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Quantize every ``nn.Linear`` of ``model`` (the LM head included) in place to fbgemm
    dynamic int8 (per-channel weights, per-tensor activations); returns ``model``. Idempotent."""
    if getattr(model, "_omnidraft_int8", False):
        return model
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else old
    try:
        with warnings.catch_warnings():  # deprecated in favour of torchao, still maintained in torch
            warnings.simplefilter("ignore")
            torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    finally:
        torch.backends.quantized.engine = old
    model._omnidraft_int8 = True
    return model


def runner_backend(runner) -> str:
    """A short name of the kernels a runner uses (for reports and profile keys)."""
    if hasattr(runner, "backend"):
        return runner.backend
    model = runner.model
    if getattr(model, "_omnidraft_int8", False):
        return "fbgemm-int8 (transformers)"
    return f"transformers-{_TORCH_NAMES.get(next(model.parameters()).dtype, 'float')}"
