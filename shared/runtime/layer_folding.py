"""How a Hugging Face Llama/Qwen2 decoder layer becomes the four fused, folded float32 matrices
the runner packs (qkv, o, gate_up, down).

* the RMSNorm gains are folded into the matrix that follows each norm, and the attention scale
  ``1/sqrt(head_dim)`` into the query rows;
* the query/key rows of each head are permuted so that the two RoPE halves ``(i, i + d/2)``
  sit next to each other (``rope_pair_perms``): RoPE is then a complex multiply (q.k is
  unchanged because queries and keys are permuted alike);
* a LoRA adapter is merged as a weight delta ``B A`` (``lora_deltas``), as peft's
  ``merge_adapter`` computes it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def rope_pair_perms(n_heads: int, n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row orders of the query and key projections: within each head, new row ``r`` is old row
    ``perm[r]`` with ``perm = (0, d/2, 1, d/2 + 1, ...)``."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    q_perm = (torch.arange(n_heads)[:, None] * head_dim + perm[None, :]).reshape(-1)
    k_perm = (torch.arange(n_kv)[:, None] * head_dim + perm[None, :]).reshape(-1)
    return q_perm, k_perm


def linear_of(layer, name: str) -> torch.nn.Module:
    """A decoder layer's Linear ``name`` (``q_proj`` ... ``o_proj`` in attention, the rest in the MLP);
    ValueError when the layer has none of that name."""
    for parent in (layer.self_attn, layer.mlp):
        if hasattr(parent, name):
            return getattr(parent, name)
    raise ValueError(f"LoRA for unknown Linear {name!r}")


def lora_deltas(mods: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A layer's LoRA matrices ``{name: (A [r, in], B [out, r])}`` as weight deltas ``B A`` [out, in]."""
    return {name: b.detach().float() @ a.detach().float() for name, (a, b) in mods.items()}


def fold_layer(
    layer, deltas: dict[str, torch.Tensor], q_perm: torch.Tensor, k_perm: torch.Tensor, head_dim: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """A decoder layer's four fused float32 matrices ``(weight, bias)`` (qkv, o, gate_up, down)
    with the norm gains, the query scale and the RoPE row order folded in; each Linear's
    weight plus its ``deltas[name]`` [out, in] where given (a merged adapter). Made one at a
    time as they are asked for, so a caller that packs each and lets it go holds one fused
    float32 matrix at a time (gate_up of a 1.5B target: 0.11 GB)."""
    attn, mlp = layer.self_attn, layer.mlp

    def weight(name: str) -> torch.Tensor:
        w = linear_of(layer, name).weight.detach().float()
        return w + deltas[name] if name in deltas else w

    def bias(name: str) -> torch.Tensor | None:
        b = getattr(linear_of(layer, name), "bias", None)
        return None if b is None else b.detach().float()

    g_in = layer.input_layernorm.weight.detach().float()
    g_post = layer.post_attention_layernorm.weight.detach().float()
    scale = float(getattr(attn, "scaling", head_dim**-0.5))
    b_qkv = None
    if attn.q_proj.bias is not None:
        b_qkv = torch.cat([bias("q_proj")[q_perm] * scale, bias("k_proj")[k_perm], bias("v_proj")])
    yield torch.cat([weight("q_proj")[q_perm] * scale, weight("k_proj")[k_perm], weight("v_proj")]).mul_(g_in), b_qkv
    yield weight("o_proj"), bias("o_proj")
    b_gu = None
    if mlp.gate_proj.bias is not None:
        b_gu = torch.cat([bias("gate_proj"), bias("up_proj")])
    yield torch.cat([weight("gate_proj"), weight("up_proj")]).mul_(g_post), b_gu
    yield weight("down_proj"), bias("down_proj")
