"""qkv translate end to end on corpora the tests write: train, run, eval, errors."""

import dataclasses
import hashlib
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli import main
from qkv.tasks.translate import TranslateSettings, Translator, train_translator

PAIRS = [
    ("Go.", "Va !"), ("I lost.", "J'ai perdu."), ("I'm home.", "Je suis chez moi."),
    ("He's calm.", "Il est calme."), ("Hi.", "Salut !"), ("Run!", "Cours !"),
    ("Who?", "Qui ?"), ("Wow!", "Ça alors !"), ("I won.", "J'ai gagné."),
    ("Help!", "À l'aide !"), ("Stop!", "Arrête !"), ("Wait!", "Attends !"),
    ("I see.", "Je comprends."), ("I try.", "J'essaye."), ("I paid.", "J'ai payé."),
    ("Be calm.", "Sois calme !"), ("Be nice.", "Sois gentil !"), ("Get up.", "Lève-toi !"),
    ("Go on.", "Poursuis."), ("I'm OK.", "Je vais bien."),
]
FAST = ["--preset", "d2l", "--min-freq", "1", "--dropout", "0", "--lr", "0.01", "--no-progress"]



@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tiny.txt"
    # A third column (attribution) is ignored, like the Tatoeba export's.
    path.write_text("".join(f"{s}\t{t}\tCC-BY\n" for s, t in PAIRS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    code = main(["translate", "train", "--data", str(corpus), "--run-dir", str(run_dir),
                 "--epochs", "80", "--batch-size", "4", *FAST])
    assert code == 0
    return run_dir


def test_train_overfits_and_reports(trained, capsys):
    # (output of the module fixture was captured earlier; check the artefacts instead)
    for name in ("model.safetensors", "config.json", "checkpoint.json", "loss.png",
                 "attention.png"):
        assert (trained / name).is_file(), name
    assert (trained / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((trained / "config.json").read_text())
    assert config["settings"]["data"].endswith("tiny.txt")
    assert config["model"]["src_vocab_size"] == len(config["src_vocab"]["idx_to_token"])


def test_run_translates_the_training_pairs(trained, capsys):
    assert main(["translate", "run", "--ckpt", str(trained), "--text", "go .", "i lost .",
                 "I'm home.", "he's calm ."]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "go . => va !",
        "i lost . => j'ai perdu .",
        "I'm home. => je suis chez moi .",
        "he's calm . => il est calme .",
    ]


def test_translate_pads_the_source_like_training(trained):
    """The GRU encoder reads padding in training, so inference must pad the same way."""
    translator = Translator.load(trained)
    seen = []
    encode = translator.model.encode
    translator.model.encode = lambda src, valid, **kw: seen.append((src, valid)) or encode(
        src, valid, **kw
    )
    translator.translate(["go ."])
    src, valid = seen[0]
    assert src.shape == (1, translator.settings.num_steps) and valid.tolist() == [3]
    assert src[0, 3:].eq(translator.src_vocab["<pad>"]).all()


def test_bleu_against_references(trained, capsys):
    assert main(["translate", "run", "--ckpt", str(trained), "--text", "go .", "i lost .",
                 "--ref", "Va !", "j'ai gagné."]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "go . => va !, bleu 1.000",
        "i lost . => j'ai perdu ., bleu 0.000",
    ]
    one_line_error(capsys, ["translate", "run", "--ckpt", str(trained), "--text", "go .",
                            "--ref", "a", "b"], "--ref has 2 sentences but there are 1")


def test_beam_search_and_heatmap(trained, tmp_path, capsys):
    png = tmp_path / "a.png"
    assert main(["translate", "run", "--ckpt", str(trained), "--beam", "3",
                 "--text", "i won .", "--heatmap", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("i won . => j'ai gagné .   (score ")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_words_and_truncation_warning(trained, capsys):
    assert main(["translate", "run", "--ckpt", str(trained), "--num_steps", "3",
                 "--text", "zebra lost the game ."]) == 0
    out = capsys.readouterr().out
    assert "warning: 'zebra lost the game .' has 5 tokens; truncated to num_steps=3" in out
    translator = Translator.load(trained)
    (t,) = translator.translate(["zebra ."])
    assert t.source_tokens == ["zebra", ".", "<eos>"]
    assert translator.src_vocab["zebra"] == translator.src_vocab.unk


def test_eval_on_the_training_file(trained, corpus, capsys):
    assert main(["translate", "eval", "--ckpt", str(trained), "--data", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\(20 pairs, greedy\): exact match 100\.0%, BLEU \(d2l, k=2\) 1\.000, "
                     r"sacreBLEU 100\.0 \(13a, detokenized\)", out), out


def test_eval_without_sacrebleu_reports_the_rest(trained, corpus, capsys, monkeypatch):
    import sys

    # sacreBLEU is an optional extra; `pip install -e .` alone must still train and evaluate
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # makes `import sacrebleu` fail
    assert main(["translate", "eval", "--ckpt", str(trained), "--data", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\(20 pairs, greedy\): exact match 100\.0%, BLEU \(d2l, k=2\) 1\.000, "
                     r"sacreBLEU n/a \(pip install 'qkv\[bleu\]'\)", out), out


def one_line_error(capsys, argv, match):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert re.search(match, captured.err), captured.err


def _rehash(run_dir, name):
    manifest = json.loads((run_dir / "checkpoint.json").read_text())
    data = (run_dir / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (run_dir / "checkpoint.json").write_text(json.dumps(manifest))


def test_checkpoint_errors(trained, tmp_path, capsys):
    one_line_error(capsys, ["translate", "run", "--ckpt", str(tmp_path / "nope")],
                   "qkv translate: error: .*nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in trained.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    # A vocabulary that no longer matches the weights (manifest re-hashed to match).
    config = json.loads((bad / "config.json").read_text())
    config["src_vocab"]["idx_to_token"].append("extra")
    (bad / "config.json").write_text(json.dumps(config))
    _rehash(bad, "config.json")
    one_line_error(capsys, ["translate", "run", "--ckpt", str(bad)],
                   r"vocabulary sizes .* do not match the model's")
    # A corrupt weights file.
    data = bytearray((trained / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "config.json").write_bytes((trained / "config.json").read_bytes())
    _rehash(bad, "config.json")
    (bad / "model.safetensors").write_bytes(bytes(data))
    one_line_error(capsys, ["translate", "run", "--ckpt", str(bad)], r"model\.safetensors")


def test_input_errors(trained, capsys):
    one_line_error(capsys, ["translate", "run", "--ckpt", str(trained), "--text", "  "],
                   "cannot translate '  ': it has no tokens")
    one_line_error(capsys, ["translate", "run", "--ckpt", str(trained), "--beam", "0"],
                   r"--beam must be an integer in \[1, 1,000\] \(1: greedy\), got 0")
    one_line_error(capsys, ["translate", "run", "--ckpt", str(trained), "--heatmap", "x.bmp"],
                   r"cannot write an image to 'x\.bmp'")
    one_line_error(capsys, ["translate", "train", "--data", "/no/such/file.txt"],
                   "neither 'dates', 'fra-eng' nor an existing file")
    one_line_error(capsys, ["translate", "train", "--epochs", "-1"],
                   r"epochs must be an integer in \[0, 2147483647\], got -1")
    with pytest.raises(SystemExit) as info:
        main(["translate", "run"])
    assert info.value.code == 2
    assert "the following arguments are required: --ckpt" in capsys.readouterr().err


def test_resume_continues_exactly(corpus, tmp_path):
    common = dict(data=str(corpus), min_freq=1, lr=0.01, seed=3)
    straight, _ = train_translator(TranslateSettings(**common, epochs=6), tmp_path / "a",
                                   progress=False, log=lambda _: None)
    train_translator(TranslateSettings(**common, epochs=3), tmp_path / "b", progress=False,
                     log=lambda _: None)
    resumed, history = train_translator(TranslateSettings(epochs=6), tmp_path / "b",
                                        resume=True, progress=False, log=lambda _: None)
    assert history["epoch"] == [1, 2, 3, 4, 5, 6]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(
        tmp_path / "b" / "model.safetensors"
    )
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_dates_default_runs_end_to_end(tmp_path, capsys):
    run_dir = tmp_path / "dates"
    assert main(["translate", "train", "--run-dir", str(run_dir), "--epochs", "1",
                 "--num-examples", "400", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^loss [0-9.]+, [0-9.]+ tokens/sec on cpu$", out, flags=re.M)
    assert "tuesday, march 3, 2021 => " in out
    assert re.search(r"held-out \(40 pairs, greedy\): exact match [0-9.]+%", out)
    assert (run_dir / "attention.png").is_file()


def test_transformer_and_trace(corpus, tmp_path, capsys):
    run_dir = tmp_path / "tr"
    assert main(["translate", "train", "--data", str(corpus), "--model", "transformer",
                 "--run-dir", str(run_dir), "--epochs", "2", "--trace", *FAST]) == 0
    out = capsys.readouterr().out
    assert "transformer translator:" in out
    assert main(["translate", "run", "--ckpt", str(run_dir), "--text", "go ."]) == 0
    assert capsys.readouterr().out.startswith("go . => ")


def test_fra_eng_data_goes_through_the_verified_download(corpus, tmp_path, monkeypatch, capsys):
    """--data fra-eng trains on whatever download_fra_eng returns (tested on a local server
    in test_data_translation.py); here it is stubbed to the test corpus."""
    import qkv.tasks.translate

    calls = []
    monkeypatch.setattr(qkv.tasks.translate, "download_fra_eng",
                        lambda: calls.append(1) or corpus)
    assert main(["translate", "train", "--data", "fra-eng", "--run-dir", str(tmp_path / "f"),
                 "--epochs", "1", *FAST]) == 0
    assert calls == [1]
    assert "20 training pairs" in capsys.readouterr().out


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_loss_skips_all_padding_steps_without_changing_loss_or_gradients(model_name):
    from qkv.models.build import build_model
    from qkv.models.seq2seq import Seq2SeqConfig, teacher_forcing_input
    from qkv.tasks.translate import translation_loss
    from qkv.training.losses import masked_cross_entropy

    torch.manual_seed(0)
    config = Seq2SeqConfig(model=model_name, src_vocab_size=12, tgt_vocab_size=12,
                           embed_size=16, num_hiddens=16, dropout=0.0)
    model = build_model(config).double()
    src = torch.randint(4, 12, (5, 9))
    src_len = torch.tensor([9, 4, 2, 7, 5])
    tgt = torch.randint(4, 12, (5, 9))
    tgt_len = torch.tensor([3, 6, 1, 4, 6])  # every row ends by step 6 of 9
    tgt[torch.arange(9)[None, :] >= tgt_len[:, None]] = 1  # <pad>
    bos = 2

    # independent reference: the model over all 9 steps, the loss masked afterwards
    full = masked_cross_entropy(model(src, src_len, teacher_forcing_input(tgt, bos)), tgt,
                                tgt_len)
    ref_grads = torch.autograd.grad(full[0], list(model.parameters()), allow_unused=True)
    steps_seen = []
    handle = model.register_forward_hook(lambda m, args, out: steps_seen.append(out.shape[1]))
    loss_sum, tokens = translation_loss(bos)(model, (src, src_len, tgt, tgt_len))
    handle.remove()
    assert steps_seen == [6]
    assert int(tokens) == int(full[1]) == 20
    torch.testing.assert_close(loss_sum, full[0])
    grads = torch.autograd.grad(loss_sum, list(model.parameters()), allow_unused=True)
    for a, b in zip(grads, ref_grads, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b)


def test_a_checkpoint_runs_under_the_eager_backend_with_the_same_translations(trained, tmp_path):
    """The backend is how the model computes, not what it is: a checkpoint saved by the
    fused default loads with backend 'eager' (d2l's loop) and translates the same."""
    eager = tmp_path / "eager"
    eager.mkdir()
    for f in trained.iterdir():
        if f.is_file():
            (eager / f.name).write_bytes(f.read_bytes())
    config = json.loads((eager / "config.json").read_text())
    assert config["model"]["backend"] == "fused"
    config["model"]["backend"] = "eager"
    (eager / "config.json").write_text(json.dumps(config))
    _rehash(eager, "config.json")
    fused, loaded = Translator.load(trained), Translator.load(eager)
    assert loaded.model.decoder.backend == "eager"
    sentences = ["go .", "i lost .", "he's calm .", "i'm home ."]
    for a, b in zip(fused.translate(sentences), loaded.translate(sentences), strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.attention, b.attention, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# --backend: how the model computes, never what it is

TINY_DATES = ["--num-examples", "200", "--num-hiddens", "16", "--embed-size", "16",
              "--num-heads", "2", "--ffn-num-hiddens", "16", "--num-layers", "1",
              "--epochs", "1", "--batch-size", "32", "--dropout", "0", "--min-freq", "1",
              "--no-progress"]


def _history(run_dir):
    return json.loads((run_dir / "trainer.json").read_text())["trainer_state"]["history"]


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_backend_flag_trains_the_same_loss_and_is_recorded(model_name, tmp_path, capsys):
    """One epoch of a tiny dates model under each backend: the same batches, the same
    weights, so the same loss to float32 rounding; the checkpoint says which ran."""
    losses = {}
    for backend in ("fused", "eager"):
        run_dir = tmp_path / backend
        assert main(["translate", "train", "--model", model_name, "--run-dir", str(run_dir),
                     "--backend", backend, *TINY_DATES]) == 0
        config = json.loads((run_dir / "config.json").read_text())
        assert config["settings"]["backend"] == config["model"]["backend"] == backend
        losses[backend] = _history(run_dir)["loss"]
    capsys.readouterr()
    assert len(losses["fused"]) == 1
    torch.testing.assert_close(losses["eager"], losses["fused"], rtol=1e-4, atol=1e-5)
    # and the eager run's modules really ran eager
    translator = Translator.load(tmp_path / "eager")
    if model_name == "bahdanau":
        assert (translator.model.encoder.backend, translator.model.decoder.backend) == (
            "eager", "eager")
    else:
        layers = [m for m in translator.model.modules() if hasattr(m, "W_query")]
        assert layers and {m.backend for m in layers} == {"eager"}


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_eval_and_run_under_the_other_backend_translate_the_same(model_name, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["translate", "train", "--model", model_name, "--run-dir", str(run_dir),
                 *TINY_DATES]) == 0
    capsys.readouterr()
    outputs = {}
    for backend in ("fused", "eager"):
        assert main(["translate", "eval", "--ckpt", str(run_dir), "--backend", backend]) == 0
        assert main(["translate", "run", "--ckpt", str(run_dir), "--backend", backend]) == 0
        outputs[backend] = capsys.readouterr().out
    assert outputs["eager"] == outputs["fused"]
    assert "held-out (20 pairs, greedy): exact match" in outputs["fused"]
    # The flag overrides the checkpoint's backend, for this load only.
    assert Translator.load(run_dir, backend="eager").settings.backend == "eager"
    assert json.loads((run_dir / "config.json").read_text())["model"]["backend"] == "fused"


def test_resume_may_change_the_backend(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["translate", "train", "--run-dir", str(run_dir), *TINY_DATES]) == 0
    resume = ["translate", "train", "--run-dir", str(run_dir), "--resume", "--no-progress"]
    assert main([*resume, "--epochs", "2", "--backend", "eager"]) == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["settings"]["backend"] == config["model"]["backend"] == "eager"
    # Without the flag a resume keeps the run's backend.
    assert main([*resume, "--epochs", "3"]) == 0
    assert json.loads((run_dir / "config.json").read_text())["model"]["backend"] == "eager"
    assert _history(run_dir)["epoch"] == [1, 2, 3]
    capsys.readouterr()


@pytest.mark.parametrize("action", [["train"], ["eval", "--ckpt", "x"], ["run", "--ckpt", "x"]])
def test_bad_backend_is_one_line_exit_2(action, capsys):
    with pytest.raises(SystemExit) as info:
        main(["translate", *action, "--backend", "cuda"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--backend: invalid choice: 'cuda' (choose from " in err
    assert "fused" in err and "eager" in err


def test_bad_backend_in_the_library_is_one_line(trained):
    with pytest.raises(ValueError, match="^backend must be one of 'fused', 'eager', got 'cuda'$"):
        TranslateSettings(backend="cuda").resolved()
    with pytest.raises(ValueError, match="^backend must be one of 'fused', 'eager', got 'x'$"):
        Translator.load(trained, backend="x")


# ---------------------------------------------------------------------------- recipes


def _many_pairs(n: int) -> str:
    # Distinct pairs: "i see N ." -> "je vois N ." for N in 0..n-1, plus the d2l ones.
    lines = [f"I see {i}.\tJe vois {i}." for i in range(n)]
    return "".join(f"{line}\n" for line in lines)


def test_corpus_recipe_is_chosen_for_a_file_and_printed(tmp_path, capsys):
    corpus = tmp_path / "pairs.txt"
    corpus.write_text(_many_pairs(400), encoding="utf-8")
    run_dir = tmp_path / "run"
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(run_dir),
                 "--num-hiddens", "16", "--embed-size", "16", "--epochs", "2", "--beam", "2",
                 "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    settings = json.loads((run_dir / "config.json").read_text())["settings"]
    # every pair read; 5 % held out, raised to one batch (128) but at most a fifth: 80
    assert settings["preset"] == "corpus" and settings["num_examples"] is None
    assert settings["held_out"] == 80
    assert settings["num_steps"] == 5  # "je vois N ." is 4 tokens, + <eos>
    assert (settings["warmup_steps"], settings["decay"], settings["label_smoothing"],
            settings["patience"]) == (200, "cosine", 0.1, 4)  # bahdanau
    # one line per choice, naming its flag; given flags are not "chosen"
    assert "recipe 'corpus'" in out
    assert "  label_smoothing 0.1  (--label-smoothing)" in out
    assert "  held_out 80  (--held-out)" in out
    assert "--num-hiddens)" not in out and "--epochs)" not in out
    # the report is on the held-out pairs, with the beam and sacreBLEU's tokenizer named
    assert re.search(r"held-out \(80 pairs, beam 2\): exact match [0-9.]+%, BLEU \(d2l, "
                     r"k=2\) [0-9.]+, sacreBLEU [0-9.]+ \(13a, detokenized\)", out), out
    assert "held-out examples:" in out and "(reference: je vois" in out
    assert "tokenized period" not in out
    # early stopping keeps the best weights apart; loading the run uses them
    best = load_file(run_dir / "best" / "model.safetensors")
    loaded = Translator.load(run_dir)
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, best[name]), name


def test_held_out_split_is_deterministic_and_disjoint(tmp_path):
    from qkv.tasks.translate import prepare_run_data

    corpus = tmp_path / "pairs.txt"
    corpus.write_text(_many_pairs(300), encoding="utf-8")
    settings = TranslateSettings(data=str(corpus), batch_size=8).resolved()
    a_settings, a = prepare_run_data(settings)
    b_settings, b = prepare_run_data(settings)
    assert a_settings.held_out == b_settings.held_out == 15  # 5 % of 300
    assert a.valid_pairs == b.valid_pairs and len(a.valid_pairs) == 15
    train = {(tuple(s), tuple(t)) for s, t in a.train_pairs}
    held = {(tuple(s), tuple(t)) for s, t in a.valid_pairs}
    assert not train & held and len(train) + len(held) == 300
    # the vocabularies are built on the training pairs only
    held_only = {w for s, _ in a.valid_pairs for w in s} - {w for s, _ in a.train_pairs
                                                           for w in s}
    assert held_only and all(w not in a.src_vocab for w in held_only)


@pytest.mark.parametrize("n, batch, expected", [
    (18066, 128, 903),      # 5 %
    (400, 128, 80),         # one batch would be 128, but at most a fifth of the pairs
    (1000, 128, 128),       # 5 % = 50, raised to one batch
    (500_000, 64, 5000),    # capped
])
def test_held_out_count_by_corpus_size(n, batch, expected):
    for model, budget in (("bahdanau", 1600), ("transformer", 2700)):
        s = TranslateSettings(data="x.txt", model=model,
                              batch_size=batch).resolved().for_corpus(n, 10)
        assert s.held_out == expected
        steps = -(-(n - expected) // batch)
        assert s.epochs == min(max(-(-budget // steps), 3), 100)


def test_presets_keep_the_books_recipe_for_fra_eng_and_dates():
    d2l = TranslateSettings(data="fra-eng").resolved()
    assert (d2l.recipe, d2l.num_examples, d2l.num_steps, d2l.epochs, d2l.num_hiddens,
            d2l.lr, d2l.held_out, d2l.label_smoothing, d2l.patience, d2l.beam,
            d2l.warmup_steps) == ("d2l", 600, 10, 250, 32, 0.005, 0.0, 0.0, 0, 1, 0)
    dates = TranslateSettings().resolved()
    assert (dates.recipe, dates.num_examples, dates.epochs) == ("dates", 10_000, 10)
    # a file with --preset d2l trains exactly d2l's recipe
    assert TranslateSettings(data="x.txt", preset="d2l").resolved().num_examples == 600


def test_a_run_saved_before_recipes_loads_as_d2l():
    old = dataclasses.asdict(TranslateSettings(data="x.txt", preset="d2l").resolved())
    for name in ("preset", "warmup_steps", "decay", "label_smoothing", "patience", "beam",
                 "accumulate", "dtype", "compile"):
        del old[name]
    loaded = TranslateSettings.from_dict(old)
    assert loaded.recipe == "d2l" and loaded.patience == 0 and loaded.beam == 1


def test_bad_recipe_flags_are_one_line(capsys):
    one_line_error(capsys, ["translate", "train", "--label-smoothing", "1.5"],
                   r"label_smoothing must be")
    one_line_error(capsys, ["translate", "train", "--patience", "-1"], r"patience must be")
    one_line_error(capsys, ["translate", "train", "--decay", "inverse_sqrt",
                            "--warmup-steps", "0"], r"inverse_sqrt' needs warmup_steps")


def test_a_resumed_corpus_run_keeps_the_corpus_recipes_threads(tmp_path, capsys):
    # --threads defaults by recipe; a resume names no --data, so the saved run decides.
    corpus = tmp_path / "pairs.txt"
    corpus.write_text(_many_pairs(300), encoding="utf-8")
    run_dir = tmp_path / "run"
    common = ["--no-progress", "--beam", "1", "--num-hiddens", "8", "--embed-size", "8"]
    before = torch.get_num_threads()
    try:
        assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(run_dir),
                     "--epochs", "1", *common]) == 0
        torch.set_num_threads(1)
        assert main(["translate", "train", "--run-dir", str(run_dir), "--resume",
                     "--epochs", "2", "--no-progress"]) == 0
        assert torch.get_num_threads() == min(os.cpu_count() or 1, 8)
    finally:
        torch.set_num_threads(before)


def test_validation_leaves_the_training_random_stream_alone(tmp_path, monkeypatch):
    # Held-out loss and exact match after each epoch must not change what training draws
    # (dropout masks, shuffles): a run with validation trains exactly as one without.
    from qkv.tasks import pipeline

    settings = TranslateSettings(num_examples=400, epochs=3, num_hiddens=16,
                                 embed_size=16)
    _, with_validation = train_translator(settings, tmp_path / "a", progress=False,
                                          log=lambda s: None)
    real_fit = pipeline.fit

    def fit_without_validation(*args, **kwargs):
        return real_fit(*args, **{**kwargs, "validate": None})

    monkeypatch.setattr(pipeline, "fit", fit_without_validation)
    _, without = train_translator(settings, tmp_path / "b", progress=False,
                                  log=lambda s: None)
    assert "valid_loss" in with_validation and "valid_loss" not in without
    assert with_validation["loss"] == without["loss"]


def test_group_references_collects_every_translation_of_a_sentence():
    from qkv.tasks.translate import group_references

    src = [["go", "."], ["hi", "."], ["go", "."], ["run", "!"], ["go", "."]]
    tgt = [["va", "!"], ["salut", "."], ["marche", "."], ["cours", "!"], ["bouge", "!"]]
    sources, refs = group_references(src, tgt)
    assert sources == [["go", "."], ["hi", "."], ["run", "!"]]
    assert refs == [[["va", "!"], ["marche", "."], ["bouge", "!"]], [["salut", "."]],
                    [["cours", "!"]]]
    with pytest.raises(ValueError, match="2 source and 1 target"):
        group_references(src[:2], tgt[:1])


def test_transformer_loss_is_the_same_with_the_source_padding_trimmed():
    from qkv.models import Seq2SeqConfig, build_model
    from qkv.tasks.translate import translation_loss

    torch.manual_seed(0)
    config = Seq2SeqConfig(model="transformer", src_vocab_size=30, tgt_vocab_size=40, embed_size=16,
                           num_hiddens=16, num_layers=2, num_heads=4, ffn_num_hiddens=32,
                           dropout=0.0)
    model = build_model(config).eval()
    src = torch.randint(3, 30, (6, 12))
    src_len = torch.tensor([3, 5, 2, 4, 5, 1])  # everything past 5 is padding
    src[:, 5:] = 1
    tgt = torch.randint(3, 40, (6, 12))
    tgt_len = torch.tensor([4, 7, 2, 3, 6, 5])
    batch = (src, src_len, tgt, tgt_len)
    full, n_full = translation_loss(2, 0.1)(model, batch)
    trimmed, n_trimmed = translation_loss(2, 0.1, trim_source=True)(model, batch)
    assert n_full == n_trimmed == int(tgt_len.sum())
    torch.testing.assert_close(trimmed, full, rtol=1e-6, atol=1e-6)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    translation_loss(2, trim_source=True)(model, batch)
    assert seen == [5]


def test_a_file_with_several_translations_per_sentence_is_split_and_scored_by_sentence(
        tmp_path, capsys):
    # 100 sentences, each with 1 to 3 translations: held-out sentences are never trained
    # on under another translation, and each is scored once against all of its own.
    lines = []
    for i in range(100):
        for word in ("vois", "regarde", "aperçois")[: i % 3 + 1]:
            lines.append(f"I see {i}.\tJe {word} {i}.")
    corpus = tmp_path / "pairs.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_dir = tmp_path / "run"
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(run_dir),
                 "--num-hiddens", "8", "--embed-size", "8", "--epochs", "1", "--beam", "1",
                 "--batch-size", "16", "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "  split_by source  (--split-by)" in out
    m = re.search(r"held-out \((\d+) sentences, (\d+) references, greedy\)", out)
    assert m, out
    sentences, references = int(m[1]), int(m[2])
    assert references >= 16 > sentences  # at least one batch of pairs held out
    assert re.search(r"\(reference: je \w+ \d+ \. and [12] more\)", out), out
    # the run's saved settings give back the same split: those sentences, with all of
    # their translations, and none of them trained on
    from qkv.tasks.translate import prepare_run_data

    translator = Translator.load(run_dir)
    _, data = prepare_run_data(translator.settings, translator.src_vocab,
                               translator.tgt_vocab)
    held = {tuple(s) for s, _ in data.valid_pairs}
    assert len(held) == sentences and len(data.valid_pairs) == references
    assert not held & {tuple(s) for s, _ in data.train_pairs}
    for s in held:
        i = int(s[2])
        assert sum(tuple(p) == s for p, _ in data.valid_pairs) == i % 3 + 1
    # --split-by pair is the plain random split, and runs saved before it load as that
    capsys.readouterr()
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(run_dir),
                 "--overwrite", "--split-by", "pair", "--num-hiddens", "8", "--embed-size",
                 "8", "--epochs", "1", "--beam", "1", "--batch-size", "16", "--no-progress",
                 "--threads", "1"]) == 0
    assert Translator.load(run_dir).settings.split_by == "pair"
    saved = dataclasses.asdict(TranslateSettings(data="x.txt").resolved()
                               .for_corpus(200, 5))
    del saved["split_by"]
    assert TranslateSettings.from_dict(saved).split_by == "pair"
    assert TranslateSettings(data="x.txt").resolved().split_by == "source"
    assert TranslateSettings(data="fra-eng").resolved().split_by == "pair"


def test_curves_plot_held_out_scores_against_minutes_and_eval_reports_like_training(
        tmp_path, capsys):
    from qkv.training import read_history

    lines = [f"I see {i}.\tJe {w} {i}." for i in range(150)
             for w in ("vois", "regarde")[: i % 2 + 1]]
    corpus = tmp_path / "pairs.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    runs = []
    for model in ("bahdanau", "transformer"):
        runs.append(tmp_path / model)
        assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(runs[-1]),
                     "--model", model, "--num-hiddens", "8", "--embed-size", "8",
                     "--num-heads", "2", "--ffn-num-hiddens", "16", "--epochs", "3",
                     "--beam", "1", "--batch-size", "16", "--no-progress",
                     "--threads", "1"]) == 0
    rng = torch.get_rng_state()
    history = read_history(runs[0])
    assert torch.equal(torch.get_rng_state(), rng)  # reading restores nothing
    assert len(history["seconds"]) == 3 and all(s > 0 for s in history["seconds"])
    assert all(0 <= b <= 100 for b in history["valid_sacrebleu"])
    capsys.readouterr()
    png = tmp_path / "curves.png"
    assert main(["translate", "curves", *map(str, runs), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    minutes = sum(history["seconds"]) / 60
    assert f"bahdanau (bahdanau): 3 epochs, {minutes:.1f} min, last sacrebleu " \
           f"{history['valid_sacrebleu'][-1]:.3f}" in out
    assert "transformer (transformer): 3 epochs" in out
    # eval prints what training's report printed: scores by sentence, then examples
    assert main(["translate", "eval", "--ckpt", str(runs[1]), "--beam", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"held-out \(\d+ sentences, \d+ references, beam 2\): exact match", out)
    assert "held-out examples:" in out and "(reference: je " in out
    # a run trained without a held-out split has nothing to plot: one line, exit 2
    flat = tmp_path / "flat"
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(flat),
                 "--held-out", "0", "--num-hiddens", "8", "--embed-size", "8", "--epochs",
                 "1", "--beam", "1", "--no-progress", "--threads", "1"]) == 0
    one_line_error(capsys, ["translate", "curves", str(flat), "--out", str(png)],
                   r"flat \(bahdanau\): its history has no per-epoch 'seconds' and "
                   r"'valid_sacrebleu'")
    one_line_error(capsys, ["translate", "eval", "--ckpt", str(runs[0]), "--beam", "0"],
                   r"--beam must be an integer in \[1, 1,000\] \(1: greedy\), got 0")


def test_a_resume_may_change_the_forward_dtype_and_compilation_and_keeps_them(tmp_path):
    corpus = tmp_path / "pairs.txt"
    corpus.write_text(_many_pairs(120), encoding="utf-8")
    run_dir = tmp_path / "run"
    small = ["--num-hiddens", "8", "--embed-size", "8", "--beam", "1", "--no-progress",
             "--threads", "1"]
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(run_dir),
                 "--epochs", "1", *small]) == 0

    def saved():
        return json.loads((run_dir / "config.json").read_text())["settings"]

    assert (saved()["dtype"], saved()["compile"]) == ("float32", False)
    assert main(["translate", "train", "--run-dir", str(run_dir), "--resume", "--epochs",
                 "2", "--dtype", "bfloat16", "--no-progress"]) == 0
    assert saved()["dtype"] == "bfloat16"
    # a later resume that names no --dtype goes on in the run's own
    assert main(["translate", "train", "--run-dir", str(run_dir), "--resume", "--epochs",
                 "3", "--no-progress"]) == 0
    assert (saved()["dtype"], saved()["compile"]) == ("bfloat16", False)


def test_the_corpus_recipe_skips_padding_and_d2ls_reads_it():
    from qkv.data.translate import Vocab

    vocab = Vocab([["a", "b"]], 1, ("<pad>", "<bos>", "<eos>"))
    corpus = TranslateSettings(data="x.txt").resolved().for_corpus(1000, 8)
    assert corpus.skip_padding and corpus.model_config(vocab, vocab).skip_padding
    given = TranslateSettings(data="x.txt")
    assert "  skip_padding True  (--skip-padding)" in corpus.choices(given)
    d2l = TranslateSettings(data="fra-eng").resolved()
    assert not d2l.skip_padding and not d2l.model_config(vocab, vocab).skip_padding
    # the Transformer's attention masks padding anyway: its config does not claim it
    tf = TranslateSettings(data="x.txt", model="transformer").resolved().for_corpus(1000, 8)
    assert not tf.model_config(vocab, vocab).skip_padding
    assert not any("skip_padding" in line for line in tf.choices(given))
    off = TranslateSettings(data="x.txt", skip_padding=False).resolved()
    assert off.skip_padding is False


def test_the_corpus_recipe_never_outputs_unk_and_d2ls_may():
    assert TranslateSettings(data="x.txt").resolved().ban_unk is True
    assert TranslateSettings(data="fra-eng").resolved().ban_unk is False
    assert TranslateSettings().resolved().ban_unk is False  # dates
    saved = dataclasses.asdict(TranslateSettings(data="x.txt").resolved().for_corpus(200, 5))
    del saved["ban_unk"]
    assert TranslateSettings.from_dict(saved).ban_unk is False  # runs saved before it


def test_the_bahdanau_translator_trains_under_torch_compile(tmp_path):
    # Its fused kernels draw dropout masks with sizes torch.compile sees as symbols
    # (that crashed). Compiling takes a minute or two on 2 cores: QKV_SLOW=1 only.
    if os.environ.get("QKV_SLOW") != "1":
        pytest.skip("set QKV_SLOW=1 to compile the Bahdanau translator")
    settings = TranslateSettings(num_examples=64, epochs=1, num_hiddens=8, embed_size=8,
                                 batch_size=16, dropout=0.2)
    _, eager = train_translator(settings, tmp_path / "eager", progress=False,
                                log=lambda s: None)
    _, compiled = train_translator(dataclasses.replace(settings, compile=True),
                                   tmp_path / "compiled", progress=False, log=lambda s: None)
    # compiled code draws its dropout masks from its own generator: close, not equal
    assert compiled["loss"][0] == pytest.approx(eager["loss"][0], rel=0.02)
