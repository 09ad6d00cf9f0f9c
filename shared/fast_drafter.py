"""A lean incremental decoder for Llama-architecture drafters on small CPUs.

``FastLlamaRunner`` has the interface of :class:`omnidraft.shared.model_runner.ModelRunner`
(``forward`` / ``crop`` / ``reset`` / ``length`` / ``forward_calls``) but runs the decoder
layers itself, reusing the weights of a loaded HF ``LlamaForCausalLM``:

* one fused QKV matrix and one fused gate/up matrix per layer; the RMSNorm gains are folded
  into the matrix that follows each norm, and the attention scale ``1/sqrt(head_dim)`` into
  the query rows;
* the query/key rows of each head are permuted so that the two RoPE halves ``(i, i + d/2)``
  sit next to each other: rotary embedding is then one in-place complex multiply of the
  fused QKV output by a precomputed ``exp(i * pos * inv_freq)`` table (q.k is unchanged
  because queries and keys are permuted alike);
* a static, preallocated KV cache ``[layers, 2, kv_heads, max_positions, head_dim]`` written
  by slice assignment: ``crop`` is O(1) (a length counter);
* grouped-query attention as ``bmm -> softmax -> bmm`` over ``[kv_heads, group * M, head_dim]``
  queries against the cache (no mask for one query token, a causal mask for blocks);
* the Linear kernels picked per call by the number of new tokens ``M`` (see ``weights``).

``weights`` chooses the Linear kernels:

* ``"fp32"``: plain ``F.linear`` (MKL) in float32; matches HF's fp32 forward to ~1e-5.
* ``"bf16"``: oneDNN prepacked bf16 weights (``torch.ops.mkldnn._linear_pointwise``; AMX on
  CPUs that have it); the residual stream, norms, RoPE and attention stay float32.
* ``"int8"``: fbgemm dynamic-quantized int8 (per-output-channel symmetric int8 weights,
  per-call per-tensor uint8 activations: ``torch.ops.quantized.linear_dynamic`` on weights
  prepacked once). For calls with more than ``prefill_min_tokens`` new tokens (prompt
  prefill) the ``prefill_weights`` kernels are used instead: by default oneDNN bf16 when the
  CPU has native bf16 (AMX / AVX512-BF16), where it is both faster and more accurate than
  int8 with one activation scale shared by hundreds of tokens. This keeps a second (bf16)
  copy of the weights; pass ``prefill_weights=None`` to use int8 for every call.

``vocab_rows`` prunes the LM head to the given drafter ids: ``forward`` still returns logits
over the full vocabulary, with ``-inf`` at every pruned id (so argmax / softmax / sampling in
the caller work unchanged and pruned ids get probability 0).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

WEIGHT_KINDS = ("fp32", "bf16", "int8")

_NATIVE_SRC = r'''
// Native int8 decode step for FastLlamaRunner (AVX-512 VNNI). Compiled at first use.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    int32_t D, H, KV, HD, I, L, maxpos, n_qkv, n_head;  // n_* are padded to 16
    float eps;
    const int64_t* layer_ptrs;  // [L][16]: (w, ws, rs, bias) x (qkv, o, gu, down)
    const int64_t* head_ptrs;   // [4]:  w, ws, rs, bias
    float* cache;               // [L][2][KV][maxpos][HD]
    const float* cos_t;         // [maxpos][HD/2]
    const float* sin_t;         // [maxpos][HD/2]
} fd_model;

static void* amalloc(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

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

// Symmetric int8 quantization of one row, stored as uint8 (q + 128). Returns the scale of
// the row times `mult` (the RMSNorm factor when the row is the un-normalized hidden state).
static float quant_row(const float* x, int K, uint8_t* q, float mult) {
    __m512 am = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    float a = _mm512_reduce_max_ps(am);
    float s = a > 0.f ? a / 127.f : 1.f;
    __m512 inv = _mm512_set1_ps(1.f / s);
    __m512i off = _mm512_set1_epi32(128);
    for (int k = 0; k < K; k += 16) {
        __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
        i = _mm512_add_epi32(i, off);
        _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtusepi32_epi8(i));
    }
    return s * mult;
}

static float rms_factor(const float* x, int K, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    return 1.f / sqrtf(hsum(ss) / (float)K + eps);
}

// y[m][n] (+)= (sum_k xq[m][k] w[n][k] - 128 rs[n]) * sx[m] * ws[n] + b[n], for n-blocks [nb0, nb1).
// w packed as [N/16][K/4][16][4].
static void gemm_q8(int M, int K, const uint8_t* xq, const float* sx, const int8_t* wp, const float* ws,
                    const int32_t* rs, const float* bias, float* y, int ldy, int accumulate, int nb0, int nb1) {
    const __m512i c128 = _mm512_set1_epi32(128);
    for (int nb = nb0; nb < nb1; nb++) {
        const int8_t* w = wp + (size_t)nb * 16 * K;
        const int n0 = nb * 16;
        const __m512i rsv = _mm512_mullo_epi32(_mm512_loadu_si512(rs + n0), c128);
        const __m512 wsv = _mm512_loadu_ps(ws + n0);
        const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
        int m = 0;
        for (; m + 4 <= M; m += 4) {
            const uint8_t* x0 = xq + (size_t)m * K;
            const uint8_t* x1 = x0 + K;
            const uint8_t* x2 = x1 + K;
            const uint8_t* x3 = x2 + K;
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            __m512i a2 = _mm512_setzero_si512(), a3 = _mm512_setzero_si512();
            for (int k = 0; k < K; k += 4) {
                __m512i wv = _mm512_loadu_si512(w + k * 16);
                a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(*(const int32_t*)(x0 + k)), wv);
                a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(*(const int32_t*)(x1 + k)), wv);
                a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(*(const int32_t*)(x2 + k)), wv);
                a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(*(const int32_t*)(x3 + k)), wv);
            }
            __m512i acc[4] = {a0, a1, a2, a3};
            for (int r = 0; r < 4; r++) {
                __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], rsv));
                v = _mm512_fmadd_ps(v, _mm512_mul_ps(wsv, _mm512_set1_ps(sx[m + r])), bv);
                float* yo = y + (size_t)(m + r) * ldy + n0;
                if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
                _mm512_storeu_ps(yo, v);
            }
        }
        for (; m < M; m++) {
            const uint8_t* x0 = xq + (size_t)m * K;
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            __m512i a2 = _mm512_setzero_si512(), a3 = _mm512_setzero_si512();
            for (int k = 0; k < K; k += 16) {
                const int8_t* wk = w + k * 16;
                a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(*(const int32_t*)(x0 + k)), _mm512_loadu_si512(wk));
                a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(*(const int32_t*)(x0 + k + 4)), _mm512_loadu_si512(wk + 64));
                a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(*(const int32_t*)(x0 + k + 8)), _mm512_loadu_si512(wk + 128));
                a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(*(const int32_t*)(x0 + k + 12)), _mm512_loadu_si512(wk + 192));
            }
            __m512i a = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(a, rsv));
            v = _mm512_fmadd_ps(v, _mm512_mul_ps(wsv, _mm512_set1_ps(sx[m])), bv);
            float* yo = y + (size_t)m * ldy + n0;
            if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
            _mm512_storeu_ps(yo, v);
        }
    }
}

static void gemm_q8_mt(int nthreads, int M, int N, int K, const uint8_t* xq, const float* sx, const int64_t* p,
                       float* y, int ldy, int accumulate) {
    const int8_t* w = (const int8_t*)p[0];
    const float* ws = (const float*)p[1];
    const int32_t* rs = (const int32_t*)p[2];
    const float* b = (const float*)p[3];
    int nblocks = N / 16;
    if (nthreads <= 1 || nblocks < 8) {
        gemm_q8(M, K, xq, sx, w, ws, rs, b, y, ldy, accumulate, 0, nblocks);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int t = 0, nt = 1;
#endif
        int b0 = (int)((long)nblocks * t / nt), b1 = (int)((long)nblocks * (t + 1) / nt);
        gemm_q8(M, K, xq, sx, w, ws, rs, b, y, ldy, accumulate, b0, b1);
    }
}

// Attention of one query row (all heads) at position `pos` over keys [0, pos].
static void attend_row(const fd_model* md, int layer, const float* q, int pos, float* out, float* scores) {
    const int HD = md->HD, KV = md->KV, G = md->H / md->KV, T = pos + 1;
    const size_t head_stride = (size_t)md->maxpos * HD;
    const float* kbase = md->cache + (size_t)layer * 2 * KV * head_stride;
    const float* vbase = kbase + (size_t)KV * head_stride;
    for (int kh = 0; kh < KV; kh++) {
        const float* K = kbase + kh * head_stride;
        const float* V = vbase + kh * head_stride;
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            const float* qh = q + (size_t)h * HD;
            float* sc = scores;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            if (HD == 64) {
                __m512 q0 = _mm512_loadu_ps(qh), q1 = _mm512_loadu_ps(qh + 16);
                __m512 q2 = _mm512_loadu_ps(qh + 32), q3 = _mm512_loadu_ps(qh + 48);
                int j = 0;
                for (; j + 16 <= T; j += 16) {
                    float tmp[16];
                    for (int jj = 0; jj < 16; jj++) {
                        const float* kr = K + (size_t)(j + jj) * 64;
                        __m512 s = _mm512_mul_ps(q0, _mm512_loadu_ps(kr));
                        s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kr + 16), s);
                        s = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kr + 32), s);
                        s = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kr + 48), s);
                        tmp[jj] = hsum(s);
                    }
                    __m512 sv = _mm512_loadu_ps(tmp);
                    mx = _mm512_max_ps(mx, sv);
                    _mm512_storeu_ps(sc + j, sv);
                }
                for (; j < T; j++) {
                    const float* kr = K + (size_t)j * 64;
                    __m512 s = _mm512_mul_ps(q0, _mm512_loadu_ps(kr));
                    s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kr + 16), s);
                    s = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kr + 32), s);
                    s = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kr + 48), s);
                    sc[j] = hsum(s);
                }
            } else {
                for (int j = 0; j < T; j++) {
                    const float* kr = K + (size_t)j * HD;
                    __m512 s = _mm512_setzero_ps();
                    for (int d = 0; d < HD; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(kr + d), s);
                    sc[j] = hsum(s);
                }
            }
            float m = _mm512_reduce_max_ps(mx);
            for (int j = (T / 16) * 16; j < T; j++) m = sc[j] > m ? sc[j] : m;
            // exp and sum
            __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
            int j = 0;
            for (; j + 16 <= T; j += 16) {
                __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv));
                _mm512_storeu_ps(sc + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            if (j < T) {
                __mmask16 mk = (__mmask16)((1u << (T - j)) - 1u);
                __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + j), mv));
                e = _mm512_maskz_mov_ps(mk, e);
                _mm512_mask_storeu_ps(sc + j, mk, e);
                sum = _mm512_add_ps(sum, e);
            }
            const float inv = 1.f / hsum(sum);
            float* oh = out + (size_t)h * HD;
            if (HD == 64) {
                __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps(), o2 = _mm512_setzero_ps(), o3 = _mm512_setzero_ps();
                for (int jj = 0; jj < T; jj++) {
                    const float* vr = V + (size_t)jj * 64;
                    __m512 pj = _mm512_set1_ps(sc[jj]);
                    o0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr), o0);
                    o1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16), o1);
                    o2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 32), o2);
                    o3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 48), o3);
                }
                __m512 iv = _mm512_set1_ps(inv);
                _mm512_storeu_ps(oh, _mm512_mul_ps(o0, iv));
                _mm512_storeu_ps(oh + 16, _mm512_mul_ps(o1, iv));
                _mm512_storeu_ps(oh + 32, _mm512_mul_ps(o2, iv));
                _mm512_storeu_ps(oh + 48, _mm512_mul_ps(o3, iv));
            } else {
                for (int d = 0; d < HD; d += 16) {
                    __m512 o = _mm512_setzero_ps();
                    for (int jj = 0; jj < T; jj++) o = _mm512_fmadd_ps(_mm512_set1_ps(sc[jj]), _mm512_loadu_ps(V + (size_t)jj * HD + d), o);
                    _mm512_storeu_ps(oh + d, _mm512_mul_ps(o, _mm512_set1_ps(inv)));
                }
            }
        }
    }
}

// One forward over M new tokens at positions [pos, pos + M). h: [M][D] embeddings (updated in place).
// logits: [last_only ? 1 : M][n_head]. Returns 0 on success.
int fd_forward(const fd_model* md, int M, float* h, int pos, int last_only, float* logits, int nthreads) {
    const int D = md->D, H = md->H, KV = md->KV, HD = md->HD, I = md->I, NQ = md->n_qkv;
    const int qw = H * HD, half = HD / 2;
    int KMAX = D > I ? D : I;
    if (qw > KMAX) KMAX = qw;
    uint8_t* xq = (uint8_t*)amalloc((size_t)M * KMAX);
    float* sx = (float*)amalloc(sizeof(float) * M);
    float* qkv = (float*)amalloc(sizeof(float) * (size_t)M * NQ);
    float* att = (float*)amalloc(sizeof(float) * (size_t)M * qw);
    float* gu = (float*)amalloc(sizeof(float) * (size_t)M * 2 * I);
    float* act = (float*)amalloc(sizeof(float) * (size_t)M * I);
    float* scores = (float*)amalloc(sizeof(float) * ((size_t)pos + M + 16));
    if (!xq || !sx || !qkv || !att || !gu || !act || !scores) {
        free(xq); free(sx); free(qkv); free(att); free(gu); free(act); free(scores);
        return -1;
    }
    const size_t head_stride = (size_t)md->maxpos * HD;

    for (int l = 0; l < md->L; l++) {
        const int64_t* lp = md->layer_ptrs + (size_t)l * 16;
        float* kbase = md->cache + (size_t)l * 2 * KV * head_stride;
        float* vbase = kbase + (size_t)KV * head_stride;
        // --- attention block
        for (int m = 0; m < M; m++) {
            const float* hm = h + (size_t)m * D;
            sx[m] = quant_row(hm, D, xq + (size_t)m * D, rms_factor(hm, D, md->eps));
        }
        gemm_q8_mt(nthreads, M, NQ, D, xq, sx, lp + 0, qkv, NQ, 0);
        for (int m = 0; m < M; m++) {
            float* row = qkv + (size_t)m * NQ;
            const float* cs = md->cos_t + (size_t)(pos + m) * half;
            const float* sn = md->sin_t + (size_t)(pos + m) * half;
            for (int hh = 0; hh < H + KV; hh++) {
                float* x = row + (size_t)hh * HD;
                for (int i = 0; i < half; i++) {
                    float a = x[2 * i], b = x[2 * i + 1];
                    x[2 * i] = a * cs[i] - b * sn[i];
                    x[2 * i + 1] = a * sn[i] + b * cs[i];
                }
            }
            for (int kh = 0; kh < KV; kh++) {
                memcpy(kbase + kh * head_stride + (size_t)(pos + m) * HD, row + qw + (size_t)kh * HD, sizeof(float) * HD);
                memcpy(vbase + kh * head_stride + (size_t)(pos + m) * HD, row + qw + (size_t)(KV + kh) * HD, sizeof(float) * HD);
            }
        }
        for (int m = 0; m < M; m++) attend_row(md, l, qkv + (size_t)m * NQ, pos + m, att + (size_t)m * qw, scores);
        for (int m = 0; m < M; m++) sx[m] = quant_row(att + (size_t)m * qw, qw, xq + (size_t)m * qw, 1.f);
        gemm_q8_mt(nthreads, M, D, qw, xq, sx, lp + 4, h, D, 1);
        // --- MLP block
        for (int m = 0; m < M; m++) {
            const float* hm = h + (size_t)m * D;
            sx[m] = quant_row(hm, D, xq + (size_t)m * D, rms_factor(hm, D, md->eps));
        }
        gemm_q8_mt(nthreads, M, 2 * I, D, xq, sx, lp + 8, gu, 2 * I, 0);
        for (int m = 0; m < M; m++) {
            const float* g = gu + (size_t)m * 2 * I;
            const float* u = g + I;
            float* a = act + (size_t)m * I;
            for (int i = 0; i < I; i += 16) {
                __m512 gv = _mm512_loadu_ps(g + i);
                __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                _mm512_storeu_ps(a + i, _mm512_mul_ps(sg, _mm512_loadu_ps(u + i)));
            }
            sx[m] = quant_row(a, I, xq + (size_t)m * I, 1.f);
        }
        gemm_q8_mt(nthreads, M, D, I, xq, sx, lp + 12, h, D, 1);
    }
    // --- final norm (folded into the head) and LM head
    const int m0 = last_only ? M - 1 : 0;
    const int MO = M - m0;
    for (int m = 0; m < MO; m++) {
        const float* hm = h + (size_t)(m0 + m) * D;
        sx[m] = quant_row(hm, D, xq + (size_t)m * D, rms_factor(hm, D, md->eps));
    }
    gemm_q8_mt(nthreads, MO, md->n_head, D, xq, sx, md->head_ptrs, logits, md->n_head, 0);
    free(xq); free(sx); free(qkv); free(att); free(gu); free(act); free(scores);
    return 0;
}
'''


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16 (Linux only; False elsewhere)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


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
        qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        # fbgemm is the fastest engine here for M = 1..~16 (oneDNN/x86 are 10x slower for M > 1);
        # the packed object remembers its engine, so the global setting is restored afterwards.
        with _quantized_engine("fbgemm"):
            packed = torch.ops.quantized.linear_prepack(qw, b)
        lin = torch.ops.quantized.linear_dynamic
        return lambda x: lin(x, packed, True)
    raise ValueError(f"unknown weights kind {kind!r}: choose one of {', '.join(WEIGHT_KINDS)}")


class FastLlamaRunner:
    """Incremental forward passes over one sequence for a Llama-architecture causal LM.

    Same interface as ``ModelRunner``: ``forward(ids, last_only)`` appends ``ids`` and returns
    float32 logits ``[len(ids), vocab]`` (``[1, vocab]`` when ``last_only``); ``crop(n)``
    keeps the first ``n`` positions; ``length`` is the number of cached positions.
    """

    def __init__(self, model, *, weights: str = "int8", max_positions: int = 4096,
                 vocab_rows: torch.Tensor | None = None, prefill_weights: str | None = "auto",
                 prefill_min_tokens: int = 16) -> None:
        if weights not in WEIGHT_KINDS:
            raise ValueError(f"unknown weights kind {weights!r}: choose one of {', '.join(WEIGHT_KINDS)}")
        config = model.config
        if getattr(config, "model_type", "llama") not in ("llama",):
            raise ValueError(f"FastLlamaRunner supports Llama-architecture models, not {config.model_type!r}")
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
        kinds = [weights] + ([prefill_weights] if prefill_weights else [])

        # --- RoPE table: exp(i * pos * inv_freq) * attention_scaling, as complex64 -----------
        rotary = decoder.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope type {rope_type!r} depends on the sequence length; not supported")
        inv_freq = rotary.inv_freq.detach().float().cpu()
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        angles = pos[:, None] * inv_freq[None, :]
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cis = torch.complex(angles.cos() * scaling, angles.sin() * scaling)  # [P, hd/2]

        # --- per-layer fused, folded weights ------------------------------------------------
        hd, half = self.head_dim, self.head_dim // 2
        # new row r of a head <- old row perm[r]: (0, d/2, 1, d/2+1, ...) pairs the RoPE halves
        perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
        q_perm = (torch.arange(self.n_heads)[:, None] * hd + perm[None, :]).reshape(-1)
        k_perm = (torch.arange(self.n_kv)[:, None] * hd + perm[None, :]).reshape(-1)
        self._layers = {k: [] for k in kinds}
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
            for k in kinds:
                self._layers[k].append((
                    _make_linear(k, w_qkv, b_qkv),
                    _make_linear(k, attn.o_proj.weight, attn.o_proj.bias),
                    _make_linear(k, w_gu, b_gu),
                    _make_linear(k, mlp.down_proj.weight, mlp.down_proj.bias),
                ))

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
        self._head = {k: _make_linear(k, w_head, b_head) for k in kinds}

        # --- static KV cache -----------------------------------------------------------------
        self._cache = torch.zeros(self.num_layers, 2, self.n_kv, self.max_positions, hd)
        self._cache_views = [(self._cache[i], self._cache[i, 0], self._cache[i, 1])
                             for i in range(self.num_layers)]
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
        n_kv, g, hd = self.n_kv, self.group, self.head_dim
        q_width = self.n_heads * hd
        qk_heads = self.n_heads + self.n_kv
        inter = self.intermediate
        eps = self.eps
        norm_shape = (self.hidden,)
        rms_norm = torch.rms_norm

        h = self._embed.index_select(0, torch.tensor(ids, dtype=torch.long))
        if h.dtype != torch.float32:
            h = h.float()
        cis = self._cis[p:t].unsqueeze(1)  # [m, 1, hd/2]
        mask = None
        if m > 1:
            # row (group g, token i) sees keys j <= p + i
            allowed = torch.ones(m, t, dtype=torch.bool).tril_(p)
            mask = torch.zeros(m, t).masked_fill_(~allowed, float("-inf")).repeat(g, 1)

        for (f_qkv, f_o, f_gu, f_down), (kv_l, k_l, v_l) in zip(self._layers[kind], self._cache_views):
            x = rms_norm(h, norm_shape, None, eps)
            qkv = f_qkv(x)
            if qkv.dtype != torch.float32:
                qkv = qkv.float()
            # RoPE on the (pair-interleaved) q and k heads, in place
            torch.view_as_complex(qkv[:, : qk_heads * hd].view(m, qk_heads, hd // 2, 2)).mul_(cis)
            kv_l.narrow(2, p, m).copy_(qkv[:, q_width:].view(m, 2, n_kv, hd).permute(1, 2, 0, 3))
            q = qkv[:, :q_width].view(m, n_kv, g, hd).permute(1, 2, 0, 3).reshape(n_kv, g * m, hd)
            scores = torch.bmm(q, k_l.narrow(1, 0, t).transpose(1, 2))  # [n_kv, g*m, t]
            if mask is not None:
                scores.add_(mask)
            probs = torch.softmax(scores, dim=-1)
            o = torch.bmm(probs, v_l.narrow(1, 0, t))  # [n_kv, g*m, hd]
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
        if self.vocab_rows is not None:
            full = torch.full((logits.shape[0], self.vocab), float("-inf"))
            full.index_copy_(1, self.vocab_rows, logits)
            logits = full
        self.length = t
        self.forward_calls += 1
        return logits
