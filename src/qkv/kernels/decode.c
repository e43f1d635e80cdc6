/* One-token decoding for qkv.models.native_decode (x86-64, AVX2 + FMA, OpenMP; the dot
   products of weight rows use AVX-512 where the library is built with -mavx512f).

   Decoding with a KV cache multiplies one token's activations by every weight matrix:
   each weight is read once per token and used for one multiply-add, so a step takes as
   long as streaming the weights from memory. These kernels read the weights where
   PyTorch keeps them (nn.Linear's (out, in) row-major layout, float32 or bfloat16) and
   keep the activations in float32. A bfloat16 weight is the top half of a float32, so
   it widens with a shift, in registers: memory traffic is the weights' own 2 bytes.

   qkv_step runs a whole decoder step (embedding, every block, final norm, output head)
   in one OpenMP parallel region: the pieces below are work-shared loops (`omp for`) and
   `omp single` sections, each ending in the barrier its successor needs. Opening a
   parallel region per layer and per matrix from Python cost about 5 % of a step. The
   pieces are also exported one by one (qkv_linear, qkv_gated and qkv_attend each open a
   region of their own; the norms, qkv_rope and qkv_embed are serial), so that
   tests/test_native_decode.py can check each against its definition.

   One step serves every model qkv.models.gpt builds: GPT-2 (LayerNorm, learned
   positions, GELU MLP) and the open families (RMSNorm, Gemma's 1 + w norms given here
   as their float32 scale, rotary positions, grouped-query attention, QK-norm, gated
   SiLU/GELU MLPs, post-norms, sliding-window layers on ring caches, scaled embeddings).

   The caller (Python, through ctypes) owns every buffer. dtype codes: 0 = float32,
   1 = bfloat16. Each weight matrix carries its own type (a qkv_mat), so one model may
   mix them; the activations and the caches' dtype are the model's. A weight may also be
   kept in one of GGML's quantized block types (quant.c computes its products). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant.h" /* qkv_mat, the type codes, GGML's block types (quant.c) */

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

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

#define ACT_GELU 0 /* tanh-approximated GELU: GPT-2's MLP, Gemma's GeGLU */
#define ACT_SILU 1 /* SiLU: Llama's, Qwen's SwiGLU */

static inline float activate(float x, int act) { return act == ACT_SILU ? silu(x) : gelu_tanh(x); }

/* ---------------------------------------------------------------------------------
   The dot product of one weight row with x.

   With AVX-512 (__AVX512F__) the bulk of a row runs 64 bytes per load, half the loop
   of AVX2's; the rest of the row finishes in AVX2. Both sum the same products in
   another order, so they agree to rounding.

   Each loop asks for the cache lines AHEAD bytes further on (the rest of this row, then
   the next, which follows it in memory). The hardware prefetcher alone kept fewer
   lines in flight: on a 2-core Xeon with AVX-512 this took SmolLM2-135M's steps from
   90 to 93 % of the read bandwidth in float32 and from 85 to 91 % in bfloat16. */

#define AHEAD 2048 /* bytes */
/*
   Rows are taken one at a time, so each thread reads its share of the matrix as one
   sequential stream. Four accumulators keep four multiply-adds in flight.

   float32: 8 values per load. bfloat16: 16 values per 32-byte load; each 32-bit lane j
   holds values 2j (low half) and 2j + 1 (high half), so `w << 16` is the even values
   as float32 and `w & 0xffff0000` the odd ones, multiplied by x's even and odd values
   (xe, xo: x de-interleaved once per call). */

static float dot_row_f32(const float *w, long n, const float *x) {
    long k = 0;
#ifdef __AVX512F__
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
    for (; k + 64 <= n; k += 64) {
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(w + k + AHEAD / 4 + 16 * line), _MM_HINT_T0);
        b0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), b0);
        b1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), b1);
        b2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), b2);
        b3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), b3);
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3)));
    __m256 a0 = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    s += hsum8(a0);
