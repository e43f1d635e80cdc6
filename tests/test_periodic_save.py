"""Nothing lost, whatever ends a run: periodic checkpoints on a clock, SIGKILL with an exact
resume, SIGHUP, and a disk that is full before or during a save."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import qkv.training.checkpoint as checkpoint_module
import qkv.training.trainer as trainer_module
from qkv.cli import main
from qkv.training import (
    TrainConfig,
    Trainer,
    checkpoint_progress,
    load_weights,
)
from qkv.training.limits import InsufficientDiskError
from test_run_safety import start, wait_paused  # real processes, paused at named points

PAIRS = [("Go.", "Va !"), ("I lost.", "J'ai perdu."), ("Hi.", "Salut !"), ("Run!", "Cours !"),
         ("Who?", "Qui ?"), ("Wow!", "Ça alors !"), ("I won.", "J'ai gagné."),
         ("Help!", "À l'aide !")]
TRAIN = ["translate", "train", "--preset", "d2l", "--min-freq", "1", "--batch-size", "2",
         "--no-progress", "--num-hiddens", "8", "--embed-size", "8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.txt"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS), encoding="utf-8")
    return path


# ------------------------------------------------------------------ the clock, in one process


class FakeClock:
    """Stands in for ``time.monotonic`` in the trainer: each epoch takes ``epoch_minutes``."""

    def __init__(self, epoch_minutes: float) -> None:
        self.now, self.step = 1000.0, 60 * epoch_minutes

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step


def _trainer(run_dir: Path, clock: FakeClock, **config) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))

    calls = 0

    def loss_fn(m, batch):
        nonlocal calls
        calls += 1
        if calls % 2 == 0:  # the epoch's time passes during its last (second) batch
            clock.tick()
        x, y = batch
        return nn.functional.cross_entropy(m(x), y, reduction="sum"), torch.tensor(len(y))

    def batches(generator):
        return DataLoader(data, batch_size=4, shuffle=True, generator=generator)

    return Trainer(model, loss_fn, batches,
                   TrainConfig(device="cpu", progress=False, log_every=0, **config),
                   run_dir=run_dir)


def _saved_epochs(monkeypatch) -> list[int]:
    saved: list[int] = []
    real = trainer_module.save_checkpoint

    def spy(run_dir, weights, config, **kwargs):
        if kwargs.get("trainer_state") is not None:  # not a copy of the best weights
            saved.append(kwargs["trainer_state"]["epoch"])
        return real(run_dir, weights, config, **kwargs)

    monkeypatch.setattr(trainer_module, "save_checkpoint", spy)
    return saved


def _expected_saves(epochs: int, epoch_minutes: float, every: float, first_seconds: float
                    ) -> list[int]:
    """The rule, written out as a loop over wall-clock minutes."""
    out, last = [], 0.0
    for epoch in range(1, epochs + 1):
        now = epoch * epoch_minutes
        if epoch == epochs:
            out.append(epoch)  # the end of the run, always
        elif now - last >= every or (epoch == 1 and 60 * epoch_minutes * epochs > first_seconds):
            out.append(epoch)
            last = now
    return out


@pytest.mark.parametrize(("epoch_minutes", "every", "epochs"), [
    (4.0, 10.0, 12),   # a long run: its first epoch, then every 12 minutes
    (0.01, 10.0, 20),  # a short run: the end only
    (1.5, 0.0, 5),     # 0: every epoch
    (2.5, 4.0, 9),
])
def test_saves_follow_the_clock(tmp_path, monkeypatch, epoch_minutes, every, epochs):
    clock = FakeClock(epoch_minutes)
    monkeypatch.setattr(trainer_module.time, "monotonic", clock)
    saved = _saved_epochs(monkeypatch)
    _trainer(tmp_path / "run", clock, epochs=epochs, save_every=every).fit()
    assert saved == _expected_saves(epochs, epoch_minutes, every,
                                    trainer_module.FIRST_SAVE_SECONDS)
    if epoch_minutes == 4.0:
        assert saved[:3] == [1, 4, 7]  # by hand: minutes 4, 16 (4 + 12), 28


def test_save_every_is_checked_in_one_line():
    for bad in (-1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(ValueError, match="save_every"):
            TrainConfig(save_every=bad)


def test_the_cli_flag_is_checked_before_anything_runs(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*TRAIN, "--data", str(corpus), "--run-dir", str(tmp_path / "run"),
              "--save-every", "-3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--save-every" in err and "-3" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_eval_every_saves_at_each_evaluation_with_or_without_patience(tmp_path, monkeypatch):
    text = tmp_path / "story.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 40)
    for patience in ("0", "2"):
        saved = _saved_epochs(monkeypatch)
        code = main(["lm", "train", "--text", str(text), "--preset", "tiny",
                     "--context-length", "16", "--batch-size", "4", "--epochs", "3",
                     "--eval-every", "2", "--patience", patience, "--no-progress",
                     "--run-dir", str(tmp_path / f"run-{patience}")])
        assert code == 0
        assert saved == [1, 2, 3], patience


# --------------------------------------------------------------- real processes, real signals


def test_sigkill_after_a_periodic_save_resumes_exactly(corpus, tmp_path, capsys):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    args = [*TRAIN, "--data", str(corpus), "--epochs", "5", "--save-every", "0"]
    # KilledError while epoch 3 trains: the periodic save after epoch 2 is complete.
    proc = start(*[*args, "--run-dir", str(run_dir)], pause="epoch-end@3", folder=folder)
    wait_paused(proc, folder, "epoch-end")
    proc.kill()
    proc.wait()
    assert checkpoint_progress(run_dir) == (2, 5)
    assert main(["translate", "train", "--run-dir", str(run_dir), "--resume"]) == 0
    assert checkpoint_progress(run_dir) == (5, 5)
    # An uninterrupted run of the same five epochs, in the same kind of process.
    straight = subprocess.run([sys.executable, "-m", "qkv", *args, "--run-dir",
                               str(tmp_path / "straight")], env={**os.environ,
                              "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr
    a = load_file(run_dir / "model.safetensors")
    b = load_file(tmp_path / "straight" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sighup_is_handled_as_sigterm(corpus, tmp_path):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    proc = start(*[*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "4"],
                  pause="epoch-end@2", folder=folder)
    wait_paused(proc, folder, "epoch-end")
    proc.send_signal(signal.SIGHUP)
    (folder / "resume-epoch-end").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "interrupted (SIGHUP)" in lines[0]
    assert f"{run_dir} holds the checkpoint after epoch 2 of 4" in lines[0]
    assert checkpoint_progress(run_dir) == (2, 4)


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs of its own (root only: skipped where it cannot be mounted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path, leave: int) -> Path:
    """Write a file that leaves about ``leave`` bytes free on ``folder``'s disk."""
    filler = folder / "filler.bin"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(free - leave, 0))
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_training_is_refused_before_it_starts_when_the_disk_cannot_take_a_checkpoint(
        corpus, small_disk, capsys):
    run_dir = small_disk / "run"
    code = main([*TRAIN, "--data", str(corpus), "--run-dir", str(run_dir), "--epochs", "2",
                 "--num-hiddens", "256", "--embed-size", "64"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "not enough disk space to train into" in err and str(run_dir) in err
    assert "MiB" in err and "free there" in err
    assert not run_dir.exists()  # nothing left behind


def _tiny_trainer(run_dir: Path, epochs: int, on_epoch=None) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)  # 16.6 kB of weights, 33 kB of Adam moments
    data = TensorDataset(torch.randn(8, 64), torch.randint(0, 64, (8,)))

    def loss_fn(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x), y, reduction="sum"), torch.tensor(len(y))

    def batches(generator):
        if on_epoch is not None:
            on_epoch()
        return DataLoader(data, batch_size=4, shuffle=True, generator=generator)

    return Trainer(model, loss_fn, batches,
                   TrainConfig(epochs=epochs, device="cpu", progress=False, log_every=0,
                               save_every=0),
                   run_dir=run_dir)


