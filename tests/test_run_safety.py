"""A user's run is never lost: real processes, real signals, real pipes.

Each test drives ``python -m qkv`` in subprocesses. Where the moment of a signal
matters, the process runs with ``QKV_TEST_PAUSE`` (see :mod:`qkv.utils.testing`): it stops at
a named point, the test sends the signal, then lets it go on.
"""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli import main
from qkv.tasks.translate import Translator
from qkv.training import checkpoint_progress, is_checkpoint, load_config
from qkv.utils.testing import PAUSE_ENV

PAIRS = [("Go.", "Va !"), ("I lost.", "J'ai perdu."), ("Hi.", "Salut !"), ("Run!", "Cours !"),
         ("Who?", "Qui ?"), ("Wow!", "Ça alors !"), ("I won.", "J'ai gagné."),
         ("Help!", "À l'aide !")]
TRAIN = ["translate", "train", "--preset", "d2l", "--min-freq", "1", "--batch-size", "2",
         "--no-progress", "--num-hiddens", "8", "--embed-size", "8"]
SAVE_PHASES = ["save-begin", "save-staged", "save-committed", "save-moving", "save-done"]
# A save that dies before its manifest is committed leaves the old checkpoint.
COMMITTED = {"save-begin": False, "save-staged": False, "save-committed": True,
             "save-moving": True, "save-done": True}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.txt"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def one_epoch(corpus, tmp_path_factory):
    """A run directory holding a checkpoint after epoch 1 of 1 (copy it before use)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    assert main([*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "1"]) == 0
    return run_dir


def env(pause: str | None = None, folder: Path | None = None) -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out.pop(PAUSE_ENV, None)
    if pause is not None:
        out[PAUSE_ENV] = f"{pause}:{folder}"
    return out


def run(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (saves starting torch again), with its output."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def start(*args: str, pause: str, folder: Path, **kwargs) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "qkv", *args], env=env(pause, folder),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            **kwargs)


def wait_paused(proc: subprocess.Popen, folder: Path, point: str) -> None:
    deadline = time.monotonic() + 120
    while not (folder / f"paused-{point}").exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before pausing at {point}: {err}{out}")
        assert time.monotonic() < deadline, f"never paused at {point}"
        time.sleep(0.02)


def go_on(folder: Path, point: str) -> None:
    (folder / f"resume-{point}").touch()


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def one_line(err: str) -> str:
    """The only line on stderr that is not a note from the save (there must be one)."""
    lines = [line for line in err.splitlines()
             if not line.startswith("qkv: a checkpoint is being written")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- one writer


def test_a_second_writer_is_refused_naming_the_holder(corpus, tmp_path, capsys):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    first = start(*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "2",
                  pause="train-start", folder=folder)
    wait_paused(first, folder, "train-start")
    second = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir", str(run_dir),
                 "--epochs", "2")
    resumed = run(capsys, "translate", "train", "--run-dir", str(run_dir), "--resume")
    go_on(folder, "train-start")
    code, _, err = finish(first)
    assert code == 0, err
    for refused in (second, resumed):
        assert refused.returncode == 2
        line = one_line(refused.stderr)
        assert f"is in use by process {first.pid} on {socket.gethostname()} since " in line
        assert "translate train" in line  # the holder's command
    assert checkpoint_progress(run_dir) == (2, 2)


def test_a_lock_left_by_a_killed_run_is_taken_over(corpus, tmp_path, capsys):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    first = start(*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "1",
                  pause="train-start", folder=folder)
    wait_paused(first, folder, "train-start")
    first.kill()
    first.wait()
    assert (run_dir / ".qkv-lock").exists()  # left behind by the dead process
    second = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir", str(run_dir),
                 "--epochs", "1")
    assert second.returncode == 0, second.stderr
    assert f"took over the lock of {run_dir} from process {first.pid}" in second.stdout
    assert "no longer running" in second.stdout
    assert not (run_dir / ".qkv-lock").exists()
    assert checkpoint_progress(run_dir) == (1, 1)


# ----------------------------------------------------------- no checkpoint replaced by accident


def test_a_new_run_over_a_checkpoint_is_refused(one_epoch, corpus, tmp_path, capsys):
    run_dir = copy_run(one_epoch, tmp_path / "run")
    before = (run_dir / "checkpoint.json").read_bytes()
    again = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir", str(run_dir))
    assert again.returncode == 2
    line = one_line(again.stderr)
    assert "holds the checkpoint after epoch 1 of 1" in line
    assert "--resume" in line and "--overwrite" in line
    # Even a checkpoint of the other task, and files a save would replace.
    lm = run(capsys, "lm", "train", "--run-dir", str(run_dir), "--epochs", "1")
    assert lm.returncode == 2 and "--overwrite" in one_line(lm.stderr)
    assert (run_dir / "checkpoint.json").read_bytes() == before
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config.json").write_text("{}")
    refused = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir", str(stray))
    assert refused.returncode == 2 and "does not load" in one_line(refused.stderr)
    assert (stray / "config.json").read_text() == "{}"


def test_overwrite_keeps_the_old_checkpoint_until_the_new_one_is_saved(one_epoch, corpus,
                                                                        tmp_path):
    run_dir, folder = copy_run(one_epoch, tmp_path / "run"), tmp_path / "pause"
    old_weights = load_file(run_dir / "model.safetensors")
    proc = start(*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "3",
                 "--overwrite", pause="epoch-end@2", folder=folder)
    wait_paused(proc, folder, "epoch-end")
    # Two epochs into the new run, the old checkpoint still loads, unchanged.
    Translator.load(run_dir)
    assert checkpoint_progress(run_dir) == (1, 1)
    for name, value in load_file(run_dir / "model.safetensors").items():
        assert torch.equal(value, old_weights[name]), name
    go_on(folder, "epoch-end")
    code, _, err = finish(proc)
    assert code == 0, err
    assert checkpoint_progress(run_dir) == (3, 3)


def test_overwrite_interrupted_before_saving_says_the_old_checkpoint_is_still_there(
        one_epoch, corpus, tmp_path):
    run_dir, folder = copy_run(one_epoch, tmp_path / "run"), tmp_path / "pause"
    before = (run_dir / "checkpoint.json").read_bytes()
    args = [*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--overwrite"]
    proc = start(*args, pause="train-start", folder=folder)
    wait_paused(proc, folder, "train-start")
    proc.send_signal(signal.SIGINT)
    go_on(folder, "train-start")
    code, _, err = finish(proc)
    assert code == 130
    line = one_line(err)
    assert "interrupted (Ctrl-C); this run saved nothing" in line
    assert f"{run_dir} still holds the checkpoint after epoch 1 of 1" in line
    assert line.endswith("start again: qkv " + shlex.join(args))
    assert (run_dir / "checkpoint.json").read_bytes() == before


# ------------------------------------------------------------------------ honest interruptions


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_before_the_first_epoch_saves_nothing_and_says_so(corpus, tmp_path, sig):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    args = [*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "3"]
    proc = start(*args, pause="train-start", folder=folder)
    wait_paused(proc, folder, "train-start")
    proc.send_signal(sig)
    go_on(folder, "train-start")
    code, _, err = finish(proc)
    assert code == (130 if sig == signal.SIGINT else 143)
    line = one_line(err)
    assert "no epoch had completed, so nothing was saved" in line
    assert ("Ctrl-C" if sig == signal.SIGINT else "SIGTERM") in line
    assert not run_dir.exists()  # nor is an empty directory left behind


def test_interrupt_between_epochs_saves_the_last_one_and_the_advice_continues_it(
        corpus, tmp_path, capsys):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    proc = start(*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "4",
                 pause="epoch-end@2", folder=folder)
    wait_paused(proc, folder, "epoch-end")
    proc.send_signal(signal.SIGTERM)
    go_on(folder, "epoch-end")
    code, _, err = finish(proc)
    assert code == 143
    line = one_line(err)
    assert f"{run_dir} holds the checkpoint after epoch 2 of 4" in line
    command = line.split("continue with: ")[1]
    assert command == f"qkv translate train --run-dir {run_dir} --resume"
    # The advice, run as printed (with --epochs left to the run), finishes the run.
    resumed = run(capsys, *shlex.split(command)[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert checkpoint_progress(run_dir) == (4, 4)
    # ...and gives what an uninterrupted run gives, to the bit (same ops, same order).
    straight = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir",
                   str(tmp_path / "straight"), "--epochs", "4")
    assert straight.returncode == 0, straight.stderr
    a, b = load_file(run_dir / "model.safetensors"), load_file(
        tmp_path / "straight" / "model.safetensors")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(("phase", "sig"), [
    (phase, (signal.SIGINT, signal.SIGTERM)[i % 2]) for i, phase in enumerate(SAVE_PHASES)])
def test_a_signal_during_a_save_waits_for_it(one_epoch, tmp_path, phase, sig):
    """Ctrl-C or SIGTERM at each phase of the final save: the save completes, then the
    process stops, and the message states what is on disk."""
    run_dir, folder = copy_run(one_epoch, tmp_path / "run"), tmp_path / "pause"
    proc = start("translate", "train", "--run-dir", str(run_dir), "--resume", "--epochs", "2",
                 "--no-progress", pause=phase, folder=folder)
    wait_paused(proc, folder, phase)
    proc.send_signal(sig)
    time.sleep(0.2)  # let the handler run while the save is held
    go_on(folder, phase)
    code, _, err = finish(proc)
    assert code == (130 if sig == signal.SIGINT else 143), err
    assert "qkv: a checkpoint is being written; stopping as soon as it is complete" in err
    assert f"{run_dir} holds the checkpoint after epoch 2 of 2" in one_line(err)
    assert checkpoint_progress(run_dir) == (2, 2)
    Translator.load(run_dir)
    assert not (run_dir / ".checkpoint-incoming").exists()


@pytest.mark.parametrize("phase", SAVE_PHASES)
def test_sigkill_at_any_phase_of_a_save_leaves_a_checkpoint_that_loads(one_epoch, tmp_path,
                                                                       phase, capsys):
    run_dir, folder = copy_run(one_epoch, tmp_path / "run"), tmp_path / "pause"
    proc = start("translate", "train", "--run-dir", str(run_dir), "--resume", "--epochs", "2",
                 pause=phase, folder=folder)
    wait_paused(proc, folder, phase)
    proc.kill()
    proc.wait()
    # The old checkpoint before the commit point, the new one after it; never a mix.
    assert checkpoint_progress(run_dir) == ((2, 2) if COMMITTED[phase] else (1, 1))
    Translator.load(run_dir)
    # A temporary file of a write killed mid-way, as write_atomic names them.
    stale = run_dir / f".loss.png.{proc.pid}.0123abcd.tmp"
    stale.write_bytes(b"half a png")
    # The next run finishes the job (or discards the uncommitted one) and cleans up.
    resumed = run(capsys, "translate", "train", "--run-dir", str(run_dir), "--resume",
                  "--epochs", "3", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert checkpoint_progress(run_dir) == (3, 3)
    assert not stale.exists()
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "attention.png", "checkpoint.json", "config.json", "loss.png", "model.safetensors",
        "trainer.json", "trainer.safetensors"]


def test_a_second_ctrl_c_during_the_rescue_save_is_reported_truthfully(corpus, tmp_path):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    proc = start(*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "3",
                 pause="epoch-end@1,save-staged", folder=folder)
    wait_paused(proc, folder, "epoch-end")
    proc.send_signal(signal.SIGINT)
    go_on(folder, "epoch-end")
    wait_paused(proc, folder, "save-staged")  # the rescue save of epoch 1
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    go_on(folder, "save-staged")
    code, out, err = finish(proc)
    assert code == 130
    assert "saving the state after epoch 1" in out
    assert f"{run_dir} holds the checkpoint after epoch 1 of 3" in one_line(err)
    assert checkpoint_progress(run_dir) == (1, 3)


def test_a_closed_stdout_stops_the_output_not_the_training(corpus, tmp_path):
    """`qkv translate train ... | head -1`: the run goes on, saves, and says so."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkv", *TRAIN, "--data", str(corpus), "--run-dir",
         str(run_dir), "--epochs", "30"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after one line
    err = proc.stderr.read()
    code = proc.wait(timeout=300)
    assert first.startswith("bahdanau translator:")
    assert code == 0, err
    assert "stdout was closed, so output stopped; training ran on to the end" in err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert checkpoint_progress(run_dir) == (30, 30)
    assert (run_dir / "attention.png").is_file()


