// AVX2 + FMA + F16C kernels, for x86-64 CPUs without AVX-512 VNNI (AMD Zen 1-3, older Intel).
// The weights keep the shared layout; each 64-byte step of a 16-row block is two 256-bit
// halves (rows 0-7, rows 8-15). Products use the sign trick of VPMADDUBSW:
// |q_w| (uint8) * (a * sign(q_w)) (int8), exact because |q_w|, |a| <= 127 (pair sums <= 32258),
// then VPMADDWD by ones gives exact int32 sums of q_w * a over 4 inputs. No -128 * sum(a)
// correction is needed (the weights are used signed).
// Activations: per-token 16-bit (x = s * q16, |q16| <= 32512), split q16 = 255 * hi + lo with
// |hi|, |lo| <= 127 (two passes), or 8-bit with a scale per (token, 64 inputs) (one pass).
// As in the AVX-512 kernels, a row's result never depends on how many rows a call holds.

#define FD_INLINE static inline __attribute__((always_inline))

static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));  // 2^n stays a normal float (n <= 127)
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

static float rms_factor(const float* x, int K, float eps) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
        s0 = _mm256_fmadd_ps(v0, v0, s0);
        s1 = _mm256_fmadd_ps(v1, v1, s1);
    }
    return 1.f / sqrtf(hsum8(_mm256_add_ps(s0, s1)) / (float)K + eps);
}

static inline void store_i8x16(int8_t* dst, __m256i a, __m256i b) {  // 16 int32 in [-127, 127] -> int8
    const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i*)dst, _mm_packs_epi16(w0, w1));
}

static void quant_row8(const float* x, int K, qact* a, int m, float mult) {
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    int8_t* hi = a->hi + (size_t)m * a->ld;
    float* gsc = a->gsc + (size_t)m * (a->ld / 64);
    for (int g = 0; g < K / 64; g++) {
        __m256 am = _mm256_setzero_ps();
        for (int k = g * 64; k < g * 64 + 64; k += 8) am = _mm256_max_ps(am, abs8(_mm256_loadu_ps(x + k)));
        const float mx = hmax8(am);
        const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 1.f);
        for (int k = g * 64; k < g * 64 + 64; k += 16) {
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), inv));
            q0 = _mm256_max_epi32(_mm256_min_epi32(q0, lim), nlim);
            q1 = _mm256_max_epi32(_mm256_min_epi32(q1, lim), nlim);
            store_i8x16(hi + k, q0, q1);
        }
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
    __m256 am = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) am = _mm256_max_ps(am, abs8(_mm256_loadu_ps(x + k)));
    const float mx = hmax8(am);
    const float s = mx > 0.f ? mx / 32512.f : 1.f;
    const __m256 inv = _mm256_set1_ps(mx > 0.f ? 32512.f / mx : 1.f), inv255 = _mm256_set1_ps(1.f / 255.f);
    const __m256i lim = _mm256_set1_epi32(32512), nlim = _mm256_set1_epi32(-32512);
    int8_t* hi = a->hi + (size_t)m * a->ld;
    int8_t* lo = a->lo + (size_t)m * a->ld;
    for (int k = 0; k < K; k += 16) {
        __m256i h[2], l[2];
        for (int j = 0; j < 2; j++) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * j), inv));
            q = _mm256_max_epi32(_mm256_min_epi32(q, lim), nlim);
            // hi = round(q / 255): |q - 255 * hi| <= 127 (q / 255 is never within 0.002 of a half)
            h[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(q), inv255));
            l[j] = _mm256_sub_epi32(q, _mm256_sub_epi32(_mm256_slli_epi32(h[j], 8), h[j]));
        }
        store_i8x16(hi + k, h[0], h[1]);
        store_i8x16(lo + k, l[0], l[1]);
    }
    a->s[m] = s * mult;
}

#ifndef PF_DIST
#define PF_DIST 4096
#endif

// acc (8 rows) += exact int32 dot products of the rows' 4 signed weights (w = q_w, wabs = |q_w|)
// with the 4 int8 activations broadcast in `act`.
#define DOT4(acc, wabs, w, act) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(act, w)), ones))
#define BCAST(p) _mm256_set1_epi32(*(const int32_t*)(p))

