"""Output is never garbage, and no size a user types is unbounded (issue 21, items 3 and 6):
valid_lens values, reserved tokens in decoding, imported weights, JSON nesting, beam and
max-new-tokens bounds, streamed generation, library warnings and a closed or full stdout."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import functional as F

# ---------------------------------------------------------------------------
# valid_lens: whole numbers in [0, num_keys], or a one-line ValueError


BAD_LENS = [
    (torch.tensor([3.5, 1.0]), r"got 3\.5: not a whole number"),
    (torch.tensor([-1, 2]), r"got -1: negative"),
    (torch.tensor([2, 5]), r"got 5: more than the 4 keys there are"),
    (torch.tensor([float("nan"), 1.0]), r"got nan: not a whole number"),
    (torch.tensor([[1, 2], [2, 7]]), r"got 7: more than the 4 keys"),
]


@pytest.mark.parametrize(("lens", "message"), BAD_LENS)
def test_masked_softmax_refuses_lengths_it_would_round_or_clamp(lens, message):
    X = torch.rand(2, 2, 4)
    with pytest.raises(ValueError, match=r"valid_lens must be whole numbers in \[0, 4\].*"
                                         + message):
        qkv.masked_softmax(X, lens)


@pytest.mark.parametrize(("lens", "message"), BAD_LENS)
def test_attention_modules_refuse_bad_lengths(lens, message):
    torch.manual_seed(0)
    queries, keys = torch.randn(2, 2, 8), torch.randn(2, 4, 8)
    values = torch.randn(2, 4, 3)
    dot = qkv.DotProductAttention(dropout=0.0)
    with pytest.raises(ValueError, match=message):
        dot(queries, keys, values, lens)
    mha = qkv.MultiHeadAttention(8, 8, num_heads=2, dropout=0.0)
    with pytest.raises(ValueError, match=message):
        mha(queries, keys, valid_lens=lens)


def test_whole_number_lengths_of_any_dtype_mean_the_same_as_integers():
    # d2l passes float tensors of whole numbers as well as integer ones; the bounds
    # themselves (0 and the number of keys) are valid.
    torch.manual_seed(0)
    X = torch.rand(3, 2, 4)
    ints = torch.tensor([0, 2, 4])
    expected = torch.softmax(X.masked_fill(torch.arange(4) >= ints[:, None, None], -1e6), -1)
    for lens in (ints, ints.float(), ints.double(), ints.int()):
        torch.testing.assert_close(qkv.masked_softmax(X, lens), expected)


def test_a_length_changed_in_place_is_checked_again():
    # The check reads a tensor's values once however many layers pass it; a change in
    # place must not slip through that.
    X = torch.rand(2, 2, 4)
    lens = torch.tensor([1, 2])
    qkv.masked_softmax(X, lens)
    qkv.masked_softmax(X, lens)
    lens[0] = 9
    with pytest.raises(ValueError, match="got 9"):
        qkv.masked_softmax(X, lens)
    with pytest.raises(ValueError, match="got 3"):  # the same tensor, fewer keys
        qkv.masked_softmax(X[..., :2], torch.tensor([3, 1]))
    assert F.check_valid_lens(torch.tensor([4, 0]), 2, 2, 4) is None


# ---------------------------------------------------------------------------
# Hugging Face folders: non-floating or non-finite weights, deeply nested config.json


def _hf_folder(tmp_path, *, with_tokenizer=False):
    transformers = pytest.importorskip("transformers")
    import shutil
    from pathlib import Path

    vocab = 101
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2"
    if with_tokenizer:
        if not (shared / "encoder.json").is_file():
            pytest.skip("GPT-2's BPE files are not beside the repository")
        vocab = 50257
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=24, n_layer=2,
                                     n_head=4)
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    if with_tokenizer:
        shutil.copy(shared / "encoder.json", folder / "vocab.json")
        shutil.copy(shared / "vocab.bpe", folder / "merges.txt")
    return model, folder


def _rewrite_weights(folder, name, change, *, as_bin=False):
    """Save the folder's weights again with ``change`` applied to tensor ``name``."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights[f"transformer.{name}"] = change(weights[f"transformer.{name}"])
    if as_bin:
        (folder / "model.safetensors").unlink()
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, folder / "model.safetensors")


def _nan_at_one(t):
    t = t.clone()
    t.view(-1)[7] = float("nan")
    return t


