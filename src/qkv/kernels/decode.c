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
   SiLU/GELU MLPs, post-norms, sliding-window layers on ring caches, scaled embeddings),
   and the layer kinds of 2025-26, chosen per layer: attention sinks, gated outputs
   with partial RoPE, NoPE layers, KV sharing, multi-head latent attention (absorbed)
   and DeepSeek's sparse attention, Gated DeltaNet, mixtures of experts, and Gemma 4's
   values taken from the keys, value norms, per-layer inputs, layer scalars,
   soft-capped logits and dense MLPs beside experts. Each of these was designed to read fewer bytes per token, and
   the kernels read only those: the latent cache once for all heads, the selected
   latents, the chosen experts' rows, one row of the per-layer input table.

   The caller (Python, through ctypes) owns every buffer. dtype codes: 0 = float32,
   1 = bfloat16. Each weight matrix carries its own type (a qkv_mat), so one model may
   mix them; the activations and the caches' dtype are the model's. A weight may also be
   kept in one of GGML's quantized block types (quant.c computes its products). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
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

   Built with QKV_PREFETCH=1 (qkv.kernels.flags(): on Intel CPUs), each loop asks for
   the cache lines AHEAD bytes further on (the rest of this row, then the next, which
   follows it in memory). There the hardware prefetcher alone kept fewer lines in
   flight: on a 2-core Xeon with AVX-512 this took SmolLM2-135M's steps from 90 to 93 %
   of the read bandwidth in float32 and from 85 to 91 % in bfloat16. On a 2-core AMD
   EPYC (AVX-512) the same requests made the steps slower, not faster: a 370 M Llama
   decoded 1.14x faster in float32 and 1.17x in bfloat16 without them (medians of
   interleaved rounds), so elsewhere the loops leave prefetching to the hardware. */

#define AHEAD 2048 /* bytes */
#if QKV_PREFETCH
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) ((void)0)
#endif
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
            PREFETCH(w + k + AHEAD / 4 + 16 * line);
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
        PREFETCH(w + k + AHEAD / 4);
        PREFETCH(w + k + AHEAD / 4 + 16);
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
        PREFETCH(w + k + AHEAD / 2);
        PREFETCH(w + k + AHEAD / 2 + 32);
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
        PREFETCH(w + k + AHEAD / 2);
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

/* Rotary position embedding, "rotate half" layout, in place on `heads` vectors of
   `stride` values: the first rd of each turn (dimension i pairs with i + rd / 2), the
   rest pass (partial RoPE, Qwen3-Next's); cos, sin: the position's row (rd) of a table
   built for an rd-wide head. */
