"""A lean incremental decoder for Llama-architecture drafters on small CPUs.

``FastLlamaRunner`` has the interface of :class:`omnidraft.shared.model_runner.ModelRunner`
(``forward`` / ``crop`` / ``reset`` / ``length`` / ``forward_calls``) but runs the decoder
itself, reusing the weights of a loaded HF ``LlamaForCausalLM`` (nothing is re-loaded):

* one fused QKV matrix and one fused gate/up matrix per layer; the RMSNorm gains are folded
  into the matrix that follows each norm (the final norm into the LM head), and the attention
  scale ``1/sqrt(head_dim)`` into the query rows;
* the query/key rows of each head are permuted so that the two RoPE halves ``(i, i + d/2)``
  sit next to each other: RoPE is then a complex multiply by a precomputed table (q.k is
  unchanged because queries and keys are permuted alike);
* a static, preallocated KV cache (keys ``[layers, kv_heads, max_positions / 16, head_dim, 16]``
  so that one query scores 16 keys with plain FMAs, values ``[layers, kv_heads, max_positions,
  head_dim]``) written in place: ``crop`` is O(1) (a length counter);
* the kernels picked per call by the number of new tokens ``M`` (see ``weights``).

``weights`` chooses the kernels:

* ``"fp32"``: torch ops with ``F.linear`` (MKL) in float32; matches HF's fp32 forward to ~1e-6.
* ``"bf16"``: torch ops with oneDNN prepacked bf16 weights (``torch.ops.mkldnn._linear_pointwise``,
  AMX where the CPU has it); residual stream, norms, RoPE and attention stay float32.
* ``"int8"``: on x86-64 with AVX-512 VNNI, a native C kernel (built once with gcc at first use,
  cached under ``$OMNIDRAFT_HOME/fast_drafter``) runs the whole step in one call: int8 weights
  with a float scale per (output row, 64 inputs), 16-bit per-token activations (split into two
  int8 halves so that VPDPBUSD computes exact int32 group sums), float16 KV cache, fused
  RMSNorm/RoPE/softmax/SiLU. It is memory-bound (~140 MB of weights per token for SmolLM2) and
  about as accurate as bf16 (8-bit activations lose far more on SmolLM2). Elsewhere
  ``"int8"`` falls back to fbgemm dynamic quantization (``torch.ops.quantized.linear_dynamic``:
  per-channel int8 weights, per-tensor 7-bit activations), which is fast but noticeably less
  accurate. Calls with more than ``prefill_min_tokens`` new tokens (prompt prefill) use the
  ``prefill_weights`` kernels instead: by default bf16 on CPUs with native bf16 (AMX /
  AVX512-BF16), where they are several times faster for long blocks. That keeps a second
  (bf16) copy of the weights; ``prefill_weights=None`` runs every call on the int8 kernels.

Threads: the native kernel splits its matrix products (and attention heads) over ``threads``
(default ``torch.get_num_threads()`` at each call) OpenMP threads (the same libgomp pool as torch). On a CPU shared
with other busy processes, prefer one thread: fine-grained barriers stall whenever a helper
thread is descheduled (torch's own ops suffer the same way).

``vocab_rows`` prunes the LM head to the given drafter ids: ``forward`` still returns logits
over the full vocabulary, with ``-inf`` at every pruned id (so argmax / softmax / sampling in
the caller work unchanged and pruned ids get probability 0).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

WEIGHT_KINDS = ("fp32", "bf16", "int8")
# Llama and Qwen2 share the decoder (Qwen2 adds biases to q/k/v, which the runner folds in)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_NATIVE_SRC = r'''
// Native decode step for FastLlamaRunner's int8 weights (x86-64 AVX-512 VNNI).
// Weights: int8 with one float scale per 64 inputs (group) and output row, stored as
// uint8 (q + 128) in [N/16][K/4][16][4] order (16 output rows x 4 inputs per 64-byte vector).
// Activations: per-token 16-bit (x = s * q16, |q16| <= 32639), split q16 = 256 * hi + lo with
// int8 hi and lo, so that each group dot product is two VPDPBUSD passes computed exactly in int32.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    int32_t D, H, KV, HD, I, L, maxpos, n_qkv, n_head;  // n_qkv / n_head padded to 16
    float eps;
    const int64_t* layer_ptrs;  // [L][12]: (w, scales, bias) x (qkv, o, gate_up, down)
    const int64_t* head_ptrs;   // [3]:  w, scales, bias
    uint16_t* kcache;           // fp16 [L][KV][maxpos/16][HD][16]  (16 keys interleaved per dim)
    uint16_t* vcache;           // fp16 [L][KV][maxpos][HD]
    const float* cos_t;         // [maxpos][HD/2]
    const float* sin_t;         // [maxpos][HD/2]
    int32_t act8;               // 1: 8-bit activations with a scale per (token, 64 inputs); 0: 16-bit split
} fd_model;

typedef struct {  // quantized activation rows
    int8_t* hi;   // [M][ld]
    int8_t* lo;   // [M][ld]
    int32_t* gs;  // [M][ld/64]: sum of q16 over each group
    float* s;     // [M]: row scale (1 in 8-bit mode)
    float* gsc;   // [M][ld/64]: 8-bit mode: scale of each group of 64 inputs
    int ld;
    int act8;     // 8-bit mode: only `hi` holds the quantized values
} qact;

static void* amalloc(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static float rms_factor(const float* x, int K, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    return 1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps);
}

// 8-bit mode: each group of 64 inputs gets its own scale (absmax / 127), like llama.cpp's Q8
// activations: an outlier channel only coarsens its own group. One VPDPBUSD pass per product.
static void quant_row8(const float* x, int K, qact* a, int m, float mult) {
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    int8_t* hi = a->hi + (size_t)m * a->ld;
    int32_t* gs = a->gs + (size_t)m * (a->ld / 64);
    float* gsc = a->gsc + (size_t)m * (a->ld / 64);
    for (int g = 0; g < K / 64; g++) {
        __m512 am = _mm512_setzero_ps();
        for (int k = g * 64; k < g * 64 + 64; k += 16) am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
        const float mx = _mm512_reduce_max_ps(am);
        const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 1.f);
        __m512i sum = _mm512_setzero_si512();
        for (int k = g * 64; k < g * 64 + 64; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
            q = _mm512_max_epi32(_mm512_min_epi32(q, lim), nlim);
            sum = _mm512_add_epi32(sum, q);
            _mm_storeu_si128((__m128i*)(hi + k), _mm512_cvtepi32_epi8(q));
        }
        gs[g] = _mm512_reduce_add_epi32(sum);
        gsc[g] = (mx > 0.f ? mx / 127.f : 1.f) * mult;
    }
    a->s[m] = 1.f;
}

// Quantize row m of `a` from x[K] (K % 64 == 0); the stored scale is multiplied by `mult`.
static void quant_row(const float* x, int K, qact* a, int m, float mult) {
    if (a->act8) {
        quant_row8(x, K, a, m, mult);
        return;
    }
    __m512 am = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const float mx = _mm512_reduce_max_ps(am);
    const float s = mx > 0.f ? mx / 32639.f : 1.f;
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32639.f / mx : 1.f);
    const __m512i lim = _mm512_set1_epi32(32639), nlim = _mm512_set1_epi32(-32639), c128 = _mm512_set1_epi32(128);
    int8_t* hi = a->hi + (size_t)m * a->ld;
    int8_t* lo = a->lo + (size_t)m * a->ld;
    int32_t* gs = a->gs + (size_t)m * (a->ld / 64);
    for (int g = 0; g < K / 64; g++) {
        __m512i sum = _mm512_setzero_si512();
        for (int k = g * 64; k < g * 64 + 64; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
            q = _mm512_max_epi32(_mm512_min_epi32(q, lim), nlim);
            sum = _mm512_add_epi32(sum, q);
            __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, c128), 8);
            __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
            _mm_storeu_si128((__m128i*)(hi + k), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i*)(lo + k), _mm512_cvtepi32_epi8(l));
        }
        gs[g] = _mm512_reduce_add_epi32(sum);
    }
    a->s[m] = s * mult;
}

#ifndef PF_DIST
#define PF_DIST 4096
#endif
#define BCAST(p) _mm512_set1_epi32(*(const int32_t*)(p))

// Four activation rows against one 16-row weight block; returns the float dot products in acc[4].
static inline void block_rows4(int K, const uint8_t* w, const float* sc, const qact* a, int m, __m512* acc) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const int8_t* l0 = a->lo + (size_t)m * a->ld;
    const size_t ld = a->ld;
    const int32_t* g0 = a->gs + (size_t)m * (a->ld / 64);
    const size_t ldg = a->ld / 64;
    __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps(), f2 = _mm512_setzero_ps(), f3 = _mm512_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m512i H0 = _mm512_setzero_si512(), H1 = H0, H2 = H0, H3 = H0, L0 = H0, L1 = H0, L2 = H0, L3 = H0;
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            const __m512i wv = _mm512_loadu_si512(w + (size_t)k * 16);
            H0 = _mm512_dpbusd_epi32(H0, wv, BCAST(h0 + k));
            L0 = _mm512_dpbusd_epi32(L0, wv, BCAST(l0 + k));
            H1 = _mm512_dpbusd_epi32(H1, wv, BCAST(h0 + ld + k));
            L1 = _mm512_dpbusd_epi32(L1, wv, BCAST(l0 + ld + k));
            H2 = _mm512_dpbusd_epi32(H2, wv, BCAST(h0 + 2 * ld + k));
            L2 = _mm512_dpbusd_epi32(L2, wv, BCAST(l0 + 2 * ld + k));
            H3 = _mm512_dpbusd_epi32(H3, wv, BCAST(h0 + 3 * ld + k));
            L3 = _mm512_dpbusd_epi32(L3, wv, BCAST(l0 + 3 * ld + k));
        }
        const __m512 s = _mm512_loadu_ps(sc + g * 16);
#define FIN(Hx, Lx, fx, r)                                                                              \
    fx = _mm512_fmadd_ps(                                                                               \
        _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(Hx, 8), Lx),             \
                                            _mm512_set1_epi32(128 * g0[(r) * ldg + g]))),               \
        s, fx)
        FIN(H0, L0, f0, 0);
        FIN(H1, L1, f1, 1);
        FIN(H2, L2, f2, 2);
        FIN(H3, L3, f3, 3);
#undef FIN
    }
    acc[0] = f0; acc[1] = f1; acc[2] = f2; acc[3] = f3;
}

static inline __m512 block_row1(int K, const uint8_t* w, const float* sc, const qact* a, int m) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const int8_t* l0 = a->lo + (size_t)m * a->ld;
    const int32_t* g0 = a->gs + (size_t)m * (a->ld / 64);
    __m512 f = _mm512_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m512i Ha = _mm512_setzero_si512(), Hb = Ha, La = Ha, Lb = Ha;
#pragma GCC unroll 8
        for (int k = g * 64; k < g * 64 + 64; k += 8) {
            _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
            _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST + 64), _MM_HINT_T0);
            const __m512i wa = _mm512_loadu_si512(w + (size_t)k * 16);
            const __m512i wb = _mm512_loadu_si512(w + (size_t)k * 16 + 64);
            Ha = _mm512_dpbusd_epi32(Ha, wa, BCAST(h0 + k));
            La = _mm512_dpbusd_epi32(La, wa, BCAST(l0 + k));
            Hb = _mm512_dpbusd_epi32(Hb, wb, BCAST(h0 + k + 4));
            Lb = _mm512_dpbusd_epi32(Lb, wb, BCAST(l0 + k + 4));
        }
        __m512i t = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(Ha, Hb), 8), _mm512_add_epi32(La, Lb));
        t = _mm512_sub_epi32(t, _mm512_set1_epi32(128 * g0[g]));
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_loadu_ps(sc + g * 16), f);
    }
    return f;
}


// One activation row against two adjacent 16-row weight blocks (shares the activation broadcasts).
static inline void block_row1x2(int K, const uint8_t* w, const float* sc, const qact* a, int m, __m512* out) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const int8_t* l0 = a->lo + (size_t)m * a->ld;
    const int32_t* g0 = a->gs + (size_t)m * (a->ld / 64);
    const uint8_t* w2 = w + (size_t)16 * K;
    const float* sc2 = sc + (size_t)16 * (K / 64);
    __m512 f = _mm512_setzero_ps(), f2 = _mm512_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m512i Ha = _mm512_setzero_si512(), Hb = Ha, La = Ha, Lb = Ha;
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
            _mm_prefetch((const char*)(w2 + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
            const __m512i wa = _mm512_loadu_si512(w + (size_t)k * 16);
            const __m512i wb = _mm512_loadu_si512(w2 + (size_t)k * 16);
            const __m512i bh = BCAST(h0 + k), bl = BCAST(l0 + k);
            Ha = _mm512_dpbusd_epi32(Ha, wa, bh);
            La = _mm512_dpbusd_epi32(La, wa, bl);
            Hb = _mm512_dpbusd_epi32(Hb, wb, bh);
            Lb = _mm512_dpbusd_epi32(Lb, wb, bl);
        }
        const __m512i c = _mm512_set1_epi32(128 * g0[g]);
        __m512i t = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(Ha, 8), La), c);
        __m512i t2 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(Hb, 8), Lb), c);
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_loadu_ps(sc + g * 16), f);
        f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t2), _mm512_loadu_ps(sc2 + g * 16), f2);
    }
    out[0] = f; out[1] = f2;
}

// 8-bit mode kernels. Every row's float result is sum over groups, in order, of
// fmadd(int32 dot - 128 * group sum, weight scales * activation group scale): the same
// operations whichever kernel (1, 1x2 or 4 rows) computes it, so a row never depends on M.
#define FIN8(H, f, gsum, gscale) \
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(H, _mm512_set1_epi32(128 * (gsum)))), \
                        _mm512_mul_ps(_mm512_loadu_ps(sc + g * 16), _mm512_set1_ps(gscale)), f)

static inline void block8_rows4(int K, const uint8_t* w, const float* sc, const qact* a, int m, __m512* acc) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const size_t ld = a->ld, ldg = a->ld / 64;
    const int32_t* g0 = a->gs + (size_t)m * ldg;
    const float* c0 = a->gsc + (size_t)m * ldg;
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int g = 0; g < K / 64; g++) {
        __m512i H0 = _mm512_setzero_si512(), H1 = H0, H2 = H0, H3 = H0;
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            const __m512i wv = _mm512_loadu_si512(w + (size_t)k * 16);
            H0 = _mm512_dpbusd_epi32(H0, wv, BCAST(h0 + k));
            H1 = _mm512_dpbusd_epi32(H1, wv, BCAST(h0 + ld + k));
            H2 = _mm512_dpbusd_epi32(H2, wv, BCAST(h0 + 2 * ld + k));
            H3 = _mm512_dpbusd_epi32(H3, wv, BCAST(h0 + 3 * ld + k));
        }
        FIN8(H0, f0, g0[g], c0[g]);
        FIN8(H1, f1, g0[ldg + g], c0[ldg + g]);
        FIN8(H2, f2, g0[2 * ldg + g], c0[2 * ldg + g]);
        FIN8(H3, f3, g0[3 * ldg + g], c0[3 * ldg + g]);
    }
    acc[0] = f0; acc[1] = f1; acc[2] = f2; acc[3] = f3;
}

static inline __m512 block8_row1(int K, const uint8_t* w, const float* sc, const qact* a, int m) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const int32_t* g0 = a->gs + (size_t)m * (a->ld / 64);
    const float* c0 = a->gsc + (size_t)m * (a->ld / 64);
    __m512 f = _mm512_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m512i Ha = _mm512_setzero_si512(), Hb = Ha;
#pragma GCC unroll 8
        for (int k = g * 64; k < g * 64 + 64; k += 8) {
            _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
            _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST + 64), _MM_HINT_T0);
            Ha = _mm512_dpbusd_epi32(Ha, _mm512_loadu_si512(w + (size_t)k * 16), BCAST(h0 + k));
            Hb = _mm512_dpbusd_epi32(Hb, _mm512_loadu_si512(w + (size_t)k * 16 + 64), BCAST(h0 + k + 4));
        }
        const __m512i H = _mm512_add_epi32(Ha, Hb);
        FIN8(H, f, g0[g], c0[g]);
    }
    return f;
}

static inline void block8_row1x2(int K, const uint8_t* w, const float* sc_a, const qact* a, int m, __m512* out) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const int32_t* g0 = a->gs + (size_t)m * (a->ld / 64);
    const float* c0 = a->gsc + (size_t)m * (a->ld / 64);
    const uint8_t* w2 = w + (size_t)16 * K;
    __m512 f = _mm512_setzero_ps(), f2 = _mm512_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m512i Ha = _mm512_setzero_si512(), Hb = Ha;
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
            _mm_prefetch((const char*)(w2 + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
            const __m512i b = BCAST(h0 + k);
            Ha = _mm512_dpbusd_epi32(Ha, _mm512_loadu_si512(w + (size_t)k * 16), b);
            Hb = _mm512_dpbusd_epi32(Hb, _mm512_loadu_si512(w2 + (size_t)k * 16), b);
        }
        {
            const float* sc = sc_a;
            FIN8(Ha, f, g0[g], c0[g]);
        }
        {
            const float* sc = sc_a + (size_t)16 * (K / 64);
            FIN8(Hb, f2, g0[g], c0[g]);
        }
    }
    out[0] = f; out[1] = f2;
}
#undef FIN8

// y[m][n] (+)= a.s[m] * sum_g scale[n][g] * dot_g(w[n], q16[m]) + bias[n], for n-blocks [nb0, nb1).
static void gemm_blocks(int M, int K, const qact* a, const uint8_t* wp, const float* sp, const float* bias,
                        float* y, int ldy, int accumulate, int nb0, int nb1) {
    const int G = K / 64;
    int nb = nb0;
    if (M == 1) {
        for (; nb + 2 <= nb1; nb += 2) {
            __m512 acc[2];
            if (a->act8) block8_row1x2(K, wp + (size_t)nb * 16 * K, sp + (size_t)nb * 16 * G, a, 0, acc);
            else block_row1x2(K, wp + (size_t)nb * 16 * K, sp + (size_t)nb * 16 * G, a, 0, acc);
            for (int r = 0; r < 2; r++) {
                const int n0 = (nb + r) * 16;
                const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
                __m512 v = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(a->s[0]), bv);
                if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(y + n0));
                _mm512_storeu_ps(y + n0, v);
            }
        }
    }
    for (; nb < nb1; nb++) {
        const uint8_t* w = wp + (size_t)nb * 16 * K;
        const float* sc = sp + (size_t)nb * 16 * G;
        const int n0 = nb * 16;
        const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
        int m = 0;
        for (; m + 4 <= M; m += 4) {
            __m512 acc[4];
            if (a->act8) block8_rows4(K, w, sc, a, m, acc);
            else block_rows4(K, w, sc, a, m, acc);
            for (int r = 0; r < 4; r++) {
                __m512 v = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(a->s[m + r]), bv);
                float* yo = y + (size_t)(m + r) * ldy + n0;
                if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
                _mm512_storeu_ps(yo, v);
            }
        }
        for (; m < M; m++) {
            const __m512 r1 = a->act8 ? block8_row1(K, w, sc, a, m) : block_row1(K, w, sc, a, m);
            __m512 v = _mm512_fmadd_ps(r1, _mm512_set1_ps(a->s[m]), bv);
            float* yo = y + (size_t)m * ldy + n0;
            if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
            _mm512_storeu_ps(yo, v);
        }
    }
}

static void gemm(int nthreads, int M, int N, int K, const qact* a, const int64_t* p, float* y, int ldy,
                 int accumulate) {
    const uint8_t* w = (const uint8_t*)p[0];
    const float* sc = (const float*)p[1];
    const float* b = (const float*)p[2];
    const int nblocks = N / 16;
#ifdef _OPENMP
    if (nthreads > 1 && nblocks >= 16) {
#pragma omp parallel num_threads(nthreads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int b0 = (int)((long)nblocks * t / nt), b1 = (int)((long)nblocks * (t + 1) / nt);
            gemm_blocks(M, K, a, w, sc, b, y, ldy, accumulate, b0, b1);
        }
        return;
    }
#endif
    (void)nthreads;
    gemm_blocks(M, K, a, w, sc, b, y, ldy, accumulate, 0, nblocks);
}

static inline __m512 load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Attention of query head h (at position pos) over keys [0, pos]; sc: scratch of >= pos + 17 floats.
static void attend_head(const fd_model* md, int layer, const float* qh, int h, int pos, float* oh, float* sc) {
    const int HD = md->HD, KV = md->KV, G = md->H / md->KV, T = pos + 1;
    const int nblk = (T + 15) / 16;
    const size_t head_stride = (size_t)md->maxpos * HD;
    const int kh = h / G;
    const uint16_t* K = md->kcache + ((size_t)layer * KV + kh) * head_stride;
    const uint16_t* V = md->vcache + ((size_t)layer * KV + kh) * head_stride;
    // scores of 16 keys at a time: sum_d q[d] * K[blk][d][0..15]
    for (int b = 0; b < nblk; b++) {
        const uint16_t* kb = K + (size_t)b * HD * 16;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
        for (int d = 0; d < HD; d += 4) {
            s0 = _mm512_fmadd_ps(_mm512_set1_ps(qh[d]), load_h(kb + d * 16), s0);
            s1 = _mm512_fmadd_ps(_mm512_set1_ps(qh[d + 1]), load_h(kb + d * 16 + 16), s1);
            s2 = _mm512_fmadd_ps(_mm512_set1_ps(qh[d + 2]), load_h(kb + d * 16 + 32), s2);
            s3 = _mm512_fmadd_ps(_mm512_set1_ps(qh[d + 3]), load_h(kb + d * 16 + 48), s3);
        }
        _mm512_storeu_ps(sc + b * 16, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < T; j += 16) {
        __mmask16 mk = T - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (T - j)) - 1u);
        mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_maskz_loadu_ps(mk, sc + j));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < T; j += 16) {
        __mmask16 mk = T - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (T - j)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + j), mv)));
        _mm512_mask_storeu_ps(sc + j, mk, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    if (HD == 64) {
        __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps(), o2 = _mm512_setzero_ps(), o3 = _mm512_setzero_ps();
        for (int j = 0; j < T; j++) {
            const uint16_t* vr = V + (size_t)j * 64;
            __m512 pj = _mm512_set1_ps(sc[j]);
            o0 = _mm512_fmadd_ps(pj, load_h(vr), o0);
            o1 = _mm512_fmadd_ps(pj, load_h(vr + 16), o1);
            o2 = _mm512_fmadd_ps(pj, load_h(vr + 32), o2);
            o3 = _mm512_fmadd_ps(pj, load_h(vr + 48), o3);
        }
        _mm512_storeu_ps(oh, _mm512_mul_ps(o0, inv));
        _mm512_storeu_ps(oh + 16, _mm512_mul_ps(o1, inv));
        _mm512_storeu_ps(oh + 32, _mm512_mul_ps(o2, inv));
        _mm512_storeu_ps(oh + 48, _mm512_mul_ps(o3, inv));
    } else {
        for (int d = 0; d < HD; d += 16) {
            __m512 o = _mm512_setzero_ps();
            for (int j = 0; j < T; j++) o = _mm512_fmadd_ps(_mm512_set1_ps(sc[j]), load_h(V + (size_t)j * HD + d), o);
            _mm512_storeu_ps(oh + d, _mm512_mul_ps(o, inv));
        }
    }
}

// Attention for M query rows (positions pos..pos+M-1) and all heads; scores: nthreads x sstride floats.
static void attention(const fd_model* md, int layer, int M, const float* qkv, int NQ, int pos, float* att,
                      float* scores, size_t sstride, int nthreads) {
    const int H = md->H, HD = md->HD, total = M * H;
#ifdef _OPENMP
    if (nthreads > 1 && total > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int i = 0; i < total; i++) {
            const int m = i / H, h = i % H;
            attend_head(md, layer, qkv + (size_t)m * NQ + (size_t)h * HD, h, pos + m,
                        att + (size_t)m * H * HD + (size_t)h * HD, scores + (size_t)omp_get_thread_num() * sstride);
        }
        return;
    }
#endif
    (void)nthreads;
    for (int i = 0; i < total; i++) {
        const int m = i / H, h = i % H;
        attend_head(md, layer, qkv + (size_t)m * NQ + (size_t)h * HD, h, pos + m,
                    att + (size_t)m * H * HD + (size_t)h * HD, scores);
    }
}

static inline void store_h(uint16_t* dst, const float* src, int n) {  // fp32 -> fp16, saturating
    const __m512 lim = _mm512_set1_ps(65504.f), nlim = _mm512_set1_ps(-65504.f);
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(src + i), lim), nlim);
        _mm256_storeu_si256((__m256i*)(dst + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

// One forward over M new tokens at positions [pos, pos + M). h: [M][D] embeddings (updated in place).
// logits: [last_only ? 1 : M][n_head]. Returns 0 on success, -1 when out of memory.
int fd_forward(const fd_model* md, int M, float* h, int pos, int last_only, float* logits, int nthreads) {
    const int D = md->D, H = md->H, KV = md->KV, HD = md->HD, I = md->I, NQ = md->n_qkv;
    const int qw = H * HD, half = HD / 2;
    int KMAX = D > I ? D : I;
    if (qw > KMAX) KMAX = qw;
    qact a;
    a.ld = KMAX;
    a.act8 = md->act8;
    a.gsc = (float*)amalloc(sizeof(float) * (size_t)M * (KMAX / 64));
    a.hi = (int8_t*)amalloc((size_t)M * KMAX);
    a.lo = (int8_t*)amalloc((size_t)M * KMAX);
    a.gs = (int32_t*)amalloc(sizeof(int32_t) * (size_t)M * (KMAX / 64));
    a.s = (float*)amalloc(sizeof(float) * M);
    float* qkv = (float*)amalloc(sizeof(float) * (size_t)M * NQ);
    float* att = (float*)amalloc(sizeof(float) * (size_t)M * qw);
    float* gu = (float*)amalloc(sizeof(float) * (size_t)M * 2 * I);
    float* act = (float*)amalloc(sizeof(float) * (size_t)M * I);
    const size_t sstride = ((size_t)pos + M + 32 + 15) / 16 * 16;
    float* scores = (float*)amalloc(sizeof(float) * sstride * (size_t)(nthreads > 1 ? nthreads : 1));
    int rc = 0;
    if (!a.hi || !a.lo || !a.gs || !a.s || !a.gsc || !qkv || !att || !gu || !act || !scores) {
        rc = -1;
        goto done;
    }
    const size_t head_stride = (size_t)md->maxpos * HD;

    for (int l = 0; l < md->L; l++) {
        const int64_t* lp = md->layer_ptrs + (size_t)l * 12;
        uint16_t* kbase = md->kcache + (size_t)l * KV * head_stride;
        uint16_t* vbase = md->vcache + (size_t)l * KV * head_stride;
        // --- attention block (input RMSNorm gain folded into the QKV weights)
        for (int m = 0; m < M; m++) {
            const float* hm = h + (size_t)m * D;
            quant_row(hm, D, &a, m, rms_factor(hm, D, md->eps));
        }
        gemm(nthreads, M, NQ, D, &a, lp + 0, qkv, NQ, 0);
        for (int m = 0; m < M; m++) {
            float* row = qkv + (size_t)m * NQ;
            const int p = pos + m;
            const float* cs = md->cos_t + (size_t)p * half;
            const float* sn = md->sin_t + (size_t)p * half;
            for (int hh = 0; hh < H + KV; hh++) {  // RoPE on pair-interleaved q and k heads
                float* x = row + (size_t)hh * HD;
                for (int i = 0; i < half; i++) {
                    const float u = x[2 * i], v = x[2 * i + 1];
                    x[2 * i] = u * cs[i] - v * sn[i];
                    x[2 * i + 1] = u * sn[i] + v * cs[i];
                }
            }
            for (int kh = 0; kh < KV; kh++) {
                uint16_t kh16[HD];
                store_h(kh16, row + qw + (size_t)kh * HD, HD);
                uint16_t* kd = kbase + kh * head_stride + (size_t)(p / 16) * HD * 16 + (p % 16);
                for (int d = 0; d < HD; d++) kd[d * 16] = kh16[d];
                store_h(vbase + kh * head_stride + (size_t)p * HD, row + qw + (size_t)(KV + kh) * HD, HD);
            }
        }
        attention(md, l, M, qkv, NQ, pos, att, scores, sstride, nthreads);
        for (int m = 0; m < M; m++) quant_row(att + (size_t)m * qw, qw, &a, m, 1.f);
        gemm(nthreads, M, D, qw, &a, lp + 3, h, D, 1);
        // --- MLP block
        for (int m = 0; m < M; m++) {
            const float* hm = h + (size_t)m * D;
            quant_row(hm, D, &a, m, rms_factor(hm, D, md->eps));
        }
        gemm(nthreads, M, 2 * I, D, &a, lp + 6, gu, 2 * I, 0);
        for (int m = 0; m < M; m++) {
            const float* g = gu + (size_t)m * 2 * I;
            const float* u = g + I;
            float* y = act + (size_t)m * I;
            for (int i = 0; i < I; i += 16) {
                __m512 gv = _mm512_loadu_ps(g + i);
                __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
                __m512 sg = _mm512_div_ps(gv, den);
                _mm512_storeu_ps(y + i, _mm512_mul_ps(sg, _mm512_loadu_ps(u + i)));
            }
            quant_row(y, I, &a, m, 1.f);
        }
        gemm(nthreads, M, D, I, &a, lp + 9, h, D, 1);
    }
    {
        // --- final norm (gain folded into the head) and LM head
        const int m0 = last_only ? M - 1 : 0;
        const int MO = M - m0;
        for (int m = 0; m < MO; m++) {
            const float* hm = h + (size_t)(m0 + m) * D;
            quant_row(hm, D, &a, m, rms_factor(hm, D, md->eps));
        }
        gemm(nthreads, MO, md->n_head, D, &a, md->head_ptrs, logits, md->n_head, 0);
    }
done:
    free(a.hi); free(a.lo); free(a.gs); free(a.s); free(a.gsc); free(qkv); free(att); free(gu); free(act); free(scores);
    return rc;
}
'''


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16 (Linux only; False elsewhere)."""
    flags = _cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


