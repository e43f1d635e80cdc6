"""Corpora of any size, in bounded memory; inputs that are not regular files refused.

The hostile inputs run in a child process with a timeout, so that a FIFO that blocks
or a file read whole fails the test instead of hanging or swapping the machine.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.data.lm import GPTDataset
from qkv.data.tokenfile import TOKENS_FILE, TOKENS_INFO, prepare_token_file
from qkv.data.tokenizers import get_tokenizer
from qkv.tasks.lm import LMSettings, train_language_model
from qkv.training import limits

PAIRS = "".join(f"{s}\t{t}\n" for s, t in [("Go.", "Va !"), ("Hi.", "Salut !"),
                                              ("Run!", "Cours !"), ("Who?", "Qui ?")] * 4)
TEXT = ("The cat sat on the mat. The dog sat on the log.\nA cat and a dog met on the mat. "
        * 12)
LM_FAST = ["--context-length", "16", "--batch-size", "4", "--no-progress", "--sample", ""]
# The corpus recipe (no --preset): every pair is kept unless --num-examples says otherwise.
TR_FAST = ["--min-freq", "1", "--batch-size", "2", "--no-progress", "--num-hiddens", "8",
           "--embed-size", "8", "--epochs", "1"]

# Runs qkv's main() on each argv in argv_list (JSON in argv[1]) in one process, and
# prints, as JSON, each call's exit status and stderr, and the process's peak RSS.
PROBE = textwrap.dedent("""
    import contextlib, io, json, resource, sys
    from qkv.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        results.append([code, err.getvalue()])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"results": results, "peak": peak}))