static void rope_heads(float *x, const float *cos, const float *sin, long heads, long stride,
                       long rd) {
    const long half = rd / 2;
    for (long h = 0; h < heads; h++) {
        float *v = x + h * stride;
        for (long i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* Every dimension of each of `heads` vectors of hd turns. */
void qkv_rope(float *x, const float *cos, const float *sin, long heads, long hd) {
    rope_heads(x, cos, sin, heads, hd, hd);
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

/* q . K[off .. off + hd), four sums side by side: one chain of dependent multiply-adds
   would wait out each one's latency, and a score is this dot product per head and
   cached position. */
static float dot_hd(const float *q, const void *K, long off, long hd, int dt) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long d = 0;
    for (; d + 32 <= hd; d += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(K, off + d, dt), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(K, off + d + 8, dt), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 16), load8(K, off + d + 16, dt), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 24), load8(K, off + d + 24, dt), a3);
    }
    for (; d + 8 <= hd; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(K, off + d, dt), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
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

/* Every query head over slots 0 .. n - 1 of its key/value head, shared out by head.
   sinks (heads, or NULL): head h's softmax has one more logit, sinks[h], with no value
   behind it (gpt-oss), so its weights over the slots sum to less than one. gate (heads
   * hd, or NULL): each output value is then scaled by sigmoid(gate) (Qwen3-Next's
   gated attention). */
static void attend_heads_shared(const float *q, const void *K, const void *V, int dt,
                                float *out, long heads, long kv_heads, long hd,
                                long cache_len, long n, float scale, const float *sinks,
                                const float *gate, float *scores) {
    const long group = heads / kv_heads, stride = cache_len * hd;
#pragma omp for schedule(static)
    for (long h = 0; h < heads; h++) {
        const long base = (h / group) * stride;
        float *s = scores + h * n, *o = out + h * hd;
        const float *qh = q + h * hd;
        float m = sinks ? sinks[h] : -INFINITY;
        for (long p = 0; p < n; p++) {
            s[p] = dot_hd(qh, K, base + p * hd, hd, dt) * scale;
            if (s[p] > m) m = s[p];
        }
        float total = sinks ? expf(sinks[h] - m) : 0.0f;
        for (long p = 0; p < n; p++) {
            s[p] = expf(s[p] - m);
            total += s[p];
        }
        for (long d = 0; d < hd; d++) o[d] = 0.0f;
        for (long p = 0; p < n; p++) axpy_hd(s[p] / total, V, base + p * hd, o, hd, dt);
        if (gate)
            for (long d = 0; d < hd; d++) o[d] *= 1.0f / (1.0f + expf(-gate[h * hd + d]));
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
                            NULL, NULL, scores);
    }
}

/* Attention over a cache without writing to it (a KV-sharing layer reads its source
   layer's), with sinks and gate as attend_heads_shared takes them (NULL: none). */
void qkv_attend_cached(const float *q, const void *K, const void *V, int dt, float *out,
                       long heads, long kv_heads, long head_dim, long cache_len, long n,
                       float scale, const float *sinks, const float *gate, float *scores,
                       int threads) {
#pragma omp parallel num_threads(threads)
    attend_heads_shared(q, K, V, dt, out, heads, kv_heads, head_dim, cache_len, n, scale,
                        sinks, gate, scores);
}

/* y += a * row r of W (n values). */
static void axpy_row(const qkv_mat *W, long r, long n, float a, float *y) {
    if (W->type == QKV_F32 || W->type == QKV_BF16) {
        axpy_hd(a, W->data, r * n, y, n, W->type);
    } else {
        float w[n];
        row_to_f32(W, r, n, w);
        for (long i = 0; i < n; i++) y[i] += a * w[i];
    }
}

/* ---------------------------------------------------------------------------------
   Mixture of experts for one token (qkv.models.moe.MoE).

   route: logits = W_router x (+b), E of them (float32, whatever the weights' dtype);
     scores = softmax(logits) or sigmoid(logits);  choice = scores (+ correction bias);
     with n_group > 1 each group of E / n_group experts is scored by the sum of its two
     best choices and only the topk_group best groups stay candidates;
     the top_k candidates by choice, weighted by their *scores* (divided by their sum
     with norm_topk), times `scaling`.
   experts: out = sum_j w_j (D_j glu(G_j x + bg_j, U_j x + bu_j) + bd_j)
     (+ s * shared expert, s = sigmoid(w_sg . x) with a shared gate, else 1).

   The experts live in two 3-D tensors, as qkv's Experts keeps them: gate_up (E, 2I, d),
   expert e's gate rows e 2I .. e 2I + I - 1 then its up rows; down (E, I, d), input
   rows first (the transpose of nn.Linear's), expert e's rows e I .. e I + I - 1, so
   its output is sum_i h_i down[e I + i, :]. Only the chosen experts' rows are read, so
   a token streams the active parameters, not all of them. The shared expert's three
   matrices are separate nn.Linear weights (S, d), (S, d), (d, S). */

#define SCORE_SOFTMAX 0
#define SCORE_SIGMOID 1

#define GLU_SWIGLU 0  /* silu(g) u */
#define GLU_GEGLU 1   /* gelu_tanh(g) u */
#define GLU_CLAMPED 2 /* gpt-oss: g <= limit, |u| <= limit, (u + 1) g sigmoid(alpha g) */

typedef struct {
    int experts, top_k, score, norm_topk, n_group, topk_group, glu;
    long width, shared_width; /* I, and S (0: no shared expert) */
    float scaling, alpha, limit;
    qkv_mat router;                          /* (E, d) */
    const float *router_bias, *choice_bias;  /* (E,) float32 or NULL */
    qkv_mat gate_up, down;                   /* (E, 2I, d), (E, I, d) */
    const float *gate_up_bias, *down_bias;   /* (E, 2I), (E, d) float32 or NULL */
    qkv_mat shared1, shared2, shared3;       /* gate (S, d), up (S, d), down (d, S) */
    const float *shared_b1, *shared_b2, *shared_b3;
    qkv_mat shared_gate;                     /* (1, d), or data NULL */
    /* float32 work buffers: logits (E + 1), weights (top_k), hidden (top_k I + S);
       chosen (top_k) int32 */
    float *logits, *weights, *hidden;
    int *chosen;
    /* Gemma 4's router (NULL: none): it scores rms_norm(r) * router_scale / sqrt(d), r
       what it routes (router_eps the norm's epsilon; into `route`, d float32), and each
       chosen weight is then multiplied by expert_scale[expert] */
    const float *router_scale, *expert_scale; /* (d,), (E,) float32 or NULL */
    float router_eps;
    float *route;
    float *partial; /* (threads, d) float32: each thread's sum of the routed down rows */
} qkv_moe;

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

static inline float glu(float g, float u, const qkv_moe *e) {
    if (e->glu == GLU_SWIGLU) return silu(g) * u;
    if (e->glu == GLU_GEGLU) return gelu_tanh(g) * u;
    g = fminf(g, e->limit);
    u = fminf(fmaxf(u, -e->limit), e->limit);
    return (u + 1.0f) * g * sigmoidf(e->alpha * g);
}

/* The routing above, from e->logits (E router logits) into e->chosen, e->weights.
   Exported (serial) for the tests. */
void qkv_route(const qkv_moe *e) {
    const int E = e->experts, size = E / e->n_group;
    float scores[E], choice[E];
    if (e->score == SCORE_SOFTMAX) {
        float mx = -INFINITY, total = 0.0f;
        for (int i = 0; i < E; i++) mx = fmaxf(mx, e->logits[i]);
        for (int i = 0; i < E; i++) total += scores[i] = expf(e->logits[i] - mx);
        for (int i = 0; i < E; i++) scores[i] /= total;
    } else {
        for (int i = 0; i < E; i++) scores[i] = sigmoidf(e->logits[i]);
    }
    for (int i = 0; i < E; i++) choice[i] = scores[i] + (e->choice_bias ? e->choice_bias[i] : 0.0f);
    if (e->n_group > 1) { /* hide every expert of all but the topk_group best groups */
        float group[e->n_group];
        for (int g = 0; g < e->n_group; g++) {
            float a = -INFINITY, b = -INFINITY; /* the two best of the group */
            for (int i = g * size; i < (g + 1) * size; i++) {
                if (choice[i] > a) b = a, a = choice[i];
                else if (choice[i] > b) b = choice[i];
            }
            group[g] = a + b;
        }
        int kept[e->n_group];
        memset(kept, 0, sizeof kept);
        for (int t = 0; t < e->topk_group; t++) {
            int best = -1;
            for (int g = 0; g < e->n_group; g++)
                if (!kept[g] && (best < 0 || group[g] > group[best])) best = g;
            kept[best] = 1;
        }
        for (int i = 0; i < E; i++)
            if (!kept[i / size]) choice[i] = -INFINITY;
    }
    float total = 0.0f;
    for (int j = 0; j < e->top_k; j++) { /* the best remaining candidate, k times */
        int best = -1;
        for (int i = 0; i < E; i++) {
            int taken = 0;
            for (int t = 0; t < j; t++) taken |= e->chosen[t] == i;
            if (!taken && (best < 0 || choice[i] > choice[best])) best = i;
        }
        e->chosen[j] = best;
        total += e->weights[j] = scores[best];
    }
    for (int j = 0; j < e->top_k; j++) {
        e->weights[j] = (e->norm_topk ? e->weights[j] / total : e->weights[j]) * e->scaling;
        if (e->expert_scale) e->weights[j] *= e->expert_scale[e->chosen[j]];
    }
}

/* One expert the token runs through: its three matrices, the first row of each it
   reads, biases (NULL or at their first row), width and weight. A routed expert's down
   rows are its inputs ((I, d) rows, d0 its first), the shared expert's its outputs
   ((d, S), nn.Linear's). */
typedef struct {
    const qkv_mat *gate, *up, *down;
    long g0, u0, d0, width, offset; /* offset: where its hidden values start */
    const float *bg, *bu, *bd;
    float weight;
} active_expert;

static int active_experts(const qkv_moe *e, long d, active_expert *a) {
    const long I = e->width;
    int n = 0;
    for (int j = 0; j < e->top_k; j++) {
        const long x = e->chosen[j];
        const float *bgu = e->gate_up_bias ? e->gate_up_bias + x * 2 * I : NULL;
        a[n++] = (active_expert){&e->gate_up, &e->gate_up, &e->down, x * 2 * I, x * 2 * I + I,
                                 x * I, I, j * I, bgu, bgu ? bgu + I : NULL,
                                 e->down_bias ? e->down_bias + x * d : NULL, e->weights[j]};
    }
    if (e->shared_width) {
        float s = e->shared_gate.data ? sigmoidf(e->logits[e->experts]) : 1.0f;
        a[n++] = (active_expert){&e->shared1, &e->shared2, &e->shared3, 0, 0, 0,
                                 e->shared_width, e->top_k * I, e->shared_b1, e->shared_b2,
                                 e->shared_b3, s};
    }
    return n;
}

/* y = (or +=, mode ADD) the experts' output for x (d), routed by route_x (d; NULL: by
   x itself). Called by every thread. */
static void moe_shared(const qkv_moe *e, const float *x, float *y, long d, int mode,
                       const float *route_x) {
    const float *r = route_x ? route_x : x;
    if (e->router_scale) {
#pragma omp single
        {
            qkv_rms_norm(r, e->router_scale, e->route, d, e->router_eps);
            const float down = 1.0f / sqrtf((float)d);
            for (long i = 0; i < d; i++) e->route[i] *= down;
        }
        r = e->route;
    }
    linear_shared(&e->router, r, e->router_bias, e->logits, e->experts, d, STORE);
    if (e->shared_gate.data) linear_shared(&e->shared_gate, x, NULL, e->logits + e->experts, 1, d, STORE);
#pragma omp single
    qkv_route(e);
    active_expert a[e->top_k + 1]; /* each thread lists them itself: no barrier */
    const int n = active_experts(e, d, a);
    const long rows = e->top_k * e->width + e->shared_width;
    /* every active expert's gate and up rows in one work-shared loop */
    {
        const int need = e->gate_up.type == QKV_BF16 ||
                         (e->shared_width && (e->shared1.type == QKV_BF16 || e->shared2.type == QKV_BF16));
        DEINTERLEAVE(x, d, need)
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            int j = 0;
            while (j + 1 < n && r >= a[j + 1].offset) j++;
            const long i = r - a[j].offset;
            float g = dot_row(a[j].gate, a[j].g0 + i, d, x, xe, xo) + (a[j].bg ? a[j].bg[i] : 0.0f);
            float u = dot_row(a[j].up, a[j].u0 + i, d, x, xe, xo) + (a[j].bu ? a[j].bu[i] : 0.0f);
            e->hidden[r] = glu(g, u, e);
        }
    }
    /* then the down projections, weighted, into y. The routed experts' are (I, d), input
       rows first: each thread takes one contiguous share of all their rows and adds each
       row, times its weight w_j h_i, into a d-wide sum of its own (`partial`), so that
       it reads its share as one stream, as the other products do. (Splitting y's
       outputs instead had each thread read half of every row: two streams interleaved
       within each row.) After a barrier each thread adds up the threads' sums for its
       share [c0, c1) of the outputs, with the biases and the shared expert, whose
       (d, S) matrix it reads by rows. */
    const long t = omp_get_thread_num(), T = omp_get_num_threads();
    const long I = e->width, routed = (long)e->top_k * I;
    float *mine = e->partial + t * d;
    for (long c = 0; c < d; c++) mine[c] = 0.0f;
    for (long r = routed * t / T; r < routed * (t + 1) / T; r++) {
        const long j = r / I, i = r - j * I;
        axpy_row(a[j].down, a[j].d0 + i, d, a[j].weight * e->hidden[r], mine);
    }
#pragma omp barrier
    const long c0 = d * t / T, c1 = d * (t + 1) / T;
    const float *h_shared = e->hidden + routed;
    {
        DEINTERLEAVE(h_shared, e->shared_width, e->shared_width && e->shared3.type == QKV_BF16)
        for (long c = c0; c < c1; c++) {
            float v = 0.0f;
            for (long u = 0; u < T; u++) v += e->partial[u * d + c];
            for (int j = 0; j < e->top_k; j++)
                if (a[j].bd) v += a[j].weight * a[j].bd[c];
            if (e->shared_width) {
                const active_expert *s = &a[n - 1];
                v += s->weight * (dot_row(s->down, c, s->width, h_shared, xe, xo)
                                  + (s->bd ? s->bd[c] : 0.0f));
            }
            y[c] = mode == STORE ? v : y[c] + v;
        }
    }
#pragma omp barrier
}