_NATIVE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c",
                 "-shared", "-fPIC"]
_NATIVE_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"}
_native_lock = threading.Lock()
_native_state: dict = {}


def native_library():
    """The compiled native int8 kernel library (ctypes), or None where it cannot be used.

    Needs x86-64 Linux with AVX-512 VNNI and a C compiler (``$CC``, default ``gcc``). The shared
    object is built once (~1-2 s) into ``$OMNIDRAFT_HOME/fast_drafter/`` and reused. Setting
    ``OMNIDRAFT_NATIVE=0`` disables it.
    """
    with _native_lock:
        if "lib" in _native_state:
            return _native_state["lib"]
        _native_state["lib"] = None
        _native_state["error"] = None
        try:
            _native_state["lib"] = _build_native()
        except Exception as exc:  # no compiler, unsupported CPU, ...: fall back to torch kernels
            _native_state["error"] = f"{type(exc).__name__}: {exc}"
        return _native_state["lib"]


def _build_native():
    if os.environ.get("OMNIDRAFT_NATIVE", "1") == "0":
        raise RuntimeError("disabled by OMNIDRAFT_NATIVE=0")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError("native kernels need x86-64 Linux")
    missing = _NATIVE_CPU_FLAGS - _cpu_flags()
    if missing:
        raise RuntimeError(f"CPU lacks {sorted(missing)}")
    from omnidraft.shared import catalog

    cc = os.environ.get("CC", "gcc")
    key = hashlib.sha256((_NATIVE_SRC + " ".join(_NATIVE_FLAGS) + cc).encode()).hexdigest()[:16]
    out_dir = catalog.omnidraft_home() / "fast_drafter"
    so = out_dir / f"fd_{key}.so"
    if not so.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            c_file = Path(tmp) / "fd.c"
            c_file.write_text(_NATIVE_SRC)
            tmp_so = Path(tmp) / "fd.so"
            for extra in (["-fopenmp"], []):  # OpenMP only for 2+ threads; build without it if absent
                proc = subprocess.run([cc, *_NATIVE_FLAGS, *extra, str(c_file), "-o", str(tmp_so), "-lm"],
                                      capture_output=True, text=True)
                if proc.returncode == 0:
                    break
            else:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
            os.replace(tmp_so, so)  # atomic: concurrent builders agree on the result
    lib = ctypes.CDLL(str(so))
    lib.fd_forward.restype = ctypes.c_int
    lib.fd_forward.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int]
    return lib