#else
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= n; k += 32) {
        _mm_prefetch((const char *)(w + k + AHEAD / 4), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + AHEAD / 4 + 16), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= n; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
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
    long k = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
    for (; k + 64 <= n; k += 64) {
        _mm_prefetch((const char *)(w + k + AHEAD / 2), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + AHEAD / 2 + 32), _MM_HINT_T0);
        __m512i v0 = _mm512_loadu_si512((const void *)(w + k));
        __m512i v1 = _mm512_loadu_si512((const void *)(w + k + 32));
        b0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), _mm512_loadu_ps(xe + k / 2), b0);
        b1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v0, odd)), _mm512_loadu_ps(xo + k / 2), b1);
        b2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), _mm512_loadu_ps(xe + k / 2 + 16), b2);
        b3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v1, odd)), _mm512_loadu_ps(xo + k / 2 + 16), b3);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3)));
#endif
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= n; k += 32) {
        _mm_prefetch((const char *)(w + k + AHEAD / 2), _MM_HINT_T0);
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
    s += hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < n; k++) s += bf16_to_f32(w[k]) * x[k];
    return s;
}

/* ---------------------------------------------------------------------------------
   Linear layer for one token: y = W x + b, W (rows, n) row-major.

   mode 0: y = W x + b;  mode 1: y += W x + b (a residual connection).
   bias may be NULL. x, y, bias: float32; W: a qkv_mat of any type.
   Called by every thread of a parallel region; the rows are shared out in one
   contiguous range per thread. For bfloat16 each thread de-interleaves x itself
   (n floats: cheaper than a barrier). */

#define STORE 0
#define ADD 1

/* Every product opens with it, on every thread: it also tells quant.c that x may have
   changed since its last product (block matrices quantize x once per product). */
#define DEINTERLEAVE(x, n, need)                                                          \
    float xe[(need) ? n / 2 + 1 : 1], xo[(need) ? n / 2 + 1 : 1];                        \
    qkv_quant_forget_x();                                                                 \
    if (need)                                                                             \
        for (long k_ = 0; k_ + 1 < n; k_ += 2) {                                          \
            xe[k_ / 2] = x[k_];                                                           \
            xo[k_ / 2] = x[k_ + 1];                                                       \
        }

static inline float dot_row(const qkv_mat *W, long r, long n, const float *x, const float *xe,
                            const float *xo) {
    if (W->type == QKV_BF16) return dot_row_bf16((const uint16_t *)W->data + r * n, n, x, xe, xo);
    if (W->type == QKV_F32) return dot_row_f32((const float *)W->data + r * n, n, x);
    return qkv_quant_dot_row(W, r, n, x);
}

/* Row r of W (n values) as float32 (a quantized embedding expands only this row). */
static void row_to_f32(const qkv_mat *W, long r, long n, float *y) {
    if (qkv_is_quantized(W->type)) {
        qkv_dequantize_row(W, r, n, y);
        return;
    }
    for (long i = 0; i < n; i++) y[i] = load1(W->data, r * n + i, W->type);
}

static void linear_shared(const qkv_mat *W, const float *x, const float *bias, float *y,
                          long rows, long n, int mode) {
    DEINTERLEAVE(x, n, W->type == QKV_BF16)
#pragma omp for schedule(static)
    for (long r = 0; r < rows; r++) {
        float v = dot_row(W, r, n, x, xe, xo) + (bias ? bias[r] : 0.0f);
        if (mode == ADD)
            y[r] += v;
        else
            y[r] = v;
    }
}

void qkv_linear(const qkv_mat *W, const float *x, const float *bias, float *y, long rows,
                long n, int mode, int threads) {
#pragma omp parallel num_threads(threads)
    linear_shared(W, x, bias, y, rows, n, mode);
}

/* The MLP's first half for one token, f (rows) from x (n):
     act(W_1 x + b_1)                      without W_2 (GPT-2's MLP)
     act(W_1 x + b_1) * (W_2 x + b_2)      with W_2 (gated: SwiGLU, GeGLU)
   Row r of both matrices is read in the same pass, so each thread streams its share of
   the two once. W2->data NULL: no gate. */