// Step k (4 inputs) of a 16-row block: signed weights w0 (rows 0-7), w1 (rows 8-15) and their
// magnitudes a0, a1 (the stored bytes are q + 128).
FD_INLINE void load_step(const uint8_t* w, int k, __m256i* w0, __m256i* w1, __m256i* a0, __m256i* a1) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    _mm_prefetch((const char*)(w + (size_t)k * 16 + PF_DIST), _MM_HINT_T0);
    *w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + (size_t)k * 16)), flip);
    *w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + (size_t)k * 16 + 32)), flip);
    *a0 = _mm256_abs_epi8(*w0);
    *a1 = _mm256_abs_epi8(*w1);
}

// R activation rows (16-bit split) against one 16-row block: out[2r], out[2r+1] = rows 0-7, 8-15.
FD_INLINE void block16(const int R, int K, const uint8_t* w, const float* sc, const qact* a, int m, __m256* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t ld = a->ld;
    const int8_t* h0 = a->hi + (size_t)m * ld;
    const int8_t* l0 = a->lo + (size_t)m * ld;
    __m256 f[4];
    for (int i = 0; i < 2 * R; i++) f[i] = _mm256_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m256i H[4], L[4];
        for (int i = 0; i < 2 * R; i++) H[i] = L[i] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            __m256i w0, w1, a0, a1;
            load_step(w, k, &w0, &w1, &a0, &a1);
            for (int r = 0; r < R; r++) {
                const __m256i bh = BCAST(h0 + r * ld + k), bl = BCAST(l0 + r * ld + k);
                DOT4(H[2 * r], a0, w0, bh);
                DOT4(H[2 * r + 1], a1, w1, bh);
                DOT4(L[2 * r], a0, w0, bl);
                DOT4(L[2 * r + 1], a1, w1, bl);
            }
        }
        const __m256 s0 = _mm256_loadu_ps(sc + g * 16), s1 = _mm256_loadu_ps(sc + g * 16 + 8);
        for (int i = 0; i < 2 * R; i++) {
            const __m256i t = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(H[i], 8), H[i]), L[i]);
            f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), (i & 1) ? s1 : s0, f[i]);
        }
    }
    for (int i = 0; i < 2 * R; i++) out[i] = f[i];
}

// R activation rows (8-bit, a scale per 64 inputs) against one 16-row block.
FD_INLINE void block8(const int R, int K, const uint8_t* w, const float* sc, const qact* a, int m, __m256* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t ld = a->ld, ldg = a->ld / 64;
    const int8_t* h0 = a->hi + (size_t)m * ld;
    const float* c0 = a->gsc + (size_t)m * ldg;
    __m256 f[8];
    for (int i = 0; i < 2 * R; i++) f[i] = _mm256_setzero_ps();
    for (int g = 0; g < K / 64; g++) {
        __m256i H[8];
        for (int i = 0; i < 2 * R; i++) H[i] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            __m256i w0, w1, a0, a1;
            load_step(w, k, &w0, &w1, &a0, &a1);
            for (int r = 0; r < R; r++) {
                const __m256i b = BCAST(h0 + r * ld + k);
                DOT4(H[2 * r], a0, w0, b);
                DOT4(H[2 * r + 1], a1, w1, b);
            }
        }
        const __m256 s0 = _mm256_loadu_ps(sc + g * 16), s1 = _mm256_loadu_ps(sc + g * 16 + 8);
        for (int i = 0; i < 2 * R; i++) {
            const __m256 s = _mm256_mul_ps((i & 1) ? s1 : s0, _mm256_set1_ps(c0[(i / 2) * ldg + g]));
            f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(H[i]), s, f[i]);
        }
    }
    for (int i = 0; i < 2 * R; i++) out[i] = f[i];
}
#undef DOT4
#undef BCAST

// Rows [m, m + R) of y[.][n0 .. n0 + 16) from the block results (scaled by the row scale, + bias).
FD_INLINE void store_rows(const int R, const __m256* acc, const qact* a, int m, const float* bias, int n0,
                          float* y, int ldy, int accumulate) {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        const __m256 s = _mm256_set1_ps(a->s[m + r]);
        float* yo = y + (size_t)(m + r) * ldy + n0;
        __m256 v0 = _mm256_fmadd_ps(acc[2 * r], s, b0), v1 = _mm256_fmadd_ps(acc[2 * r + 1], s, b1);
        if (accumulate) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(yo));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(yo + 8));
        }
        _mm256_storeu_ps(yo, v0);
        _mm256_storeu_ps(yo + 8, v1);
    }
}