class _FdModel(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("D", "H", "KV", "HD", "I", "L", "maxpos", "n_qkv", "n_head")] + [
        ("eps", ctypes.c_float), ("layer_ptrs", ctypes.c_void_p), ("head_ptrs", ctypes.c_void_p),
        ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p), ("cos_t", ctypes.c_void_p),
        ("sin_t", ctypes.c_void_p), ("act8", ctypes.c_int32)]


@contextlib.contextmanager
def _quantized_engine(name: str):
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def _make_linear(kind: str, w: torch.Tensor, b: torch.Tensor | None):
    """A callable ``x -> x @ w.T + b`` for float32 ``w`` [out, in] using the ``kind`` kernel.

    The fp32 and int8 kernels return float32; the bf16 kernel returns bfloat16.
    """
    w = w.detach().float().contiguous()
    b = None if b is None else b.detach().float().contiguous()
    if kind == "fp32":
        return lambda x: F.linear(x, w, b)
    if kind == "bf16":
        wb = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16))
        bb = None if b is None else b.to(torch.bfloat16)
        lp = torch.ops.mkldnn._linear_pointwise
        bf16 = torch.bfloat16
        return lambda x: lp(x.to(bf16), wb, bb, "none", [], "")
    if kind == "int8":
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated (but still the fastest here)
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        # fbgemm is the fastest engine here for M = 1..~16 (oneDNN/x86 are 10x slower for M > 1);
        # the packed object remembers its engine, so the global setting is restored afterwards.
        with _quantized_engine("fbgemm"):
            packed = torch.ops.quantized.linear_prepack(qw, b)
        lin = torch.ops.quantized.linear_dynamic
        return lambda x: lin(x, packed, True)
    raise ValueError(f"unknown weights kind {kind!r}: choose one of {', '.join(WEIGHT_KINDS)}")


