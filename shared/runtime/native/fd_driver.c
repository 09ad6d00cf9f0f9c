// Instruction-set independent parts: thread splits, attention over heads, the layer loop.

// n-blocks [nb0, nb1) of one product: AMX tiles for 2+ rows where built with them, else the vector kernels.
static void gemm_range(int M, int K, const qact* a, const uint8_t* w, const float* sc, const float* b, float* y,
                       int ldy, int accumulate, int nb0, int nb1) {
#ifdef FD_AMX
    if (M >= 2) {
        gemm_blocks_amx(M, K, a, w, sc, b, y, ldy, accumulate, nb0, nb1);
        return;
    }
#endif
    gemm_blocks(M, K, a, w, sc, b, y, ldy, accumulate, nb0, nb1);
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
            gemm_range(M, K, a, w, sc, b, y, ldy, accumulate, b0, b1);
        }
        return;
    }
#endif
    (void)nthreads;
    gemm_range(M, K, a, w, sc, b, y, ldy, accumulate, 0, nblocks);
}

// RMS-normalize (no gain: it is folded into the weights) and quantize each of the M rows of h.
static void normalize_rows(const fd_model* md, int M, const float* h, qact* a) {
    const int D = md->D;
    for (int m = 0; m < M; m++) {
        const float* hm = h + (size_t)m * D;
        quant_row(hm, D, a, m, rms_factor(hm, D, md->eps));
    }
}

// Attention for M query rows and all heads: row m is position rpos[m] of the sequence whose
// KV cache rmd[m] holds; scores: nthreads x sstride floats.
static void attention(const fd_model* const* rmd, const int32_t* rpos, int layer, int M, const float* qkv, int NQ,
                      float* att, float* scores, size_t sstride, int nthreads) {
    const int H = rmd[0]->H, HD = rmd[0]->HD, total = M * H;
#ifdef _OPENMP
    if (nthreads > 1 && total > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int i = 0; i < total; i++) {
            const int m = i / H, h = i % H;
            attend_head(rmd[m], layer, qkv + (size_t)m * NQ + (size_t)h * HD, h, rpos[m],
                        att + (size_t)m * H * HD + (size_t)h * HD, scores + (size_t)omp_get_thread_num() * sstride);
        }
        return;
    }
#endif
    (void)nthreads;
    for (int i = 0; i < total; i++) {
        const int m = i / H, h = i % H;
        attend_head(rmd[m], layer, qkv + (size_t)m * NQ + (size_t)h * HD, h, rpos[m],
                    att + (size_t)m * H * HD + (size_t)h * HD, scores);
    }
}

