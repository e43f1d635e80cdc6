/* What decode.c and quant.c share: the weight matrix and the block kernels' entry points.

   A matrix's type code is 0 (float32), 1 (bfloat16), or one of GGML's block types,
   whose codes the build passes in as -DQKV_Q8_0=... (qkv.kernels.QUANT_TYPES declares
   them once, in Python). */
#ifndef QKV_QUANT_H
#define QKV_QUANT_H

#define QKV_F32 0
#define QKV_BF16 1

/* A weight matrix, (rows, n) row-major: its address and its type code. A block type's
   row is n / (values per block) blocks, back to back, as a GGUF file stores them. */
typedef struct {
    const void *data;
    int type;
} qkv_mat;

/* Whether `type` is one of the block types (quant.c). */
int qkv_is_quantized(int type);

/* Row r of the block matrix W (n values a row) times x (n float32). The first call on a
   thread after qkv_quant_forget_x quantizes x to 8 bits (see quant.c); later calls reuse
   it while x is the same address. Every work-shared product calls qkv_quant_forget_x
   on each thread before its rows, since the vector at an address changes between them. */
float qkv_quant_dot_row(const qkv_mat *W, long r, long n, const float *x);
void qkv_quant_forget_x(void);

/* Y (T, rows) = X (T, n) W^T (+ bias (rows), may be NULL), all float32, W a block matrix
   (rows, n): each row of X quantized to 8 bits once, as for qkv_quant_dot_row, and the
   rows of W shared out among `threads` threads. Returns 0, or -1 when its buffers for
   the quantized X (about T n bytes) could not be allocated. */
int qkv_quant_matmul(const qkv_mat *W, const float *X, const float *bias, float *Y, long T,
                     long rows, long n, int threads);

/* Row r of the block matrix W as n float32 values. */
void qkv_dequantize_row(const qkv_mat *W, long r, long n, float *y);

#endif
