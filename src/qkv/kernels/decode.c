/* One-token decoding for qkv.models.native_decode (x86-64, AVX2 + FMA, OpenMP).

   Decoding with a KV cache multiplies one token's activations by every weight matrix:
   each weight is read once per token and used for one multiply-add, so a step takes as
   long as streaming the weights from memory. These kernels read the weights where
   PyTorch keeps them (nn.Linear's (out, in) row-major layout, float32 or bfloat16) and
   keep the activations in float32. A bfloat16 weight is the top half of a float32, so
   it widens with a shift, in registers: memory traffic is the weights' own 2 bytes.

   qkv_step runs a whole GPT step (embedding, every block, final norm, output head) in
   one OpenMP parallel region: the pieces below are work-shared loops (`omp for`) and
   `omp single` sections, each ending in the barrier its successor needs. Opening a
   parallel region per layer and per matrix from Python cost about 5 % of a step. The
   pieces are also exported one by one (qkv_linear and qkv_attend each open a region
   of their own; qkv_layer_norm and qkv_embed are serial), so that
   tests/test_native_decode.py can check each against its definition.

   The caller (Python, through ctypes) owns every buffer. dtype codes: 0 = float32,
   1 = bfloat16. */

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
   The dot product of one weight row with x.

   Rows are taken one at a time, so each thread reads its share of the matrix as one
   sequential stream. Four accumulators keep four multiply-adds in flight.

   float32: 8 values per load. bfloat16: 16 values per 32-byte load; each 32-bit lane j
   holds values 2j (low half) and 2j + 1 (high half), so `w << 16` is the even values
   as float32 and `w & 0xffff0000` the odd ones, multiplied by x's even and odd values
   (xe, xo: x de-interleaved once per call). */

static float dot_row_f32(const float *w, long n, const float *x) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 32 <= n; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= n; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < n; k++) s += w[k] * x[k];
    return s;
}

static inline __m256 bf16_even(__m256i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline __m256 bf16_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

static float dot_row_bf16(const uint16_t *w, long n, const float *x, const float *xe,
                          const float *xo) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + k + 16));
        a0 = _mm256_fmadd_ps(bf16_even(v0), _mm256_loadu_ps(xe + k / 2), a0);
        a1 = _mm256_fmadd_ps(bf16_odd(v0), _mm256_loadu_ps(xo + k / 2), a1);
        a2 = _mm256_fmadd_ps(bf16_even(v1), _mm256_loadu_ps(xe + k / 2 + 8), a2);
        a3 = _mm256_fmadd_ps(bf16_odd(v1), _mm256_loadu_ps(xo + k / 2 + 8), a3);
    }
    for (; k + 16 <= n; k += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + k));
        a0 = _mm256_fmadd_ps(bf16_even(v), _mm256_loadu_ps(xe + k / 2), a0);
        a1 = _mm256_fmadd_ps(bf16_odd(v), _mm256_loadu_ps(xo + k / 2), a1);
    }
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < n; k++) s += bf16_to_f32(w[k]) * x[k];
    return s;
}

/* ---------------------------------------------------------------------------------
   Linear layer for one token: y = W x + b, W (rows, n) row-major.

   mode 0: y = W x + b;  mode 1: y += W x + b (a residual connection);
   mode 2: y = gelu(W x + b).  bias may be NULL. x, y, bias: float32; W: dt.
   Called by every thread of a parallel region; the rows are shared out in one
   contiguous range per thread. For bfloat16 each thread de-interleaves x itself
   (n floats: cheaper than a barrier). */

#define STORE 0
#define ADD 1
#define GELU 2

static void linear_shared(const void *W, int dt, const float *x, const float *bias, float *y,
                          long rows, long n, int mode) {
    float xe[dt == QKV_BF16 ? n / 2 + 1 : 1], xo[dt == QKV_BF16 ? n / 2 + 1 : 1];
    if (dt == QKV_BF16)
        for (long k = 0; k + 1 < n; k += 2) {
            xe[k / 2] = x[k];
            xo[k / 2] = x[k + 1];
        }
#pragma omp for schedule(static)
    for (long r = 0; r < rows; r++) {
        float v = dt == QKV_BF16 ? dot_row_bf16((const uint16_t *)W + r * n, n, x, xe, xo)
                                 : dot_row_f32((const float *)W + r * n, n, x);
        v += bias ? bias[r] : 0.0f;
        if (mode == ADD)
            y[r] += v;
        else if (mode == GELU)
            y[r] = gelu_tanh(v);
        else
            y[r] = v;
    }
}