void qkv_moe_forward(const qkv_moe *e, const float *x, float *y, long d, int mode, int threads) {
#pragma omp parallel num_threads(threads)
    moe_shared(e, x, y, d, mode, NULL);
}

/* ---------------------------------------------------------------------------------
   Multi-head latent attention for one token, in the absorbed form (DeepSeek-V2/V3,
   qkv.latent_attention.LatentAttention), and DeepSeek's sparse attention (V3.2).

   With h heads, r = kv_lora_rank, dn, dr, dv the head widths (nope, RoPE, value):
     c_q = RMSNorm(W_qa x (+b))            (or none: q = W_q x)
     [q_n,i ; q_r,i] = W_qb c_q            q_r,i rotated at pos
     [c ; k_r] = W_kva x (+b);  c = RMSNorm(c);  k_r rotated;  cache[pos] = [c ; k_r]
     q_c,i = W_UK,i^T q_n,i                (r wide; W_UK,i: rows i (dn + dv) .. + dn of W_kvb)
     s_i(u) = scale [q_c,i ; q_r,i] . cache[u]
     o_c,i = sum_u softmax_u(s_i(u)) c(u)  (r wide)
     o_i = W_UV,i o_c,i                    (dv; W_UV,i: rows i (dn + dv) + dn .. + dv)
     out = W_o [o_1 .. o_h] (+b)
   The cache holds [c ; k_r] only (r + dr per token), nothing is decompressed, and the
   cache is read once per step for all heads: the positions are shared out among the
   threads, each thread keeps every head's running softmax (max, sum, weighted sum of
   latents) over its positions, and the threads' partial results are merged at the end.

   Sparse (indexer present): per token the index key k^I = RoPE_half(LayerNorm(W_k^I x))
   is cached too; the index queries q^I_j = RoPE_half(W_q^I c_q) (H heads of dI), weights
   w_j = (W_w^I x)_j / sqrt(H); every cached position u gets
     I(u) = sum_j w_j ReLU(q^I_j . k^I(u) / sqrt(dI)),
   and attention reads only the latents of the index_topk positions of largest I(u). */

