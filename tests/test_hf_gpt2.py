"""GPT-2 from a Hugging Face folder, against ``transformers`` itself (nothing downloaded:
each test builds a small random ``GPT2LMHeadModel`` and saves it)."""

from __future__ import annotations

import pytest
import torch

from qkv.models.gpt import GPTModel, generate

transformers = pytest.importorskip("transformers")


def _hf_model(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{"vocab_size": 101, "n_positions": 32, "n_embd": 24,
                                        "n_layer": 2, "n_head": 4, **overrides})
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("overrides", [{}, {"n_layer": 3, "n_head": 2},
                                       {"tie_word_embeddings": False}],
                         ids=["tied", "3-layers", "untied"])
def test_logits_equal_transformers(tmp_path, overrides):
    hf, folder = _hf_model(tmp_path, **overrides)
    ours = GPTModel.from_hf(folder)
    assert not ours.training
    assert ours.cfg.qkv_bias and ours.cfg.tie_weights == overrides.get(
        "tie_word_embeddings", True)
    assert ours.cfg.context_length == 32 and ours.cfg.n_layers == overrides.get("n_layer", 2)
    ids = torch.randint(0, 101, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    if ours.cfg.tie_weights:  # one matrix, as in GPT-2
        assert ours.out_head.weight is ours.tok_emb.weight


def test_greedy_generation_equals_transformers_token_for_token(tmp_path):
    hf, folder = _hf_model(tmp_path, seed=3)
    ours = GPTModel.from_hf(folder)
    prompt = torch.tensor([[5, 17, 42, 8]])
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    for use_cache in (True, False):
        got = generate(ours, prompt, 20, use_cache=use_cache)
        assert got.tolist() == want.tolist()


def test_a_pytorch_model_bin_loads_weights_only(tmp_path):
    hf, folder = _hf_model(tmp_path, seed=4)
    (folder / "model.safetensors").unlink()
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    ours = GPTModel.from_hf(folder)
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


class _Payload:
    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _Payload.ran = True
    return {}


def test_a_pickle_that_runs_code_is_refused_and_never_run(tmp_path):
    _, folder = _hf_model(tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save({"wte.weight": _Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a weights-only PyTorch zip file"):
        GPTModel.from_hf(folder)
    assert not _Payload.ran


def _edit_config(folder, **changes):
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, match", [
    ({"activation_function": "relu"}, r"activation_function='relu' is not supported"),
    ({"n_head": 5}, r"n_embd \(24\) must be divisible by n_head \(5\)"),
    ({"n_inner": 50}, r"n_inner=50 is not supported"),
    ({"model_type": "llama"}, r"model_type must be 'gpt2'"),
    ({"n_layer": 0}, r"n_layer must be"),
    ({"n_positions": 64}, r"wpe.weight has shape \[32, 24\], expected \[64, 24\]"),
    ({"n_layer": 3}, r"missing 12 tensors, e.g. 'h.2.ln_1.weight'"),
    ({"n_layer": 1}, r"unexpected tensors for this config, e.g. 'h.1"),
])
def test_bad_configs_and_weights_are_one_line_errors(tmp_path, changes, match):
    _, folder = _hf_model(tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match) as error:
        GPTModel.from_hf(folder)
    assert "\n" not in str(error.value)


def test_sizes_are_checked_before_anything_is_allocated(tmp_path):
    # 2 billion tokens x 24 would be 192 GB: refused from the file's header, unbuilt
    _, folder = _hf_model(tmp_path)
    _edit_config(folder, vocab_size=2_000_000_000)
    with pytest.raises(ValueError, match=r"wte.weight has shape \[101, 24\]"):
        GPTModel.from_hf(folder)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json: no such file"):
        GPTModel.from_hf(tmp_path)
    _, folder = _hf_model(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor "
                                                "pytorch_model.bin"):
        GPTModel.from_hf(folder)


def test_a_hugging_face_folders_vocab_and_merges_give_gpt2s_ids(tmp_path):
    # vocab.json + merges.txt are GPT-2's encoder.json + vocab.bpe under other names;
    # checked against transformers' own GPT-2 tokenizer built from the same two files.
    import shutil
    from pathlib import Path

    from qkv.data import get_tokenizer

    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2"
    if not (shared / "encoder.json").is_file():
        pytest.skip("GPT-2's BPE files are not beside the repository")
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(shared / "encoder.json", folder / "vocab.json")
    shutil.copy(shared / "vocab.bpe", folder / "merges.txt")
    ours = get_tokenizer("gpt2", bpe_dir=folder)
    theirs = transformers.GPT2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    text = ("Hello, do you like tea? <|endoftext|> In the sunlit terraces of "
            "someunknownPlace. Ça alors ! 1234  spaces\n\ttabs")
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text) == get_tokenizer("gpt2", bpe_dir=shared).encode(text)
    assert ours.decode(ours.encode(text)) == text


def _hf_folder_with_tokenizer(tmp_path):
    import shutil
    from pathlib import Path

    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2"
    if not (shared / "encoder.json").is_file():
        pytest.skip("GPT-2's BPE files are not beside the repository")
    hf, folder = _hf_model(tmp_path, seed=5, vocab_size=50257, n_positions=64)
    shutil.copy(shared / "encoder.json", folder / "vocab.json")
    shutil.copy(shared / "vocab.bpe", folder / "merges.txt")
    return hf, folder


def test_lm_import_makes_a_run_that_generates_what_transformers_generates(tmp_path, capsys):
    from qkv.cli import main
    from qkv.tasks.lm import LanguageModel

    hf, folder = _hf_folder_with_tokenizer(tmp_path)
    run = tmp_path / "run"
    assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 0
    assert "2 layers, 4 heads, width 24, context 64, 50,257 ids" in capsys.readouterr().out
    prompt = "Hello, I am"
    assert main(["lm", "generate", "--ckpt", str(run), "--prompt", prompt,
                 "--max-new-tokens", "12"]) == 0
    ours = capsys.readouterr().out.splitlines()[0]
    tok = transformers.GPT2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    ids = tok(prompt, return_tensors="pt").input_ids
    want = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    assert ours == tok.decode(want[0])
    # the run loads like any other, with the same logits
    lm = LanguageModel.load(run)
    assert lm.settings.qkv_bias and lm.settings.tie_weights and lm.settings.emb_dim == 24
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    assert main(["lm", "attention", "--ckpt", str(run), "--prompt", prompt, "--heatmap",
                 str(tmp_path / "att.png")]) == 0
    # an imported run has weights but no training state: resuming it points to --init
    capsys.readouterr()
    assert main(["lm", "train", "--run-dir", str(run), "--resume", "--epochs", "1",
                 "--no-progress", "--sample", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--init {run}" in err
    # a second import into the same run directory needs --overwrite
    assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_lm_import_refuses_a_tokenizer_of_another_size_before_building(tmp_path, capsys):
    from qkv.cli import main

    _, folder = _hf_folder_with_tokenizer(tmp_path)
    _edit_config(folder, vocab_size=50000)
    capsys.readouterr()  # transformers' own progress bar, from saving the folder
    assert main(["lm", "import", str(folder), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the model has vocab_size 50000 but the GPT-2 tokenizer" in err
    assert not (tmp_path / "run").exists()


def test_an_imported_gpt2_fine_tunes_with_its_own_tokenizer_and_context(tmp_path, capsys):
    import json

    from qkv.cli import main

    _, folder = _hf_folder_with_tokenizer(tmp_path)
    run = tmp_path / "run"
    assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 0
    text = tmp_path / "story.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    tuned = tmp_path / "tuned"
    assert main(["lm", "train", "--init", str(run), "--text", str(text), "--run-dir",
                 str(tuned), "--epochs", "1", "--batch-size", "2", "--no-progress",
                 "--sample", ""]) == 0
    settings = json.loads((tuned / "config.json").read_text())["settings"]
    assert (settings["tokenizer"], settings["context_length"], settings["qkv_bias"],
            settings["tie_weights"], settings["emb_dim"]) == ("gpt2", 64, True, True, 24)
    assert "starting from the weights of" in capsys.readouterr().out
