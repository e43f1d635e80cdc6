/* Matrix-vector products on GGML's quantized blocks, read in place (x86-64, AVX2 + FMA +
   F16C; AVX-512 VNNI's byte dot product where the library is built with it).

   A GGUF file stores a matrix row as blocks: 32 (or 256) values share float16 scales and
   keep 4 to 8 bits each. A decoding step reads each weight once, so the fewer bytes the
   faster, as long as the arithmetic keeps up with memory. On a few cores it does not when
   every weight is first expanded to float32 (one multiply-add per value after several
   unpacking steps). So, as GGML's CPU backend does, the activation vector x is quantized
   once per product to 8 bits in blocks of 32 (x_j ~ dx_b * qx_j, dx_b = max |x_b| / 127,
   qx_j = round(x_j / dx_b)), and each block's products are integer dot products of
   bytes, 32 per instruction: VNNI's vpdpbusd, or AVX2's maddubs + madd.

   Every type's value is an unsigned integer u times a scale, plus an offset shared by a
   sub-block of 32 (16 for Q6_K) values:

     Q8_0   d * q, q signed 8 bits        Q4_0  d * (u - 8)     Q5_0  d * (u - 16)
     Q4_1   d * u + m                     Q5_1  d * u + m
     Q4_K   d * sc_s * u - dmin * m_s     (super-blocks of 256: 8 sub-blocks of 32 with
     Q5_K   the same, u of 5 bits          6-bit scales and mins)
     Q6_K   d * sc_s * (u - 32)           (16 sub-blocks of 16, 8-bit signed scales)

   so a sub-block's share of the dot product is, with S = sum of qx over it,

     scale * dx_b * sum(u * qx) + offset * dx_b * S.

   The integer sums go into a float32 vector accumulator (scale * dx_b broadcast), and the
   offsets into a scalar one. dx_b * S comes with the quantized x (and per 16 values, for
   Q6_K).

   Q8_0's q is signed, and maddubs/vpdpbusd take one unsigned operand: |q| times qx with
   q's sign, which is the same product.

   Each product has a scalar reference (qkv_quant_dot_ref, and qkv_dequantize_row, the
   blocks' values as the format defines them) that tests/test_quant_kernels.py checks
   against gguf's own decoder; the vector code is checked against it. */
#include "quant.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(QKV_Q8_0) || !defined(QKV_Q4_0) || !defined(QKV_Q4_1) || !defined(QKV_Q5_0) || \
    !defined(QKV_Q5_1) || !defined(QKV_Q4_K) || !defined(QKV_Q5_K) || !defined(QKV_Q6_K)
#error "the block types' codes come from the build (qkv.kernels.QUANT_TYPES)"
#endif

/* values per block and bytes per block of a type; 0 for a type that is not a block type */
static void block_shape(int type, long *values, long *bytes) {
    *values = 32, *bytes = 0;
    if (type == QKV_Q8_0) *bytes = 34;      /* d, 32 x int8 */
    else if (type == QKV_Q4_0) *bytes = 18; /* d, 16 bytes of nibbles */
    else if (type == QKV_Q4_1) *bytes = 20; /* d, m, 16 bytes of nibbles */
    else if (type == QKV_Q5_0) *bytes = 22; /* d, 4 bytes of high bits, nibbles */
    else if (type == QKV_Q5_1) *bytes = 24; /* d, m, high bits, nibbles */
    else {
        *values = 256;
        if (type == QKV_Q4_K) *bytes = 144;      /* d, dmin, 12 scale bytes, 128 nibbles */
        else if (type == QKV_Q5_K) *bytes = 176; /* ... and 32 bytes of high bits */
        else if (type == QKV_Q6_K) *bytes = 210; /* 128 low, 64 high, 16 scales, d */
    }
}

int qkv_is_quantized(int type) {
    long values, bytes;
    block_shape(type, &values, &bytes);
    return bytes != 0;
}

