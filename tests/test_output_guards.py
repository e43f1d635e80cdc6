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


# ---------------------------------------------------------------------------
# Sizes a user types are bounded before any work: --beam, --max-new-tokens, --num-steps,
# --repeats, --threads


def _main(capsys, *argv):
    from qkv.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "says"), [
    (["translate", "run", "--beam", "1000000"],
     r"--beam must be an integer in \[1, 1,000\] \(1: greedy\), got 1000000 \(each step "
     r"scores beam x vocabulary candidates"),
    (["translate", "run", "--beam", "0"], r"--beam must be an integer in \[1, 1,000\]"),
    (["translate", "eval", "--beam", "5000"], r"--beam must be an integer in \[1, 1,000\]"),
    (["lm", "generate", "--prompt", "x", "--max-new-tokens", str(10**20)],
     r"--max-new-tokens must be an integer in \[0, 100,000\], got 100000000000000000000 "
     r"\(one call generates at most that many"),
    (["lm", "generate", "--prompt", "x", "--max-new-tokens", "-1"],
     r"--max-new-tokens must be an integer in \[0, 100,000\], got -1"),
])
def test_huge_sizes_are_refused_before_the_checkpoint_is_even_read(capsys, tmp_path, argv,
                                                                   says):
    import re

    # The checkpoint does not exist: the error is about the size, so nothing was read.
    code, out, err = _main(capsys, *argv[:2], "--ckpt", str(tmp_path / "none"), *argv[2:])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and re.search(says, err), err
    assert str(tmp_path / "none") not in err


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--repeats", "1000000000000", r"--repeats must be an integer in \[1, 10,000\]"),
    ("--warmup", "-1", r"--warmup must be an integer in \[0, 10,000\]"),
    ("--threads", "100000000", r"--threads must be an integer in \[1, 1,024\]"),
])
def test_bench_counts_are_bounded(capsys, tmp_path, flag, value, says):
    import re

    code, out, err = _main(capsys, "bench", "data", "--quick", flag, value,
                           "--out", str(tmp_path / "bench"))
    assert code == 2 and err.count("\n") == 1 and re.search(says, err), err
    assert not (tmp_path / "bench").exists()  # refused before the folder was made