// y[m][n] (+)= a.s[m] * sum_g scale[n][g] * dot_g(w[n], q[m]) + bias[n], for n-blocks [nb0, nb1).
static void gemm_blocks(int M, int K, const qact* a, const uint8_t* wp, const float* sp, const float* bias,
                        float* y, int ldy, int accumulate, int nb0, int nb1) {
    const int G = K / 64;
    for (int nb = nb0; nb < nb1; nb++) {
        const uint8_t* w = wp + (size_t)nb * 16 * K;
        const float* sc = sp + (size_t)nb * 16 * G;
        const int n0 = nb * 16;
        __m256 acc[8];
        int m = 0;
        if (a->act8) {
            for (; m + 4 <= M; m += 4) {
                block8(4, K, w, sc, a, m, acc);
                store_rows(4, acc, a, m, bias, n0, y, ldy, accumulate);
            }
            for (; m + 2 <= M; m += 2) {
                block8(2, K, w, sc, a, m, acc);
                store_rows(2, acc, a, m, bias, n0, y, ldy, accumulate);
            }
            for (; m < M; m++) {
                block8(1, K, w, sc, a, m, acc);
                store_rows(1, acc, a, m, bias, n0, y, ldy, accumulate);
            }
        } else {
            for (; m + 2 <= M; m += 2) {
                block16(2, K, w, sc, a, m, acc);
                store_rows(2, acc, a, m, bias, n0, y, ldy, accumulate);
            }
            for (; m < M; m++) {
                block16(1, K, w, sc, a, m, acc);
                store_rows(1, acc, a, m, bias, n0, y, ldy, accumulate);
            }
        }
    }
}

static inline __m256 load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

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
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, t0 = s0, t1 = s0;
        for (int d = 0; d < HD; d += 2) {
            const __m256 q0 = _mm256_set1_ps(qh[d]), q1 = _mm256_set1_ps(qh[d + 1]);
            s0 = _mm256_fmadd_ps(q0, load_h(kb + d * 16), s0);
            t0 = _mm256_fmadd_ps(q0, load_h(kb + d * 16 + 8), t0);
            s1 = _mm256_fmadd_ps(q1, load_h(kb + d * 16 + 16), s1);
            t1 = _mm256_fmadd_ps(q1, load_h(kb + d * 16 + 24), t1);
        }
        _mm256_storeu_ps(sc + b * 16, _mm256_add_ps(s0, s1));
        _mm256_storeu_ps(sc + b * 16 + 8, _mm256_add_ps(t0, t1));
    }
    const int TP = nblk * 16;
    for (int j = T; j < TP; j++) sc[j] = -INFINITY;  // keys past the query are not attended
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < TP; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + j));
    const __m256 mv = _mm256_set1_ps(hmax8(mx));
    for (int j = 0; j < TP; j += 8) _mm256_storeu_ps(sc + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv)));
    for (int j = T; j < TP; j++) sc[j] = 0.f;
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < TP; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(sc + j));
    const __m256 inv = _mm256_set1_ps(1.f / hsum8(sum));
    if (HD == 64) {
        __m256 o[8];
        for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();
        for (int j = 0; j < T; j++) {
            const uint16_t* vr = V + (size_t)j * 64;
            const __m256 pj = _mm256_set1_ps(sc[j]);
            for (int i = 0; i < 8; i++) o[i] = _mm256_fmadd_ps(pj, load_h(vr + 8 * i), o[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(oh + 8 * i, _mm256_mul_ps(o[i], inv));
    } else {
        for (int d = 0; d < HD; d += 8) {
            __m256 o = _mm256_setzero_ps();
            for (int j = 0; j < T; j++) o = _mm256_fmadd_ps(_mm256_set1_ps(sc[j]), load_h(V + (size_t)j * HD + d), o);
            _mm256_storeu_ps(oh + d, _mm256_mul_ps(o, inv));
        }
    }
}

static inline void store_h(uint16_t* dst, const float* src, int n) {  // fp32 -> fp16, saturating
    const __m256 lim = _mm256_set1_ps(65504.f), nlim = _mm256_set1_ps(-65504.f);
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(src + i), lim), nlim);
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

// y[i] = silu(g[i]) * u[i] for i < n (n % 8 == 0).
static void silu_mul(const float* g, const float* u, float* y, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
}