static const uint8_t *row_of(const qkv_mat *W, long r, long n) {
    long values, bytes;
    block_shape(W->type, &values, &bytes);
    return (const uint8_t *)W->data + r * (n / values) * bytes;
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j (0..7), from 12 bytes: bytes 0-3
   hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; sub-blocks 4-7 take their low 4 bits
   from bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits from the top
   2 bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---------------------------------------------------------------------------------
   The scalar reference: each block's values from the format's definition, and the
   product with x quantized to 8 bits the same way (summed in double). */

/* values of one block (32 or 256) of `type` at b -> y */
static void dequantize_block(int type, const uint8_t *b, float *y) {
    if (type == QKV_Q8_0) {
        const float d = f16(b);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
    } else if (type == QKV_Q4_0 || type == QKV_Q4_1) {
        /* value j: low nibble of byte j, value j + 16: its high nibble */
        const int one = type == QKV_Q4_1;
        const float d = f16(b), m = one ? f16(b + 2) : 0.0f;
        const uint8_t *qs = b + (one ? 4 : 2);
        for (int j = 0; j < 16; j++) {
            int lo = qs[j] & 15, hi = qs[j] >> 4;
            y[j] = one ? d * lo + m : d * (float)(lo - 8);
            y[j + 16] = one ? d * hi + m : d * (float)(hi - 8);
        }
    } else if (type == QKV_Q5_0 || type == QKV_Q5_1) {
        /* Q4's nibbles, plus bit j of a little-endian 32-bit word as value j's 5th bit */
        const int one = type == QKV_Q5_1;
        const float d = f16(b), m = one ? f16(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + (one ? 4 : 2), sizeof qh);
        const uint8_t *qs = b + (one ? 8 : 6);
        for (int j = 0; j < 32; j++) {
            int u = (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | (int)(((qh >> j) & 1u) << 4);
            y[j] = one ? d * u + m : d * (float)(u - 16);
        }
    } else if (type == QKV_Q4_K || type == QKV_Q5_K) {
        /* sub-block s of 32: nibbles of bytes 32 (s / 2) .. +31, low for even s, high for
           odd; Q5_K's 5th bit of value i of sub-block s is bit s of high-bit byte i */
        const int five = type == QKV_Q5_K;
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            k_scale_min(scales, s, &sc, &mn);
            const float ds = d * sc, dm = dmin * mn;
            for (int i = 0; i < 32; i++) {
                int u = (s & 1 ? qs[32 * (s / 2) + i] >> 4 : qs[32 * (s / 2) + i] & 15);
                if (five) u |= ((qh[i] >> s) & 1) << 4;
                y[32 * s + i] = ds * u - dm;
            }
        }
    } else if (type == QKV_Q6_K) {
        /* value 128 h + 32 k + i (halves h, quarters k): low 4 bits from byte
           64 h + 32 (k % 2) + i of ql (low nibble for k < 2, high for k >= 2), top 2 bits
           from bits 2k, 2k + 1 of byte 32 h + i of qh; scale: one per 16 values */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 32; i++) {
                    const uint8_t low = ql[64 * h + 32 * (k % 2) + i];
                    const int u = (k < 2 ? low & 15 : low >> 4) | (((qh[32 * h + i] >> (2 * k)) & 3) << 4);
                    const int at = 128 * h + 32 * k + i;
                    y[at] = d * (float)scales[at / 16] * (float)(u - 32);
                }
    }
}

void qkv_dequantize_row(const qkv_mat *W, long r, long n, float *y) {
    long values, bytes;
    block_shape(W->type, &values, &bytes);
    const uint8_t *row = row_of(W, r, n);
    for (long b = 0; b < n / values; b++) dequantize_block(W->type, row + b * bytes, y + b * values);
}

/* x (n, a multiple of 32) quantized to 8 bits per block of 32: d[b] = max |x_b| / 127,
   q = round to nearest even (x * (127 / max |x_b|)); an all-zero block has d 0, q 0. */
