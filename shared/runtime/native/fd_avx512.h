// AVX-512 VNNI kernels. Activations: per-token 16-bit (x = s * q16, |q16| <= 32639), split
// q16 = 256 * hi + lo with int8 hi and lo, so that each group dot product is two VPDPBUSD passes
// computed exactly in int32; or 8-bit with a scale per (token, 64 inputs), one pass.

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

#ifndef PF_DIST_L2
#define PF_DIST_L2 16384  // how far ahead an 8-row pass streaming from memory prefetches, into L2
#endif
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


// 8-bit mode kernels. Every row's float result is sum over groups, in order, of
// fmadd(int32 dot - 128 * group sum, weight scales * activation group scale): the same
// operations whichever kernel (1, 4 or 8 rows) computes it, so a row never depends on M.
#define FIN8(H, f, gsum, gscale) \
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(H, _mm512_set1_epi32(128 * (gsum)))), \
                        _mm512_mul_ps(_mm512_loadu_ps(sc + g * 16), _mm512_set1_ps(gscale)), f)

// R (4 or 8, a constant after inlining) activation rows against one weight block: each 64-byte
// weight vector serves R rows. Eight rows, where two 4-row passes would load each vector twice
// (the second time from cache): on a Zen 4 EPYC a block of 5-8 tokens costs 1.25-1.4x one of 4
// this way, 1.5-1.65x in two passes (BENCHMARKS.md). pf: where this pass prefetches from (its
// k-th step prefetches pf + 16 k), into L2 where to_l2 is set, else into L1.
static inline __attribute__((always_inline)) void block8_rows(const int R, int K, const uint8_t* w, const float* sc,
                                                              const qact* a, int m, __m512* acc, const uint8_t* pf,
                                                              const int to_l2) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const size_t ld = a->ld, ldg = a->ld / 64;
    const int32_t* g0 = a->gs + (size_t)m * ldg;
    const float* c0 = a->gsc + (size_t)m * ldg;
    __m512 f[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m512i H[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) H[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            if (to_l2) _mm_prefetch((const char*)(pf + (size_t)k * 16), _MM_HINT_T1);
            else _mm_prefetch((const char*)(pf + (size_t)k * 16), _MM_HINT_T0);
            const __m512i wv = _mm512_loadu_si512(w + (size_t)k * 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) H[r] = _mm512_dpbusd_epi32(H[r], wv, BCAST(h0 + r * ld + k));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) FIN8(H[r], f[r], g0[r * ldg + g], c0[r * ldg + g]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = f[r];
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

#undef FIN8

// y[m][n] (+)= a.s[m] * sum_g scale[n][g] * dot_g(w[n], q16[m]) + bias[n], for n-blocks [nb0, nb1).
static void gemm_blocks(int M, int K, const qact* a, const uint8_t* wp, const float* sp, const float* bias,
                        float* y, int ldy, int accumulate, int nb0, int nb1) {
    const int G = K / 64;
    for (int nb = nb0; nb < nb1; nb++) {
        const uint8_t* w = wp + (size_t)nb * 16 * K;
        const float* sc = sp + (size_t)nb * 16 * G;
        const int n0 = nb * 16;
        const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
        int m = 0;
        // 2+ rows: eight at a time (8-bit activations) while more than four remain, then four at
        // a time, the last group padded (fd_forward allocates the activation rows in whole groups
        // of eight; a padding row's results are not stored). One weight load serves all the rows
        // of a pass, where one row at a time would read the block again per row: a block of 2 or
        // 3 tokens costs what a block of 4 does, one of 5-7 what one of 8 does. The first pass
        // over a block prefetches ahead in the weight stream; a later pass, which finds this
        // block in cache, prefetches the next block.
        while (M >= 2 && m < M) {
            // a lone last row (blocks of 9 or 13 tokens) takes the one-row kernel below, which
            // finds this weight block in cache: a padded 4-row pass would compute three rows
            // for nothing (results bit-identical either way)
            if (m > 0 && M - m == 1) break;
            const int R = a->act8 && M - m > 4 ? 8 : 4;
            // the first pass streams this block from memory: eight rows compute long enough per
            // weight vector that prefetching far ahead into L2 hides the stream (on a Zen 4 EPYC
            // an 8-token block 0.80-0.85x the time of prefetching 4 KB ahead into L1, which four
            // rows do better with); a later pass finds the block in cache and fetches the next
            const int first = m == 0, to_l2 = first && R == 8;
            const uint8_t* pf = first ? w + (to_l2 ? PF_DIST_L2 : PF_DIST) : w + (size_t)16 * K;
            __m512 acc[8];
            if (R == 8) block8_rows(8, K, w, sc, a, m, acc, pf, to_l2);
            else if (a->act8) block8_rows(4, K, w, sc, a, m, acc, pf, to_l2);
            else block_rows4(K, w, sc, a, m, acc);
            for (int r = 0; r < R && m + r < M; r++) {
                __m512 v = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(a->s[m + r]), bv);
                float* yo = y + (size_t)(m + r) * ldy + n0;
                if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
                _mm512_storeu_ps(yo, v);
            }
            m += R;
        }
        // one row (a one-token step): one weight block at a time, a single prefetched stream.
        // On a Zen 4 EPYC this runs a step 10-20 % faster than two blocks side by side (two
        // streams sharing each activation load), which the kernels did before (docs/findings.md).
        for (; m < M; m++) {
            const __m512 r1 = a->act8 ? block8_row1(K, w, sc, a, m) : block_row1(K, w, sc, a, m);
            __m512 v = _mm512_fmadd_ps(r1, _mm512_set1_ps(a->s[m]), bv);
            float* yo = y + (size_t)m * ldy + n0;
            if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
            _mm512_storeu_ps(yo, v);
        }
    }
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

static inline void store_h(uint16_t* dst, const float* src, int n) {  // fp32 -> fp16, saturating
    const __m512 lim = _mm512_set1_ps(65504.f), nlim = _mm512_set1_ps(-65504.f);
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(src + i), lim), nlim);
        _mm256_storeu_si256((__m256i*)(dst + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

// y[i] = silu(g[i]) * u[i] for i < n (n % 16 == 0).
static void silu_mul(const float* g, const float* u, float* y, int n) {
    for (int i = 0; i < n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
        __m512 sg = _mm512_div_ps(gv, den);
        _mm512_storeu_ps(y + i, _mm512_mul_ps(sg, _mm512_loadu_ps(u + i)));
    }
}
