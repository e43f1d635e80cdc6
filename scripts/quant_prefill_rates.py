"""Prefill rate of QuantizedLinear layers, backend "torch" against "native".

    PYTHONPATH=src python scripts/quant_prefill_rates.py [TOKENS ...]

A prompt of T tokens multiplies T rows of activations by every matrix of every layer.
For each GGML block type, this times one layer's linear products of SmolLM2-135M
(hidden 576, MLP 1536, 9 query and 3 key/value heads of 64; the matrices whose rows are
whole blocks of the type: all seven for the 32-value types, the MLP's down projection
for the K types, whose blocks are 256 values) on T rows (default 128 and 512), with the
layers' backend "torch" (each weight expanded to float32, then F.linear) and "native"
(kernels/quant.c's matrix product on the blocks), and prints each one's tokens/s (of one
layer's products: T / time) and their ratio. Median of 7 rounds, wall time, PyTorch's
threads (``torch.get_num_threads()``; set OMP_NUM_THREADS).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from qkv.kernels import QUANT_TYPES, decode_kernels
from qkv.models.quantized import QuantizedLinear

tokens = [int(t) for t in sys.argv[1:]] or [128, 512]
# one layer of SmolLM2-135M: (in_features, out_features)
SHAPES = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
          "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}
if decode_kernels() is None:
    sys.exit("no native kernels here: nothing to compare")
rng = np.random.default_rng(0)


def random_blocks(qtype: str, rows: int, cols: int) -> torch.Tensor:
    """Random bytes as blocks, with float16 scales of 0.01 (every bit pattern of the
    values is valid)."""
    _, values, size = QUANT_TYPES[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    at = {"Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,)}.get(qtype, (0, 2))
    for a in at:
        raw[:, :, a:a + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def seconds(layers: list[QuantizedLinear], x: dict[int, torch.Tensor]) -> float:
    """Median wall time of one pass of x through every layer."""
    samples = []
    for _ in range(8):
        start = time.perf_counter()
        for layer in layers:
            layer(x[layer.in_features])
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])  # the first warms up


print(f"{torch.get_num_threads()} threads; one SmolLM2-135M layer's linear products")
print(f"{'type':5s} {'T':>4s} {'matrices':>9s} {'torch tok/s':>12s} {'native tok/s':>13s} "
      f"{'native/torch':>13s}")
with torch.no_grad():
    for qtype, (_, values, _) in QUANT_TYPES.items():
        names = [name for name, (cols, _) in SHAPES.items() if cols % values == 0]
        layers = [QuantizedLinear(SHAPES[n][0], SHAPES[n][1], qtype,
                                  blocks=random_blocks(qtype, SHAPES[n][1], SHAPES[n][0]))
                  for n in names]
        for t in tokens:
            x = {cols: torch.randn(t, cols) for cols in {m.in_features for m in layers}}
            rate = {}
            for backend in ("torch", "native"):
                for layer in layers:
                    layer.backend = backend
                rate[backend] = t / seconds(layers, x)
            print(f"{qtype:5s} {t:4d} {len(names):9d} {rate['torch']:12.0f} "
                  f"{rate['native']:13.0f} {rate['native'] / rate['torch']:12.2f}x")