static void quantize_x_ref(const float *x, long n, int8_t *q, float *d) {
    for (long b = 0; b < n / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int j = 0; j < 32; j++) q[32 * b + j] = (int8_t)nearbyintf(x[32 * b + j] * inv);
    }
}

/* sum_j w_j * dx_b * qx_j over row r: what qkv_quant_dot_row computes, in double */
double qkv_quant_dot_ref(const qkv_mat *W, long r, long n, const float *x) {
    float *w = malloc((size_t)n * sizeof *w), *d = malloc((size_t)(n / 32) * sizeof *d);
    int8_t *q = malloc((size_t)n);
    qkv_dequantize_row(W, r, n, w);
    quantize_x_ref(x, n, q, d);
    double s = 0.0;
    for (long j = 0; j < n; j++) s += (double)w[j] * ((double)d[j / 32] * q[j]);
    free(w), free(d), free(q);
    return s;
}

/* ---------------------------------------------------------------------------------
   The vector path. */

/* x quantized for the products on this thread: q (n), d (n / 32), and d times the sums
   of q per 16 values (ds16) and per block (ds: d * S, the offsets' factor). */
typedef struct {
    const float *x;
    long n, cap;
    int valid;
    int8_t *q;
    float *d, *ds, *ds16;
} quantized_x;

static __thread quantized_x xq_;

void qkv_quant_forget_x(void) { xq_.valid = 0; }

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

/* x (n) quantized as quantize_x_ref does (the same float operations, so the same bytes),
   32 values at a time, into q (n), d (n / 32), ds (n / 32) and ds16 (n / 16). */
static void quantize_x(const float *x, long n, int8_t *q, float *d, float *ds, float *ds16) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8),
               a2 = _mm256_loadu_ps(v + 16), a3 = _mm256_loadu_ps(v + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a0, abs_mask), _mm256_and_ps(a1, abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(a2, abs_mask), _mm256_and_ps(a3, abs_mask)));
        const float amax = hmax8(m);
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        d[b] = amax / 127.0f;
        /* rounds to nearest even (the default rounding mode), as nearbyintf */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, inv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, inv));
        /* the packs work per 128-bit lane: 32-bit groups come out as i0 lo, i1 lo, i2 lo,
           i3 lo | i0 hi, ..., and the permutation puts them back in order */
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(bytes, order));
        int sums[2] = {0, 0};
        for (int j = 0; j < 32; j++) sums[j / 16] += q[32 * b + j];
        ds16[2 * b] = d[b] * (float)sums[0];
        ds16[2 * b + 1] = d[b] * (float)sums[1];
        ds[b] = d[b] * (float)(sums[0] + sums[1]);
    }
}

/* x quantized for the vector products on this thread (kept while x is the same). */
static const quantized_x *prepared(const float *x, long n) {
    quantized_x *p = &xq_;
    if (p->valid && p->x == x && p->n == n) return p;
    if (n > p->cap) { /* kept for the thread's later products; grows to the longest row */
        free(p->q), free(p->d), free(p->ds), free(p->ds16);
        p->q = malloc((size_t)n);
        p->d = malloc((size_t)(n / 32) * sizeof *p->d);
        p->ds = malloc((size_t)(n / 32) * sizeof *p->ds);
        p->ds16 = malloc((size_t)(n / 16) * sizeof *p->ds16);
        p->cap = n;
    }
    quantize_x(x, n, p->q, p->d, p->ds, p->ds16);
    p->x = x, p->n = n, p->valid = 1;
    return p;
}

/* 8 sums of 4 byte products each, u (unsigned) times s (signed): lane i holds bytes
   4i .. 4i + 3, so lanes 0-3 are the first 16 bytes. No overflow for u <= 128:
   maddubs's pairs reach at most 2 * 128 * 127 < 2^15. */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones */
static inline __m256i nibbles16(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

/* bit j of a 32-bit word -> 16 in byte j (the 5th bit of Q5_0/Q5_1's value j) */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    /* byte j gets byte j / 8 of the word, then keeps bit j % 8 of it */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}


