"""What the runtime tests (test_precision.py, test_cost_profile.py, test_native_runtime.py) share:
the prompts they decode, a random tiny Qwen2 (biases, tied embeddings) for the fast runner, and
skipping a test where an instruction set's native kernels do not load on this machine."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from omnidraft.shared.runtime.native_kernels import native_error, native_library


def needs_isa(isa: str) -> None:
    if native_library(isa) is None:
        pytest.skip(f"native {isa} kernels unavailable: {native_error(isa)}")


PROMPTS = [
    "def alpha_3(beta, gamma):\n",
    "def items_9(count, result):\n    items = count // result\n",
    "\n\ndef",
    'def delta_0(total, items):\n    """Return total * items."""\n    delta = total',
]


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
    return model.eval().requires_grad_(False)