""")


def probe(argv_list, timeout=180):
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv_list)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def assert_one_line(code, err, *phrases):
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifos_devices_and_directories_are_refused_by_what_they_are(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "checkpoint.json")  # the manifest, read first when loading a run
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    os.mkfifo(bpe / "encoder.json")
    (bpe / "vocab.bpe").write_text("#version: 0.2\n")
    text = tmp_path / "story.txt"
    text.write_text(TEXT, encoding="utf-8")
    run = str(tmp_path / "run")
    cases = [
        (["lm", "train", "--text", str(fifo), "--run-dir", run, *LM_FAST], "FIFO (named pipe)"),
        (["translate", "train", "--data", str(fifo), "--run-dir", run, *TR_FAST],
         "FIFO (named pipe)"),
        (["lm", "generate", "--ckpt", str(ckpt), "--prompt", "x"], "FIFO (named pipe)"),
        (["lm", "train", "--text", str(text), "--tokenizer", "gpt2", "--bpe-dir", str(bpe),
          "--run-dir", run, *LM_FAST], "FIFO (named pipe)"),
        (["translate", "run", "--ckpt", str(ckpt), "--text", "go ."], "FIFO (named pipe)"),
        (["lm", "train", "--text", "/dev/zero", "--run-dir", run, *LM_FAST],
         "is a character device"),
        (["translate", "train", "--data", "/dev/zero", "--run-dir", run, *TR_FAST],
         "is a character device"),
        (["lm", "train", "--text", str(folder), "--run-dir", run, *LM_FAST], "is a directory"),
        (["translate", "train", "--data", str(folder), "--run-dir", run, *TR_FAST],
         "is a directory"),
    ]
    if not os.path.exists("/dev/zero"):
        cases = [c for c in cases if "/dev/zero" not in c[0]]
    out = probe([argv for argv, _ in cases])
    for (_argv, phrase), (code, err) in zip(cases, out["results"], strict=True):
        assert_one_line(code, err, phrase, "not a regular file")
        assert "not found" not in err
    assert not (tmp_path / "run").exists()


def test_a_huge_sparse_file_is_refused_in_bounded_memory(tmp_path):
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(3 * 2**30)  # 3 GiB of zero bytes, no newline, costing no disk
    run = str(tmp_path / "run")
    out = probe([
        # refused before it is read (its pairs cannot fit), or at its first line
        ["translate", "train", "--data", str(sparse), "--run-dir", run, *TR_FAST],
        ["translate", "train", "--data", str(sparse), "--num-examples", "10", "--run-dir", run,
         *TR_FAST],
        # read as a stream, refused where it is clearly no text
        ["lm", "train", "--text", str(sparse), "--run-dir", run, *LM_FAST],
    ])
    (code, err), (code_n, err_n), (code_lm, err_lm) = out["results"]
    assert_one_line(code, err, "sparse.txt")
    assert ("3.0 GiB" in err and "would fit" in err) or "line 1 is longer than" in err
    assert_one_line(code_n, err_n, "line 1 is longer than 1,048,576 characters")
    assert_one_line(code_lm, err_lm, "no space or newline", "is it text?")
    # Reading any of them whole would take 3 GiB and more.
    assert out["peak"] < 1.5 * 2**30, out["peak"]
    assert not list((tmp_path / "run").glob("*.bin"))  # no ids file left behind


def test_a_corpus_larger_than_memory_is_refused_before_it_is_read(tmp_path, monkeypatch,
                                                                  capsys):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:  4096 kB\n")  # 4 MiB
    monkeypatch.setattr(limits, "MEMINFO", meminfo)
    monkeypatch.setattr(limits, "CGROUP_ROOT", tmp_path / "no-cgroup")
    corpus = tmp_path / "big.txt"
    corpus.write_bytes(PAIRS.encode() * (2**20 // len(PAIRS) + 1))  # just over 1 MiB
    run = tmp_path / "run"
    code = main(["translate", "train", "--data", str(corpus), "--run-dir", str(run), *TR_FAST])
    err = capsys.readouterr().err
    assert_one_line(code, err, "big.txt (1.0 MiB)", "12.0 MiB", "4.0 MiB is available",
                    "a corpus of at most 341.3 KiB would fit", "--num-examples")
    assert not run.exists()
    # Asking for more pairs than fit is refused as soon as the lines read would not fit.
    code = main(["translate", "train", "--data", str(corpus), "--run-dir", str(run),
                 "--num-examples", "1000000", *TR_FAST])
    err = capsys.readouterr().err
    assert_one_line(code, err, "big.txt: its first", "more than the 349,525 whose pairs fit")
    assert not run.exists()
    # Its first pairs are read as a stream, and fit.
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(run),
                 "--num-examples", "8", *TR_FAST]) == 0


def test_gpt_windows_from_a_memmap_are_those_of_the_ids(tmp_path):
    ids = list(np.random.default_rng(0).integers(0, 257, size=500))
    path = tmp_path / "ids.bin"
    np.asarray(ids, dtype=np.uint16).tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r")
    for window, stride in ((8, 8), (8, 3), (16, 1)):
        a, b = GPTDataset(ids, window, stride), GPTDataset(mapped, window, stride)
        assert len(a) == len(b)
        for n in (0, 1, len(a) // 2, -1):
            for x, y in zip(a[n], b[n], strict=True):
                assert y.dtype == torch.long and torch.equal(x, y)
    with pytest.raises(ValueError, match="1-D array of integers"):
        GPTDataset(np.zeros(50, dtype=np.float32), 4, 4)


def _quiet(_line):
    pass


def test_the_text_is_tokenized_once_and_reused_on_resume(tmp_path):
    text = tmp_path / "story.txt"
    text.write_text(TEXT, encoding="utf-8")
    settings = dict(text=str(text), context_length=16, stride=16, batch_size=8, device="cpu",
                    emb_dim=32, n_heads=2, n_layers=1)
    whole, _ = train_language_model(LMSettings(**settings, epochs=2), tmp_path / "whole",
                                    progress=False, log=_quiet)
    run_dir = tmp_path / "run"
    train_language_model(LMSettings(**settings, epochs=1), run_dir, progress=False, log=_quiet)
    ids_path = run_dir / TOKENS_FILE
    # The ids are the tokenizer's ids of the whole text, as uint16.
    expected = get_tokenizer("bytes").encode(TEXT)
    assert np.fromfile(ids_path, dtype=np.uint16).tolist() == expected
    info = json.loads((run_dir / TOKENS_INFO).read_text())
    assert info["count"] == len(expected) and info["dtype"] == "uint16"
    assert info["tokens_per_second"] > 0 and info["source"]["bytes"] == len(TEXT)
    before = os.stat(ids_path)
    lines = []
    resumed, history = train_language_model(LMSettings(epochs=2), run_dir, resume=True,
                                            progress=False, log=lines.append)
    after = os.stat(ids_path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert any("reusing the" in line for line in lines), lines
    assert not any("tokenized" in line and "tokens/s" in line for line in lines)
    assert history["epoch"] == [1, 2]
    for (name, a), (_, b) in zip(whole.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_damaged_ids_are_tokenized_again_and_a_changed_text_is_refused(tmp_path):
    text = tmp_path / "story.txt"
    text.write_text(TEXT, encoding="utf-8")
    tokenizer = get_tokenizer("bytes")
    first = prepare_token_file(text, tokenizer, tmp_path)
    assert not first.reused and first.ids.tolist() == tokenizer.encode(TEXT)
    assert prepare_token_file(text, tokenizer, tmp_path).reused
    data = bytearray((tmp_path / TOKENS_FILE).read_bytes())
    data[10] ^= 1  # the same size, one id changed
    (tmp_path / TOKENS_FILE).write_bytes(bytes(data))
    lines = []
    again = prepare_token_file(text, tokenizer, tmp_path, log=lines.append)
    assert not again.reused and again.ids.tolist() == tokenizer.encode(TEXT)
    assert "does not match its record" in lines[0]
    # A record of another tokenizer of the same name and size (other BPE merges) is
    # told apart by the ids of its probe sentence.
    record = json.loads((tmp_path / TOKENS_INFO).read_text())
    record["probe"][0] += 1
    (tmp_path / TOKENS_INFO).write_text(json.dumps(record))
    lines = []
    assert not prepare_token_file(text, tokenizer, tmp_path, log=lines.append).reused
    assert "another tokenizer made them" in lines[0]
    text.write_text(TEXT + "More.", encoding="utf-8")
    with pytest.raises(ValueError, match="has changed since the run was trained on it"):
        prepare_token_file(text, tokenizer, tmp_path, sha256=first.sha256)
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        prepare_token_file(empty, tokenizer, tmp_path / "e")
    assert list((tmp_path / "e").iterdir()) == []  # the partial ids file was removed


def test_regular_file_stat_names_what_a_path_is(tmp_path):
    import socket

    from qkv.utils.fileio import NotRegularFileError, open_regular, regular_file_stat

    regular = tmp_path / "a.txt"
    regular.write_bytes(b"abc")
    assert regular_file_stat(regular).st_size == 3
    with open_regular(regular, "text file") as f:
        assert f.read() == b"abc"
    kinds = {tmp_path: "a directory"}
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        kinds[tmp_path / "fifo"] = "a FIFO (named pipe)"
    if hasattr(socket, "AF_UNIX"):
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(tmp_path / "sock"))  # the socket file outlives the socket
        kinds[tmp_path / "sock"] = "a socket"
    if os.path.exists("/dev/zero"):
        kinds["/dev/zero"] = "a character device"
    for path, kind in kinds.items():
        for check in (regular_file_stat, open_regular):  # neither blocks on the FIFO
            with pytest.raises(NotRegularFileError) as error:
                check(path, "text file")
            assert str(error.value) == (f"text file {str(path)!r} is {kind}, not a regular "
                                        "file; name a regular file")
            assert error.value.kind == kind
            assert isinstance(error.value, OSError) and isinstance(error.value, ValueError)
    with pytest.raises(FileNotFoundError, match=r"^text file not found: .*nope$"):
        open_regular(tmp_path / "nope", "text file")
    with pytest.raises(FileNotFoundError, match="a parent is not a directory"):
        regular_file_stat(regular / "below", "text file")
