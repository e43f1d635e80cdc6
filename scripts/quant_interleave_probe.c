/* Does interleaving weight rows at load speed up the Q4_0 matrix-vector product?

   Builds on kernels/quant.c (included, with its helpers) and times, on one thread,
   y = W x for COPIES distinct (ROWS, N) Q4_0 matrices (default 200 of SmolLM2-135M's FFN
   shape, (1536, 576): 100 MB, out of the caches, as a model's
   weights are), three ways:

     rows        quant.c's vector product, one row at a time (what decoding runs);
     group rows  four (GROUP) rows at a time from their own places: each block of x is loaded
                 once for four rows and the four rows' sums share the loop;
     interleaved the same four rows, repacked so that block b of the four rows lies
                 together (one stream of bytes instead of four), as GGML repacks
                 Q4_0 rows in groups at load on AVX2.

   Prints the median of 9 interleaved rounds for each, and the ratios to "rows".

     cc -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -fopenmp \
        -DQKV_Q8_0=2 -DQKV_Q4_0=3 -DQKV_Q4_1=4 -DQKV_Q5_0=5 -DQKV_Q5_1=6 -DQKV_Q4_K=7 \
        -DQKV_Q5_K=8 -DQKV_Q6_K=9 -Isrc/qkv/kernels -o /tmp/probe \
        scripts/quant_interleave_probe.c -lm && /tmp/probe [ROWS N [COPIES]]
   (drop the AVX-512 flags for the AVX2 build) */
#include "../src/qkv/kernels/quant.c"

#include <stdio.h>
#include <time.h>

#ifndef GROUP /* rows a group (-DGROUP=8 for groups of 8) */
#define GROUP 4
#endif

/* four rows' products with x: blocks of row i at block b are at rows[i] + b * stride_b
   (stride_b = 18 for rows in place, 4 * 18 when interleaved) */
static void dot4_q4_0(const uint8_t *const rows[GROUP], long stride_b, long nb, const quantized_x *xq,
                      float *out) {
    __m256 acc[GROUP], off[GROUP];
    for (int i = 0; i < GROUP; i++) acc[i] = off[i] = _mm256_setzero_ps();
    long b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256i p[GROUP][8];
        for (int k = 0; k < 8; k++) {
            const __m256i x = load32(xq->q + 32 * (b + k));
            for (int i = 0; i < GROUP; i++)
                p[i][k] = dot_u8_s8(unpack32(QKV_Q4_0, rows[i] + (b + k) * stride_b).u, x);
        }
        const __m256 xd = _mm256_loadu_ps(xq->d + b), xds = _mm256_loadu_ps(xq->ds + b);
        for (int i = 0; i < GROUP; i++) {
            const uint8_t *blk = rows[i] + b * stride_b;
            const long s = stride_b;
            const __m256 d = _mm256_cvtph_ps(_mm_setr_epi16(
                (short)u16(blk), (short)u16(blk + s), (short)u16(blk + 2 * s), (short)u16(blk + 3 * s),
                (short)u16(blk + 4 * s), (short)u16(blk + 5 * s), (short)u16(blk + 6 * s),
                (short)u16(blk + 7 * s)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each8(p[i])), _mm256_mul_ps(d, xd), acc[i]);
            off[i] = _mm256_fmadd_ps(d, xds, off[i]);
        }
    }
    for (int i = 0; i < GROUP; i++) {
        float s = hsum8(acc[i]), offset = -8.0f * hsum8(off[i]);
        for (long c = b; c < nb; c++) {
            const uint8_t *blk = rows[i] + c * stride_b;
            const __m256i q = block_dot(QKV_Q4_0, unpack32(QKV_Q4_0, blk), xq->q + 32 * c);
            s += f16(blk) * xq->d[c] * hsum8(_mm256_cvtepi32_ps(q));
            offset += -8.0f * f16(blk) * xq->ds[c];
        }
        out[i] = s + offset;
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const long rows = argc > 2 ? atol(argv[1]) : 1536, n = argc > 2 ? atol(argv[2]) : 576;
    const long nb = n / 32, row_bytes = nb * 18, copies = argc > 3 ? atol(argv[3]) : 200;
    uint8_t **plain = malloc(copies * sizeof *plain), **packed = malloc(copies * sizeof *packed);
    srand(1);
    for (long c = 0; c < copies; c++) {
        plain[c] = malloc(rows * row_bytes);
        packed[c] = malloc(rows * row_bytes);
        for (long i = 0; i < rows * row_bytes; i++) plain[c][i] = (uint8_t)rand();
        for (long r = 0; r < rows; r++)
            for (long b = 0; b < nb; b++) { /* scale 0.01 */
                plain[c][r * row_bytes + b * 18] = 0x1f, plain[c][r * row_bytes + b * 18 + 1] = 0x21;
            }
        /* group g, block b, row i of the group -> (g * nb + b) * GROUP + i */
        for (long r = 0; r < rows; r++)
            for (long b = 0; b < nb; b++)
                memcpy(packed[c] + (((r / GROUP) * nb + b) * GROUP + r % GROUP) * 18,
                       plain[c] + r * row_bytes + b * 18, 18);
    }
    float *x = malloc(n * sizeof *x), *y = malloc(rows * sizeof *y), *y2 = malloc(rows * sizeof *y2);
    for (long j = 0; j < n; j++) x[j] = (float)rand() / RAND_MAX - 0.5f;
    double t[3][9];
    float worst = 0.0f;
    for (int round = 0; round < 9; round++)
        for (int k = 0; k < 3; k++) {
            const int way = (k + round) % 3; /* the order turns each round */
            const double start = now();
            for (long c = 0; c < copies; c++) {
                qkv_quant_forget_x();
                const qkv_mat W = {plain[c], QKV_Q4_0};
                const quantized_x *xq = prepared(x, n);
                for (long r = 0; r < rows; r += GROUP) {
                    if (way == 0) {
                        for (int i = 0; i < GROUP; i++) y[r + i] = qkv_quant_dot_row(&W, r + i, n, x);
                    } else if (way == 1) {
                        const uint8_t *rs[GROUP];
                        for (int i = 0; i < GROUP; i++) rs[i] = plain[c] + (r + i) * row_bytes;
                        dot4_q4_0(rs, 18, nb, xq, y2 + r);
                    } else {
                        const uint8_t *g = packed[c] + (r / GROUP) * nb * GROUP * 18, *rs[GROUP];
                        for (int i = 0; i < GROUP; i++) rs[i] = g + i * 18;
                        dot4_q4_0(rs, GROUP * 18, nb, xq, y2 + r);
                    }
                }
            }
            t[way][round] = (now() - start) / copies;
        }
    /* the last copy's results agree with the vector product */
    for (long r = 0; r < rows; r++) {
        const qkv_mat W = {plain[copies - 1], QKV_Q4_0};
        worst = fmaxf(worst, fabsf(y2[r] - qkv_quant_dot_row(&W, r, n, x)));
    }
    const char *names[3] = {"rows", "group rows", "interleaved"};
    double med[3];
    for (int w = 0; w < 3; w++) {
        qsort(t[w], 9, sizeof t[w][0], by_value);
        med[w] = t[w][4];
    }
    printf("Q4_0 (%ld, %ld) x %ld copies, groups of %d rows, one thread; largest difference from "
           "the vector product %.2g\n", rows, n, copies, GROUP, worst);
    for (int w = 0; w < 3; w++)
        printf("%-12s %8.1f us  %.3fx the rows' speed\n", names[w], med[w] * 1e6, med[0] / med[w]);
    return 0;
}