typedef struct {
    int heads, interleave; /* interleave: RoPE turns pairs (2i, 2i + 1) (DeepSeek's) */
    int threads;           /* the most threads `part` has room for */
    long rank, nope, rope, vdim, q_rank; /* r, dn, dr, dv; q_rank 0: one q_proj */
    float scale;
    qkv_mat wq_a, wq, wkv_a, wkv_b; /* (q_rank, d); (h (dn + dr), q_rank or d); (r + dr, d); (h (dn + dv), r) */
    const float *bq_a, *bkv_a;
    qkv_norm q_norm, kv_norm; /* RMSNorms of c_q and c */
    void *kv;                 /* the cache, (cache_len, r + dr) of the model's dtype */
    /* the indexer (index_heads 0: dense MLA) */
    long index_heads, index_dim, index_topk;
    qkv_mat iwq, iwk, iww; /* (H dI, q_rank), (dI, d), (H, d) */
    qkv_norm ik_norm;      /* LayerNorm of the index key */
    void *index_keys;      /* (cache_len, dI) */
    /* float32 work buffers: cq (q_rank), q (h (dn + dr)), ql (h (r + dr)), kvn (r + dr),
       oc (h r), part (threads h (r + 2)), o (h dv); iq (H dI), ik (dI), iw (H),
       iscore (cache_len); sel (index_topk) int32 */
    float *cq, *q, *ql, *kvn, *oc, *part, *o, *iq, *ik, *iw, *iscore;
    int *sel;
} qkv_latent;

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* RoPE on interleaved pairs (2i, 2i + 1) of one vector of rd; cos, sin: the position's
   row of the rd-wide table (its first half holds one angle per pair). */
static void rope_pairs(float *v, const float *cos, const float *sin, long rd) {
    for (long i = 0; i < rd / 2; i++) {
        float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos[i] - b * sin[i];
        v[2 * i + 1] = b * cos[i] + a * sin[i];
    }
}

/* Store float32 x (n) into row `slot` of a (rows, n) buffer of dt. */
static void store_row(const float *x, void *buf, int dt, long slot, long n) {
    for (long i = 0; i < n; i++) {
        if (dt == QKV_BF16)
            ((uint16_t *)buf)[slot * n + i] = f32_to_bf16(x[i]);
        else
            ((float *)buf)[slot * n + i] = x[i];
    }
}

/* y = (or +=) the layer's attention output for x (d) at pos, Wo/bo the output
   projection. cos, sin: the position's rows of the dr-wide RoPE table. */
/* The positions of the `count` largest of score (n), ties to the earliest, in position
   order, into sel. The count-th largest is found bit by bit on the scores' order-keeping
   integer keys (32 counting passes, not count passes of a maximum search: 8,192 cached
   positions and 2,048 chosen cost 0.26 M comparisons, not 17 M). */