static void gated_shared(const qkv_mat *W1, const float *b1, const qkv_mat *W2,
                         const float *b2, const float *x, float *f, long rows, long n, int act) {
    const int gate = W2->data != NULL;
    DEINTERLEAVE(x, n, W1->type == QKV_BF16 || (gate && W2->type == QKV_BF16))
#pragma omp for schedule(static)
    for (long r = 0; r < rows; r++) {
        float g = activate(dot_row(W1, r, n, x, xe, xo) + (b1 ? b1[r] : 0.0f), act);
        if (gate) g *= dot_row(W2, r, n, x, xe, xo) + (b2 ? b2[r] : 0.0f);
        f[r] = g;
    }
}

void qkv_gated(const qkv_mat *W1, const float *b1, const qkv_mat *W2, const float *b2,
               const float *x, float *f, long rows, long n, int act, int threads) {
#pragma omp parallel num_threads(threads)
    gated_shared(W1, b1, W2, b2, x, f, rows, n, act);
}

/* ---------------------------------------------------------------------------------
   Norms of one vector, float32 throughout (sums in double), y may be x.

   LayerNorm: (x - mean) / sqrt(var + eps) * scale + shift (biased variance, as
   F.layer_norm). RMSNorm: x / sqrt(mean(x^2) + eps) * scale; Gemma's 1 + w is passed in
   as its scale. */

#define NORM_NONE 0
#define NORM_LAYER 1
#define NORM_RMS 2

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

void qkv_rms_norm(const float *x, const float *scale, float *y, long n, float eps) {
    double squares = 0.0;
    for (long i = 0; i < n; i++) squares += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(squares / (double)n + (double)eps));
    for (long i = 0; i < n; i++) y[i] = x[i] * inv * scale[i];
}

typedef struct {
    int kind; /* NORM_NONE, NORM_LAYER, NORM_RMS */
    float eps;
    const float *scale, *shift; /* float32; shift for LayerNorm only */
} qkv_norm;

static void norm(const qkv_norm *nm, const float *x, float *y, long n) {
    if (nm->kind == NORM_LAYER)
        qkv_layer_norm(x, nm->scale, nm->shift, y, n, nm->eps);
    else if (nm->kind == NORM_RMS)
        qkv_rms_norm(x, nm->scale, y, n, nm->eps);
    else if (x != y)
        memcpy(y, x, (size_t)n * sizeof *y);
}

/* Row `token` of tok (times scale) plus, where the model has them (pos->data not NULL),
   row `position` of pos -> float32 y (n). */
void qkv_embed(const qkv_mat *tok, long token, const qkv_mat *pos, long position, float scale,
               float *y, long n) {
    row_to_f32(tok, token, n, y);
    for (long i = 0; i < n; i++) y[i] *= scale;
    if (pos->data) {
        float p[n];
        row_to_f32(pos, position, n, p);
        for (long i = 0; i < n; i++) y[i] += p[i];
    }
}

/* Rotary position embedding, "rotate half" layout, in place on `heads` vectors of hd:
   dimension i pairs with i + hd / 2; cos, sin: the position's row (hd) of the table. */