/* A product runs up to MAX_NX rows of quantized activations past each weight block it
   unpacks: the matrix product (qkv_quant_matmul) reuses every unpacked block MAX_NX
   times, and the vector product is the case of one row. Every helper below takes the
   rows (xs, nx) and writes each row's product (out); inlined with nx a constant, each
   row's arithmetic is the same sequence of operations whatever nx is. */
#define MAX_NX 4
#define INLINE static inline __attribute__((always_inline))

/* One 32-value block unpacked for the byte dot products: u, the unsigned bytes
   (Q4_0 ... Q5_1: nibbles, and Q5's fifth bits; Q8_0: |q|), and Q8_0's q for its signs */
typedef struct {
    __m256i u, q;
} block32;

INLINE block32 unpack32(const int type, const uint8_t *w) {
    block32 b;
    if (type == QKV_Q8_0) {
        b.q = load32(w + 2);
        b.u = _mm256_abs_epi8(b.q);
        return b;
    }
    const int one = type == QKV_Q4_1 || type == QKV_Q5_1, five = type == QKV_Q5_0 || type == QKV_Q5_1;
    b.u = nibbles16(w + (one ? 4 : 2) + (five ? 4 : 0));
    if (five) b.u = _mm256_or_si256(b.u, fifth_bits(w + (one ? 4 : 2)));
    b.q = b.u;
    return b;
}

/* The integer dot product of an unpacked block with its 32 bytes of x (Q8_0: |q| times
   x with q's sign) */
INLINE __m256i block_dot(const int type, const block32 w, const int8_t *xq) {
    const __m256i x = load32(xq);
    return dot_u8_s8(w.u, type == QKV_Q8_0 ? _mm256_sign_epi8(x, w.q) : x);
}

/* 8 vectors of 8 int32 -> the 8 vectors' sums, in order */
static inline __m256i sum_each8(const __m256i p[8]) {
    /* hadd works within 128-bit halves: after two rounds, g0 holds p0..p3's sums over
       their low halves (low) and high halves (high), g1 p4..p7's */
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                            _mm256_permute2x128_si256(g0, g1, 0x31));
}

static inline uint16_t u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks of 32 with scale d and offset m (Q4_1, Q5_1) or
   -8 d, -16 d (Q4_0, Q5_0). Eight blocks at a time: their eight integer sums in one
   vector, times the eight d * dx_b (float16 scales widened together), so that the
   per-block work is the unpacking and one byte dot product per row; the offsets the
   same way. */
INLINE void dot_blocks32(const int type, const uint8_t *w, long nb, const quantized_x *const *xs,
                         const int nx, float *out) {
    long values, bytes;
    block_shape(type, &values, &bytes);
    const int one = type == QKV_Q4_1 || type == QKV_Q5_1;
    const float shift = type == QKV_Q8_0 ? 0.0f : type == QKV_Q4_0 ? -8.0f : -16.0f;
    __m256 acc[MAX_NX], off[MAX_NX];
    for (int j = 0; j < nx; j++) acc[j] = off[j] = _mm256_setzero_ps();
    long b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *blk = w + b * bytes;
        __m256i p[MAX_NX][8];
        for (int k = 0; k < 8; k++) {
            const block32 u = unpack32(type, blk + k * bytes);
            for (int j = 0; j < nx; j++) p[j][k] = block_dot(type, u, xs[j]->q + 32 * (b + k));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_setr_epi16(
            (short)u16(blk), (short)u16(blk + bytes), (short)u16(blk + 2 * bytes), (short)u16(blk + 3 * bytes),
            (short)u16(blk + 4 * bytes), (short)u16(blk + 5 * bytes), (short)u16(blk + 6 * bytes),
            (short)u16(blk + 7 * bytes)));
        __m256 mins = d;
        if (one) {
            const uint8_t *m = blk + 2;
            mins = _mm256_cvtph_ps(_mm_setr_epi16(
                (short)u16(m), (short)u16(m + bytes), (short)u16(m + 2 * bytes), (short)u16(m + 3 * bytes),
                (short)u16(m + 4 * bytes), (short)u16(m + 5 * bytes), (short)u16(m + 6 * bytes),
                (short)u16(m + 7 * bytes)));
        }
        for (int j = 0; j < nx; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each8(p[j])),
                                     _mm256_mul_ps(d, _mm256_loadu_ps(xs[j]->d + b)), acc[j]);
            if (type != QKV_Q8_0) off[j] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs[j]->ds + b), off[j]);
        }
    }
    float s[MAX_NX], offset[MAX_NX];
    for (int j = 0; j < nx; j++) s[j] = hsum8(acc[j]), offset[j] = one ? hsum8(off[j]) : shift * hsum8(off[j]);
    for (; b < nb; b++) { /* the row's last blocks, one at a time */
        const uint8_t *blk = w + b * bytes;
        const block32 u = unpack32(type, blk);
        const float d = f16(blk), m = one ? f16(blk + 2) : shift * f16(blk);
        for (int j = 0; j < nx; j++) {
            s[j] += d * xs[j]->d[b] * hsum8(_mm256_cvtepi32_ps(block_dot(type, u, xs[j]->q + 32 * b)));
            offset[j] += m * xs[j]->ds[b];
        }
    }
    for (int j = 0; j < nx; j++) out[j] = s[j] + offset[j];
}

