// Kernel check without Python: a random model in the native layout, run by the native kernels of
// whatever instruction set this file is compiled with (the test includes shared/native/fd_unit.c
// before it, with that set's flags; see tests/test_native_kernels.py). It checks that a
// block of tokens gives the logits of single steps bit for bit (both activation modes), and
// writes the logits of a fixed sequence (float32, little-endian) to argv[1] so that another
// build's can be compared with them. Exit status 0 when every check holds.
#include <stdio.h>

enum { D = 128, H = 4, KV = 2, HD = 32, I = 256, L = 2, VOCAB = 80, MAXPOS = 64, PROMPT = 9, BLOCK = 12 };

static uint32_t rng = 12345u;
static float frand(void) {  // uniform in [-1, 1)
    rng = rng * 1664525u + 1013904223u;
    return (float)((rng >> 8) & 0xFFFFFF) / (float)0x800000 - 1.f;
}

// A packed random matrix [N][K]: bytes q + 128 with q in [-127, 127], a positive scale per
// (row, 64 inputs), and a bias (or none).
static void matrix(int N, int K, int with_bias, int64_t* out) {
    uint8_t* w = (uint8_t*)amalloc((size_t)N * K);
    float* sc = (float*)amalloc(sizeof(float) * (size_t)N * (K / 64));
    float* b = with_bias ? (float*)amalloc(sizeof(float) * (size_t)N) : NULL;
    for (size_t i = 0; i < (size_t)N * K; i++) w[i] = (uint8_t)(128 + (int)(127.f * frand()));
    for (size_t i = 0; i < (size_t)N * (K / 64); i++) sc[i] = (0.5f + 0.5f * frand() + 0.5f) / (127.f * 8.f);
    if (b)
        for (int i = 0; i < N; i++) b[i] = 0.1f * frand();
    out[0] = (int64_t)(intptr_t)w;
    out[1] = (int64_t)(intptr_t)sc;
    out[2] = (int64_t)(intptr_t)b;
}

static float* embed(int n, uint32_t seed) {  // n token embeddings [n][D]
    const uint32_t keep = rng;
    rng = seed;
    float* h = (float*)amalloc(sizeof(float) * (size_t)n * D);
    for (int i = 0; i < n * D; i++) h[i] = frand();
    rng = keep;
    return h;
}

int main(int argc, char** argv) {
#ifdef FD_AMX
    if (fd_amx_init() != 0) {
        printf("Linux refused the AMX tile state\n");
        return 3;
    }
#endif
    const int n_qkv = (H + 2 * KV) * HD, n_head = (VOCAB + 15) / 16 * 16;
    int64_t layer_ptrs[L * 12], head_ptrs[3];
    for (int l = 0; l < L; l++) {
        matrix(n_qkv, D, 1, layer_ptrs + l * 12 + 0);
        matrix(D, H * HD, 0, layer_ptrs + l * 12 + 3);
        matrix(2 * I, D, 0, layer_ptrs + l * 12 + 6);
        matrix(D, I, 0, layer_ptrs + l * 12 + 9);
    }
    matrix(n_head, D, 0, head_ptrs);
    float* cos_t = (float*)amalloc(sizeof(float) * MAXPOS * (HD / 2));
    float* sin_t = (float*)amalloc(sizeof(float) * MAXPOS * (HD / 2));
    for (int p = 0; p < MAXPOS; p++)
        for (int i = 0; i < HD / 2; i++) {
            const float angle = (float)p * powf(10000.f, -2.f * (float)i / (float)HD);
            cos_t[p * (HD / 2) + i] = cosf(angle);
            sin_t[p * (HD / 2) + i] = sinf(angle);
        }
    const size_t cache = (size_t)L * KV * MAXPOS * HD;
    fd_model md = {D, H, KV, HD, I, L, MAXPOS, n_qkv, n_head, 1e-6f, layer_ptrs, head_ptrs,
                   (uint16_t*)calloc(cache, 2), (uint16_t*)calloc(cache, 2), cos_t, sin_t, 0};
    FILE* out = argc > 1 ? fopen(argv[1], "wb") : NULL;
    int failures = 0;
    for (int act8 = 0; act8 <= 1; act8++) {
        md.act8 = act8;
        float* prompt = embed(PROMPT, 7u);
        float* prompt_logits = (float*)amalloc(sizeof(float) * (size_t)PROMPT * n_head);
        if (fd_forward(&md, PROMPT, prompt, 0, 0, prompt_logits, 2) != 0) return 2;
        // the block at once, then the same tokens one at a time from the same cache position
        float* block = embed(BLOCK, 11u);
        float* together = (float*)amalloc(sizeof(float) * (size_t)BLOCK * n_head);
        if (fd_forward(&md, BLOCK, block, PROMPT, 0, together, 2) != 0) return 2;
        float* alone = (float*)amalloc(sizeof(float) * (size_t)BLOCK * n_head);
        float* step = embed(BLOCK, 11u);
        for (int t = 0; t < BLOCK; t++)
            if (fd_forward(&md, 1, step + (size_t)t * D, PROMPT + t, 0, alone + (size_t)t * n_head, 1) != 0) return 2;
        const int same = memcmp(together, alone, sizeof(float) * (size_t)BLOCK * n_head) == 0;
        int finite = 1;
        for (int i = 0; i < BLOCK * n_head; i++) finite &= isfinite(together[i]) != 0;
        printf("%d-bit activations: block of %d %s single steps%s\n", act8 ? 8 : 16, BLOCK,
               same ? "==" : "!=", finite ? "" : " (non-finite logits)");
        failures += !same + !finite;
        if (out) {
            fwrite(prompt_logits, sizeof(float), (size_t)PROMPT * n_head, out);
            fwrite(together, sizeof(float), (size_t)BLOCK * n_head, out);
        }
        free(prompt); free(prompt_logits); free(block); free(together); free(alone); free(step);
    }
    if (out) fclose(out);
    return failures ? 1 : 0;
}