@pytest.mark.parametrize("as_bin", [False, True], ids=["safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize(("name", "change", "message"), [
    ("h.1.mlp.c_fc.weight", _nan_at_one,
     r"h\.1\.mlp\.c_fc\.weight holds 1 NaN or infinite value\(s\) of 2,304"),
    ("ln_f.bias", lambda t: t.clone().fill_(float("inf")),
     r"ln_f\.bias holds 24 NaN or infinite value\(s\) of 24"),
    ("wte.weight", lambda t: t.round().to(torch.int32),
     r"wte\.weight holds (I32|int32) values; GPT-2's weights are floating point"),
    ("h.0.ln_1.weight", lambda t: t > 0,
     r"h\.0\.ln_1\.weight holds (BOOL|bool) values"),
], ids=["nan", "inf", "int32", "bool"])
def test_weights_that_are_not_finite_floats_are_refused_naming_the_tensor(
        tmp_path, name, change, message, as_bin):
    from qkv.models.gpt import GPTModel

    _, folder = _hf_folder(tmp_path)
    _rewrite_weights(folder, name, change, as_bin=as_bin)
    with pytest.raises(ValueError, match=message):
        GPTModel.from_hf(folder)


def test_lm_import_of_nan_or_integer_weights_is_one_line_exit_2_and_no_run(tmp_path, capsys):
    from qkv.cli import main
    from qkv.training import is_checkpoint

    _, folder = _hf_folder(tmp_path, with_tokenizer=True)
    for i, (name, change, says) in enumerate([
            ("h.0.attn.c_attn.weight", _nan_at_one, "h.0.attn.c_attn.weight holds 1 NaN"),
            ("wpe.weight", lambda t: (t * 100).to(torch.int64), "wpe.weight holds I64")]):
        _rewrite_weights(folder, name, change)
        capsys.readouterr()
        run = tmp_path / f"run{i}"
        assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
        assert not is_checkpoint(run)
        _hf_folder(tmp_path, with_tokenizer=True)  # a sound folder again


@pytest.mark.parametrize("depth", [40, 100_000])
def test_a_deeply_nested_config_json_is_bad_input(tmp_path, capsys, depth):
    import json

    from qkv.cli import main
    from qkv.models.hf_gpt2 import read_config

    _, folder = _hf_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    text = json.dumps(config)[:-1] + ', "nested": ' + "[" * depth + "]" * depth + "}"
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config\.json: JSON nested more than 32 levels"):
        read_config(folder)
    capsys.readouterr()
    assert main(["lm", "import", str(folder), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "JSON nested more than 32 levels deep" in err


# ---------------------------------------------------------------------------
# Decoding never outputs <pad> or <bos>


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_a_translator_never_outputs_reserved_tokens_however_much_the_model_wants_them(
        model_name):
    from torch import nn

    from qkv.data.translate import BOS, EOS, PAD, RESERVED_TOKENS, Vocab
    from qkv.models import Seq2SeqConfig, build_model, greedy_decode
    from qkv.tasks.translate import TranslateSettings, Translator

    src_vocab = Vocab(["go", "home", "now"], reserved_tokens=RESERVED_TOKENS)
    tgt_vocab = Vocab(["va", "maison", "vite"], reserved_tokens=RESERVED_TOKENS)
    config = Seq2SeqConfig(model=model_name, src_vocab_size=len(src_vocab),
                           tgt_vocab_size=len(tgt_vocab), embed_size=8, num_hiddens=8,
                           num_layers=1, dropout=0.0, num_heads=2, ffn_num_hiddens=16,
                           max_len=16)
    torch.manual_seed(0)
    model = build_model(config)
    head = [m for m in model.modules()
            if isinstance(m, nn.Linear) and m.out_features == len(tgt_vocab)][-1]
    pad, bos, eos = tgt_vocab[PAD], tgt_vocab[BOS], tgt_vocab[EOS]
    with torch.no_grad():  # what a model trained on a handful of pairs may end up like
        head.bias[pad], head.bias[bos], head.bias[eos] = 60.0, 50.0, -60.0
    translator = Translator(model, src_vocab, tgt_vocab,
                            TranslateSettings(data="pairs.tsv", num_steps=6))
    # Unbanned, the model's first choices are the reserved tokens: the test can fail.
    src = torch.tensor([[src_vocab["go"], eos, 1, 1, 1, 1]])
    raw, _ = greedy_decode(model, src, torch.tensor([2]), bos_id=bos, eos_id=eos,
                           max_steps=6)
    assert set(raw[0]) == {pad}
    for beam in (1, 3):
        (t,) = translator.translate(["go home"], beam=beam)
        assert len(t.tokens) == 6  # <eos> is never chosen either: the next best words are
        assert not set(t.tokens) & {PAD, BOS, EOS}, t.tokens
        outputs = translator.predict([["go", "home"], ["now"]], beam=beam)
        assert all(out and not set(out) & {PAD, BOS, EOS} for out in outputs), outputs