def test_a_save_that_cannot_fit_says_so_and_keeps_the_old_checkpoint(small_disk):
    run_dir = small_disk / "run"
    epochs = iter(range(1, 10))
    # Another process fills the disk while epoch 2 trains.
    trainer = _tiny_trainer(run_dir, 3, lambda: next(epochs) == 2 and _fill(small_disk, 20_000))
    with pytest.raises(InsufficientDiskError) as error:
        trainer.fit()
    message = str(error.value)
    assert "\n" not in message
    assert f"cannot save the checkpoint after epoch 2 to {run_dir}" in message
    assert f"{run_dir} still holds the checkpoint after epoch 1 of 3" in message
    assert not (run_dir / ".checkpoint-incoming").exists()
    assert checkpoint_progress(run_dir) == (1, 3)
    load_weights(run_dir, nn.Linear(64, 64))
    # Nor does a run start into a disk that cannot take its next save.
    again = _tiny_trainer(run_dir, 3)
    again.resume()
    with pytest.raises(InsufficientDiskError, match="not enough disk space to train into"):
        again.fit()


def test_a_disk_that_fills_up_mid_save_leaves_no_staging_copy(small_disk, monkeypatch):
    run_dir = small_disk / "run"
    trainer = _tiny_trainer(run_dir, 1)
    trainer.fit()
    _fill(small_disk, 40_000)
    # The disk fills up after the check: another process wrote meanwhile.
    monkeypatch.setattr(checkpoint_module, "free_disk_space", lambda path: 1 << 40)
    trainer.config.epochs = 2
    with pytest.raises(InsufficientDiskError) as error:
        trainer.fit()
    message = str(error.value)
    assert "\n" not in message
    assert "the disk filled up while saving the checkpoint after epoch 2" in message
    assert "the partial copy was removed" in message
    assert f"{run_dir} still holds the checkpoint after epoch 1 of 1" in message
    assert not (run_dir / ".checkpoint-incoming").exists()
    assert checkpoint_progress(run_dir) == (1, 1)
    # Space freed, the run resumes from what the directory holds and finishes.
    (small_disk / "filler.bin").unlink()
    resumed = _tiny_trainer(run_dir, 2)
    resumed.resume()
    resumed.fit()
    assert checkpoint_progress(run_dir) == (2, 2)


