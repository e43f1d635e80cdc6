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