/* k_scale_min's eight scales and eight mins as two vectors, four at a time in 32-bit
   words (a = bytes 0-3, b = 4-7, c = 8-11) and in registers: going through memory, a
   32-byte load of values just stored one by one stalls on the stores. */
INLINE void k_scales_mins(const uint8_t *s, __m256 *scales, __m256 *mins) {
    uint32_t a, b, c;
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint64_t sc = (a & low6) | (uint64_t)((c & low4) | (((a >> 6) & low2) << 4)) << 32;
    const uint64_t mn = (b & low6) | (uint64_t)(((c >> 4) & low4) | (((b >> 6) & low2) << 4)) << 32;
    *scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
    *mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
}

/* Q4_K, Q5_K: super-blocks of 256, eight sub-blocks of 32: their eight integer sums in
   one vector, times d * sc_s * dx_b; the mins' offsets dmin * m_s * dx_b S_b likewise */
INLINE void dot_q4_q5_k(const int five, const uint8_t *w, long nb, const quantized_x *const *xs,
                        const int nx, float *out) {
    const long bytes = five ? 176 : 144;
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc[MAX_NX], off[MAX_NX];
    for (int j = 0; j < nx; j++) acc[j] = off[j] = _mm256_setzero_ps();
    for (long sb = 0; sb < nb; sb++, w += bytes) {
        const uint8_t *qs = w + (five ? 48 : 16);
        __m256i high = five ? load32(w + 16) : _mm256_setzero_si256();
        __m256i p[MAX_NX][8];
        for (int c = 0; c < 4; c++) {
            const __m256i raw = load32(qs + 32 * c);
            __m256i lo = _mm256_and_si256(raw, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (five) { /* bit s of each byte of `high` is sub-block s's 5th bit */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
                high = _mm256_srli_epi16(high, 1);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
                high = _mm256_srli_epi16(high, 1);
            }
            for (int j = 0; j < nx; j++) {
                const int8_t *x = xs[j]->q + 256 * sb;
                p[j][2 * c] = dot_u8_s8(lo, load32(x + 64 * c));
                p[j][2 * c + 1] = dot_u8_s8(hi, load32(x + 64 * c + 32));
            }
        }
        __m256 scales, mins;
        k_scales_mins(w + 4, &scales, &mins);
        const __m256 d = _mm256_set1_ps(f16(w)), dmin = _mm256_set1_ps(f16(w + 2));
        const __m256 dsc = _mm256_mul_ps(d, scales), dmn = _mm256_mul_ps(dmin, mins);
        for (int j = 0; j < nx; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each8(p[j])),
                                     _mm256_mul_ps(dsc, _mm256_loadu_ps(xs[j]->d + 8 * sb)), acc[j]);
            off[j] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(xs[j]->ds + 8 * sb), off[j]);
        }
    }
    for (int j = 0; j < nx; j++) out[j] = hsum8(acc[j]) - hsum8(off[j]);
}

