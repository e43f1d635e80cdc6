"""A run directory someone tampered with: FIFOs where qkv's files go are named as such,
in one line, and never read (a read would block forever)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli import main

TEXT = "the cat sat on the mat and the dog sat on the log. " * 40
TRAIN = ["lm", "train", "--preset", "tiny", "--context-length", "16", "--batch-size", "4",
         "--epochs", "1", "--no-progress", "--sample", ""]


def _qkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "story.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_fifo_manifest_in_a_new_runs_directory_does_not_hang(tmp_path, text, overwrite):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "checkpoint.json")
    done = _qkv(*TRAIN, "--text", str(text), "--run-dir", str(run_dir),
                *(["--overwrite"] if overwrite else []))
    if overwrite:  # the new run's save replaces what was there
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "FIFO" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("member", ["config.json", "model.safetensors"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_named_as_such(tmp_path, text, member, capsys):
    run_dir = tmp_path / "run"
    assert main([*TRAIN, "--text", str(text), "--run-dir", str(run_dir)]) == 0
    (run_dir / member).unlink()
    os.mkfifo(run_dir / member)
    capsys.readouterr()
    assert main(["lm", "generate", "--ckpt", str(run_dir), "--prompt", "the"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{member}: is a FIFO (named pipe), not a regular file" in err


def test_a_fifo_lock_file_is_named_as_such(tmp_path, text, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / ".qkv-lock")
    assert main([*TRAIN, "--text", str(text), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert ".qkv-lock is a FIFO (named pipe), not the lock file qkv makes" in err


@pytest.mark.parametrize(("flags", "named"), [
    (["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--top-k", "0"], "--top-k"), (["--seed", str(10**20)], "--seed")])
def test_generate_refuses_bad_sampling_flags_before_any_output(tmp_path, text, flags, named,
                                                                capsys):
    run_dir = tmp_path / "run"
    assert main([*TRAIN, "--text", str(text), "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["lm", "generate", "--ckpt", str(run_dir), "--prompt", "PROMPT", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and named in err
