"""qkv lm end to end on text the tests write: train, generate, attention, errors."""

import json
import re

import pytest
import torch

from qkv.cli import main
from qkv.tasks.lm import LanguageModel, LMSettings, train_language_model
from test_tokenizers import write_tiny_bpe

TEXT = ("The cat sat on the mat. The dog sat on the log. A cat and a dog met on the mat. "
        * 40)
FAST = ["--context-length", "32", "--batch-size", "8", "--no-progress", "--sample", ""]



@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(text_file, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    assert main(["lm", "train", "--text", str(text_file), "--run-dir", str(run_dir),
                 "--epochs", "4", *FAST]) == 0
    return run_dir


def test_train_writes_a_checkpoint(trained):
    for name in ("model.safetensors", "config.json", "checkpoint.json", "loss.png"):
        assert (trained / name).is_file(), name


def test_generate_with_and_without_cache_agree(trained, capsys):
    args = ["lm", "generate", "--ckpt", str(trained), "--prompt", "The cat",
            "--max-new-tokens", "30"]
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert main([*args, "--no-kv-cache"]) == 0
    uncached = capsys.readouterr().out
    # The two paths' float32 logits differ in the last bits, but the trained model's
    # greedy choices are far from ties (closest top-2 gap 0.6 when written), so the
    # texts must be identical.
    assert cached.splitlines()[0] == uncached.splitlines()[0]
    assert cached.startswith("The cat")
    assert re.search(r"30 tokens in [0-9.]+ s: [0-9.]+ tokens/s \(with KV cache", cached)
    assert "without KV cache" in uncached


def test_sampling_is_seedable(trained, capsys):
    args = ["lm", "generate", "--ckpt", str(trained), "--prompt", "A", "--max-new-tokens",
            "20", "--temperature", "1.5", "--top-k", "20"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out.splitlines()[0])
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_attention_heatmap(trained, tmp_path, capsys):
    png = tmp_path / "attn.png"
    assert main(["lm", "attention", "--ckpt", str(trained), "--prompt", "The cat sat",
                 "--heatmap", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lm = LanguageModel.load(trained)
    labels, weights = lm.attention("The cat sat")
    assert labels[:4] == ["T", "h", "e", " "]
    assert len(weights) == lm.model.cfg.n_layers
    w = weights[0]
    assert w.shape == (lm.model.cfg.n_heads, 11, 11)
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:2]))
    assert (w.triu(1) == 0).all()  # causal: nothing above the diagonal