/* Q6_K: super-blocks of 256, a signed scale per 16 values. Each group of 32 values's
   pair products (maddubs: int16 sums of 2) are summed in fours by madd with the group's
   two scales (first 16 bytes, next 16), so one vector per group already holds
   sc * sum(u * qx); eight groups' sums in one vector, times d * dx_b. */
INLINE void dot_q6_k(const uint8_t *w, long nb, const quantized_x *const *xs, const int nx,
                     float *out) {
    __m256 acc[MAX_NX], off[MAX_NX];
    for (int j = 0; j < nx; j++) acc[j] = off[j] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
    /* group t's two scales from the half's eight (int16, in both lanes): bytes 4k, 4k + 1
       (scale 2k) over the low lane, 4k + 2, 4k + 3 (scale 2k + 1) over the high lane */
    const __m256i pick[4] = {
        _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3),
        _mm256_setr_epi8(4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
                         6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7),
        _mm256_setr_epi8(8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9,
                         10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11),
        _mm256_setr_epi8(12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
                         14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15)};
    for (long sb = 0; sb < nb; sb++, w += 210) {
        const int8_t *scales = (const int8_t *)(w + 192);
        __m256i p[MAX_NX][8];
        for (int h = 0; h < 2; h++) {
            /* this half's eight scales widened once, then picked per group by a shuffle
               (rather than two scalar loads and broadcasts per group) */
            const __m256i sc8 = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(scales + 8 * h))));
            __m256i high = load32(w + 128 + 32 * h);
            const __m256i raw0 = load32(w + 64 * h), raw1 = load32(w + 64 * h + 32);
            for (int k = 0; k < 4; k++) {
                const __m256i raw = k % 2 ? raw1 : raw0;
                const __m256i low = k < 2 ? _mm256_and_si256(raw, low4)
                                          : _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                const __m256i u = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(high, low2), 4));
                high = _mm256_srli_epi16(high, 2);
                const int t = 4 * h + k;
                const __m256i sc = _mm256_shuffle_epi8(sc8, pick[k]);
                /* u <= 63: the pairs stay below 2 * 63 * 127 < 2^15 */
                for (int j = 0; j < nx; j++)
                    p[j][t] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, load32(xs[j]->q + 256 * sb + 32 * t)), sc);
            }
        }
        const __m256 d = _mm256_set1_ps(f16(w + 208));
        /* offsets: -32 d sum_s sc_s dx S_s over the 16 scales */
        const __m128i sc16 = _mm_loadu_si128((const __m128i *)scales);
        const __m256 s_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16));
        const __m256 s_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8)));
        for (int j = 0; j < nx; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each8(p[j])),
                                     _mm256_mul_ps(d, _mm256_loadu_ps(xs[j]->d + 8 * sb)), acc[j]);
            const float *ds16 = xs[j]->ds16 + 16 * sb;
            const __m256 part = _mm256_fmadd_ps(s_hi, _mm256_loadu_ps(ds16 + 8),
                                                _mm256_mul_ps(s_lo, _mm256_loadu_ps(ds16)));
            off[j] = _mm256_fmadd_ps(d, part, off[j]);
        }
    }
    for (int j = 0; j < nx; j++) out[j] = hsum8(acc[j]) - 32.0f * hsum8(off[j]);
}

/* A row of W's blocks (n values) times nx rows of quantized x -> out (nx); each type its
   own copy of its helper, the type a constant there. */
