// AArch64 NEON kernels (edge boards, Android phones). The weights keep the shared layout
// ([N/16][K/4][16][4] bytes q + 128); each 64-byte step of a 16-row block is four 16-byte
// quarters of 4 rows x 4 inputs. The stored bytes XOR 0x80 are the signed weights q, so the
// products need no -128 * sum(a) correction. With the dot-product extension (Armv8.2 and later:
// Cortex-A55/A76 and newer, __ARM_FEATURE_DOTPROD) SDOT gives exact int32 sums of 4 products;
// without it, SMULL + SADALP do (int8 x int8 fits int16, pair sums are exact in int32).
// Activations: per-token 16-bit split q16 = 256 * hi + lo (two passes) or 8-bit with a scale
// per (token, 64 inputs) (one pass), as in fd_avx512.h. Every row is computed by the same
// sequence of operations whatever the number of rows in the call, so a block's logits equal
// single steps' bit for bit. Hand-written for the same reason as the x86 kernels: no maintained
// library exposes these exact per-group integer sums with this weight layout.

static inline float32x4_t exp4(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(-87.3f));
    x = vminq_f32(x, vdupq_n_f32(88.0f));  // 2^n stays a normal float (n <= 127)
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500E-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

static float rms_factor(const float* x, int K, float eps) {
    float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0, s2 = s0, s3 = s0;
    for (int k = 0; k < K; k += 16) {
        const float32x4_t v0 = vld1q_f32(x + k), v1 = vld1q_f32(x + k + 4);
        const float32x4_t v2 = vld1q_f32(x + k + 8), v3 = vld1q_f32(x + k + 12);
        s0 = vfmaq_f32(s0, v0, v0);
        s1 = vfmaq_f32(s1, v1, v1);
        s2 = vfmaq_f32(s2, v2, v2);
        s3 = vfmaq_f32(s3, v3, v3);
    }
    return 1.f / sqrtf(vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3))) / (float)K + eps);
}

static inline float absmax(const float* x, int n) {  // n % 4 == 0
    float32x4_t m = vdupq_n_f32(0.f);
    for (int k = 0; k < n; k += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + k)));
    return vmaxvq_f32(m);
}

// round-to-nearest-even (as the x86 conversions) and clamp to [-lim, lim]
static inline int32x4_t quant4(float32x4_t v, float inv, int32_t lim) {
    const int32x4_t q = vcvtnq_s32_f32(vmulq_n_f32(v, inv));
    return vmaxq_s32(vminq_s32(q, vdupq_n_s32(lim)), vdupq_n_s32(-lim));
}

// Quantize row m of `a` from x[K] (K % 64 == 0); the stored scale is multiplied by `mult`.
static void quant_row(const float* x, int K, qact* a, int m, float mult) {
    int8_t* hi = a->hi + (size_t)m * a->ld;
    int8_t* lo = a->lo + (size_t)m * a->ld;
    if (a->act8) {
        float* gsc = a->gsc + (size_t)m * (a->ld / 64);
        for (int g = 0; g < K / 64; g++) {
            const float mx = absmax(x + g * 64, 64);
            const float inv = mx > 0.f ? 127.f / mx : 1.f;
            for (int k = g * 64; k < g * 64 + 64; k += 4) {
                const int32x4_t q = quant4(vld1q_f32(x + k), inv, 127);
                vst1_lane_s32((int32_t*)(hi + k), vreinterpret_s32_s8(vmovn_s16(vcombine_s16(vmovn_s32(q), vdup_n_s16(0)))), 0);
            }
            gsc[g] = (mx > 0.f ? mx / 127.f : 1.f) * mult;
        }
        a->s[m] = 1.f;
        return;
    }
    const float mx = absmax(x, K);
    const float inv = mx > 0.f ? 32639.f / mx : 1.f;
    for (int k = 0; k < K; k += 4) {
        const int32x4_t q = quant4(vld1q_f32(x + k), inv, 32639);
        const int32x4_t h = vshrq_n_s32(vaddq_s32(q, vdupq_n_s32(128)), 8);
        const int32x4_t l = vsubq_s32(q, vshlq_n_s32(h, 8));
        vst1_lane_s32((int32_t*)(hi + k), vreinterpret_s32_s8(vmovn_s16(vcombine_s16(vmovn_s32(h), vdup_n_s16(0)))), 0);
        vst1_lane_s32((int32_t*)(lo + k), vreinterpret_s32_s8(vmovn_s16(vcombine_s16(vmovn_s32(l), vdup_n_s16(0)))), 0);
    }
    a->s[m] = (mx > 0.f ? mx / 32639.f : 1.f) * mult;
}

