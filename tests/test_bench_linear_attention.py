"""The linear-attention benchmark suite (qkv.bench.linear_attention) on tiny shapes: its
cases agree before they are timed, a broken peer is refused, the report and the figure
are written. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.bench import linear_attention as suite
from qkv.bench import timing

pytest.importorskip("transformers")


def tiny(**overrides):
    return suite.LinearBenchConfig.quick(**{
        "tokens": (40, 70), "long_tokens": (150,), "key_heads": 1, "value_heads": 2,
        "head_dim": 8, "chunk_size": 16, "repeats": 1, "warmup": 0, "memory": "in-process",
        "cases": ("qkv-chunked", "qkv-recurrent", "hf-chunked", "hf-recurrent"),
        **overrides})


def test_suite_writes_json_and_png(tmp_path):
    suite.run_linear(tiny(), tmp_path, log=lambda s: None)
    report = json.loads((tmp_path / "linear_attention.json").read_text())
    assert report["machine"]["torch"] == torch.__version__
    assert set(report["results"]) == {"40", "70"}
    for row in report["results"].values():
        assert set(row) == {"qkv-chunked", "qkv-recurrent", "hf-chunked", "hf-recurrent"}
        for entry in row.values():
            assert entry["seconds"]["median"] > 0 and entry["memory"]["bytes"] >= 0
    assert set(report["long"]["150"]) == {"qkv-chunked", "hf-chunked"}
    assert all(diff < 1e-5 for diff in report["agreement"].values())
    names = [t["name"] for t in report["targets"]]
    assert any("at least as fast as transformers" in n for n in names)
    assert any("no more memory than transformers" in n for n in names)
    assert any("at 150 tokens holds at most its output" in n for n in names)
    assert (tmp_path / "linear_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_agreement_check_catches_a_broken_peer(monkeypatch):
    chunk, recurrent = suite._hf_functions()

    def broken(q, k, v, **kwargs):
        out, state = chunk(q, k, v, **kwargs)
        return out * 0.5, state

    monkeypatch.setattr(suite, "_hf_functions", lambda: (broken, recurrent))
    with pytest.raises(RuntimeError, match="'hf-chunked' disagrees with qkv-chunked"):
        suite.check_agreement(tiny(), ("hf-chunked",))


def test_missing_package_is_skipped_with_its_reason(monkeypatch):
    def missing():
        raise ImportError("No module named 'fla'")

    monkeypatch.setattr(suite, "_fla_naive", missing)
    names, skipped = suite.available_cases(("qkv-chunked", "fla-chunked"))
    assert names == ("qkv-chunked",)
    assert skipped == {"fla-chunked": "ImportError: No module named 'fla'"}


def test_memory_in_a_fresh_process():
    result = timing.run_isolated(suite.measure_case, name="qkv-chunked", tokens=64,
                                 key_heads=1, value_heads=2, head_dim=8, chunk_size=16)
    assert result["bytes"] >= 0 and result["output_bytes"] == 64 * 2 * 8 * 4


def test_config_refusals():
    for overrides, message in (
        ({"cases": ("qkv-recurrent",)}, "cases must include 'qkv-chunked'"),
        ({"cases": ("qkv-chunked", "nope")}, "cases must include 'qkv-chunked' and come from"),
        ({"value_heads": 3, "key_heads": 2}, "value_heads (3) must be a multiple of key_heads"),
        ({"memory": "fast"}, "memory must be one of"),
        ({"tokens": ()}, "tokens must be positive lengths"),
    ):
        with pytest.raises(ValueError) as e:
            tiny(**overrides).validate()
        assert message in str(e.value) and "\n" not in str(e.value)
