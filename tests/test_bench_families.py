"""``qkv bench generate --ckpt RUN`` on a tiny model of each family of the new layer kinds,
and the Hugging Face folders it writes of them for its transformers peer.

Each model is made with transformers' own classes (:func:`test_open_models.hf_model`),
saved as a folder and imported with ``qkv lm import``; the benchmark then writes it back
as a folder for its transformers peer. The reference is transformers' ``generate`` on
the original model: every float32 path, the peer's included, must give its greedy
tokens. Timings are not checked. The written folders of every family are checked in the
default suite, the benchmark on one family (latent attention with experts), on the others
with ``QKV_SLOW=1`` (the suite's time budget).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from qkv.bench import generate_run
from qkv.bench.peers import Peer
from qkv.cli import main
from qkv.models.hf_open import config_fields, hf_config, read_open_weights, write_hf_folder

transformers = pytest.importorskip("transformers")
open_models = pytest.importorskip("test_open_models")

DEFAULT = ("deepseek_v3",)
SLOW = ("qwen3_5_text", "gpt_oss", "deepseek_v32", "qwen3_next", "gemma4_text")
FAMILIES = (*DEFAULT, *SLOW)
NEW_TOKENS = 6


def imported_run(family, root):
    """(transformers' model of ``family``, the run ``qkv lm import`` made of its folder)."""
    model = open_models.hf_model(family, seed=3)
    folder = root / "hf"
    model.save_pretrained(folder)
    open_models.byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert main(["lm", "import", str(folder), "--run-dir", str(root / "run")]) == 0
    return model, root / "run"


@pytest.mark.parametrize("family", FAMILIES)
def test_written_folder_gives_transformers_logits(family, tmp_path):
    """A model read from transformers' folder and written back by qkv loads in transformers
    as the same model: the same logits as the original."""
    hf = open_models.hf_model(family, seed=5)
    hf.save_pretrained(tmp_path / "original")
    config = json.loads((tmp_path / "original" / "config.json").read_text())
    fields = config_fields(config, family)
    state = read_open_weights(tmp_path / "original", fields, model_type=family)
    write_hf_folder(tmp_path / "written", fields, family, state)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "written",
                                                             dtype=torch.float32).eval()
    ids = torch.randint(0, open_models.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family, change, match", [
    # DeepSeek-V3 keeps its dense layers first (first_k_dense_replace)
    ("deepseek_v3", lambda f: f["layout"].reverse(), "layout[2] is"),
    # Qwen3-Next's router is a softmax
    ("qwen3_next", lambda f: f["moe"].update(score="sigmoid"),
     "moe['score'] is 'sigmoid'; transformers would run 'softmax'"),
])
def test_hf_config_refuses_what_a_family_cannot_express(family, change, match):
    fields = config_fields(open_models.FAMILIES[family]().to_dict(), family)
    change(fields)
    with pytest.raises(ValueError) as error:
        hf_config(fields, family)
    assert len(str(error.value).splitlines()) == 1 and match in str(error.value)


def test_gemma4_layer_indices_as_transformers_saves_them():
    """transformers saves per_layer_config's keys zero-padded ("05" of 12 layers): the same
    layers as "5"."""
    config = transformers.Gemma4TextConfig(**{**open_models.GEMMA4, "num_hidden_layers": 12,
                                              "num_kv_shared_layers": 0, "layer_types": None})
    saved = json.loads(config.to_json_string())
    assert "05" in saved["per_layer_config"]
    unpadded = {**saved, "per_layer_config": {str(int(k)): v for k, v in
                                              saved["per_layer_config"].items()}}
    fields = config_fields(saved, "saved")
    assert fields == config_fields(unpadded, "unpadded")
    assert [entry["head_dim"] for entry in fields["layout"]][5::6] == [32, 32]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> (transformers' model, its run), made once per module."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = imported_run(family, tmp_path_factory.mktemp(family))
        return made[family]
    return get


def check_family(family, runs, tmp_path):
    hf, run = runs(family)
    config = generate_run.RunGenerateConfig(
        ckpt=str(run), new_tokens=NEW_TOKENS, repeats=1, warmup=0, prefill_tokens=8,
        contexts=(8,), sweep_tokens=2, bandwidth_mib=8)
    lines: list[str] = []
    report = generate_run.run_generate_run(config, tmp_path / "out", log=lines.append)
    prompt = report["prompt"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                              dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert report["tokens"] == want
    assert "transformers" not in report["skipped"], report["skipped"]
    for name in ("qkv float32, model forward", "transformers float32"):
        assert report["identity"][name]["identical"], name
    # a family llama.cpp is not given is skipped with a one-line note, never a crash
    for why in report["skipped"].values():
        assert "\n" not in why
    return report


@pytest.mark.parametrize("family", DEFAULT)
def test_bench_gives_transformers_tokens(family, runs, tmp_path):
    report = check_family(family, runs, tmp_path)
    # the sweep's reference for the absorbed form: the latents decompressed each step
    decompressed = "qkv float32, model forward, MLA decompressed"
    assert report["identity"][decompressed]["identical"]
    assert set(report["results"][decompressed]["sweep_tokens_per_sec"]) == {8}


@pytest.mark.slow
@pytest.mark.parametrize("family", SLOW)
def test_bench_gives_transformers_tokens_slow(family, runs, tmp_path):
    if os.environ.get("QKV_SLOW") != "1":  # the suite's time budget
        pytest.skip("set QKV_SLOW=1 to run the bench on this family too")
    report = check_family(family, runs, tmp_path)
    latent = family.startswith("deepseek")
    assert latent == any("decompressed" in name for name in report["results"])


def test_a_peer_that_cannot_run_the_model_is_skipped_in_one_line(runs, tmp_path,
                                                                  monkeypatch):
    """A peer that loads the folder but fails on it (transformers 5.24's KV-sharing Gemma 4
    without per-layer inputs) is skipped with a note; qkv's paths are still timed."""
    def failing(folder, dtype, name):
        def fail(*args):
            raise RuntimeError("cannot run this model\nsecond line")
        return Peer(name, fail, fail)

    monkeypatch.setattr(generate_run, "transformers_peer", failing)
    config = generate_run.RunGenerateConfig(
        ckpt=str(runs("deepseek_v3")[1]), new_tokens=2, repeats=1, warmup=0,
        prefill_tokens=4, contexts=(4,), sweep_tokens=2, bandwidth_mib=8)
    report = generate_run.run_generate_run(config, tmp_path, log=lambda s: None)
    assert report["skipped"]["transformers"] == "RuntimeError: cannot run this model"
    assert set(report["results"]) == {"qkv float32", "qkv bfloat16",
                                      "qkv float32, model forward",
                                      "qkv float32, model forward, MLA decompressed"}