# ------------------------------------------------------------ saves inside a long epoch


class KilledError(Exception):
    """Stands in for SIGKILL: the process is gone, only the disk remains."""


def _long_epoch_trainer(run_dir: Path, clock: FakeClock | None, kill_at: int | None = None
                        ) -> Trainer:
    """Dropout (so the RNG state matters) and 12 batches an epoch; each batch takes one
    minute on ``clock``; a batch numbered ``kill_at`` (counting from 1) never returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,)))
    calls = 0

    def loss_fn(m, batch):
        nonlocal calls
        calls += 1
        if kill_at is not None and calls == kill_at:
            raise KilledError
        if clock is not None:
            clock.tick()
        x, y = batch
        return nn.functional.cross_entropy(m(x), y, reduction="sum"), torch.tensor(len(y))

    return Trainer(model, loss_fn,
                   lambda g: DataLoader(data, batch_size=4, shuffle=True, generator=g),
                   TrainConfig(epochs=3, device="cpu", progress=False, log_every=0,
                               save_every=5.0),
                   run_dir=run_dir)


def test_a_long_epoch_is_saved_inside_and_resumed_exactly(tmp_path, monkeypatch):
    straight = _long_epoch_trainer(tmp_path / "straight", None, None)
    straight.fit()
    clock = FakeClock(1.0)  # a minute a batch: a save every five batches
    monkeypatch.setattr(trainer_module.time, "monotonic", clock)
    saved = _saved_epochs(monkeypatch)
    killed = _long_epoch_trainer(tmp_path / "run", clock, kill_at=19)  # 7th batch of epoch 2
    with pytest.raises(KilledError):
        killed.fit()
    # Saves after batches 5 and 10 (epoch 0 completed), then the first epoch's end
    # (its 12 minutes make the run's 36 > three), then batch 5 of epoch 2.
    assert saved == [0, 0, 1, 1]
    assert checkpoint_progress(tmp_path / "run") == (1, 3)
    from qkv.training import describe_run_dir
    assert describe_run_dir(tmp_path / "run") == \
        "the checkpoint after epoch 1 of 3 and 5 steps into epoch 2"
    monkeypatch.undo()
    resumed = _long_epoch_trainer(tmp_path / "run", None)
    resumed.resume()
    resumed.fit()
    for (name, a), b in zip(straight.module.state_dict().items(),
                            resumed.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.history["loss"] == straight.history["loss"]
    assert resumed.step == straight.step == 36


def test_lm_killed_inside_an_epoch_resumes_to_the_bit(tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 60)
    args = ["lm", "train", "--text", str(text), "--preset", "tiny", "--context-length", "16",
            "--batch-size", "4", "--epochs", "2", "--no-progress", "--dropout", "0.1"]
    folder, run_dir = tmp_path / "pause", tmp_path / "run"
    # A save after every step (the clock is always due); killed after the third.
    proc = start(*[*args, "--run-dir", str(run_dir), "--save-every", "1e-9"],
                  pause="mid-epoch-save@3", folder=folder)
    wait_paused(proc, folder, "mid-epoch-save")
    proc.kill()
    proc.wait()
    assert checkpoint_progress(run_dir) == (0, 2)
    assert main(["lm", "train", "--run-dir", str(run_dir), "--resume", "--no-progress"]) == 0
    assert main([*args, "--run-dir", str(tmp_path / "straight")]) == 0
    a = load_file(run_dir / "model.safetensors")
    b = load_file(tmp_path / "straight" / "model.safetensors")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_ctrl_c_during_the_first_save_after_an_epoch_keeps_that_save(tmp_path, monkeypatch):
    """The signal held during a save acts after the trainer has recorded the save, so the
    rollback does not replace the newer checkpoint on disk with the older epoch's end."""
    clock = FakeClock(1.0)  # a minute a batch, 12 batches an epoch, a save every 5 minutes
    monkeypatch.setattr(trainer_module.time, "monotonic", clock)
    monkeypatch.setattr(trainer_module, "FIRST_SAVE_SECONDS", 1e9)  # no first-epoch save
    staged = 0
    real_pause = checkpoint_module.pause_point

    def pause(name):
        nonlocal staged
        real_pause(name)
        if name == "save-staged":
            staged += 1
            if staged == 3:  # epoch 2's first save, before its commit
                signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(checkpoint_module, "pause_point", pause)
    trainer = _long_epoch_trainer(tmp_path / "run", clock)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    from qkv.training import describe_run_dir
    # Saves after batches 5 and 10 of epoch 1, none at its end (2 minutes after the
    # last), then 3 steps into epoch 2 (minute 15): that one is what the disk holds.
    assert describe_run_dir(tmp_path / "run") == \
        "the checkpoint after epoch 1 of 3 and 3 steps into epoch 2"