// acc[q] (rows 4q..4q+3) += exact int32 dot products of the 16 rows' 4 signed weights at step w
// with the 4 int8 activations `act` (a 32-bit word).
static inline void dot_step(const uint8_t* w, int32_t act, int32x4_t* acc) {
    const int8x16_t flip = vdupq_n_s8((int8_t)0x80);
    const int8x16_t b = vreinterpretq_s8_s32(vdupq_n_s32(act));
    for (int q = 0; q < 4; q++) {
        const int8x16_t wq = veorq_s8(vreinterpretq_s8_u8(vld1q_u8(w + 16 * q)), flip);
#if defined(__ARM_FEATURE_DOTPROD)
        acc[q] = vdotq_s32(acc[q], wq, b);
#else
        // rows 4q, 4q+1 (low half) and 4q+2, 4q+3 (high half): pair sums, then the row's two pairs
        const int16x8_t p0 = vmull_s8(vget_low_s8(wq), vget_low_s8(b));
        const int16x8_t p1 = vmull_s8(vget_high_s8(wq), vget_high_s8(b));
        acc[q] = vaddq_s32(acc[q], vpaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)));
#endif
    }
}

static inline int32_t word(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// One activation row against one 16-row block: f[q] = outputs 4q..4q+3 before the row scale.
static void block_row(int K, const uint8_t* w, const float* sc, const qact* a, int m, float32x4_t* f) {
    const int8_t* h0 = a->hi + (size_t)m * a->ld;
    const int8_t* l0 = a->lo + (size_t)m * a->ld;
    const size_t ldg = a->ld / 64;
    for (int q = 0; q < 4; q++) f[q] = vdupq_n_f32(0.f);
    for (int g = 0; g < K / 64; g++) {
        int32x4_t H[4], L[4];
        for (int q = 0; q < 4; q++) H[q] = L[q] = vdupq_n_s32(0);
        for (int k = g * 64; k < g * 64 + 64; k += 4) {
            __builtin_prefetch(w + (size_t)k * 16 + 4096);
            dot_step(w + (size_t)k * 16, word(h0 + k), H);
            if (!a->act8) dot_step(w + (size_t)k * 16, word(l0 + k), L);
        }
        if (a->act8) {
            const float gscale = a->gsc[(size_t)m * ldg + g];
            for (int q = 0; q < 4; q++)
                f[q] = vfmaq_f32(f[q], vcvtq_f32_s32(H[q]), vmulq_n_f32(vld1q_f32(sc + g * 16 + 4 * q), gscale));
        } else {
            for (int q = 0; q < 4; q++)
                f[q] = vfmaq_f32(f[q], vcvtq_f32_s32(vaddq_s32(vshlq_n_s32(H[q], 8), L[q])), vld1q_f32(sc + g * 16 + 4 * q));
        }
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
        for (int m = 0; m < M; m++) {  // the block stays in cache for the next rows
            float32x4_t f[4];
            block_row(K, w, sc, a, m, f);
            float* yo = y + (size_t)m * ldy + n0;
            for (int q = 0; q < 4; q++) {
                const float32x4_t bv = bias ? vld1q_f32(bias + n0 + 4 * q) : vdupq_n_f32(0.f);
                float32x4_t v = vfmaq_n_f32(bv, f[q], a->s[m]);
                if (accumulate) v = vaddq_f32(v, vld1q_f32(yo + 4 * q));
                vst1q_f32(yo + 4 * q, v);
            }
        }
    }
}

static inline float32x4_t load_h(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Attention of query head h (at position pos) over keys [0, pos]; sc: scratch of >= pos + 17 floats.
static void attend_head(const fd_model* md, int layer, const float* qh, int h, int pos, float* oh, float* sc) {
    const int HD = md->HD, KV = md->KV, G = md->H / md->KV, T = pos + 1;
    const int nblk = (T + 15) / 16;
    const size_t head_stride = (size_t)md->maxpos * HD;
    const int kh = h / G;
    const uint16_t* Kc = md->kcache + ((size_t)layer * KV + kh) * head_stride;
    const uint16_t* Vc = md->vcache + ((size_t)layer * KV + kh) * head_stride;
    for (int b = 0; b < nblk; b++) {  // scores of 16 keys at a time: sum_d q[d] * K[blk][d][0..15]
        const uint16_t* kb = Kc + (size_t)b * HD * 16;
        float32x4_t s[4];
        for (int j = 0; j < 4; j++) s[j] = vdupq_n_f32(0.f);
        for (int d = 0; d < HD; d++)
            for (int j = 0; j < 4; j++) s[j] = vfmaq_n_f32(s[j], load_h(kb + d * 16 + 4 * j), qh[d]);
        for (int j = 0; j < 4; j++) vst1q_f32(sc + b * 16 + 4 * j, s[j]);
    }
    float mx = -INFINITY;
    for (int j = 0; j < T; j++) mx = sc[j] > mx ? sc[j] : mx;
    float sum = 0.f;
    int j = 0;
    for (; j + 4 <= T; j += 4) {
        const float32x4_t e = exp4(vsubq_f32(vld1q_f32(sc + j), vdupq_n_f32(mx)));
        vst1q_f32(sc + j, e);
        sum += vaddvq_f32(e);
    }
    for (; j < T; j++) {  // the tail through the same vector exp
        const float e = vgetq_lane_f32(exp4(vdupq_n_f32(sc[j] - mx)), 0);
        sc[j] = e;
        sum += e;
    }
    const float inv = 1.f / sum;
    for (int d = 0; d < HD; d += 16) {
        float32x4_t o[4];
        for (int q = 0; q < 4; q++) o[q] = vdupq_n_f32(0.f);
        for (int t = 0; t < T; t++)
            for (int q = 0; q < 4; q++) o[q] = vfmaq_n_f32(o[q], load_h(Vc + (size_t)t * HD + d + 4 * q), sc[t]);
        for (int q = 0; q < 4; q++) vst1q_f32(oh + d + 4 * q, vmulq_n_f32(o[q], inv));
    }
}

static inline void store_h(uint16_t* dst, const float* src, int n) {  // fp32 -> fp16, saturating
    for (int i = 0; i < n; i += 4) {
        const float32x4_t v = vmaxq_f32(vminq_f32(vld1q_f32(src + i), vdupq_n_f32(65504.f)), vdupq_n_f32(-65504.f));
        vst1_u16(dst + i, vreinterpret_u16_f16(vcvt_f16_f32(v)));
    }
}

// y[i] = silu(g[i]) * u[i] for i < n (n % 4 == 0).
static void silu_mul(const float* g, const float* u, float* y, int n) {
    for (int i = 0; i < n; i += 4) {
        const float32x4_t gv = vld1q_f32(g + i);
        const float32x4_t den = vaddq_f32(vdupq_n_f32(1.f), exp4(vnegq_f32(gv)));
        vst1q_f32(y + i, vmulq_f32(vdivq_f32(gv, den), vld1q_f32(u + i)));
    }
}
