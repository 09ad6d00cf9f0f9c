// AMX-INT8 kernels for calls of 2+ tokens (block verification, short refeeds), built on top of
// fd_avx512.h. Hand-written because the result must be bit-identical to the one-token VNNI
// path: torch's and oneDNN's int8 GEMMs quantize differently and do not expose per-group
// integer dot products. The weight layout [N/16][K/4][16][4] is exactly AMX's B-tile layout:
// each 64-input group of a 16-row block is one 16 x 64-byte tile. TDPBSUD (signed activations x
// unsigned weights) gives the same exact int32 group dot products as VPDPBUSD; the float
// epilogue below repeats the VNNI kernels' operations in the same order, so a token's logits
// never depend on how many tokens share the call.
#define FD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define FD_ARCH_REQ_XCOMP_PERM 0x1023
#define FD_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fd_tilecfg;

// Ask Linux for the AMX tile state (once per process). 0 when AMX may be used.
int fd_amx_init(void) { return (int)syscall(SYS_arch_prctl, FD_ARCH_REQ_XCOMP_PERM, FD_XFEATURE_XTILEDATA); }

// Tiles: 0, 1 activations (hi, lo or two groups) [mc x 64 B]; 2, 4 weights [16 x 64 B];
// 3, 5 int32 results [mc x 16]. 8-bit activations alternate two tile sets between groups, so one
// group's multiply overlaps the previous group's float epilogue.
static void amx_config(int mc) {
    fd_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = (uint8_t)(t == 2 || t == 4 ? 16 : mc);
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);  // per call: other libraries (oneDNN) load their own configuration
}

#ifndef AMX_PF_DIST
#define AMX_PF_DIST 4096
#endif

// int32 dot products of group g (rows of `act`, stride ld) with the weight block's group g into d.
#define AMX_GROUP(g, TA, TB, TC, act, d)                  \
    do {                                                    \
        const char* pf_ = (const char*)(w + (size_t)(g) * 1024 + AMX_PF_DIST); \
        for (int l_ = 0; l_ < 1024; l_ += 64) _mm_prefetch(pf_ + l_, _MM_HINT_T0); \
        _tile_zero(TC);                                     \
        _tile_loadd(TA, (act) + (g) * 64, ld);              \
        _tile_loadd(TB, w + (size_t)(g) * 1024, 64);        \
        _tile_dpbsud(TC, TA, TB);                           \
        _tile_stored(TC, d, 64);                            \
    } while (0)

// f[r] += group g's contribution, exactly as FIN8 (8-bit) or FIN (16-bit) in fd_avx512.h.
static inline void amx_fin(int mc, int m0, int g, const qact* a, const float* sc, const int32_t (*dh)[16],
                           const int32_t (*dl)[16], __m512* f) {
    const size_t ldg = a->ld / 64;
    const __m512 s = _mm512_loadu_ps(sc + g * 16);
    for (int r = 0; r < mc; r++) {
        const __m512i c = _mm512_set1_epi32(128 * a->gs[(size_t)(m0 + r) * ldg + g]);
        const __m512i H = _mm512_load_si512(dh[r]);
        if (dl == NULL) {
            const float gscale = a->gsc[(size_t)(m0 + r) * ldg + g];
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(H, c)), _mm512_mul_ps(s, _mm512_set1_ps(gscale)),
                                   f[r]);
        } else {
            const __m512i L = _mm512_load_si512(dl[r]);
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(H, 8), L), c)),
                                   s, f[r]);
        }
    }
}

// Rows [m0, m0 + mc) (mc <= 16, the configured tile rows) of y against n-block nb; same
// contract as gemm_blocks.
static void block_amx(int mc, int m0, int nb, int K, const qact* a, const uint8_t* wp, const float* sp,
                      const float* bias, float* y, int ldy, int accumulate) {
    const int G = K / 64;
    const size_t ld = a->ld;
    const int8_t* hi = a->hi + (size_t)m0 * ld;
    const int8_t* lo = a->lo + (size_t)m0 * ld;
    int32_t d0[16][16] __attribute__((aligned(64)));
    int32_t d1[16][16] __attribute__((aligned(64)));
    __m512 f[16];
    const uint8_t* w = wp + (size_t)nb * 16 * K;
    const float* sc = sp + (size_t)nb * 16 * G;
    for (int r = 0; r < mc; r++) f[r] = _mm512_setzero_ps();
    if (a->act8) {
        int g = 0;
        for (; g + 1 < G; g += 2) {
            AMX_GROUP(g, 0, 2, 3, hi, d0);
            AMX_GROUP(g + 1, 1, 4, 5, hi, d1);
            amx_fin(mc, m0, g, a, sc, d0, NULL, f);
            amx_fin(mc, m0, g + 1, a, sc, d1, NULL, f);
        }
        if (g < G) {
            AMX_GROUP(g, 0, 2, 3, hi, d0);
            amx_fin(mc, m0, g, a, sc, d0, NULL, f);
        }
    } else {
        for (int g = 0; g < G; g++) {  // the high and low bytes share the weight tile
            const char* pf = (const char*)(w + (size_t)g * 1024 + AMX_PF_DIST);
            for (int l = 0; l < 1024; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
            _tile_zero(3);
            _tile_zero(5);
            _tile_loadd(0, hi + g * 64, ld);
            _tile_loadd(1, lo + g * 64, ld);
            _tile_loadd(2, w + (size_t)g * 1024, 64);
            _tile_dpbsud(3, 0, 2);
            _tile_dpbsud(5, 1, 2);
            _tile_stored(3, d0, 64);
            _tile_stored(5, d1, 64);
            amx_fin(mc, m0, g, a, sc, d0, d1, f);
        }
    }
    const int n0 = nb * 16;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < mc; r++) {
        __m512 v = _mm512_fmadd_ps(f[r], _mm512_set1_ps(a->s[m0 + r]), bv);
        float* yo = y + (size_t)(m0 + r) * ldy + n0;
        if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yo));
        _mm512_storeu_ps(yo, v);
    }
}
#undef AMX_GROUP

// gemm_blocks for M >= 2 rows on AMX: each 16-row weight block is read from memory once and
// multiplied with every 16-row chunk of the activations while it is in cache.
static void gemm_blocks_amx(int M, int K, const qact* a, const uint8_t* wp, const float* sp, const float* bias,
                            float* y, int ldy, int accumulate, int nb0, int nb1) {
    int configured = 0;  // tile rows of the loaded configuration
    for (int nb = nb0; nb < nb1; nb++) {
        for (int m0 = 0; m0 < M; m0 += 16) {
            const int mc = M - m0 < 16 ? M - m0 : 16;
            if (mc != configured) {
                amx_config(mc);
                configured = mc;
            }
            block_amx(mc, m0, nb, K, a, wp, sp, bias, y, ldy, accumulate);
        }
    }
    _tile_release();
}