def test_bench_train_checks_its_batches_against_memory_before_making_them(
        capsys, tmp_path, monkeypatch):
    from qkv.training import limits

    monkeypatch.setattr(limits, "available_memory", lambda device="cpu": 2**30)
    code, _, err = _main(capsys, "bench", "train", "--quick", "--batch-size", "10000000",
                         "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    # 2 steps x 10,000,000 x 33 ids x 8 bytes
    assert "making the random token ids of 2 steps of 10,000,000 x 32 tokens ('tiny') " \
           "needs at least 4.9 GiB, but 1.0 GiB is available" in err


def test_generate_refuses_an_unbounded_length_and_keeps_its_output_in_one_buffer():
    from qkv.models.gpt import MAX_NEW_TOKENS, GPTConfig, GPTModel, generate

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=50, context_length=8, emb_dim=16, n_heads=2,
                               n_layers=1, drop_rate=0.0))
    idx = torch.tensor([[1, 2, 3]])
    for bad in (10**20, MAX_NEW_TOKENS + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"max_new_tokens must be an integer in \[0, "):
            generate(model, idx, bad)
    # Past the context: the book's loop (crop, forward, argmax, append) gives the same ids.
    want = idx
    with torch.no_grad():
        for _ in range(20):
            logits = model(want[:, -8:])
            want = torch.cat([want, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    for use_cache in (True, False):
        assert torch.equal(generate(model, idx, 20, use_cache=use_cache), want)


def test_beam_search_memory_is_checked_before_decoding(monkeypatch):
    from qkv.data.translate import RESERVED_TOKENS, Vocab
    from qkv.models import Seq2SeqConfig, build_model
    from qkv.tasks.translate import TranslateSettings, Translator
    from qkv.training import InsufficientMemoryError, limits

    vocab = Vocab([f"w{i}" for i in range(2000)], reserved_tokens=RESERVED_TOKENS)
    config = Seq2SeqConfig(model="transformer", src_vocab_size=len(vocab),
                           tgt_vocab_size=len(vocab), embed_size=8, num_hiddens=8,
                           num_layers=2, dropout=0.0, num_heads=2, ffn_num_hiddens=16,
                           max_len=64)
    translator = Translator(build_model(config), vocab, vocab,
                            TranslateSettings(data="pairs.tsv", num_steps=10))
    monkeypatch.setattr(limits, "available_memory", lambda device="cpu": 10 * 2**20)
    # 4 bytes x 1,000 x (3 x 2,004 + 10 x 10 + (10 + 2 x 2 x 10) x 8) = 26.0 MB > 10 MiB
    with pytest.raises(InsufficientMemoryError,
                       match=r"beam search with a beam of 1,000 of 10 steps over 2,004 "
                             r"target words needs at least 24\.8 MiB, but 10\.0 MiB"):
        translator.translate(["w1 w2"], beam=1000)
    with pytest.raises(InsufficientMemoryError, match="beam of 1,000"):
        translator.predict([["w1"]], beam=1000)
    (t,) = translator.translate(["w1 w2"], beam=3)  # 80 KB: decodes
    assert len(t.tokens) <= 10
    with pytest.raises(ValueError, match=r"num_steps must be an integer in \[2, 100000\]"):
        translator.translate(["w1"], num_steps=10**9)


# ---------------------------------------------------------------------------
# Generation streams its text, never splitting a character


def test_text_stream_pieces_join_to_the_decoded_text_and_never_split_a_character():
    from qkv.data.tokenizers import ByteTokenizer
    from qkv.tasks.lm import TextStream

    tokenizer = ByteTokenizer()
    text = "héllo wörld € 😀 ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # multi-byte characters: several ids each
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[:2] == ["h", ""] and pieces[2] == "é"  # given out as soon as whole
    # Bytes that are no UTF-8 at all, and a character cut off by <|endoftext|>: the same
    # text as decoding everything at once.
    raw = [0xFF, 0x41, 0xE2, 0x82, 256, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xE2]
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in raw] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(raw)


def test_language_model_generate_streams_and_stops_when_told(tmp_path):
    from qkv.data.tokenizers import ByteTokenizer
    from qkv.models.gpt import GPTConfig, GPTModel
    from qkv.tasks.lm import LanguageModel, LMSettings

    torch.manual_seed(3)
    model = GPTModel(GPTConfig(vocab_size=257, context_length=16, emb_dim=16, n_heads=2,
                               n_layers=1, drop_rate=0.0))
    lm = LanguageModel(model, ByteTokenizer(), LMSettings())
    pieces: list[str] = []
    out = lm.generate("ab", 40, temperature=1.0, seed=0, on_text=pieces.append)
    assert "".join(pieces) == out.text and out.new_tokens == 40
    assert len(pieces) >= 10  # piece by piece, not all at the end
    assert out.text == lm.generate("ab", 40, temperature=1.0, seed=0).text

    class EnoughError(Exception):
        pass

    calls = []

    def stop_after_three(piece):
        calls.append(piece)
        if len(calls) == 3:
            raise EnoughError

    lm.model.train()
    with pytest.raises(EnoughError):
        lm.generate("ab", 40, on_text=stop_after_three)
    assert len(calls) == 3 and lm.model.training  # stopped; the model's mode restored


# ---------------------------------------------------------------------------
# Warnings: one bounded line of qkv's own


def test_library_warnings_are_one_bounded_line_each(capsys, monkeypatch):
    import warnings

    import qkv.cli.lm

    def noisy(args):
        long = "the input was " + "x" * 10_000
        warnings.warn(long, UserWarning, stacklevel=1)
        warnings.warn(long, UserWarning, stacklevel=1)  # said once
        warnings.warn("two\nlines", RuntimeWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(qkv.cli.lm, "run_generate", noisy)
    code, out, err = _main(capsys, "lm", "generate", "--ckpt", "x", "--prompt", "y")
    assert code == 0 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("qkv lm: warning: the input was xxx")
    assert lines[0].endswith("... (10,014 characters in all)") and len(lines[0]) < 260
    assert lines[1] == "qkv lm: warning: two lines"


# ---------------------------------------------------------------------------
# A closed or full stdout, in a real process


def _qkv(*argv, stdout, preexec_fn=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(qkv.__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "qkv", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=300,
                          preexec_fn=preexec_fn)


def _close_stdout():
    import os

    os.close(1)


def test_a_stdout_closed_before_qkv_starts_is_named_and_nothing_runs(tmp_path):
    done = _qkv("walkthrough", "--heatmap", str(tmp_path / "wt.png"), stdout=None,
                preexec_fn=_close_stdout)
    assert done.returncode == 2
    assert done.stderr == ("qkv walkthrough: error: stdout was closed before qkv started, "
                           "so the output would be lost; redirect it to a file (or to "
                           "/dev/null)\n")
    assert not (tmp_path / "wt.png").exists()


def test_a_full_stdout_is_named_as_such(tmp_path):
    from pathlib import Path

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    with open("/dev/full", "w") as full:
        done = _qkv("walkthrough", stdout=full)
    assert done.returncode == 2
    assert done.stderr == ("qkv walkthrough: error: stdout could not be written (No space "
                           "left on device); the output is lost\n")


def test_training_with_a_closed_or_full_stdout_runs_on_and_says_so(tmp_path):
    from pathlib import Path

    from qkv.training import checkpoint_progress

    cases = [("closed", None, _close_stdout, "was closed before qkv started")]
    if Path("/dev/full").exists():
        cases.append(("full", open("/dev/full", "w"), None,  # noqa: SIM115
                      "could not be written (No space left on device)"))
    for name, stdout, preexec_fn, says in cases:
        run_dir = tmp_path / name
        done = _qkv("translate", "train", "--num-examples", "200", "--epochs", "1",
                    "--run-dir", str(run_dir), "--no-progress", stdout=stdout,
                    preexec_fn=preexec_fn)
        if stdout is not None:
            stdout.close()
        assert done.returncode == 0, done.stderr
        assert done.stderr.endswith(f"qkv translate train: stdout {says}, so output stopped; "
                                    "training ran on to the end\n"), done.stderr
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
        assert checkpoint_progress(run_dir) == (1, 1)


def test_a_deeply_nested_vocab_json_is_bad_input(tmp_path):
    from qkv.data.tokenizers import get_tokenizer

    (tmp_path / "vocab.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match=r"vocab\.json and .*merges\.txt are not a matching "
                                         r"GPT-2 BPE pair \(RecursionError"):
        get_tokenizer("gpt2", bpe_dir=tmp_path)