INLINE void dot_rows(const int type, const uint8_t *row, long n, const quantized_x *const *xs,
                     const int nx, float *out) {
    if (type == QKV_Q8_0) dot_blocks32(QKV_Q8_0, row, n / 32, xs, nx, out);
    else if (type == QKV_Q4_0) dot_blocks32(QKV_Q4_0, row, n / 32, xs, nx, out);
    else if (type == QKV_Q4_1) dot_blocks32(QKV_Q4_1, row, n / 32, xs, nx, out);
    else if (type == QKV_Q5_0) dot_blocks32(QKV_Q5_0, row, n / 32, xs, nx, out);
    else if (type == QKV_Q5_1) dot_blocks32(QKV_Q5_1, row, n / 32, xs, nx, out);
    else if (type == QKV_Q4_K) dot_q4_q5_k(0, row, n / 256, xs, nx, out);
    else if (type == QKV_Q5_K) dot_q4_q5_k(1, row, n / 256, xs, nx, out);
    else dot_q6_k(row, n / 256, xs, nx, out);
}

float qkv_quant_dot_row(const qkv_mat *W, long r, long n, const float *x) {
    const quantized_x *xq = prepared(x, n);
    float y;
    dot_rows(W->type, row_of(W, r, n), n, &xq, 1, &y);
    return y;
}

/* ---------------------------------------------------------------------------------
   The matrix product: a prompt's T rows of activations times W^T.

   Each row of X is quantized once (as the vector path quantizes x), then the threads
   share out tiles of ROW_TILE weight rows. Within a tile, each group of MAX_NX rows of
   X (MAX_NX n bytes) meets every weight row of the tile while both stay in the L1
   cache, and each weight block is unpacked once per group rather than once per row. */
#define ROW_TILE 16

/* nx (1 .. MAX_NX) rows at a time, nx a constant in each copy */
static void dot_rows_n(int type, const uint8_t *row, long n, const quantized_x *const *xs, int nx,
                       float *out) {
    switch (nx) {
    case 4: dot_rows(type, row, n, xs, 4, out); break;
    case 3: dot_rows(type, row, n, xs, 3, out); break;
    case 2: dot_rows(type, row, n, xs, 2, out); break;
    default: dot_rows(type, row, n, xs, 1, out);
    }
}

int qkv_quant_matmul(const qkv_mat *W, const float *X, const float *bias, float *Y, long T,
                     long rows, long n, int threads) {
    int8_t *q = malloc((size_t)(T * n));
    float *d = malloc((size_t)(T * (n / 32)) * sizeof *d), *ds = malloc((size_t)(T * (n / 32)) * sizeof *ds),
          *ds16 = malloc((size_t)(T * (n / 16)) * sizeof *ds16);
    quantized_x *xs = malloc((size_t)T * sizeof *xs);
    const int ok = q && d && ds && ds16 && xs;
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                quantize_x(X + t * n, n, q + t * n, d + t * (n / 32), ds + t * (n / 32), ds16 + t * (n / 16));
                xs[t] = (quantized_x){.x = X + t * n, .n = n, .cap = n, .valid = 1, .q = q + t * n,
                                      .d = d + t * (n / 32), .ds = ds + t * (n / 32), .ds16 = ds16 + t * (n / 16)};
            }
            const long tiles = (rows + ROW_TILE - 1) / ROW_TILE;
#pragma omp for schedule(static)
            for (long tile = 0; tile < tiles; tile++) {
                const long r0 = tile * ROW_TILE, r1 = r0 + ROW_TILE < rows ? r0 + ROW_TILE : rows;
                for (long t0 = 0; t0 < T; t0 += MAX_NX) {
                    const int nx = T - t0 < MAX_NX ? (int)(T - t0) : MAX_NX;
                    const quantized_x *group[MAX_NX];
                    for (int j = 0; j < nx; j++) group[j] = &xs[t0 + j];
                    for (long r = r0; r < r1; r++) {
                        float out[MAX_NX];
                        dot_rows_n(W->type, row_of(W, r, n), n, group, nx, out);
                        for (int j = 0; j < nx; j++) Y[(t0 + j) * rows + r] = out[j] + (bias ? bias[r] : 0.0f);
                    }
                }
            }
        }
    }
    free(q), free(d), free(ds), free(ds16), free(xs);
    return ok ? 0 : -1;
}
