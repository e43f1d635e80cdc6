"""Time one matrix-vector product per GGML block type on qkv's kernels (2 threads).

    PYTHONPATH=src python scripts/quant_kernel_rates.py [ROWS COLS]

Prints, per type, the fastest of 7 rounds (CPU time with one thread, else wall time) of
qkv_linear over a (ROWS, COLS) matrix (default SmolLM2-135M's FFN, (1536, 576)), times 30
matrices to leave the caches: a model's worth
of distinct weights), the bytes it reads per second, and the float32 / bfloat16 rates.
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np
import torch

from qkv.kernels import QUANT_TYPES, Mat, decode_kernels

rows, cols = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (1536, 576)
copies = 30
lib = decode_kernels()
threads = torch.get_num_threads()
# On a shared machine the process's own CPU time (one thread) is the steadier measure of
# a kernel's work; with more threads, wall time.
clock = time.process_time if threads == 1 else time.perf_counter
x = torch.randn(cols)
y = torch.empty(rows)
rng = np.random.default_rng(0)


def rate(mats: list, nbytes: int) -> tuple[float, float]:
    for m in mats:
        lib.qkv_linear(ctypes.byref(m), x.data_ptr(), None, y.data_ptr(), rows, cols, 0, threads)
    samples = []
    for _ in range(7):
        start = clock()
        for m in mats:
            lib.qkv_linear(ctypes.byref(m), x.data_ptr(), None, y.data_ptr(), rows, cols, 0,
                           threads)
        samples.append((clock() - start) / len(mats))
    t = min(samples)  # the least disturbed round on a shared machine
    return t * 1e6, nbytes / t / 1e9


print(f"({rows}, {cols}) x {copies} copies, {threads} threads")
for name, dtype in (("F32", torch.float32), ("BF16", torch.bfloat16)):
    ws = [torch.randn(rows, cols).to(dtype) for _ in range(copies)]
    us, gbs = rate([Mat(data=w.data_ptr(), type=0 if dtype == torch.float32 else 1)
                    for w in ws], ws[0].nbytes)
    print(f"{name:5s} {us:8.1f} us  {gbs:6.1f} GB/s  {rows * cols / us / 1e3:6.2f} Gvalues/s")
for name, (code, values, size) in QUANT_TYPES.items():
    if cols % values:
        continue
    raw = [rng.integers(0, 256, (rows, cols // values * size), dtype=np.uint8)
           for _ in range(copies)]
    for r in raw:  # finite float16 scales where the type keeps them
        blocks = r.reshape(rows, cols // values, size)
        at = {"Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,)}.get(name, (0, 2))
        for a in at:
            blocks[:, :, a:a + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    us, gbs = rate([Mat(data=r.ctypes.data, type=code) for r in raw], raw[0].nbytes)
    print(f"{name:5s} {us:8.1f} us  {gbs:6.1f} GB/s  {rows * cols / us / 1e3:6.2f} Gvalues/s")