def _pack_native(w: torch.Tensor, b: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Native int8 layout: [uint8 weights (q + 128) as [N/16][K/4][16][4], float scales per
    (row, group of 64 inputs) as [N/16][K/64][16], bias or None], with N padded to 16."""
    w = w.detach().float()
    n, k = w.shape
    n_pad = -n % 16
    if n_pad:
        w = torch.cat([w, torch.zeros(n_pad, k)])
    groups = w.view(n + n_pad, k // 64, 64)
    scale = (groups.abs().amax(dim=-1) / 127.0).clamp_min(1e-30)  # [N, K/64]
    q = torch.round(groups / scale[..., None]).clamp_(-127, 127).view(n + n_pad, k)
    u = (q + 128).to(torch.uint8)
    packed = u.view(-1, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = scale.view(-1, 16, k // 64).permute(0, 2, 1).contiguous()
    bias = None
    if b is not None:
        bias = torch.cat([b.detach().float(), torch.zeros(n_pad)]).contiguous()
    return [packed, scales, bias]


class FastLlamaRunner:
    """Incremental forward passes over one sequence for a Llama-architecture causal LM.

    Same interface as ``ModelRunner``: ``forward(ids, last_only)`` appends ``ids`` and returns
    float32 logits ``[len(ids), vocab]`` (``[1, vocab]`` when ``last_only``); ``crop(n)``
    keeps the first ``n`` positions; ``reset()`` empties the cache; ``length`` is the number
    of cached positions and ``forward_calls`` counts ``forward`` calls.

    Arguments (see the module docstring): ``weights`` ("fp32" | "bf16" | "int8");
    ``max_positions`` (size of the static KV cache); ``vocab_rows`` (LM-head pruning; -inf
    logits elsewhere); ``prefill_weights`` ("auto" | None | a kind: kernels for calls with more
    than ``prefill_min_tokens`` tokens); ``native`` (int8 only: None = native kernels where
    available, True = require them, False = fbgemm); ``threads`` (native kernels; None = torch's
    setting at each call); ``activation_bits`` (native kernels: 16 = per-token 16-bit activations,
    two VPDPBUSD passes; 8 = 8-bit activations with a scale per token and 64 inputs, one pass:
    about half the arithmetic for multi-token calls). ``backend`` names the kernels in use.
    """

    def __init__(self, model, *, weights: str = "int8", max_positions: int = 4096,
                 vocab_rows: torch.Tensor | None = None, prefill_weights: str | None = "auto",
                 prefill_min_tokens: int = 16, native: bool | None = None,
                 threads: int | None = None, activation_bits: int = 16) -> None:
        if weights not in WEIGHT_KINDS:
            raise ValueError(f"unknown weights kind {weights!r}: choose one of {', '.join(WEIGHT_KINDS)}")
        config = model.config
        if getattr(config, "model_type", "llama") not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"FastLlamaRunner supports Llama-architecture models ({', '.join(SUPPORTED_MODEL_TYPES)}), "
                             f"not {config.model_type!r}")
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            raise ValueError("FastLlamaRunner supports full attention only (no sliding-window layers)")
        decoder = model.model
        self.config = config
        self.weights = weights
        self.max_positions = int(max_positions)
        self.num_layers = len(decoder.layers)
        self.hidden = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.intermediate = config.intermediate_size
        self.eps = float(decoder.norm.variance_epsilon)
        self._final_norm = decoder.norm.weight.detach().float().clone()
        self._last_residual: torch.Tensor | None = None
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}")

        if prefill_weights == "auto":
            prefill_weights = "bf16" if weights == "int8" and cpu_has_native_bf16() else None
        if prefill_weights == weights:
            prefill_weights = None
        if prefill_weights is not None and prefill_weights not in WEIGHT_KINDS:
            raise ValueError(f"unknown prefill_weights {prefill_weights!r}")
        self.prefill_weights = prefill_weights
        self.prefill_min_tokens = int(prefill_min_tokens)
        self.threads = threads

        # int8 through the native kernels where possible (K dims multiples of 64, head_dim of 16)
        lib = None
        if weights == "int8" and native is not False:
            dims_ok = (self.head_dim % 16 == 0 and self.n_heads % self.n_kv == 0 and all(
                d % 64 == 0 for d in (self.hidden, self.intermediate, self.n_heads * self.head_dim)))
            lib = native_library() if dims_ok else None
            if lib is None and native:
                reason = _native_state.get("error") if dims_ok else "hidden/intermediate sizes must be multiples of 64"
                raise RuntimeError(f"native int8 kernels unavailable: {reason}")
        if activation_bits not in (8, 16):
            raise ValueError("activation_bits must be 8 or 16")
        self._lib = lib
        self.activation_bits = activation_bits if lib else None
        self.backend = {"fp32": "torch-fp32", "bf16": "onednn-bf16",
                        "int8": ("native-int8" + ("-a8" if activation_bits == 8 else "")) if lib
                        else "fbgemm-int8"}[weights]
        torch_kinds = [k for k in [weights, prefill_weights] if k is not None and not (k == "int8" and lib)]

        # --- RoPE table: exp(i * pos * inv_freq) * attention_scaling ------------------------
        rotary = decoder.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope type {rope_type!r} depends on the sequence length; not supported")
        inv_freq = rotary.inv_freq.detach().float().cpu()
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        angles = pos[:, None] * inv_freq[None, :]
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = (angles.cos() * scaling).contiguous()  # [P, hd/2]
        self._sin = (angles.sin() * scaling).contiguous()
        self._cis = torch.complex(self._cos, self._sin)

        # --- per-layer fused, folded weights ------------------------------------------------
        hd, half = self.head_dim, self.head_dim // 2
        # new row r of a head <- old row perm[r]: (0, d/2, 1, d/2+1, ...) pairs the RoPE halves
        perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
        q_perm = (torch.arange(self.n_heads)[:, None] * hd + perm[None, :]).reshape(-1)
        k_perm = (torch.arange(self.n_kv)[:, None] * hd + perm[None, :]).reshape(-1)
        self._layers = {k: [] for k in torch_kinds}
        native_tensors: list[torch.Tensor] = []  # keeps the native buffers alive
        layer_ptrs = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            g_in = layer.input_layernorm.weight.detach().float()
            g_post = layer.post_attention_layernorm.weight.detach().float()
            scale = float(getattr(attn, "scaling", hd ** -0.5))
            wq = attn.q_proj.weight.detach().float()[q_perm] * scale
            wk = attn.k_proj.weight.detach().float()[k_perm]
            wv = attn.v_proj.weight.detach().float()
            w_qkv = torch.cat([wq, wk, wv]) * g_in[None, :]
            b_qkv = None
            if attn.q_proj.bias is not None:
                b_qkv = torch.cat([attn.q_proj.bias.detach().float()[q_perm] * scale,
                                   attn.k_proj.bias.detach().float()[k_perm],
                                   attn.v_proj.bias.detach().float()])
            w_gu = torch.cat([mlp.gate_proj.weight.detach().float(),
                              mlp.up_proj.weight.detach().float()]) * g_post[None, :]
            b_gu = None
            if mlp.gate_proj.bias is not None:
                b_gu = torch.cat([mlp.gate_proj.bias.detach().float(), mlp.up_proj.bias.detach().float()])
            mats = [(w_qkv, b_qkv), (attn.o_proj.weight, attn.o_proj.bias), (w_gu, b_gu),
                    (mlp.down_proj.weight, mlp.down_proj.bias)]
            for k in torch_kinds:
                self._layers[k].append(tuple(_make_linear(k, w, b) for w, b in mats))
            if lib is not None:
                for w, b in mats:
                    bufs = _pack_native(w, b)
                    native_tensors += [t for t in bufs if t is not None]
                    layer_ptrs += [0 if t is None else t.data_ptr() for t in bufs]

        # --- embeddings and (optionally pruned) LM head -------------------------------------
        self._embed = model.get_input_embeddings().weight.detach()
        head = model.get_output_embeddings()
        w_head = head.weight.detach().float() * decoder.norm.weight.detach().float()[None, :]
        b_head = None if getattr(head, "bias", None) is None else head.bias.detach().float()
        self.vocab = w_head.shape[0]
        self.vocab_rows = None
        if vocab_rows is not None:
            rows = torch.as_tensor(vocab_rows, dtype=torch.long).flatten().unique(sorted=True)
            if rows.numel() == 0 or rows[0] < 0 or rows[-1] >= self.vocab:
                raise ValueError("vocab_rows must hold ids in [0, vocab)")
            self.vocab_rows = rows
            w_head = w_head[rows]
            b_head = None if b_head is None else b_head[rows]
        self.head_rows = w_head.shape[0]
        self._head = {k: _make_linear(k, w_head, b_head) for k in torch_kinds}

        # --- static KV cache -----------------------------------------------------------------
        # keys as [layers, kv_heads, blocks of 16 positions, head_dim, 16]: a query scores 16 keys
        # with head_dim broadcast-FMAs (no horizontal sums); values as [layers, kv_heads, pos, head_dim]
        # (float16 for the native int8 path: halves the cache traffic of long contexts)
        pos_pad = -(-self.max_positions // 16) * 16
        cache_dtype = torch.float16 if lib is not None else torch.float32
        self._kcache = torch.zeros(self.num_layers, self.n_kv, pos_pad // 16, hd, 16, dtype=cache_dtype)
        self._vcache = torch.zeros(self.num_layers, self.n_kv, pos_pad, hd, dtype=cache_dtype)
        self._pos_pad = pos_pad

        if lib is not None:
            bufs = _pack_native(w_head, b_head)
            native_tensors += [t for t in bufs if t is not None]
            head_ptrs = torch.tensor([0 if t is None else t.data_ptr() for t in bufs], dtype=torch.int64)
            layer_ptrs = torch.tensor(layer_ptrs, dtype=torch.int64)
            self._native_tensors = native_tensors + [layer_ptrs, head_ptrs]
            self._head_pad = bufs[0].shape[0] * 16
            n_qkv = (self.n_heads + 2 * self.n_kv) * hd
            self._fd = _FdModel(
                D=self.hidden, H=self.n_heads, KV=self.n_kv, HD=hd, I=self.intermediate, L=self.num_layers,
                maxpos=self._pos_pad, n_qkv=n_qkv + (-n_qkv % 16),
                n_head=self._head_pad, eps=self.eps, layer_ptrs=layer_ptrs.data_ptr(),
                head_ptrs=head_ptrs.data_ptr(), kcache=self._kcache.data_ptr(), vcache=self._vcache.data_ptr(),
                cos_t=self._cos.data_ptr(), sin_t=self._sin.data_ptr(), act8=int(activation_bits == 8))
            self._fd_ref = ctypes.addressof(self._fd)
        self.length = 0
        self.forward_calls = 0

    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds only the first ``length`` positions."""
        if length < 0:
            raise ValueError("length must be >= 0")
        if length < self.length:
            self.length = length

    @torch.inference_mode()
    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append ``ids``; return float32 logits ``[len(ids), vocab]`` (``[1, vocab]`` if ``last_only``)."""
        m = len(ids)
        if m == 0:
            raise ValueError("forward needs at least one token id")
        p = self.length
        t = p + m
        if t > self.max_positions:
            raise ValueError(f"sequence of {t} positions exceeds max_positions={self.max_positions}")
        kind = self.weights
        if self.prefill_weights is not None and m > self.prefill_min_tokens:
            kind = self.prefill_weights
        h = self._embed.index_select(0, torch.tensor(ids, dtype=torch.long))
        if h.dtype != torch.float32:
            h = h.float()
        if kind == "int8" and self._lib is not None:
            out = torch.empty(1 if last_only else m, self._head_pad)
            rc = self._lib.fd_forward(self._fd_ref, m, h.data_ptr(), p, int(last_only), out.data_ptr(),
                                      self.threads or torch.get_num_threads())
            if rc != 0:
                raise MemoryError("native forward failed to allocate its work buffers")
            logits = out[:, : self.head_rows] if self._head_pad != self.head_rows else out
        else:
            logits = self._forward_torch(kind, h, p, m, last_only)
        self._last_residual = h[-1]  # both kernel paths leave the final residual stream in h
        if self.vocab_rows is not None:
            full = torch.full((logits.shape[0], self.vocab), float("-inf"))
            full.index_copy_(1, self.vocab_rows, logits)
            logits = full
        self.length = t
        self.forward_calls += 1
        return logits

    def track_hidden(self) -> None:
        """Nothing to set up: every forward keeps the final residual (``last_hidden``)."""

    def last_hidden(self) -> torch.Tensor:
        """The last forwarded position's hidden state after the final norm ``[hidden]`` (what
        HF's ``last_hidden_state`` holds): the acceptance head's input."""
        h = self._last_residual
        return torch.rms_norm(h, (self.hidden,), self._final_norm, self.eps)

    def _forward_torch(self, kind: str, h: torch.Tensor, p: int, m: int, last_only: bool) -> torch.Tensor:
        t = p + m
        n_kv, g, hd = self.n_kv, self.group, self.head_dim
        q_width = self.n_heads * hd
        qk_heads = self.n_heads + self.n_kv
        inter = self.intermediate
        eps = self.eps
        norm_shape = (self.hidden,)
        rms_norm = torch.rms_norm
        cis = self._cis[p:t].unsqueeze(1)  # [m, 1, hd/2]
        mask = None
        if m > 1:
            # row (group g, token i) sees keys j <= p + i
            allowed = torch.ones(m, t, dtype=torch.bool).tril_(p)
            mask = torch.zeros(m, t).masked_fill_(~allowed, float("-inf")).repeat(g, 1)

        half_cache = self._kcache.dtype == torch.float16
        positions = torch.arange(p, t)
        blk, lane = positions // 16, positions % 16
        nblk = -(-t // 16)
        for (f_qkv, f_o, f_gu, f_down), k_l, v_l in zip(self._layers[kind], self._kcache, self._vcache):
            x = rms_norm(h, norm_shape, None, eps)
            qkv = f_qkv(x)
            if qkv.dtype != torch.float32:
                qkv = qkv.float()
            # RoPE on the (pair-interleaved) q and k heads, in place
            torch.view_as_complex(qkv[:, : qk_heads * hd].view(m, qk_heads, hd // 2, 2)).mul_(cis)
            kv_new = qkv[:, q_width:]
            if half_cache:
                kv_new = kv_new.clamp(-65504.0, 65504.0).to(torch.float16)
            k_l[:, blk, :, lane] = kv_new[:, : n_kv * hd].view(m, n_kv, hd)
            v_l.narrow(1, p, m).copy_(kv_new[:, n_kv * hd:].view(m, n_kv, hd).transpose(0, 1))
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
            a = F.silu(gu[:, :inter])
            a.mul_(gu[:, inter:])
            h.add_(f_down(a))

        if last_only:
            h = h[-1:]
        logits = self._head[kind](rms_norm(h, norm_shape, None, eps))
        if logits.dtype != torch.float32:
            logits = logits.float()
        return logits
