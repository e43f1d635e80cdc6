/* One-token decoding kernels for qkv.models.native_decode (x86-64, AVX2 + FMA, OpenMP).

   Decoding with a KV cache multiplies one token's activations by every weight matrix:
   each weight is read once per token and used for one multiply-add, so a step takes as
   long as streaming the weights from memory. These kernels read the weights where
   PyTorch keeps them (nn.Linear's (out, in) row-major layout, float32 or bfloat16) and
   keep the activations in float32. A bfloat16 weight is the top half of a float32, so
   it widens with a shift, in registers: memory traffic is the weights' own 2 bytes.

   Every function is single-token and stateless; the caller (Python, through ctypes)
   owns every buffer. The maths is the PyTorch module path's: each function has a
   reference in tests/test_native_decode.py.

   dtype codes: 0 = float32, 1 = bfloat16. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QKV_F32 0
#define QKV_BF16 1

/* ---------------------------------------------------------------------------------
   Scalar conversions */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as PyTorch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load1(const void *p, long i, int dt) {
    return dt == QKV_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* 8 consecutive values as float32 */
static inline __m256 load8(const void *p, long i, int dt) {
    if (dt == QKV_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float gelu_tanh(float x) { /* GPT-2's approximation, as F.gelu(approximate="tanh") */
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

/* ---------------------------------------------------------------------------------
   Dot products of ROWS consecutive weight rows with x.

   float32: 8 values per load. bfloat16: 16 values per 32-byte load; each 32-bit lane j
   holds values 2j (low half) and 2j + 1 (high half), so `w << 16` is the even values
   as float32 and `w & 0xffff0000` the odd ones, multiplied by x's even and odd values
   (xe, xo: x de-interleaved once per call). */

#define DOT_ROWS 4

static void dot_rows_f32(const float *w, long n, const float *x, float *out, int rows) {
    __m256 acc[DOT_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 xv = _mm256_loadu_ps(x + k);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * n + k), xv, acc[r]);
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum8(acc[r]);
        for (long t = k; t < n; t++) s += w[r * n + t] * x[t];
        out[r] = s;
    }
}

static void dot_rows_bf16(const uint16_t *w, long n, const float *x, const float *xe,
                          const float *xo, float *out, int rows) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[DOT_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 <= n; k += 16) {
        __m256 e = _mm256_loadu_ps(xe + k / 2), o = _mm256_loadu_ps(xo + k / 2);
        for (int r = 0; r < rows; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + r * n + k));
            acc[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), e, acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), o, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum8(acc[r]);
        for (long t = k; t < n; t++) s += bf16_to_f32(w[r * n + t]) * x[t];
        out[r] = s;
    }
}

/* ---------------------------------------------------------------------------------
   Linear layer for one token: y = W x + b, W (rows, n) row-major.

   mode 0: y = W x + b;  mode 1: y += W x + b (a residual connection);
   mode 2: y = gelu(W x + b).  bias may be NULL. x, y, bias: float32; W: dt. */

void qkv_linear(const void *W, int dt, const float *x, const float *bias, float *y,
                long rows, long n, int mode, int threads) {
    long blocks = (rows + DOT_ROWS - 1) / DOT_ROWS;
    float xe[dt == QKV_BF16 ? n / 2 + 1 : 1], xo[dt == QKV_BF16 ? n / 2 + 1 : 1];
    if (dt == QKV_BF16)
        for (long k = 0; k + 1 < n; k += 2) {
            xe[k / 2] = x[k];
            xo[k / 2] = x[k + 1];
        }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) {
        long r0 = b * DOT_ROWS;
        int rows_here = (int)(rows - r0 < DOT_ROWS ? rows - r0 : DOT_ROWS);
        float d[DOT_ROWS];
        if (dt == QKV_BF16)
            dot_rows_bf16((const uint16_t *)W + r0 * n, n, x, xe, xo, d, rows_here);
        else
            dot_rows_f32((const float *)W + r0 * n, n, x, d, rows_here);
        for (int r = 0; r < rows_here; r++) {
            float v = d[r] + (bias ? bias[r0 + r] : 0.0f);
            if (mode == 1)
                y[r0 + r] += v;
            else if (mode == 2)
                y[r0 + r] = gelu_tanh(v);
            else
                y[r0 + r] = v;
        }
    }
}

