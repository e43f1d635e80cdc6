"""``qkv bench generate --ckpt RUN``: a tiny imported model on every path.

The references are transformers' own ``generate`` on the original model (the greedy
tokens every float32 path must give) and the byte counts worked out here from the
model's shapes. Timings are not checked, only that they were taken.
"""

from __future__ import annotations

import json

import pytest
import torch

from qkv.bench import generate_run
from qkv.bench.lm import decode_bytes_per_token
from qkv.cli import main
from qkv.models.gpt import GPTConfig, GPTModel

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 96


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """(the transformers model, the run qkv lm import made of its folder)."""
    root = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "hf")
    words = generate_run.PROMPT.replace(",", " ,").split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    vocab.update({f"t{i}": i for i in range(len(vocab), VOCAB)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=f"t{VOCAB - 1}"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(root / "hf" / "tokenizer.json"))
    assert main(["lm", "import", str(root / "hf"), "--run-dir", str(root / "run")]) == 0
    return model, root / "run"


def test_every_path_decodes_transformers_tokens(llama_run, tmp_path):
    hf, run = llama_run
    config = generate_run.RunGenerateConfig(
        ckpt=str(run), new_tokens=6, repeats=1, warmup=0, prefill_tokens=16,
        contexts=(8, 1000), sweep_tokens=3, bandwidth_mib=8)
    lines: list[str] = []
    report = generate_run.run_generate_run(config, tmp_path, log=lines.append)

    # the float32 paths give transformers' own greedy tokens on the original model
    prompt = report["prompt"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert report["tokens"] == want
    for name in ("qkv float32, model forward", "transformers float32"):
        assert report["identity"][name]["identical"], name
    results = report["results"]
    assert {"qkv float32", "qkv bfloat16", "qkv float32, model forward",
            "transformers float32"} <= set(results)
    if "llama.cpp" in report["skipped"]:
        assert "llama-cpp-python is not installed" in report["skipped"]["llama.cpp"]
    else:
        assert {"llama.cpp F32", "llama.cpp BF16"} <= set(results)
        assert report["identity"]["llama.cpp F32"]["identical"]
    assert "qkv C kernels" in results["qkv float32"]["decoder"] or \
        "model forward" in results["qkv float32"]["decoder"]
    # rates measured, the ceiling worked out from them, the sweep cut to the context
    # (each call's share against the readings that bracket it: the first before the
    # round, then one after each call)
    readings = report["bandwidth_bytes_per_sec"]["samples"]
    assert len(readings) == 1 + len(results)
    for name, r in results.items():
        assert r["tokens_per_sec"]["median"] > 0, name
        dtype = r["dtype"]
        (around,) = r["bandwidth_around"]
        assert around in [(a + b) / 2 for a, b in zip(readings, readings[1:], strict=False)]
        assert r["percent_of_ceiling"] == pytest.approx(
            100 * r["tokens_per_sec"]["median"] * report["bytes_per_token"][dtype]["total"]
            / around)
        assert set(r["sweep_tokens_per_sec"]) == {8}, name  # 1000 + 3 > 64
    assert results["qkv float32, model forward"]["prefill_tokens_per_sec"] is None
    assert results["qkv float32"]["prefill_tokens_per_sec"] > 0
    assert [t["met"] for t in report["targets"]][-1]  # identical tokens
    saved = json.loads((tmp_path / "generate-run.json").read_text())
    assert saved["tokens"] == want
    assert (tmp_path / "generate-run.png").stat().st_size > 0
    assert not list(tmp_path.glob("peer-files*"))  # the peers' copies are removed
    assert any(line.startswith("target ") for line in lines)


def test_no_peers_times_qkv_alone(llama_run, tmp_path):
    _, run = llama_run
    config = generate_run.RunGenerateConfig(
        ckpt=str(run), new_tokens=3, repeats=1, warmup=0, prefill_tokens=8, contexts=(4,),
        sweep_tokens=2, bandwidth_mib=8, peers=False)
    report = generate_run.run_generate_run(config, tmp_path, log=lambda s: None)
    assert set(report["results"]) == {"qkv float32", "qkv bfloat16",
                                      "qkv float32, model forward"}
    assert report["skipped"] == {"peers": "not asked for (--no-peers)"}


def test_bad_settings_are_one_line(llama_run, tmp_path, capsys):
    _, run = llama_run
    assert main(["bench", "generate", "--ckpt", str(run), "--dtype", "bfloat16",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ckpt decodes on the CPU in float32 and bfloat16" in err[0]
    with pytest.raises(ValueError, match="new_tokens and sweep_tokens must be >= 2"):
        generate_run.RunGenerateConfig(ckpt=str(run), new_tokens=1).validate()


def test_bytes_per_token_of_rope_gqa_and_sliding_layers():
    cfg = GPTConfig(vocab_size=50, context_length=32, emb_dim=16, n_heads=4, n_layers=2,
                    drop_rate=0.0, rope=True, n_kv_groups=2, window_size=4,
                    layer_types=["sliding", "full"], norm="rmsnorm", mlp="swiglu",
                    hidden_dim=24, out_bias=False, mlp_bias=False, tie_weights=True)
    model = GPTModel(cfg)
    got = decode_bytes_per_token(model, prompt_len=3, new_tokens=5)
    # every parameter once (the tied table as the head), no position table to look up
    weights = 4 * sum(p.numel() for p in model.parameters())
    assert got["weights"] == weights
    # each step attends to 3 + i positions (i = 0..4), the sliding layer to at most 4;
    # each position holds a key and a value of 2 heads x 4 dims, float32
    full = sum(3 + i for i in range(5)) / 5
    sliding = sum(min(3 + i, 4) for i in range(5)) / 5
    assert got["kv_cache"] == pytest.approx(4 * 2 * 2 * 4 * (full + sliding))
    assert got["total"] == pytest.approx(got["weights"] + got["kv_cache"])