void qkv_linear(const void *W, int dt, const float *x, const float *bias, float *y,
                long rows, long n, int mode, int threads) {
#pragma omp parallel num_threads(threads)
    linear_shared(W, dt, x, bias, y, rows, n, mode);
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

static void attend_shared(const float *q, const float *k, const float *v, void *K, void *V,
                          int dt, float *out, long heads, long head_dim, long head_stride,
                          long pos, float scale, float *scores) {
#pragma omp single
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
#pragma omp for schedule(static)
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

void qkv_attend(const float *q, const float *k, const float *v, void *K, void *V, int dt,
                float *out, long heads, long head_dim, long head_stride, long pos, float scale,
                float *scores, int threads) {
#pragma omp parallel num_threads(threads)
    attend_shared(q, k, v, K, V, dt, out, heads, head_dim, head_stride, pos, scale, scores);
}

/* ---------------------------------------------------------------------------------
   A whole step of a GPT-2 style model (qkv.models.gpt.GPTModel), per layer:

     h = LayerNorm1(x);  q, k, v = W_q h + b_q, W_k h + b_k, W_v h + b_v
     write k, v at `pos` in the layer's cache;  a = softmax(q K^T * scale) V (per head)
     x += W_o a + b_o;  h = LayerNorm2(x);  f = gelu(W_1 h + b_1);  x += W_2 f + b_2

   then logits = W_head LayerNorm_f(x). The structs mirror qkv.models.native_decode's
   ctypes declarations field for field. */

typedef struct {
    const void *w[6];  /* W_query, W_key, W_value, out_proj, ff[0], ff[2] (dt, (out, in)) */
    const float *b[6]; /* their biases, float32, or NULL */
    const float *norm1_scale, *norm1_shift, *norm2_scale, *norm2_shift;
    float norm1_eps, norm2_eps;
    void *keys, *values; /* the layer's KVCache buffers (dt, (heads, max_len, head_dim)) */
} qkv_layer;

typedef struct {
    int dt, n_layers;
    long dim, hidden, heads, head_dim, vocab, max_len;
    float scale;
    const void *tok_emb, *pos_emb, *head; /* (vocab, dim), (context, dim), (vocab, dim) */
    const float *final_scale, *final_shift;
    float final_eps;
    const qkv_layer *layers;
    /* float32 work buffers: x, h, q, k, v, a (dim); f (hidden); logits (vocab);
       scores (heads * max_len) */
    float *x, *h, *q, *k, *v, *a, *f, *logits, *scores;
} qkv_model;

void qkv_step(const qkv_model *m, long token, long pos, int threads) {
    const long d = m->dim, hd = m->head_dim, stride = m->max_len * m->head_dim;
    const int dt = m->dt;
    const size_t row = (size_t)d * (dt == QKV_BF16 ? 2 : 4);
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        qkv_embed((const char *)m->tok_emb + token * row, (const char *)m->pos_emb + pos * row,
                  dt, m->x, d);
        for (int l = 0; l < m->n_layers; l++) {
            const qkv_layer *L = &m->layers[l];
#pragma omp single
            qkv_layer_norm(m->x, L->norm1_scale, L->norm1_shift, m->h, d, L->norm1_eps);
            linear_shared(L->w[0], dt, m->h, L->b[0], m->q, d, d, STORE);
            linear_shared(L->w[1], dt, m->h, L->b[1], m->k, d, d, STORE);
            linear_shared(L->w[2], dt, m->h, L->b[2], m->v, d, d, STORE);
            attend_shared(m->q, m->k, m->v, L->keys, L->values, dt, m->a, m->heads, hd, stride,
                          pos, m->scale, m->scores);
            linear_shared(L->w[3], dt, m->a, L->b[3], m->x, d, d, ADD);
#pragma omp single
            qkv_layer_norm(m->x, L->norm2_scale, L->norm2_shift, m->h, d, L->norm2_eps);
            linear_shared(L->w[4], dt, m->h, L->b[4], m->f, m->hidden, d, GELU);
            linear_shared(L->w[5], dt, m->f, L->b[5], m->x, d, m->hidden, ADD);
        }
#pragma omp single
        qkv_layer_norm(m->x, m->final_scale, m->final_shift, m->h, d, m->final_eps);
        linear_shared(m->head, dt, m->h, NULL, m->logits, m->vocab, d, STORE);
    }
}
