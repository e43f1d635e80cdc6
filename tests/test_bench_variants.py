"""``qkv bench variants`` on toy widths through the command line: the report's structure,
every compared pair computing the same output (so that the timings compare equal work),
a path that computes something else refused, and the one-line refusals. No timing is
asserted."""

from __future__ import annotations

import argparse
import json

import pytest

from qkv.bench import variants
from qkv.cli import bench as bench_cli

transformers = pytest.importorskip("transformers")

# group -> transformers' module it is compared with
PEERS = {
    "mha": "LlamaAttention",
    "sink": "GptOssAttention",
    "gated": "Qwen3NextAttention",
    "latent": "DeepseekV3Attention",
    "sparse_latent": "DeepseekV32Attention",
    "moe-deepseek_v3": "DeepseekV3MoE",
    "moe-gpt_oss": "GptOssMLP",
    "moe-qwen3_next": "Qwen3NextSparseMoeBlock",
}
FAST = {"mha": ["qkv eager", "qkv fused"], "latent": ["qkv decompress", "qkv absorbed",
                                                      "qkv auto"]}


def parse(argv):
    parser = argparse.ArgumentParser(prog="qkv")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_every_pair_computes_the_same_output_and_the_report_adds_up(tmp_path, capsys):
    args = parse(["bench", "variants", "--quick", "--repeats", "1", "--warmup", "0",
                  "--out", str(tmp_path)])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "variants.json").read_text())
    assert (tmp_path / "variants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["suite"] == "variants" and report["transformers"] == transformers.__version__
    assert list(report["results"]) == list(PEERS) and report["skipped"] == {}

    def check(entries, paths, peer):
        assert list(entries) == paths
        roles = [e["role"] for e in entries.values()]
        assert roles[0] == "readable" and roles.count("default") == 1
        assert roles[-1] == "transformers" and peer in paths[-1]
        readable, theirs = entries[paths[0]], entries[paths[-1]]
        for name, entry in entries.items():
            # the same numbers as the readable path, which computed something
            assert entry["output_max"] > 0
            assert entry["max_rel_diff"] <= variants.TOLERANCE, name
            assert len(entry["seconds"]["samples"]) == 1
            median = entry["seconds"]["median"]
            assert entry["speedup_vs_readable"] == pytest.approx(
                readable["seconds"]["median"] / median)
            assert entry["speedup_vs_transformers"] == pytest.approx(
                theirs["seconds"]["median"] / median)

    for key, peer in PEERS.items():
        result = report["results"][key]
        if key in FAST:
            assert result["paths"][:-1] == FAST[key]
        for mode in ("prompt", "decode"):
            check(result["modes"][mode], result["paths"], peer)
        assert f"| {result['label']} " in out
    long_decode = report["long_decode"]
    assert long_decode["tokens"] == 24
    check(long_decode["decode"], long_decode["paths"], "DeepseekV3Attention")

    # A target for each group and mode (qkv's default path against transformers'), and
    # two for the long MLA step; each met exactly when its ratio is at least 1.
    targets = report["targets"]
    assert len(targets) == 2 * len(PEERS) + 2
    for target in targets:
        assert target["met"] == (target["value"] >= 1.0)
        assert f"{'MET   ' if target['met'] else 'MISSED'} {target['name']}" in out
    sink = next(t for t in targets if t["name"].startswith("SinkAttention (gpt-oss), decode"))
    entries = report["results"]["sink"]["modes"]["decode"]
    assert sink["value"] == entries["qkv fused"]["speedup_vs_transformers"]


def test_qkvs_paths_alone_and_one_line_refusals(tmp_path):
    args = parse(["bench", "variants", "--quick", "--no-peers", "--mechanisms", "latent",
                  "--long-cache", "0", "--repeats", "1", "--out", str(tmp_path)])
    assert args.run(args) == 0
    report = json.loads((tmp_path / "variants.json").read_text())
    assert list(report["results"]) == ["latent"] and report["long_decode"] is None
    assert report["results"]["latent"]["paths"] == FAST["latent"]
    assert report["targets"] == [] and report["transformers"] is None
    for argv, words in (
        (["--device", "cuda"], "float32 on the CPU"),
        (["--dtype", "bfloat16"], "float32 on the CPU"),
        (["--mechanisms", "flash"], "mechanism 'flash' is not benchmarked; choose from mha, "),
        (["--tokens", "0"], "tokens"),
    ):
        args = parse(["bench", "variants", "--quick", *argv, "--out", str(tmp_path)])
        with pytest.raises(ValueError, match=words) as excinfo:
            args.run(args)
        assert "\n" not in str(excinfo.value)


def test_a_path_that_computes_something_else_is_refused(monkeypatch, tmp_path):
    # gpt-oss's experts loaded without undoing their interleaving: qkv's paths then run
    # other weights than transformers', and the suite must say so rather than time them.
    def stacked_only(state):
        return {**state, "experts.gate_up_proj": state["experts.gate_up_proj"].transpose(1, 2)}

    monkeypatch.setattr(variants, "_gpt_oss_experts", stacked_only)
    config = variants.VariantsConfig.quick(mechanisms=("moe",), long_cache=0, repeats=1)
    with pytest.raises(RuntimeError, match=r"moe-gpt_oss prompt: 'transformers GptOssMLP "
                                           r"\(\w+\)' differs from 'qkv loop'"):
        variants.run_variants(config, tmp_path, log=lambda line: None)