def test_a_checkpoint_inside_an_epoch_is_not_relabelled_by_a_run_that_trains_nothing(
        tmp_path, monkeypatch):
    clock = FakeClock(1.0)
    monkeypatch.setattr(trainer_module.time, "monotonic", clock)
    killed = _long_epoch_trainer(tmp_path / "run", clock, kill_at=19)
    with pytest.raises(KilledError):
        killed.fit()
    resumed = _long_epoch_trainer(tmp_path / "run", None)
    resumed.resume()
    resumed.config.epochs = 1  # the epoch inside which the checkpoint was saved is 2
    with pytest.raises(ValueError, match="saved 5 steps into epoch 2: train to at least epoch 2"):
        resumed.fit()
    assert checkpoint_progress(tmp_path / "run") == (1, 3)


def test_nohup_keeps_a_run_alive_when_its_terminal_closes(corpus, tmp_path):
    run_dir, folder = tmp_path / "run", tmp_path / "pause"
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QKV_TEST_PAUSE": f"epoch-end@2:{folder}"}
    proc = subprocess.Popen(  # as nohup starts it: SIGHUP ignored
        [sys.executable, "-m", "qkv", *TRAIN, "--data", str(corpus), "--run-dir",
         str(run_dir), "--epochs", "3"], env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_paused(proc, folder, "epoch-end")
    proc.send_signal(signal.SIGHUP)
    (folder / "resume-epoch-end").touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert checkpoint_progress(run_dir) == (3, 3)
