"""Smoke test of ``qkv bench flops``: tiny shapes on the CPU, valid files, correct kernels.

No timing is asserted. What is checked: the report is complete and parses, the plot
decodes, the operation counts follow the stated convention, and the kernel the suite
times for qkv computes attention (compared here with a float64 reference written
independently of the suite's own check).
"""

import argparse
import json
import math

import pytest
import torch

from qkv.bench import flops
from qkv.cli import bench as bench_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tiny(**overrides):
    return flops.FlopsConfig.quick(
        **{"batch": 1, "heads": 2, "tokens": 32, "head_dim": 16, "matmul_size": 64,
           "repeats": 1, "warmup": 0, "device": "cpu", **overrides}
    )


def naive_attention_f64(q, k, v, causal):
    """softmax(q k^T / sqrt(d)) v in float64, one score at a time per row: (B, H, T, d)."""
    q, k, v = q.double(), k.double(), v.double()
    d, t = q.shape[-1], q.shape[-2]
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
    if causal:
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        scores = torch.where(j <= i, scores, torch.tensor(float("-inf"), dtype=torch.float64))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / weights.sum(-1, keepdim=True)
    return torch.einsum("bhij,bhjd->bhid", weights, v)


@pytest.fixture(scope="module")
def report_and_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("flops")
    return flops.run_flops(tiny(), out, log=lambda s: None), out


def test_flops_suite_writes_json_and_png(report_and_dir):
    from matplotlib.image import imread

    report, out = report_and_dir
    saved = json.loads((out / "flops.json").read_text())
    assert saved["machine"]["torch"] == torch.__version__
    assert saved["suite"] == "flops" and saved["matmul"]["tflops"]["median"] > 0
    # qkv, SDPA flash and math run on every CPU; the GPU-only backends are skipped
    for name in ("qkv", "sdpa-flash", "sdpa-math", "qkv-eager"):
        for mask in flops.MASKS:
            for mode in flops.MODES:
                entry = saved["results"][name][mask][mode]
                assert entry["tflops"]["median"] > 0 and entry["fraction_of_matmul"] > 0
                assert saved["relative_error"][name][mask][mode] < 1e-4
    assert any(k.startswith("sdpa-efficient/") for k in saved["skipped"])
    assert saved["dispatch"]["causal"]  # the profiler named qkv's SDPA kernel
    assert (out / "flops.png").read_bytes()[:8] == PNG_SIGNATURE
    assert imread(out / "flops.png").shape[0] > 50


def test_flop_convention():
    full = flops.attention_flops(2, 3, 8, 4, causal=False, mode="forward")
    assert full == 4 * 2 * 3 * 8 * 8 * 4
    assert flops.attention_flops(2, 3, 8, 4, causal=True, mode="forward") == full / 2
    assert flops.attention_flops(2, 3, 8, 4, causal=False, mode="train") == 3.5 * full
    assert flops.matmul_flops(8) == 2 * 8**3


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["qkv", "qkv-eager", "sdpa-flash", "sdpa-math"])
def test_timed_kernels_match_an_independent_reference(name, causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g) for _ in range(3))
    got = flops.kernel(name)(q, k, v, causal)
    want = naive_attention_f64(q, k, v, causal)
    assert got.dtype == torch.float32
    assert (got.double() - want).norm() / want.norm() < 1e-5


def test_qkv_kernel_is_what_multihead_attention_runs():
    from qkv.multihead import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 32, 24, 0.0, num_heads=4).eval()
    x = torch.randn(2, 24, 32)
    q, k, v = (mha._split_heads(w(x)) for w in (mha.W_query, mha.W_key, mha.W_value))
    context = flops.kernel("qkv")(q, k, v, True).transpose(1, 2).reshape(2, 24, 32)
    with torch.no_grad():
        torch.testing.assert_close(mha.out_proj(context), mha(x))


def test_a_wrong_kernel_is_skipped_not_timed():
    math_kernel = flops.kernel("sdpa-math")

    def wrong_mask(q, k, v, causal):
        return math_kernel(q, k, v, not causal)

    inputs = flops._Inputs.random(tiny(), torch.device("cpu"), torch.float32)
    reference = flops._reference(inputs, True)
    errors, skipped = flops.check_path("broken", wrong_mask, inputs, True, reference,
                                       tol=1e-3)
    assert not errors
    assert "disagrees" in skipped["forward"] and "disagrees" in skipped["train"]


def test_cli_reaches_the_flops_suite(tmp_path, monkeypatch):
    seen = {}

    def fake_run(config, out_dir):
        seen["config"] = config
        return {}

    monkeypatch.setattr(flops, "run_flops", fake_run)
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "flops", "--quick", "--device", "cpu",
                              "--out", str(tmp_path), "--repeats", "2"])
    assert args.run(args) == 0
    config = seen["config"]
    assert config.tokens == 128 and config.repeats == 2 and not config.compile_flex
    args = parser.parse_args(["bench", "flops", "--device", "cpu", "--no-compile"])
    bench_cli.run_suite("flops", args)
    assert seen["config"].tokens == 8192 and not seen["config"].compile_flex
    assert "flops" in bench_cli.SUITES