def one_line_error(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(match, err), err


def test_errors(trained, text_file, tmp_path, capsys):
    one_line_error(capsys, ["lm", "train", "--text", str(tmp_path / "none.txt"), *FAST],
                   "text file not found")
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    one_line_error(capsys, ["lm", "train", "--text", str(short), "--run-dir",
                            str(tmp_path / "r"), *FAST], r"too short|fewer than batch_size")
    one_line_error(capsys, ["lm", "generate", "--ckpt", str(tmp_path / "nope"), "--prompt",
                            "x"], "nope")
    one_line_error(capsys, ["lm", "generate", "--ckpt", str(trained), "--prompt", ""],
                   "has no tokens")
    one_line_error(capsys, ["lm", "attention", "--ckpt", str(trained), "--prompt", "ab",
                            "--heatmap", str(tmp_path / "a.png"), "--layers", "7"],
                   "layer 7 does not exist; the model has layers 0..1")
    one_line_error(capsys, ["lm", "attention", "--ckpt", str(trained), "--prompt", "x" * 40,
                            "--heatmap", str(tmp_path / "a.png")],
                   "the prompt has 40 tokens; the model's context_length is 32")
    one_line_error(capsys, ["lm", "generate", "--ckpt", str(trained), "--prompt", "a",
                            "--temperature", "-1"], "temperature")
    with pytest.raises(SystemExit) as info:
        main(["lm", "train", "--preset", "huge"])
    assert info.value.code == 2


def test_gpt2_tokenizer_offline_and_resume(text_file, tmp_path):
    bpe = write_tiny_bpe(tmp_path / "bpe")
    settings = LMSettings(text=str(text_file), tokenizer="gpt2", bpe_dir=str(bpe),
                          context_length=16, batch_size=8, epochs=2)
    lm, _ = train_language_model(settings, tmp_path / "a", progress=False, log=lambda _: None)
    assert lm.tokenizer.name == "gpt2"
    train_language_model(LMSettings(**{**settings.__dict__, "epochs": 1}), tmp_path / "b",
                         progress=False, log=lambda _: None)
    resumed, history = train_language_model(LMSettings(epochs=2), tmp_path / "b",
                                            resume=True, progress=False, log=lambda _: None)
    assert history["epoch"] == [1, 2]
    for (name, a), (_, b) in zip(lm.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    again = LanguageModel.load(tmp_path / "b")
    assert again.generate("The", 10).text == resumed.generate("The", 10).text


def test_a_checkpoint_of_another_task_is_refused(trained, tmp_path, capsys):
    one_line_error(capsys, ["translate", "run", "--ckpt", str(trained)],
                   r"holds a 'lm' checkpoint, not a 'translate' one")


def test_resume_rebuilds_the_gpt2_tokenizer_offline(text_file, tmp_path, capsys):
    """A resume whose BPE folder has moved asks for --bpe-dir; it never downloads (the
    autouse no_downloads fixture fails any tiktoken download)."""
    bpe = write_tiny_bpe(tmp_path / "bpe")
    run_dir = tmp_path / "run"
    assert main(["lm", "train", "--text", str(text_file), "--tokenizer", "gpt2", "--bpe-dir",
                 str(bpe), "--run-dir", str(run_dir), "--epochs", "1", *FAST]) == 0
    moved = bpe.rename(tmp_path / "moved")
    one_line_error(capsys, ["lm", "train", "--run-dir", str(run_dir), "--resume",
                            "--epochs", "2", "--no-progress", "--sample", ""],
                   r"pass --bpe-dir DIR")
    capsys.readouterr()
    assert main(["lm", "train", "--run-dir", str(run_dir), "--resume", "--epochs", "2",
                 "--bpe-dir", str(moved), "--no-progress", "--sample", ""]) == 0


def test_fine_tuning_starts_from_a_runs_weights_and_keeps_its_architecture(
        trained, text_file, tmp_path, capsys):
    from safetensors.torch import load_file

    other = tmp_path / "other.txt"
    other.write_text(TEXT[::-1], encoding="utf-8")
    common = ["--text", str(other), "--batch-size", "8", "--no-progress", "--sample", ""]
    start = tmp_path / "start"
    assert main(["lm", "train", "--init", str(trained), "--run-dir", str(start),
                 "--epochs", "0", *common]) == 0
    before, after = load_file(trained / "model.safetensors"), load_file(
        start / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    saved = json.loads((start / "config.json").read_text())
    assert saved["settings"]["context_length"] == 32 and saved["settings"]["init"] == str(
        trained)
    # fine-tuned for an epoch, it starts far below a model trained from scratch
    tuned, scratch = tmp_path / "tuned", tmp_path / "scratch"
    assert main(["lm", "train", "--init", str(trained), "--run-dir", str(tuned),
                 "--epochs", "1", *common]) == 0
    assert main(["lm", "train", "--run-dir", str(scratch), "--epochs", "1",
                 "--context-length", "32", *common]) == 0
    loss = {}
    for name, run in (("tuned", tuned), ("scratch", scratch)):
        state = json.loads((run / "trainer.json").read_text())["trainer_state"]
        loss[name] = state["history"]["loss"][0]
    assert loss["tuned"] < 0.8 * loss["scratch"], loss
    # and it resumes like any run
    assert main(["lm", "train", "--run-dir", str(tuned), "--resume", "--epochs", "2",
                 "--no-progress", "--sample", ""]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["lm", "train", "--init", str(trained), "--preset", "mini",
                            "--run-dir", str(tmp_path / "x"), *common],
                   r"--preset comes from the run --init starts from")
    one_line_error(capsys, ["lm", "train", "--init", str(tmp_path / "nothing"),
                            "--run-dir", str(tmp_path / "x"), *common],
                   r"--init .*nothing: no checkpoint there")
    one_line_error(capsys, ["lm", "train", "--init", str(trained), "--resume",
                            "--run-dir", str(tuned), *common], r"--init starts a new run")


def test_weight_decay_groups_leave_out_biases_norms_and_embeddings():
    from qkv.models.gpt import GPTConfig, GPTModel
    from qkv.tasks.lm import param_groups

    for tie in (False, True):
        model = GPTModel(GPTConfig.preset("tiny", vocab_size=50, qkv_bias=True,
                                          tie_weights=tie))
        decay, no_decay = param_groups(model, 0.1)
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = sorted(names[id(p)] for p in decay["params"])
        # written out by hand: every linear layer's matrix, and nothing else
        want = [f"trf_blocks.{i}.{w}.weight" for i in range(2)
                for w in ("att.W_query", "att.W_key", "att.W_value", "att.out_proj",
                          "ff.layers.0", "ff.layers.2")]
        if not tie:
            want.append("out_head.weight")
        assert decayed == sorted(want)
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
        assert any(p is model.tok_emb.weight for p in no_decay["params"])


def test_the_lm_recipe_follows_its_schedule_and_accumulates_to_a_token_batch(
        text_file, tmp_path, monkeypatch, capsys):
    import qkv.tasks.lm as task
    from qkv.training import LRSchedule

    rates = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(task.torch.optim, "AdamW", Recording)
    assert main(["lm", "train", "--text", str(text_file), "--run-dir", str(tmp_path / "r"),
                 "--epochs", "2", "--lr", "0.002", "--warmup-steps", "3", "--decay",
                 "cosine", "--batch-tokens", "700", "--patience", "1", *FAST]) == 0
    out = capsys.readouterr().out
    # 700 tokens per step from batches of 8 windows of 32 tokens: 3 micro-batches
    assert "accumulate 3: 3 x 8 x 32 = 768 tokens per step" in out
    windows = int(re.search(r"in ([\d,]+) windows", out)[1].replace(",", ""))
    steps_per_epoch = -(-(windows // 8) // 3)  # full batches only, then groups of 3
    assert len(rates) == 2 * steps_per_epoch
    schedule = LRSchedule(warmup_steps=3, decay="cosine", total_steps=len(rates))
    assert rates == pytest.approx([0.002 * schedule.factor(i) for i in range(len(rates))])
    assert (tmp_path / "r" / "best" / "model.safetensors").is_file()


def test_the_lm_trains_in_bfloat16_autocast(text_file, tmp_path):
    assert main(["lm", "train", "--text", str(text_file), "--run-dir", str(tmp_path / "r"),
                 "--epochs", "1", "--dtype", "bfloat16", *FAST]) == 0
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["settings"]
    assert saved["dtype"] == "bfloat16"
    state = json.loads((tmp_path / "r" / "trainer.json").read_text())["trainer_state"]
    assert 0 < state["history"]["loss"][0] < 10


def test_lm_validation_leaves_the_training_random_stream_alone(text_file, tmp_path,
                                                                monkeypatch):
    # With dropout on, a run with validation must train exactly as one without.
    from qkv.tasks import pipeline

    args = ["lm", "train", "--text", str(text_file), "--epochs", "2", "--dropout", "0.1",
            *FAST]
    assert main([*args, "--run-dir", str(tmp_path / "a")]) == 0
    real_fit = pipeline.fit
    monkeypatch.setattr(pipeline, "fit",
                        lambda *a, **k: real_fit(*a, **{**k, "validate": None}))
    assert main([*args, "--run-dir", str(tmp_path / "b")]) == 0
    losses = [json.loads((tmp_path / r / "trainer.json").read_text())["trainer_state"]
              ["history"]["loss"] for r in ("a", "b")]
    assert losses[0] == losses[1]


def test_eval_every_makes_an_epoch_that_many_steps_on_random_windows(text_file, tmp_path,
                                                                     capsys):
    run = tmp_path / "r"
    assert main(["lm", "train", "--text", str(text_file), "--run-dir", str(run),
                 "--epochs", "3", "--eval-every", "2", "--accumulate", "2", "--patience",
                 "5", *FAST]) == 0
    out = capsys.readouterr().out
    state = json.loads((run / "trainer.json").read_text())["trainer_state"]
    history = state["history"]
    assert state["step"] == 6  # 3 epochs of 2 steps, each of 2 micro-batches
    assert len(history["valid_loss"]) == 3 and history["valid_loss"][2] < history[
        "valid_loss"][0]
    # 2 steps x 2 micro-batches x 8 windows x 32 tokens per epoch
    tokens = 2 * 2 * 8 * 32
    assert all(0 < m < 1 for m in history["mfu"])
    assert all(tokens / s <= r * 1.0001 for s, r in
               zip(history["seconds"], history["tokens_per_sec"], strict=True))
    assert re.search(r"epoch 3/3: loss [\d.]+, [\d.]+ tokens/sec \(MFU [\d.]+%\)", out)
    saved = json.loads((run / "config.json").read_text())["settings"]
    assert saved["eval_every"] == 2


def test_the_modern_preset_trains_and_generates_past_its_context(text_file, tmp_path,
                                                                  capsys):
    run = tmp_path / "m"
    assert main(["lm", "train", "--text", str(text_file), "--run-dir", str(run),
                 "--preset", "tiny-modern", "--epochs", "2", *FAST]) == 0
    model = json.loads((run / "config.json").read_text())["model"]
    assert (model["rope"], model["n_kv_groups"], model["window_size"]) == (True, 2, 64)
    history = json.loads((run / "trainer.json").read_text())["trainer_state"]["history"]
    assert history["loss"][1] < history["loss"][0]
    capsys.readouterr()
    # 32 tokens of context (FAST), 60 new ones: the ring caches carry on past it.
    assert main(["lm", "generate", "--ckpt", str(run), "--prompt", "The cat",
                 "--max-new-tokens", "60"]) == 0
    assert "60 tokens in" in capsys.readouterr().out


def test_validation_on_a_large_text_scores_a_bounded_spread_of_windows(tmp_path, monkeypatch):
    import qkv.tasks.lm as lm_task

    monkeypatch.setattr(lm_task, "MAX_VALID_WINDOWS", 5)
    seen: list[int] = []
    real = lm_task.lm_loss

    def spy(model, batch):
        if not model.training:  # validation runs in eval mode
            seen.append(batch[0].shape[0])
        return real(model, batch)

    monkeypatch.setattr(lm_task, "lm_loss", spy)
    text = tmp_path / "story.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 80)
    settings = lm_task.LMSettings(text=str(text), preset="tiny", context_length=16,
                                  batch_size=4, epochs=2, val_fraction=0.5)
    _, history = lm_task.train_language_model(settings, tmp_path / "run", progress=False,
                                              log=lambda line: None)
    # Half the text held out: over a hundred windows of 16, of which 5 are scored per epoch.
    assert seen == [4, 1, 4, 1]
    assert len(history["valid_loss"]) == 2