static inline uint32_t order_key(float x) {
    uint32_t u;
    if (x == 0.0f) x = 0.0f; /* -0 ties with +0, as the scores compare */
    memcpy(&u, &x, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static void select_top(const float *score, long n, long count, int *sel) {
    uint32_t t = 0; /* the largest key that at least `count` scores reach */
    for (int bit = 31; bit >= 0; bit--) {
        const uint32_t candidate = t | (1u << bit);
        long reach = 0;
        for (long u = 0; u < n; u++) reach += order_key(score[u]) >= candidate;
        if (reach >= count) t = candidate;
    }
    long above = 0;
    for (long u = 0; u < n; u++) above += order_key(score[u]) > t;
    long ties = count - above, m = 0;
    for (long u = 0; u < n && m < count; u++) {
        const uint32_t key = order_key(score[u]);
        if (key > t || (key == t && ties-- > 0)) sel[m++] = (int)u;
    }
}

/* One head's running softmax over a tile of m <= LATENT_TILE cached latents (rows
   off[0..m) of kv, kw wide, of dt): Pi = [max, sum, acc (r)] over the positions so far.
   The scores of the tile first, then one rescale of acc and one pass over it for the
   whole tile: acc is read and written once per tile, not once per position (with 16 or
   128 heads of a 512-wide latent, every head's acc does not fit in L1 beside the row). */
#define LATENT_TILE 16
static void latent_tile(const float *q, const void *kv, const long *off, long m, long kw,
                        long r, float scale, int dt, float *Pi, float *s) {
    float top = Pi[0];
    for (long u = 0; u < m; u++) {
        s[u] = dot_hd(q, kv, off[u], kw, dt) * scale;
        if (s[u] > top) top = s[u];
    }
    const float f = Pi[0] == -INFINITY ? 0.0f : expf(Pi[0] - top);
    float total = 0.0f;
    for (long u = 0; u < m; u++) {
        s[u] = expf(s[u] - top);
        total += s[u];
    }
    Pi[0] = top, Pi[1] = Pi[1] * f + total;
    float *acc = Pi + 2;
    const __m256 fv = _mm256_set1_ps(f);
    long d = 0;
    for (; d + 8 <= r; d += 8) {
        __m256 a = _mm256_mul_ps(fv, _mm256_loadu_ps(acc + d));
        for (long u = 0; u < m; u++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(s[u]), load8(kv, off[u] + d, dt), a);
        _mm256_storeu_ps(acc + d, a);
    }
    for (; d < r; d++) {
        float a = f * acc[d];
        for (long u = 0; u < m; u++) a += s[u] * load1(kv, off[u] + d, dt);
        acc[d] = a;
    }
}

static void latent_shared(const qkv_latent *A, const qkv_mat *Wo, const float *bo,
                          const float *x, float *y, long d, long pos, const float *cos,
                          const float *sin, int dt, int mode) {
    const long h = A->heads, r = A->rank, dn = A->nope, dr = A->rope, dv = A->vdim;
    const long qw = dn + dr, kw = r + dr, n = pos + 1, H = A->index_heads, dI = A->index_dim;
    if (A->q_rank) linear_shared(&A->wq_a, x, A->bq_a, A->cq, A->q_rank, d, STORE);
    linear_shared(&A->wkv_a, x, A->bkv_a, A->kvn, kw, d, STORE);
    if (H) {
        linear_shared(&A->iwk, x, NULL, A->ik, dI, d, STORE);
        linear_shared(&A->iww, x, NULL, A->iw, H, d, STORE);
    }
#pragma omp single
    {
        if (A->q_rank) norm(&A->q_norm, A->cq, A->cq, A->q_rank);
        norm(&A->kv_norm, A->kvn, A->kvn, r);
        if (A->interleave)
            rope_pairs(A->kvn + r, cos, sin, dr);
        else
            rope_heads(A->kvn + r, cos, sin, 1, dr, dr);
        store_row(A->kvn, A->kv, dt, pos, kw);
        if (H) {
            norm(&A->ik_norm, A->ik, A->ik, dI);
            rope_heads(A->ik, cos, sin, 1, dI, dr);
            store_row(A->ik, A->index_keys, dt, pos, dI);
        }
    }
    linear_shared(&A->wq, A->q_rank ? A->cq : x, NULL, A->q, h * qw, A->q_rank ? A->q_rank : d,
                  STORE);
    if (H) linear_shared(&A->iwq, A->cq, NULL, A->iq, H * dI, A->q_rank, STORE);
    /* each head's query in latent coordinates, [q_c,i ; q_r,i] */
#pragma omp for schedule(static)
    for (long i = 0; i < h; i++) {
        float *q = A->q + i * qw, *ql = A->ql + i * kw;
        if (A->interleave)
            rope_pairs(q + dn, cos, sin, dr);
        else
            rope_heads(q + dn, cos, sin, 1, dr, dr);
        for (long j = 0; j < r; j++) ql[j] = 0.0f;
        for (long k = 0; k < dn; k++) axpy_row(&A->wkv_b, i * (dn + dv) + k, r, q[k], ql);
        memcpy(ql + r, q + dn, (size_t)dr * sizeof(float));
    }
    long count = n; /* the positions attention reads: 0 .. n - 1, or the selected ones */
    const int *sel = NULL;
    if (H) {
#pragma omp single
        for (long j = 0; j < H; j++) rope_heads(A->iq + j * dI, cos, sin, 1, dI, dr);
        const float qscale = 1.0f / sqrtf((float)dI), wscale = 1.0f / sqrtf((float)H);
#pragma omp for schedule(static)
        for (long u = 0; u < n; u++) {
            float s = 0.0f;
            for (long j = 0; j < H; j++) {
                float v = dot_hd(A->iq + j * dI, A->index_keys, u * dI, dI, dt) * qscale;
                s += A->iw[j] * wscale * (v > 0.0f ? v : 0.0f);
            }
            A->iscore[u] = s;
        }
        if (A->index_topk < n) { /* else every position is read, in order */
            count = A->index_topk;
#pragma omp single
            select_top(A->iscore, n, count, A->sel);
            sel = A->sel;
        }
    }
    /* attention: each thread its share of the positions, every head's running softmax,
       LATENT_TILE positions at a time */
    {
        const int nt = min_int(omp_get_num_threads(), A->threads), tid = omp_get_thread_num();
        const long lo = tid < nt ? count * tid / nt : 0, hi = tid < nt ? count * (tid + 1) / nt : 0;
        float *P = A->part + (long)tid * h * (r + 2);
        for (long i = 0; i < h; i++) {
            P[i * (r + 2)] = -INFINITY, P[i * (r + 2) + 1] = 0.0f;
            memset(P + i * (r + 2) + 2, 0, (size_t)r * sizeof(float));
        }
        long off[LATENT_TILE];
        float s[LATENT_TILE];
        for (long t0 = lo; t0 < hi; t0 += LATENT_TILE) {
            const long m = hi - t0 < LATENT_TILE ? hi - t0 : LATENT_TILE;
            for (long u = 0; u < m; u++) off[u] = (sel ? sel[t0 + u] : t0 + u) * kw;
            for (long i = 0; i < h; i++)
                latent_tile(A->ql + i * kw, A->kv, off, m, kw, r, A->scale, dt,
                            P + i * (r + 2), s);
        }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (long i = 0; i < h; i++) { /* merge the threads' partial softmaxes */
        const int nt = min_int(omp_get_num_threads(), A->threads);
        float M = -INFINITY, total = 0.0f, *oc = A->oc + i * r;
        for (int t = 0; t < nt; t++) M = fmaxf(M, A->part[((long)t * h + i) * (r + 2)]);
        for (long j = 0; j < r; j++) oc[j] = 0.0f;
        for (int t = 0; t < nt; t++) {
            const float *Pi = A->part + ((long)t * h + i) * (r + 2);
            if (Pi[0] == -INFINITY) continue;
            const float f = expf(Pi[0] - M);
            total += f * Pi[1];
            for (long j = 0; j < r; j++) oc[j] += f * Pi[2 + j];
        }
        for (long j = 0; j < r; j++) oc[j] /= total;
    }
    /* o_i = W_UV,i o_c,i: each head's value rows of W_kvb, with its own input */
    for (long i = 0; i < h; i++) {
        const float *oc = A->oc + i * r;
        DEINTERLEAVE(oc, r, A->wkv_b.type == QKV_BF16)
#pragma omp for schedule(static) nowait
        for (long k = 0; k < dv; k++)
            A->o[i * dv + k] = dot_row(&A->wkv_b, i * (dn + dv) + dn + k, r, oc, xe, xo);
    }
#pragma omp barrier
    linear_shared(Wo, A->o, bo, y, d, h * dv, mode);
}

/* ---------------------------------------------------------------------------------
   Gated DeltaNet for one token (Qwen3-Next's and Qwen3.5's linear attention,
   qkv.linear_attention.GatedDeltaNet). With Hk key heads of dk, Hv value heads of dv,
   C = 2 Hk dk + Hv dv channels and a K-tap convolution:
     m = W_qkv x (C);  z = W_z x (Hv dv);  b = W_b x, a = W_a x (Hv)
     m_c = silu(sum_j taps[c, j] window_j[c] + taps[c, K-1] m_c), the window then
       shifted by one with m (before the convolution) as its newest entry
     q, k, v = the three parts of m; q, k L2-normalised per head (eps inside the root),
       q times dk^-1/2
     g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)   (per value head)
     per value head j, on key head j / (Hv / Hk), with its state S (dk x dv, float32):
       S = exp(g) S;  S += k (beta (v - k^T S))^T;  o_j = q^T S
     o_j = w * o_j / rms(o_j) * silu(z_j)  (the gated RMSNorm)
     out = W_out o
   The state is float32 whatever the weights' dtype; the window holds the dtype's
   values, as the module path keeps it. */

typedef struct {
    int k_heads, v_heads, kernel;
    long k_dim, v_dim;
    float eps; /* the gated norm's */
    qkv_mat wqkv, wz, wb, wa, wout; /* (C, d), (Hv dv, d), (Hv, d), (Hv, d), (d_out, Hv dv) */
    const float *taps, *a_log, *dt_bias, *norm; /* float32: (C, K), (Hv), (Hv), (dv) */
    void *window; /* (K - 1, C) of the model's dtype: the last inputs */
    float *state; /* (Hv, dk, dv) float32 */
    /* float32 work buffers: m (C), z (Hv dv), b, a (Hv each), o (Hv dv) */
    float *m, *z, *b, *a, *o;
} qkv_deltanet;

static void l2_normalize(float *x, long n) {
    double squares = 0.0;
    for (long i = 0; i < n; i++) squares += (double)x[i] * x[i];
    const float inv = (float)(1.0 / sqrt(squares + 1e-6));
    for (long i = 0; i < n; i++) x[i] *= inv;
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void deltanet_shared(const qkv_deltanet *D, const float *x, float *y, long d,
                            long d_out, int dt, int mode) {
    const long Hk = D->k_heads, Hv = D->v_heads, dk = D->k_dim, dv = D->v_dim, K = D->kernel;
    const long key_dim = Hk * dk, C = 2 * key_dim + Hv * dv;
    linear_shared(&D->wqkv, x, NULL, D->m, C, d, STORE);
    linear_shared(&D->wz, x, NULL, D->z, Hv * dv, d, STORE);
    linear_shared(&D->wb, x, NULL, D->b, Hv, d, STORE);
    linear_shared(&D->wa, x, NULL, D->a, Hv, d, STORE);
    /* the short convolution, channel by channel, and the window moved on */
#pragma omp for schedule(static)
    for (long c = 0; c < C; c++) {
        const float *w = D->taps + c * K;
        float s = w[K - 1] * D->m[c];
        for (long j = 0; j < K - 1; j++) s += w[j] * load1(D->window, j * C + c, dt);
        for (long j = 0; j + 1 < K - 1; j++) { /* shift: entry j takes entry j + 1 */
            if (dt == QKV_BF16)
                ((uint16_t *)D->window)[j * C + c] = ((uint16_t *)D->window)[(j + 1) * C + c];
            else
                ((float *)D->window)[j * C + c] = ((float *)D->window)[(j + 1) * C + c];
        }
        if (K > 1) {
            if (dt == QKV_BF16)
                ((uint16_t *)D->window)[(K - 2) * C + c] = f32_to_bf16(D->m[c]);
            else
                ((float *)D->window)[(K - 2) * C + c] = D->m[c];
        }
        D->m[c] = silu(s);
    }
#pragma omp for schedule(static)
    for (long h = 0; h < Hk; h++) {
        l2_normalize(D->m + h * dk, dk);
        for (long i = 0; i < dk; i++) D->m[h * dk + i] /= sqrtf((float)dk);
        l2_normalize(D->m + key_dim + h * dk, dk);
    }
    /* the delta rule and the gated norm, value head by value head */
#pragma omp for schedule(static)
    for (long j = 0; j < Hv; j++) {
        const long kh = j / (Hv / Hk);
        const float *q = D->m + kh * dk, *k = D->m + key_dim + kh * dk;
        const float *v = D->m + 2 * key_dim + j * dv;
        float *S = D->state + j * dk * dv, *o = D->o + j * dv;
        const float decay = expf(-expf(D->a_log[j]) * softplus(D->a[j] + D->dt_bias[j]));
        const float beta = 1.0f / (1.0f + expf(-D->b[j]));
        float recalled[dv];
        for (long e = 0; e < dv; e++) recalled[e] = 0.0f;
        for (long i = 0; i < dk; i++) { /* S = decay S;  recalled = k^T S */
            float *row = S + i * dv;
            for (long e = 0; e < dv; e++) {
                row[e] *= decay;
                recalled[e] += k[i] * row[e];
            }
        }
        for (long e = 0; e < dv; e++) recalled[e] = beta * (v[e] - recalled[e]);
        for (long e = 0; e < dv; e++) o[e] = 0.0f;
        for (long i = 0; i < dk; i++) { /* S += k corr^T;  o = q^T S */
            float *row = S + i * dv;
            for (long e = 0; e < dv; e++) {
                row[e] += k[i] * recalled[e];
                o[e] += q[i] * row[e];
            }
        }
        double squares = 0.0;
        for (long e = 0; e < dv; e++) squares += (double)o[e] * o[e];
        const float inv = (float)(1.0 / sqrt(squares / (double)dv + (double)D->eps));
        for (long e = 0; e < dv; e++) o[e] = D->norm[e] * o[e] * inv * silu(D->z[j * dv + e]);
    }
    linear_shared(&D->wout, D->o, NULL, y, d_out, Hv * dv, mode);
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

   The attention of a layer is one of: the above with its variants (sinks, a gate, partial
   RoPE, no RoPE, another layer's cache: attention_shared), latent attention
   (latent_shared) or Gated DeltaNet (deltanet_shared); its MLP the dense one above or a
   mixture of experts (moe_shared). Heads and head sizes are per kind: the latent and
   DeltaNet layers carry their own.

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
    long heads, kv_heads, head_dim; /* this layer's (multi-head attention) */
    float scale;                    /* on q . k */
    const float *sinks; /* (heads,) float32: the sink logits (gpt-oss), or NULL */
    int gated;          /* wq is (2 heads hd, dim): each head's query, then its gate */
    int shared;         /* keys and values are an earlier layer's (wk, wv none; no store) */
    long rotary_dim;    /* the dimensions of each head RoPE turns (the first ones) */
    int act;  /* the dense MLP's activation */
    long hidden; /* the dense MLP's width */
    const qkv_moe *moe; /* a mixture of experts in place of the dense MLP, or NULL */
    const qkv_latent *latent; /* latent attention in place of wq .. wv and the KV cache */
    const qkv_deltanet *deltanet; /* Gated DeltaNet in their place, or NULL */
    int values_from_keys; /* wv none: the values are the keys' projection (Gemma 4) */
    qkv_norm v_norm;      /* on each value head, before it is stored (Gemma 4) */
    /* Gemma 4's per-layer input, added after the MLP (ple_gate.data NULL: none):
       x += ple_norm(ple_proj(gelu_tanh(ple_gate x) * p)), p this layer's slice of
       qkv_model's ple; then x *= *layer_scalar (NULL: none) */
    qkv_mat ple_gate, ple_proj; /* (width, dim), (dim, width) */
    qkv_norm ple_norm;
    const float *layer_scalar;
    /* Gemma 4's MLP with moe and w1 both set: the dense MLP and the experts side by side,
       post_dense_norm(dense(h)) + post_moe_norm(moe(moe_norm(x))), routed by x */
    qkv_norm post_dense_norm, moe_norm, post_moe_norm;
} qkv_layer;

typedef struct {
    int dt; /* the caches' dtype */
    int n_layers;
    long dim, vocab;
    float embed_scale;
    qkv_mat tok_emb, pos_emb, head; /* (vocab, dim), (context, dim) or data NULL, (vocab, dim) */
    qkv_norm final_norm;
    const qkv_layer *layers;
    /* float32 work buffers, sized for the widest layer: x, o (dim); h (dim); q (2 heads
       hd with gated layers, else heads hd); g, a (heads * hd); k, v (kv_heads * hd);
       f (the widest dense MLP); logits (vocab); scores (heads * the longest cache) */
    float *x, *o, *h, *q, *g, *k, *v, *a, *f, *logits, *scores;
    float logit_softcap; /* logits = c tanh(logits / c) (Gemma); 0: none */
    /* Gemma 4's per-layer inputs (ple_width 0: none): for the token, every layer's
       width-wide input, ple = (ple_norm(ple_proj(x) / sqrt(dim)) + ple_embed[token] *
       ple_embed_scale) / sqrt(2), each slice normalised on its own, from x the scaled
       embedding. Only the token's row of the big table is read. */
    qkv_mat ple_embed, ple_proj; /* (ple_vocab, n_layers width), (n_layers width, dim) */
    qkv_norm ple_norm;
    long ple_width, ple_vocab;
    float ple_embed_scale;
    float *ple, *ple_row, *ple_g; /* n_layers width, n_layers width, width */
    float *moe_x, *moe_y;         /* dim each: Gemma 4's experts' input and output */
} qkv_model;

/* q, k, v = W_q x (+b), W_k x (+b), W_v x (+b) as one work-shared loop over the rows of
   all three (qd, kvd and vd of them; 0 for a projection the layer lacks): one barrier
   where three separate products would need three. */
static void project_qkv_shared(const qkv_layer *L, const float *x, float *q, float *k,
                               float *v, long qd, long kvd, long vd, long n) {
    DEINTERLEAVE(x, n, L->wq.type == QKV_BF16 || L->wk.type == QKV_BF16 || L->wv.type == QKV_BF16)
#pragma omp for schedule(static)
    for (long r = 0; r < qd + kvd + vd; r++) {
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

/* Multi-head attention of one layer for the token at pos, with its variants: y = (or
   +=) W_o a (+b). Called by every thread. */
static void attention_shared(const qkv_model *m, const qkv_layer *L, long pos, float *y,
                             int mode) {
    const long d = m->dim, hd = L->head_dim, heads = L->heads, kv_heads = L->kv_heads;
    const long qd = heads * hd, kvd = kv_heads * hd;
    project_qkv_shared(L, m->h, m->q, m->k, m->v, L->gated ? 2 * qd : qd, L->shared ? 0 : kvd,
                       L->shared || L->values_from_keys ? 0 : kvd, d);
    const long slot = L->ring ? pos % L->cache_len : pos;
    const long n = L->ring && pos + 1 > L->cache_len ? L->cache_len : pos + 1;
#pragma omp single
    {
        if (L->gated) /* [q_h | g_h] per head -> q (heads hd), g (heads hd) */
            for (long h = 0; h < heads; h++) {
                memcpy(m->g + h * hd, m->q + (2 * h + 1) * hd, (size_t)hd * sizeof(float));
                memmove(m->q + h * hd, m->q + 2 * h * hd, (size_t)hd * sizeof(float));
            }
        if (L->values_from_keys && !L->shared) /* the keys' projection, before k_norm and RoPE */
            memcpy(m->v, m->k, (size_t)kvd * sizeof(float));
        if (L->q_norm.kind != NORM_NONE)
            for (long h = 0; h < heads; h++) norm(&L->q_norm, m->q + h * hd, m->q + h * hd, hd);
        if (L->v_norm.kind != NORM_NONE && !L->shared)
            for (long h = 0; h < kv_heads; h++) norm(&L->v_norm, m->v + h * hd, m->v + h * hd, hd);
        if (L->k_norm.kind != NORM_NONE && !L->shared)
            for (long h = 0; h < kv_heads; h++) norm(&L->k_norm, m->k + h * hd, m->k + h * hd, hd);
        if (L->rope_cos) {
            const long rd = L->rotary_dim;
            rope_heads(m->q, L->rope_cos + pos * rd, L->rope_sin + pos * rd, heads, hd, rd);
            if (!L->shared)
                rope_heads(m->k, L->rope_cos + pos * rd, L->rope_sin + pos * rd, kv_heads, hd, rd);
        }
        if (!L->shared) /* a sharing layer's source stored this token's already */
            store_kv(m->k, m->v, L->keys, L->values, m->dt, kv_heads, hd, L->cache_len, slot);
    }
    attend_heads_shared(m->q, L->keys, L->values, m->dt, m->a, heads, kv_heads, hd,
                        L->cache_len, n, L->scale, L->sinks, L->gated ? m->g : NULL, m->scores);
    linear_shared(&L->wo, m->a, L->bo, y, d, qd, mode);
}

/* Every layer's per-layer input for `token` into m->ple (m->ple holds ple_proj x, the
   projection of the scaled embedding, on entry). Serial. */
static void per_layer_inputs(const qkv_model *m, long token) {
    const long w = m->ple_width, all = m->n_layers * w;
    const float down = 1.0f / sqrtf((float)m->dim), half = (float)(1.0 / sqrt(2.0));
    row_to_f32(&m->ple_embed, token, all, m->ple_row);
    for (long l = 0; l < m->n_layers; l++) {
        float *p = m->ple + l * w;
        for (long i = 0; i < w; i++) p[i] *= down;
        norm(&m->ple_norm, p, p, w);
    }
    for (long i = 0; i < all; i++)
        m->ple[i] = (m->ple[i] + m->ple_row[i] * m->ple_embed_scale) * half;
}

/* Gemma 4's end of a block: x += ple_norm(ple_proj(gelu_tanh(ple_gate x) * p)), then
   x *= the layer's scalar, each where the layer has it. Called by every thread. */
static void block_end_shared(const qkv_model *m, const qkv_layer *L, const float *p) {
    const long d = m->dim, w = m->ple_width;
    if (L->ple_gate.data) {
        linear_shared(&L->ple_gate, m->x, NULL, m->ple_g, w, d, STORE);
#pragma omp single
        for (long i = 0; i < w; i++) m->ple_g[i] = gelu_tanh(m->ple_g[i]) * p[i];
        linear_shared(&L->ple_proj, m->ple_g, NULL, m->o, d, w, STORE);
#pragma omp single
        add_branch(&L->ple_norm, m->o, m->x, d);
    }
    if (L->layer_scalar) {
#pragma omp single
        for (long i = 0; i < d; i++) m->x[i] *= *L->layer_scalar;
    }
}

void qkv_step(const qkv_model *m, long token, long pos, int threads) {
    const long d = m->dim;
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        qkv_embed(&m->tok_emb, token, &m->pos_emb, pos, m->embed_scale, m->x, d);
        if (m->ple_width) {
            linear_shared(&m->ple_proj, m->x, NULL, m->ple, m->n_layers * m->ple_width, d, STORE);
#pragma omp single
            per_layer_inputs(m, token);
        }
        for (int l = 0; l < m->n_layers; l++) {
            const qkv_layer *L = &m->layers[l];
            /* each branch goes straight into x, or through o and its post-norm */
#pragma omp single
            norm(&L->norm1, m->x, m->h, d);
            float *y = L->post_norm1.kind == NORM_NONE ? m->x : m->o;
            int mode = L->post_norm1.kind == NORM_NONE ? ADD : STORE;
            if (L->latent)
                latent_shared(L->latent, &L->wo, L->bo, m->h, y, d, pos,
                              L->rope_cos + pos * L->rotary_dim, L->rope_sin + pos * L->rotary_dim,
                              m->dt, mode);
            else if (L->deltanet)
                deltanet_shared(L->deltanet, m->h, y, d, d, m->dt, mode);
            else
                attention_shared(m, L, pos, y, mode);
            if (mode == STORE) {
#pragma omp single
                add_branch(&L->post_norm1, m->o, m->x, d);
            }
#pragma omp single
            norm(&L->norm2, m->x, m->h, d);
            y = L->post_norm2.kind == NORM_NONE ? m->x : m->o;
            mode = L->post_norm2.kind == NORM_NONE ? ADD : STORE;
            if (L->moe && L->w1.data) { /* Gemma 4: dense and experts, summed in o */
                gated_shared(&L->w1, L->b1, &L->w2, L->b2, m->h, m->f, L->hidden, d, L->act);
                linear_shared(&L->w3, m->f, L->b3, m->o, d, L->hidden, STORE);
#pragma omp single
                {
                    norm(&L->post_dense_norm, m->o, m->o, d);
                    norm(&L->moe_norm, m->x, m->moe_x, d);
                }
                moe_shared(L->moe, m->moe_x, m->moe_y, d, STORE, m->x);
#pragma omp single
                {
                    norm(&L->post_moe_norm, m->moe_y, m->moe_y, d);
                    for (long i = 0; i < d; i++) m->o[i] += m->moe_y[i];
                }
                mode = STORE;
            } else if (L->moe) {
                moe_shared(L->moe, m->h, y, d, mode, NULL);
            } else {
                gated_shared(&L->w1, L->b1, &L->w2, L->b2, m->h, m->f, L->hidden, d, L->act);
                linear_shared(&L->w3, m->f, L->b3, y, d, L->hidden, mode);
            }
            if (mode == STORE) {
#pragma omp single
                add_branch(&L->post_norm2, m->o, m->x, d);
            }
            block_end_shared(m, L, m->ple_width ? m->ple + l * m->ple_width : NULL);
        }
#pragma omp single
        norm(&m->final_norm, m->x, m->h, d);
        linear_shared(&m->head, m->h, NULL, m->logits, m->vocab, d, STORE);
        if (m->logit_softcap > 0.0f) {
            const float cap = m->logit_softcap;
#pragma omp for schedule(static)
            for (long i = 0; i < m->vocab; i++) m->logits[i] = tanhf(m->logits[i] / cap) * cap;
        }
    }
}