void qkv_rope(float *x, const float *cos, const float *sin, long heads, long hd) {
    const long half = hd / 2;
    for (long h = 0; h < heads; h++) {
        float *v = x + h * hd;
        for (long i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* ---------------------------------------------------------------------------------
   Attention of one new token over a layer's cache.

   q: heads * hd; k, v: kv_heads * hd (float32). K, V: the cache, (kv_heads, cache_len,
   hd) of dt. The new key and value go to `slot` (rounded to dt); query head h then
   attends, through key/value head h / (heads / kv_heads), to slots 0 .. n - 1:
   out_h = softmax(q_h . K[0..n) * scale) V[0..n). A full cache has slot = pos and
   n = pos + 1; a ring of W slots (a sliding window of W) has slot = pos % W and
   n = min(pos + 1, W): every slot it holds is in the new token's window, and attention
   does not care in which order they come. */

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

/* Write the new key and value (kv_heads * hd, float32) into slot `slot`, rounded to dt. */
static void store_kv(const float *k, const float *v, void *K, void *V, int dt, long kv_heads,
                     long hd, long cache_len, long slot) {
    const long stride = cache_len * hd;
    for (long g = 0; g < kv_heads; g++)
        for (long d = 0; d < hd; d++) {
            long i = g * stride + slot * hd + d;
            if (dt == QKV_BF16) {
                ((uint16_t *)K)[i] = f32_to_bf16(k[g * hd + d]);
                ((uint16_t *)V)[i] = f32_to_bf16(v[g * hd + d]);
            } else {
                ((float *)K)[i] = k[g * hd + d];
                ((float *)V)[i] = v[g * hd + d];
            }
        }
}

/* Every query head over slots 0 .. n - 1 of its key/value head, shared out by head. */
static void attend_heads_shared(const float *q, const void *K, const void *V, int dt,
                                float *out, long heads, long kv_heads, long hd,
                                long cache_len, long n, float scale, float *scores) {
    const long group = heads / kv_heads, stride = cache_len * hd;
#pragma omp for schedule(static)
    for (long h = 0; h < heads; h++) {
        const long base = (h / group) * stride;
        float *s = scores + h * n, *o = out + h * hd;
        const float *qh = q + h * hd;
        float m = -INFINITY;
        for (long p = 0; p < n; p++) {
            s[p] = dot_hd(qh, K, base + p * hd, hd, dt) * scale;
            if (s[p] > m) m = s[p];
        }
        float total = 0.0f;
        for (long p = 0; p < n; p++) {
            s[p] = expf(s[p] - m);
            total += s[p];
        }
        for (long d = 0; d < hd; d++) o[d] = 0.0f;
        for (long p = 0; p < n; p++) axpy_hd(s[p] / total, V, base + p * hd, o, hd, dt);
    }
}

void qkv_attend(const float *q, const float *k, const float *v, void *K, void *V, int dt,
                float *out, long heads, long kv_heads, long head_dim, long cache_len,
                long slot, long n, float scale, float *scores, int threads) {
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        store_kv(k, v, K, V, dt, kv_heads, head_dim, cache_len, slot);
        attend_heads_shared(q, K, V, dt, out, heads, kv_heads, head_dim, cache_len, n, scale,
                            scores);
    }
}

/* ---------------------------------------------------------------------------------
   A whole step of a qkv.models.gpt.GPTModel. With x the residual stream (float32):

     x = tok_emb[token] * embed_scale (+ pos_emb[pos])
     per layer:
       h = norm1(x);  q, k, v = W_q h (+b), W_k h (+b), W_v h (+b)
       q, k = q_norm, k_norm per head (QK-norm);  rotate q, k at pos (RoPE)
       write k, v into the cache;  a = attention over the cache (GQA: see above)
       o = W_o a (+b);  o = post_norm1(o);  x += o
       h = norm2(x);  f = act(W_1 h (+b)) [* (W_2 h (+b))];  o = W_3 f (+b)
       o = post_norm2(o);  x += o
     logits = W_head final_norm(x)

   Each optional piece is absent when its pointer is NULL or its norm kind NORM_NONE.
   The structs mirror qkv.kernels' ctypes declarations field for field. */

typedef struct {
    qkv_mat wq, wk, wv, wo, w1, w2, w3;            /* (out, in); w2.data NULL: no gate */
    const float *bq, *bk, *bv, *bo, *b1, *b2, *b3; /* float32 or NULL */
    qkv_norm norm1, norm2, post_norm1, post_norm2, q_norm, k_norm;
    const float *rope_cos, *rope_sin; /* (rope_len, head_dim) float32, or NULL */
    void *keys, *values;              /* the layer's cache (dt, (kv_heads, cache_len, hd)) */
    long cache_len;
    int ring; /* the cache is a ring of cache_len slots (a sliding window) */
} qkv_layer;

typedef struct {
    int dt; /* the caches' dtype */
    int n_layers, act;
    long dim, hidden, heads, kv_heads, head_dim, vocab;
    float scale, embed_scale;
    qkv_mat tok_emb, pos_emb, head; /* (vocab, dim), (context, dim) or data NULL, (vocab, dim) */
    qkv_norm final_norm;
    const qkv_layer *layers;
    /* float32 work buffers: x, o (dim); h (dim); q, a (heads * hd); k, v (kv_heads * hd);
       f (hidden); logits (vocab); scores (heads * the longest cache) */
    float *x, *o, *h, *q, *k, *v, *a, *f, *logits, *scores;
} qkv_model;

/* q, k, v = W_q x (+b), W_k x (+b), W_v x (+b) as one work-shared loop over the rows of
   all three: one barrier where three separate products would need three. */
static void project_qkv_shared(const qkv_layer *L, const float *x, float *q, float *k,
                               float *v, long qd, long kvd, long n) {
    DEINTERLEAVE(x, n, L->wq.type == QKV_BF16 || L->wk.type == QKV_BF16 || L->wv.type == QKV_BF16)
#pragma omp for schedule(static)
    for (long r = 0; r < qd + 2 * kvd; r++) {
        const qkv_mat *W = &L->wq;
        const float *b = L->bq;
        float *y = q;
        long i = r;
        if (r >= qd + kvd) {
            W = &L->wv, b = L->bv, y = v, i = r - qd - kvd;
        } else if (r >= qd) {
            W = &L->wk, b = L->bk, y = k, i = r - qd;
        }
        y[i] = dot_row(W, i, n, x, xe, xo) + (b ? b[i] : 0.0f);
    }
}

/* x += o, through norm first when there is one (Gemma's post-norms). */
static void add_branch(const qkv_norm *post, float *o, float *x, long n) {
    norm(post, o, o, n);
    for (long i = 0; i < n; i++) x[i] += o[i];
}

void qkv_step(const qkv_model *m, long token, long pos, int threads) {
    const long d = m->dim, hd = m->head_dim, qd = m->heads * hd, kvd = m->kv_heads * hd;
    const int dt = m->dt;
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        qkv_embed(&m->tok_emb, token, &m->pos_emb, pos, m->embed_scale, m->x, d);
        for (int l = 0; l < m->n_layers; l++) {
            const qkv_layer *L = &m->layers[l];
#pragma omp single
            norm(&L->norm1, m->x, m->h, d);
            project_qkv_shared(L, m->h, m->q, m->k, m->v, qd, kvd, d);
            const long slot = L->ring ? pos % L->cache_len : pos;
            const long n = L->ring && pos + 1 > L->cache_len ? L->cache_len : pos + 1;
#pragma omp single
            {
                if (L->q_norm.kind != NORM_NONE)
                    for (long h = 0; h < m->heads; h++) norm(&L->q_norm, m->q + h * hd, m->q + h * hd, hd);
                if (L->k_norm.kind != NORM_NONE)
                    for (long h = 0; h < m->kv_heads; h++) norm(&L->k_norm, m->k + h * hd, m->k + h * hd, hd);
                if (L->rope_cos) {
                    qkv_rope(m->q, L->rope_cos + pos * hd, L->rope_sin + pos * hd, m->heads, hd);
                    qkv_rope(m->k, L->rope_cos + pos * hd, L->rope_sin + pos * hd, m->kv_heads, hd);
                }
                store_kv(m->k, m->v, L->keys, L->values, dt, m->kv_heads, hd, L->cache_len, slot);
            }
            attend_heads_shared(m->q, L->keys, L->values, dt, m->a, m->heads, m->kv_heads, hd,
                                L->cache_len, n, m->scale, m->scores);
            if (L->post_norm1.kind == NORM_NONE) {
                linear_shared(&L->wo, m->a, L->bo, m->x, d, qd, ADD);
            } else {
                linear_shared(&L->wo, m->a, L->bo, m->o, d, qd, STORE);
#pragma omp single
                add_branch(&L->post_norm1, m->o, m->x, d);
            }
#pragma omp single
            norm(&L->norm2, m->x, m->h, d);
            gated_shared(&L->w1, L->b1, &L->w2, L->b2, m->h, m->f, m->hidden, d, m->act);
            if (L->post_norm2.kind == NORM_NONE) {
                linear_shared(&L->w3, m->f, L->b3, m->x, d, m->hidden, ADD);
            } else {
                linear_shared(&L->w3, m->f, L->b3, m->o, d, m->hidden, STORE);
#pragma omp single
                add_branch(&L->post_norm2, m->o, m->x, d);
            }
        }
#pragma omp single
        norm(&m->final_norm, m->x, m->h, d);
        linear_shared(&m->head, m->h, NULL, m->logits, m->vocab, d, STORE);
    }
}