# ----------------------------------------------------------------------- resume and divergence


def test_resume_refuses_what_it_would_ignore_and_goes_to_the_runs_own_target(
        one_epoch, tmp_path, capsys):
    run_dir = copy_run(one_epoch, tmp_path / "run")
    changed = run(capsys, "translate", "train", "--run-dir", str(run_dir), "--resume",
                  "--epochs", "3", "--num-hiddens", "64", "--batch-size", "2")
    assert changed.returncode == 2
    assert "--num-hiddens 64 (the run has 8) cannot change" in one_line(changed.stderr)
    done = run(capsys, "translate", "train", "--run-dir", str(run_dir), "--resume")
    assert done.returncode == 2
    assert "nothing to train" in one_line(done.stderr) and "--epochs" in done.stderr
    # A flag with the run's own value is no change; a new lr is taken and reported.
    lr = run(capsys, "translate", "train", "--run-dir", str(run_dir), "--resume", "--epochs",
             "2", "--batch-size", "2", "--lr", "0.001", "--no-progress")
    assert lr.returncode == 0, lr.stderr
    assert "lr 0.005 -> 0.001" in lr.stdout
    assert load_config(run_dir)["settings"]["lr"] == 0.001
    assert checkpoint_progress(run_dir) == (2, 2)


def test_lm_resume_without_epochs_continues_to_the_runs_target(tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 80)
    run_dir, folder = tmp_path / "lm", tmp_path / "pause"
    proc = start("lm", "train", "--text", str(text), "--run-dir", str(run_dir), "--epochs", "3",
                 "--context-length", "16", "--batch-size", "8", "--no-progress", "--sample", "",
                 pause="epoch-end@1", folder=folder)
    wait_paused(proc, folder, "epoch-end")
    proc.send_signal(signal.SIGINT)
    go_on(folder, "epoch-end")
    code, _, err = finish(proc)
    assert code == 130
    line = one_line(err)
    assert "holds the checkpoint after epoch 1 of 3" in line
    assert line.endswith(f"continue with: qkv lm train --run-dir {run_dir} --resume")
    resumed = run(capsys, "lm", "train", "--run-dir", str(run_dir), "--resume", "--sample", "",
                  "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert checkpoint_progress(run_dir) == (3, 3)
    history = json.loads((run_dir / "trainer.json").read_text())["trainer_state"]["history"]
    assert history["epoch"] == [1, 2, 3]


@pytest.mark.parametrize("flags", [["--lr", "inf"], ["--lr", "nan"], ["--lr", "0"],
                                   ["--weight-decay", "nan"], ["--clip-norm", "inf"],
                                   ["--dropout", "1.5"], ["--val-fraction", "nan"]])
def test_impossible_hyperparameters_are_refused_before_anything_runs(tmp_path, flags, capsys):
    run_dir = tmp_path / "lm"
    done = run(capsys, "lm", "train", "--run-dir", str(run_dir), *flags)
    assert done.returncode == 2
    assert flags[1] in one_line(done.stderr)
    assert not run_dir.exists()


def test_a_diverging_run_stops_in_one_line_and_keeps_nothing_non_finite(tmp_path, capsys):
    """lm train --lr 1e4: the loss becomes NaN within the first epoch."""
    run_dir = tmp_path / "lm"
    done = run(capsys, "lm", "train", "--run-dir", str(run_dir), "--lr", "1e4", "--epochs",
               "2", "--no-progress")
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert "training diverged at epoch 1, step " in line
    assert "nothing was saved" in line and "with a smaller --lr" in line
    assert not is_checkpoint(run_dir)


# --------------------------------------------------------------------- the pieces, in-process


def _tiny_trainer(run_dir: Path, loss_at, epochs: int = 3):
    """A linear model on fixed data; ``loss_at(step, loss)`` may replace each step's loss."""
    from qkv.training import TrainConfig, Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    calls = {"step": 0}

    def loss_fn(m, batch):
        calls["step"] += 1
        loss = ((m(batch[0]) - batch[1]) ** 2).sum()
        return loss_at(calls["step"], loss), torch.tensor(batch[0].shape[0])

    return Trainer(model, loss_fn, lambda g: [(x[:4], y[:4]), (x[4:], y[4:])],
                   TrainConfig(epochs=epochs, lr=0.01, progress=False, log_every=0),
                   run_dir=run_dir, log=lambda _: None)


def test_divergence_mid_run_keeps_the_last_finite_epoch(tmp_path):
    from qkv.training import TrainingDivergedError

    # Reference: the same trainer stopped after 1 epoch, by an independent route.
    ref = _tiny_trainer(tmp_path / "ref", lambda step, loss: loss, epochs=1)
    ref.fit()
    trainer = _tiny_trainer(tmp_path / "run",
                            lambda step, loss: loss * float("nan") if step == 4 else loss)
    with pytest.raises(TrainingDivergedError, match=r"^training diverged at epoch 2, step 4: ")\
            as info:
        trainer.fit()
    assert (info.value.epoch, info.value.step, info.value.lr) == (2, 4, 0.01)
    assert "\n" not in str(info.value)
    assert checkpoint_progress(tmp_path / "run") == (1, 3)
    saved = load_file(tmp_path / "run" / "model.safetensors")
    for name, value in load_file(tmp_path / "ref" / "model.safetensors").items():
        assert torch.isfinite(saved[name]).all()
        assert torch.equal(saved[name], value), name


def test_weights_that_stop_being_finite_are_caught_at_the_epoch_end(tmp_path):
    from qkv.training import TrainingDivergedError

    # A finite loss with infinite gradients at step 2, the last of epoch 1: clipping turns
    # them into NaN, and the update poisons the weights while every loss stayed finite.
    trainer = _tiny_trainer(tmp_path / "run", lambda step, loss: loss)
    for p in trainer.module.parameters():
        p.register_hook(lambda g: g * float("inf") if trainer.step == 1 else g)
    with pytest.raises(TrainingDivergedError, match="epoch 1, step 2"):
        trainer.fit()
    assert not is_checkpoint(tmp_path / "run")  # nothing finite had completed


def test_a_staging_directory_that_is_not_qkvs_own_is_refused(one_epoch, tmp_path):
    from qkv.training import CheckpointError, save_checkpoint

    model = torch.nn.Linear(2, 2)
    # A symlink in its place: neither a save nor a load follows it.
    run_dir = copy_run(one_epoch, tmp_path / "link")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / ".checkpoint-incoming").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is a symlink, not the staging directory"):
        save_checkpoint(run_dir, model, {})
    with pytest.raises(CheckpointError, match="is a symlink"):
        load_config(run_dir)
    assert list(elsewhere.iterdir()) == []
    # A user's file inside it is refused, and kept.
    run_dir = copy_run(one_epoch, tmp_path / "foreign")
    (run_dir / ".checkpoint-incoming").mkdir()
    (run_dir / ".checkpoint-incoming" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds notes\.txt, which no qkv save writes"):
        save_checkpoint(run_dir, model, {})
    assert (run_dir / ".checkpoint-incoming" / "notes.txt").read_text() == "mine"
    # A plain file in its place.
    run_dir = copy_run(one_epoch, tmp_path / "file")
    (run_dir / ".checkpoint-incoming").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        save_checkpoint(run_dir, model, {})


def test_temp_files_of_killed_writes_go_and_live_ones_stay(tmp_path):
    from qkv.utils.fileio import remove_stale_temp_files

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead, alive = child.pid, os.getpid()
    names = [f".model.safetensors.{dead}.89abcdef.tmp", f".loss.png.{alive}.89abcdef.tmp",
             f".notes.{dead}.tmp", "user.tmp"]
    for name in names:
        (tmp_path / name).write_text("x")
    (tmp_path / f".link.{dead}.89abcdef.tmp").symlink_to(tmp_path / "user.tmp")
    assert remove_stale_temp_files(tmp_path) == [tmp_path / names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*names[1:], f".link.{dead}.89abcdef.tmp"])