/* ---------------------------------------------------------------------------------
   LayerNorm of one vector (biased variance, as F.layer_norm), float32 throughout. */

void qkv_layer_norm(const float *x, const float *scale, const float *shift, float *y, long n,
                    float eps) {
    double mean = 0.0, var = 0.0;
    for (long i = 0; i < n; i++) mean += x[i];
    mean /= (double)n;
    for (long i = 0; i < n; i++) var += ((double)x[i] - mean) * ((double)x[i] - mean);
    var /= (double)n;
    float inv = (float)(1.0 / sqrt(var + (double)eps)), m = (float)mean;
    for (long i = 0; i < n; i++) y[i] = (x[i] - m) * inv * scale[i] + shift[i];
}

/* Token plus position embedding rows (dt) -> float32. */
void qkv_embed(const void *tok_row, const void *pos_row, int dt, float *y, long n) {
    for (long i = 0; i < n; i++) y[i] = load1(tok_row, i, dt) + load1(pos_row, i, dt);
}

/* ---------------------------------------------------------------------------------
   Causal attention of one new token.

   q, k, v: the new token's (heads * head_dim) float32 projections. K, V: the layer's
   cache, (heads, max_len, head_dim) of dt, head h's row p at h * head_stride + p *
   head_dim. Writes k and v at position pos (rounded to dt), then for each head:
   out_h = softmax(q_h . K_h[0..pos] * scale) V_h[0..pos]. */

static float dot_hd(const float *q, const void *K, long off, long hd, int dt) {
    __m256 acc = _mm256_setzero_ps();
    long d = 0;
    for (; d + 8 <= hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(K, off + d, dt), acc);
    float s = hsum8(acc);
    for (; d < hd; d++) s += q[d] * load1(K, off + d, dt);
    return s;
}

static void axpy_hd(float a, const void *V, long off, float *out, long hd, int dt) {
    __m256 av = _mm256_set1_ps(a);
    long d = 0;
    for (; d + 8 <= hd; d += 8)
        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(av, load8(V, off + d, dt), _mm256_loadu_ps(out + d)));
    for (; d < hd; d++) out[d] += a * load1(V, off + d, dt);
}

void qkv_attend(const float *q, const float *k, const float *v, void *K, void *V, int dt,
                float *out, long heads, long head_dim, long head_stride, long pos, float scale,
                float *scores, int threads) {
    for (long h = 0; h < heads; h++)
        for (long d = 0; d < head_dim; d++) {
            long i = h * head_stride + pos * head_dim + d;
            if (dt == QKV_BF16) {
                ((uint16_t *)K)[i] = f32_to_bf16(k[h * head_dim + d]);
                ((uint16_t *)V)[i] = f32_to_bf16(v[h * head_dim + d]);
            } else {
                ((float *)K)[i] = k[h * head_dim + d];
                ((float *)V)[i] = v[h * head_dim + d];
            }
        }
    long len = pos + 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long h = 0; h < heads; h++) {
        float *s = scores + h * len, *o = out + h * head_dim;
        const float *qh = q + h * head_dim;
        float m = -INFINITY;
        for (long p = 0; p < len; p++) {
            s[p] = dot_hd(qh, K, h * head_stride + p * head_dim, head_dim, dt) * scale;
            if (s[p] > m) m = s[p];
        }
        float total = 0.0f;
        for (long p = 0; p < len; p++) {
            s[p] = expf(s[p] - m);
            total += s[p];
        }
        for (long d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (long p = 0; p < len; p++)
            axpy_hd(s[p] / total, V, h * head_stride + p * head_dim, o, head_dim, dt);
    }
}
