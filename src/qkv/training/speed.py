"""How fast the device multiplies matrices, for "model FLOPs utilisation" (MFU).

MFU is the share of a ceiling that training reaches: the model's floating-point
operations per second (e.g. :meth:`qkv.models.gpt.GPTConfig.training_flops_per_token`
times tokens per second) over what the device can do. Rather than a datasheet peak,
which a CPU does not have and a GPU rarely reaches, the ceiling here is *measured*: the
rate of one large square ``torch.mm`` in the training dtype on the same device. So a
figure near 100 % means "as fast as this machine multiplies matrices", on any machine.
"""

from __future__ import annotations

import time

import torch

__all__ = ["matmul_rate", "model_flops_utilisation", "MATMUL_SIZES"]

# n of the n x n x n product: large enough to reach the device's rate, small enough
# to take well under a second on a laptop CPU (2 n^3 = 2.1 GFLOP at 1,024).
MATMUL_SIZES = {"cpu": 1024, "cuda": 8192}


def matmul_rate(device: torch.device | str, dtype: torch.dtype = torch.float32, *,
                n: int | None = None, seconds: float = 0.25) -> float:
    """FLOP/s of ``torch.mm`` on two ``(n, n)`` matrices of ``dtype`` on ``device``.

    Times both layouts a model's products use, ``a @ b`` and ``a @ b.T`` (``nn.Linear``
    multiplies by its weight transposed), a warm-up product each, then products for
    about ``seconds``, and returns the fastest run's rate: the ceiling, least disturbed
    by other work on a shared machine. The layouts can differ a lot (bfloat16 on a CPU
    without bfloat16 instructions: 1.3 and 19 GFLOP/s). ``n`` defaults to
    :data:`MATMUL_SIZES` for the device type.
    """
    device = torch.device(device)
    n = n or MATMUL_SIZES.get(device.type, 4096)
    if n < 1 or seconds <= 0:
        raise ValueError(f"matmul_rate needs n >= 1 and seconds > 0, got n={n}, "
                         f"seconds={seconds}")
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)

    def once(right: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, right)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    best, spent = float("inf"), 0.0
    for right in (b.t(), b):
        warm = once(right)  # warm-up: kernel selection, page faults
        if warm > 4 * best:
            continue  # a layout this much slower cannot be the ceiling: no need to time it
        first = spent
        while spent - first < seconds / 2 or best == float("inf"):
            elapsed = once(right)
            best, spent = min(best, elapsed), spent + elapsed
    return 2.0 * n**3 / best


def model_flops_utilisation(flops_per_token: float, tokens_per_sec: float,
                            ceiling_flops_per_sec: float) -> float:
    """MFU as a fraction: ``flops_per_token x tokens_per_sec / ceiling``.

    E.g. 0.76 GFLOP per token (GPT-2 small at 128 tokens) at 80 tokens/s is 61 GFLOP/s
    of model work: 0.34 of a 180 GFLOP/s matmul rate.
    """
    if not ceiling_flops_per_sec > 0:
        raise ValueError(f"the matmul rate must be > 0 FLOP/s, got {ceiling_flops_per_sec}")
    return flops_per_token * tokens_per_sec / ceiling_flops_per_sec
