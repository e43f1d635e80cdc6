"""quant.c's products on GGML blocks against gguf's own decoder and float64 products.

Blocks come from ``gguf.quants.quantize`` for the types it writes (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1) and are random bytes with finite float16 scales for the others (Q4_K, Q5_K,
Q6_K: every bit pattern of their values and scales is a valid block).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv.kernels import ACT_SILU, QUANT_TYPES, Mat, decode_kernels, unavailable_reason

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

LIB = decode_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"no native kernels: "
                                   f"{unavailable_reason()}")
WRITABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# where each type keeps its float16 scales in a block (byte offsets)
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def blocks(qtype: str, rows: int, n: int, seed: int) -> np.ndarray:
    """uint8 (rows, row bytes): real blocks of a Gaussian matrix, or random valid ones."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in WRITABLE:
        return quantize(rng.standard_normal((rows, n)).astype(np.float32), kind)
    _, values, size = QUANT_TYPES[qtype]
    raw = rng.integers(0, 256, (rows, n // values, size), dtype=np.uint8)
    for at in SCALES[qtype]:  # scales of about 0.01, of either sign
        scale = (rng.standard_normal((rows, n // values)) * 0.01).astype(np.float16)
        raw[:, :, at:at + 2] = scale.view(np.uint8).reshape(rows, n // values, 2)
    return raw.reshape(rows, -1)


def as_mat(qtype: str, data: np.ndarray):
    return ctypes.byref(Mat(data=data.ctypes.data, type=QUANT_TYPES[qtype][0]))


def quantization_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """How far a product may move when x is quantized to 8 bits per block of 32.

    Each x_j becomes dx_b * round(x_j / dx_b) with dx_b = max |x_b| / 127, off by at most
    dx_b / 2, so row r's product moves by at most sum_b dx_b / 2 * sum_{j in b} |w_rj|.
    The float32 sums add a relative 1e-5 of sum |w_rj x_j| on top."""
    step = np.abs(x.reshape(-1, 32)).max(axis=1) / 127
    per_block = np.abs(w).reshape(w.shape[0], -1, 32).sum(axis=2)
    return per_block @ (step / 2) + 1e-5 * np.abs(w) @ np.abs(x) + 1e-6


@needs_kernels
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_blocks_decode_as_gguf_decodes_them(qtype):
    rows, n = 3, 512
    data = blocks(qtype, rows, n, seed=1)
    want = dequantize(data, gguf.GGMLQuantizationType[qtype])
    got = np.empty((rows, n), dtype=np.float32)
    for r in range(rows):
        LIB.qkv_dequantize_row(as_mat(qtype, data), r, n, got[r].ctypes.data)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


@needs_kernels
@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("rows, n", [(37, 256), (5, 1536)])
def test_block_products_against_float64(qtype, rows, n):
    data = blocks(qtype, rows, n, seed=rows + n)
    w = dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[:32] = 0.0  # a block of zeros (scale 0), and one of outliers
    x[32:64] *= 50.0
    exact = w @ x.astype(np.float64)
    bound = quantization_bound(w, x.astype(np.float64))
    # the fast product (through qkv_linear's threads), and the scalar reference
    y = torch.zeros(rows)
    LIB.qkv_linear(as_mat(qtype, data), x.ctypes.data, None, y.data_ptr(), rows, n, 0, 2)
    ref = np.array([LIB.qkv_quant_dot_ref(as_mat(qtype, data), r, n, x.ctypes.data)
                    for r in range(rows)])
    assert (np.abs(y.numpy() - exact) <= bound).all()
    assert (np.abs(ref - exact) <= bound).all()
    # both are the same sum of the same quantized products, in other orders (float32
    # sums of unsigned values and offsets that cancel: 1e-5 of sum |w_j x_j|)
    assert (np.abs(y.numpy() - ref) <= 1e-5 * np.abs(w) @ np.abs(x) + 1e-6).all()
    # and the bound is not loose enough to pass anything: the error is of its order
    assert np.abs(ref - exact).max() > 1e-3 * bound.max()


@needs_kernels
def test_gated_product_mixes_block_types():
    # a SwiGLU's two matrices in two block types, read in the same pass
    rows, n = 40, 256
    d1, d2 = blocks("Q4_K", rows, n, seed=4), blocks("Q8_0", rows, n, seed=5)
    w1 = torch.from_numpy(dequantize(d1, gguf.GGMLQuantizationType.Q4_K)).double()
    w2 = torch.from_numpy(dequantize(d2, gguf.GGMLQuantizationType.Q8_0)).double()
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    f = torch.empty(rows)
    LIB.qkv_gated(as_mat("Q4_K", d1), None, as_mat("Q8_0", d2), None, x.data_ptr(),
                  f.data_ptr(), rows, n, ACT_SILU, 2)
    ref = F.silu(w1 @ x.double()) * (w2 @ x.double())
    assert torch.allclose(f.double(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_embedding_expands_only_its_row(qtype):
    vocab, n = 9, 256
    data = blocks(qtype, vocab, n, seed=7)
    table = dequantize(data, gguf.GGMLQuantizationType[qtype])
    y = torch.empty(n)
    LIB.qkv_embed(as_mat(qtype, data), 6, ctypes.byref(Mat()), 0, ctypes.c_float(2.0),
                  y.data_ptr(), n)
    np.testing.assert_allclose(y.numpy(), 2.0 * table[6], rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_block_matrix_products_against_float64(qtype):
    # A prompt's rows times W^T: 7 rows (a group of 4 and one of 3) by 37 weight rows
    # (two tiles of 16 and part of one); rows of 11 blocks of 32 (eight at a time, then
    # three one by one) or 3 super-blocks of 256.
    T, rows = 7, 37
    n = 352 if QUANT_TYPES[qtype][1] == 32 else 768
    data = blocks(qtype, rows, n, seed=n + 3)
    w = dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, n)).astype(np.float32)
    x[1, :32] = 0.0  # a block of zeros, and one of outliers
    x[2, 32:64] *= 50.0
    bias = rng.standard_normal(rows).astype(np.float32)
    y = np.empty((T, rows), dtype=np.float32)
    assert LIB.qkv_quant_matmul(as_mat(qtype, data), x.ctypes.data, bias.ctypes.data,
                                y.ctypes.data, T, rows, n, 2) == 0
    exact = x.astype(np.float64) @ w.T + bias
    bound = np.stack([quantization_bound(w, xt.astype(np.float64)) for xt in x])
    assert (np.abs(y - exact) <= bound).all()
    assert np.abs(y - exact).max() > 1e-3 * bound.max()
    # the scalar reference, product by product (the same quantized sums in double)
    ref = np.array([[LIB.qkv_quant_dot_ref(as_mat(qtype, data), r, n, xt.ctypes.data)
                     for r in range(rows)] for xt in x]) + bias
    assert (np.abs(y - ref) <= 1e-5 * np.abs(x) @ np.abs(w).T + 1e-5).all()
    # each row of X is quantized as the vector product quantizes x, and each weight
    # row's sums run in the same order, so a row of Y is the vector product's, exactly
    for t in (0, 6):
        yt = np.empty(rows, dtype=np.float32)
        LIB.qkv_linear(as_mat(qtype, data), x[t].ctypes.data, bias.ctypes.data,
                       yt.ctypes.data, rows, n, 0, 1)
        np.testing.assert_array_equal(y[t], yt)
