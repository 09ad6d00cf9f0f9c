"""The runner's decoder step in torch ops: the ``fp32`` and ``bf16`` kernels, and ``int8``
through fbgemm where the native kernels are missing. It reads the same folded weights (as torch
callables, ``weight_packing.make_linear``) and the same KV cache layout as the native kernels:
keys ``[layers, kv_heads, max_positions / 16, head_dim, 16]``, values ``[layers, kv_heads,
max_positions, head_dim]``, float16 or float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def torch_forward(
    layers: list[tuple[Callable, ...]],
    head: Callable,
    kcache: torch.Tensor,
    vcache: torch.Tensor,
    cis: torch.Tensor,
    h: torch.Tensor,
    p: int,
    logits_to_keep: int,
    n_heads: int,
    hidden: int,
    intermediate: int,
    eps: float,
) -> torch.Tensor:
    """One forward over the ``m = len(h)`` new positions ``[p, p + m)``: ``layers`` holds each
    layer's fused (qkv, o, gate_up, down) callables, ``head`` the LM head's, ``cis`` the RoPE
    table ``[positions, head_dim / 2]`` (complex); ``h`` ``[m, hidden]`` embeddings, updated in
    place to the final residual stream; keys and values are written into the caches. Returns
    float32 logits of the last ``logits_to_keep`` positions (0: all)."""
    m = h.shape[0]
    t = p + m
    n_kv, hd = kcache.shape[1], kcache.shape[3]
    g = n_heads // n_kv
    q_width = n_heads * hd
    qk_heads = n_heads + n_kv
    norm_shape = (hidden,)
    rms_norm = torch.rms_norm
    rot = cis[p:t].unsqueeze(1)  # [m, 1, hd/2]
    mask = None
    if m > 1:
        # row (group g, token i) sees keys j <= p + i
        allowed = torch.ones(m, t, dtype=torch.bool).tril_(p)
        mask = torch.zeros(m, t).masked_fill_(~allowed, float("-inf")).repeat(g, 1)

    half_cache = kcache.dtype == torch.float16
    positions = torch.arange(p, t)
    blk, lane = positions // 16, positions % 16
    nblk = -(-t // 16)
    for (f_qkv, f_o, f_gu, f_down), k_l, v_l in zip(layers, kcache, vcache):
        x = rms_norm(h, norm_shape, None, eps)
        qkv = f_qkv(x)
        if qkv.dtype != torch.float32:
            qkv = qkv.float()
        # RoPE on the (pair-interleaved) q and k heads, in place
        torch.view_as_complex(qkv[:, : qk_heads * hd].view(m, qk_heads, hd // 2, 2)).mul_(rot)
        kv_new = qkv[:, q_width:]
        if half_cache:
            kv_new = kv_new.clamp(-65504.0, 65504.0).to(torch.float16)
        k_l[:, blk, :, lane] = kv_new[:, : n_kv * hd].view(m, n_kv, hd)
        v_l.narrow(1, p, m).copy_(kv_new[:, n_kv * hd :].view(m, n_kv, hd).transpose(0, 1))
        q = qkv[:, :q_width].view(m, n_kv, g, hd).permute(1, 2, 0, 3).reshape(n_kv, g * m, hd)
        k_t = k_l.narrow(1, 0, nblk).permute(0, 2, 1, 3).reshape(n_kv, hd, nblk * 16)
        v_t = v_l.narrow(1, 0, t)
        if half_cache:
            k_t, v_t = k_t.float(), v_t.float()
        scores = torch.bmm(q, k_t).narrow(2, 0, t)  # [n_kv, g*m, t]
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, v_t)  # [n_kv, g*m, hd]
        o = o.view(n_kv, g, m, hd).permute(2, 0, 1, 3).reshape(m, q_width)
        h.add_(f_o(o))
        x = rms_norm(h, norm_shape, None, eps)
        gu = f_gu(x)
        a = F.silu(gu[:, :intermediate])
        a.mul_(gu[:, intermediate:])
        h.add_(f_down(a))

    if logits_to_keep:
        h = h[-logits_to_keep:]
    logits = head(rms_norm(h, norm_shape, None, eps))
    if logits.dtype != torch.float32:
        logits = logits.float()
    return logits
