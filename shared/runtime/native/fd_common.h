// Native decode step for FastLlamaRunner's int8 weights: what every instruction set shares.
// Weights: int8 with one float scale per 64 inputs (group) and output row, stored as
// uint8 (q + 128) in [N/16][K/4][16][4] order (16 output rows x 4 inputs per 64 bytes).
// fd_unit.c includes this file, the instruction set's kernels (fd_avx512.h [+ fd_amx.h],
// fd_avx2.h or fd_neon.h) and fd_driver.c: one translation unit per instruction set.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
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
// Zero rows [M, MP) of a buffer of MP rows of `row` bytes (padding a kernel may read).
static void zero_rows(void* p, size_t row, int M, int MP) { memset((char*)p + row * M, 0, row * (size_t)(MP - M)); }