// One forward over M new token rows that may belong to several sequences on the same weights:
// row m is position rpos[m] of the sequence whose KV cache rmd[m] holds (its keys and values
// are written there; it attends to that sequence's positions up to its own). A sequence's rows
// come in position order. Every row is computed as it would be alone (a kernel's rows do not
// mix), so the logits equal one forward per sequence. h: [M][D] embeddings (updated in place);
// logits: [nkeep][n_head] for the rows listed in keep (ascending).
int fd_forward_rows(const fd_model* const* rmd, const int32_t* rpos, int M, float* h, int nkeep,
                    const int32_t* keep, float* logits, int nthreads) {
    const fd_model* md = rmd[0];  // the weights (every row's model shares them)
    const int D = md->D, H = md->H, KV = md->KV, HD = md->HD, I = md->I, NQ = md->n_qkv;
    const int qw = H * HD, half = HD / 2;
    int KMAX = D > I ? D : I;
    if (qw > KMAX) KMAX = qw;
    // activation rows in whole groups of eight, the padding zeroed (below): a kernel may compute
    // four or eight rows at a time and drop what it computed for the padding
    const int MP = (M + 7) / 8 * 8;
    qact a;
    a.ld = KMAX;
    a.act8 = md->act8;
    a.gsc = (float*)amalloc(sizeof(float) * (size_t)MP * (KMAX / 64));
    a.hi = (int8_t*)amalloc((size_t)MP * KMAX);
    a.lo = (int8_t*)amalloc((size_t)MP * KMAX);
    a.gs = (int32_t*)amalloc(sizeof(int32_t) * (size_t)MP * (KMAX / 64));
    a.s = (float*)amalloc(sizeof(float) * MP);
    float* qkv = (float*)amalloc(sizeof(float) * (size_t)M * NQ);
    float* att = (float*)amalloc(sizeof(float) * (size_t)M * qw);
    float* gu = (float*)amalloc(sizeof(float) * (size_t)M * 2 * I);
    float* act = (float*)amalloc(sizeof(float) * (size_t)M * I);
    int32_t last = 0;  // the longest context a row attends to
    for (int m = 0; m < M; m++) last = rpos[m] > last ? rpos[m] : last;
    const size_t sstride = ((size_t)last + 1 + 32 + 15) / 16 * 16;
    float* scores = (float*)amalloc(sizeof(float) * sstride * (size_t)(nthreads > 1 ? nthreads : 1));
    int rc = 0;
    if (!a.hi || !a.lo || !a.gs || !a.s || !a.gsc || !qkv || !att || !gu || !act || !scores) {
        rc = -1;
        goto done;
    }
    zero_rows(a.gsc, sizeof(float) * (KMAX / 64), M, MP);
    zero_rows(a.hi, KMAX, M, MP);
    zero_rows(a.lo, KMAX, M, MP);
    zero_rows(a.gs, sizeof(int32_t) * (KMAX / 64), M, MP);
    zero_rows(a.s, sizeof(float), M, MP);
    const size_t head_stride = (size_t)md->maxpos * HD;

    for (int l = 0; l < md->L; l++) {
        const int64_t* lp = md->layer_ptrs + (size_t)l * 12;
        // --- attention block (input RMSNorm gain folded into the QKV weights)
        normalize_rows(md, M, h, &a);
        gemm(nthreads, M, NQ, D, &a, lp + 0, qkv, NQ, 0);
        for (int m = 0; m < M; m++) {
            float* row = qkv + (size_t)m * NQ;
            const int p = rpos[m];
            uint16_t* kbase = rmd[m]->kcache + (size_t)l * KV * head_stride;
            uint16_t* vbase = rmd[m]->vcache + (size_t)l * KV * head_stride;
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
        attention(rmd, rpos, l, M, qkv, NQ, att, scores, sstride, nthreads);
        for (int m = 0; m < M; m++) quant_row(att + (size_t)m * qw, qw, &a, m, 1.f);
        gemm(nthreads, M, D, qw, &a, lp + 3, h, D, 1);
        // --- MLP block
        normalize_rows(md, M, h, &a);
        gemm(nthreads, M, 2 * I, D, &a, lp + 6, gu, 2 * I, 0);
        for (int m = 0; m < M; m++) {
            const float* g = gu + (size_t)m * 2 * I;
            const float* u = g + I;
            float* y = act + (size_t)m * I;
            silu_mul(g, u, y, I);
            quant_row(y, I, &a, m, 1.f);
        }
        gemm(nthreads, M, D, I, &a, lp + 9, h, D, 1);
    }
    {
        // --- final norm (gain folded into the head) and LM head, on the kept rows
        for (int m = 0; m < nkeep; m++) {
            const float* hm = h + (size_t)keep[m] * D;
            quant_row(hm, D, &a, m, rms_factor(hm, D, md->eps));
        }
        gemm(nthreads, nkeep, md->n_head, D, &a, md->head_ptrs, logits, md->n_head, 0);
    }
done:
    free(a.hi); free(a.lo); free(a.gs); free(a.s); free(a.gsc); free(qkv); free(att); free(gu); free(act); free(scores);
    return rc;
}

// One forward over M new tokens of one sequence at positions [pos, pos + M); the logits of the
// last logits_to_keep of them (0: all). h: [M][D] embeddings (updated in place).
int fd_forward(const fd_model* md, int M, float* h, int pos, int logits_to_keep, float* logits, int nthreads) {
    const fd_model** rmd = (const fd_model**)malloc(sizeof(fd_model*) * (size_t)M);
    int32_t* rpos = (int32_t*)malloc(sizeof(int32_t) * (size_t)M);
    int32_t* keep = (int32_t*)malloc(sizeof(int32_t) * (size_t)M);
    const int m0 = (logits_to_keep > 0 && logits_to_keep < M) ? M - logits_to_keep : 0;
    int rc = -1;
    if (rmd && rpos && keep) {
        for (int m = 0; m < M; m++) {
            rmd[m] = md;
            rpos[m] = pos + m;
            keep[m] = m0 + m;
        }
        rc = fd_forward_rows(rmd, rpos, M, h, M - m0, keep, logits, nthreads);
    }
    free(rmd); free(rpos); free(keep);
    return rc;
}

// Lay out n rows of a float32 matrix w [n][K] (K a multiple of 64) for the kernels above: one
// scale per (row, 64 inputs), max |w| / 127 (at least 1e-30); weights q = round(w / scale) to
// the nearest, ties to even, clamped to [-127, 127], stored as q + 128 in [N/16][K/4][16][4]
// order and scales as [N/16][K/64][16], with n padded to N (a multiple of 16) by zero rows.
// The same IEEE operations in the same order as shared/runtime/weight_packing.py's reference,
// so the bytes are identical; one pass over w (the torch expression makes six, ~1.2 GB/s).
void fd_pack_rows(const float* w, int n, int K, uint8_t* packed, float* scales, int nthreads) {
    const int N = (n + 15) / 16 * 16, G = K / 64;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
#endif
    for (int blk = 0; blk < N / 16; blk++) {
        for (int r = 0; r < 16; r++) {
            const int row = blk * 16 + r;
            for (int g = 0; g < G; g++) {
                float x[64], amax = 0.f;
                uint8_t q[64];
                if (row < n) memcpy(x, w + (size_t)row * K + (size_t)g * 64, sizeof x);
                else memset(x, 0, sizeof x);
                for (int i = 0; i < 64; i++) {  // a max of magnitudes: exact in any order
                    const float a = fabsf(x[i]);
                    amax = a > amax ? a : amax;
                }
                float s = amax / 127.0f;
                if (s < 1e-30f) s = 1e-30f;
                scales[((size_t)blk * G + g) * 16 + r] = s;
                for (int i = 0; i < 64; i++) {
                    float v = nearbyintf(x[i] / s);
                    v = v < -127.f ? -127.f : (v > 127.f ? 127.f : v);
                    q[i] = (uint8_t)(int)(v + 128.f);
                }
                // four inputs of this row to a 64-byte line of 16 rows x 4 inputs
                for (int j = 0; j < 16; j++)
                    memcpy(packed + (((size_t)blk * (K / 4) + (size_t)g * 16 + j) * 16 + r) * 4, q + 4 * j, 4);
            }
        }
    }
    (void)nthreads;
}