def test_every_output_location_is_checked_before_training(corpus, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for run_dir, message in ((blocker, "exists and is not a directory"),
                             (blocker / "run", "cannot create the run directory")):
        done = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir", str(run_dir))
        assert done.returncode == 2 and message in one_line(done.stderr)
    run_dir = tmp_path / "run"
    (run_dir / "attention.png").mkdir(parents=True)
    done = run(capsys, *TRAIN, "--data", str(corpus), "--run-dir", str(run_dir),
               "--epochs", "50")
    assert done.returncode == 2
    assert "attention.png': it is a directory" in one_line(done.stderr)
    assert done.stdout == ""  # refused before a single epoch
    # The image paths of run and attention, before the model is even loaded.
    for args in (["translate", "run", "--ckpt", str(tmp_path / "none"), "--heatmap"],
                 ["lm", "attention", "--ckpt", str(tmp_path / "none"), "--prompt", "a",
                  "--heatmap"]):
        done = run(capsys, *args, str(blocker / "a.png"))
        assert done.returncode == 2
        assert "cannot write into" in one_line(done.stderr)
    # A benchmark's results folder, before minutes of measuring.
    done = run(capsys, "bench", "data", "--quick", "--out", str(blocker))
    assert done.returncode == 2 and done.stdout == ""
    assert "exists and is not a directory" in one_line(done.stderr)


def test_signals_during_a_save_are_delivered_after_it():
    from qkv.utils.fileio import deferred_signals

    order = []
    held = deferred_signals(on_deferred=lambda s: order.append(("held", s)))
    with pytest.raises(KeyboardInterrupt), held:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the second waits as well
        order.append("write finished")
    assert order == [("held", signal.SIGINT), ("held", signal.SIGINT), "write finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_lock_is_reentrant_and_names_its_holder(tmp_path):
    from qkv.training import RunDirBusyError, holds_run_dir_lock, run_dir_lock

    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        with run_dir_lock(run_dir):
            assert holds_run_dir_lock(run_dir)
        assert holds_run_dir_lock(run_dir)
        record = json.loads((run_dir / ".qkv-lock").read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        other = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom qkv.training import run_dir_lock\n"
             f"with run_dir_lock({str(run_dir)!r}): pass"], capture_output=True, text=True)
        assert f"RunDirBusyError: {run_dir} is in use by process {os.getpid()}" in other.stderr
    assert not holds_run_dir_lock(run_dir)
    assert not (run_dir / ".qkv-lock").exists()
    with pytest.raises(RunDirBusyError, match="in use"), run_dir_lock(run_dir):
        raise RunDirBusyError("in use")  # an error inside releases the lock too
    assert not holds_run_dir_lock(run_dir)


def test_a_checkpoint_with_non_finite_weights_is_refused_on_load(tmp_path, capsys):
    """What `lm train --lr 1e4` used to save; sampling from it failed deep in torch."""
    from qkv.tasks.lm import LanguageModel
    from qkv.training import save_checkpoint

    run_dir = tmp_path / "lm"
    assert run(capsys, "lm", "train", "--run-dir", str(run_dir), "--epochs", "1",
               "--context-length", "16", "--no-progress", "--sample", "").returncode == 0
    lm = LanguageModel.load(run_dir)
    with torch.no_grad():
        lm.model.out_head.weight[3, 1] = float("inf")
    save_checkpoint(tmp_path / "bad", lm.model, load_config(run_dir))
    for args in (["generate", "--prompt", "The", "--temperature", "0.8"],
                 ["attention", "--prompt", "The", "--heatmap", str(tmp_path / "a.png")]):
        done = run(capsys, "lm", args[0], "--ckpt", str(tmp_path / "bad"), *args[1:])
        assert done.returncode == 2
        assert "1 tensor(s) hold NaN or infinite values (out_head.weight)" in one_line(done.stderr)
