"""The memory check made before a model is built: where the numbers come from, the
message, and the CLI refusing sizes the machine cannot hold before building anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.training import (
    InsufficientMemoryError,
    available_memory,
    check_memory,
    format_bytes,
    limits,
)

GiB = 2**30


def test_check_memory_refuses_with_the_numbers(monkeypatch):
    monkeypatch.setattr(limits, "available_memory", lambda device="cpu": 3 * GiB)
    with pytest.raises(InsufficientMemoryError) as error:
        check_memory(5 * GiB + GiB // 2, "training this 343,597,384-parameter model",
                     hint="use smaller sizes")
    assert str(error.value) == ("training this 343,597,384-parameter model needs at least "
                                "5.5 GiB, but 3.0 GiB is available; use smaller sizes")
    assert isinstance(error.value, ValueError)  # the CLI reports it in one line
    check_memory(3 * GiB, "exactly what there is", hint="")  # fits: nothing happens
    monkeypatch.setattr(limits, "available_memory", lambda device="cpu": None)
    check_memory(10**30, "unknowable", hint="")  # unknown: not checked


def test_available_memory_reads_meminfo_and_the_container_limit(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  1000 kB\nMemAvailable:  4000000 kB\n")
    monkeypatch.setattr(limits, "MEMINFO", meminfo)
    monkeypatch.setattr(limits, "CGROUP_ROOT", tmp_path / "no-cgroup")
    assert available_memory() == 4_000_000 * 1024
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    monkeypatch.setattr(limits, "CGROUP_ROOT", cgroup)
    assert available_memory() == 4_000_000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{2 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{GiB // 2}\n")
    assert available_memory() == 2 * GiB - GiB // 2  # the tighter of the two
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    monkeypatch.setattr(limits, "CGROUP_ROOT", v1.parent)
    assert available_memory() == 4_000_000 * 1024


def test_available_memory_on_this_machine():
    available = available_memory()
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        pytest.skip("no /proc/meminfo here")
    total = int(re.search(r"MemTotal:\s+(\d+) kB", text).group(1)) * 1024
    assert 0 < available <= total


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 bytes"), (1023, "1023 bytes"), (1536, "1.5 KiB"), (5 * GiB + GiB // 2, "5.5 GiB"),
     (3 * 2**60, "3.0 EiB"), (10**28, "1e+28 bytes")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


CORPUS = "".join(f"{s}\t{t}\n" for s, t in [("go .", "va !"), ("hi .", "salut !")] * 10)


def _no_build(*args, **kwargs):
    raise AssertionError("a model was built")


def test_translate_train_too_big_is_refused_before_building(tmp_path, monkeypatch, capsys):
    import qkv.tasks.translate

    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    monkeypatch.setattr(qkv.tasks.translate, "build_model", _no_build)
    assert main(["translate", "train", "--data", str(corpus), "--run-dir", str(tmp_path / "r"),
                 "--num-hiddens", "100000", "--min-freq", "1", "--epochs", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    # a GRU of width 100,000 has 3 x 100,000 x 100,000 recurrent weights per layer and side
    count = int(re.search(r"training this ([\d,]+)-parameter bahdanau translator",
                          err).group(1).replace(",", ""))
    assert count > 4 * 3 * 10**10
    assert re.search(r"needs at least [\d.]+ TiB, but [\d.]+ [GMT]iB is available; choose a "
                     r"smaller --num-hiddens", err), err


def test_lm_train_gpt2_xl_on_a_small_machine_is_refused(tmp_path, monkeypatch, capsys):
    import qkv.tasks.lm

    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 200, encoding="utf-8")
    monkeypatch.setattr(limits, "available_memory", lambda device="cpu": 8 * GiB)
    monkeypatch.setattr(qkv.tasks.lm, "GPTModel", _no_build)
    assert main(["lm", "train", "--preset", "gpt2-xl", "--context-length", "32", "--text",
                 str(text), "--run-dir", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    # The book's 1,637,792,000 for GPT-2 XL, less the vocabulary (50,257 -> 257 bytes, in the
    # embedding and the head) and the positions (1,024 -> 32) this run does not have.
    count = 1_637_792_000 - 2 * (50_257 - 257) * 1600 - (1024 - 32) * 1600
    assert (f"training this {count:,}-parameter GPT ('gpt2-xl' preset) on batches of 16 x 32 "
            "tokens (16 bytes per parameter") in err
    # 22.0 GiB for the parameters, 2.3 GiB for the activations of a batch
    assert re.search(r"and 2.3 GiB of activations\) needs at least 24.3 GiB, but 8.0 GiB is "
                     r"available; choose a smaller --preset", err), err


@pytest.mark.parametrize(
    "sizes",
    [dict(emb_dim=64, n_layers=2, context_length=32, vocab_size=5000, qkv_bias=True),
     dict(emb_dim=128, n_layers=3, context_length=256, vocab_size=257, tie_weights=True),
     dict(emb_dim=32, n_layers=6, context_length=64, vocab_size=300, drop_rate=0.2),
     dict(emb_dim=64, n_layers=1, context_length=8, vocab_size=50257)],
)
def test_activation_estimate_is_a_lower_bound(sizes):
    """Against what autograd really keeps: every tensor saved for backward during one
    training forward pass, counted once per storage (parameters excluded)."""
    import torch
    import torch.nn.functional as F

    from qkv.models.gpt import GPTConfig, GPTModel

    cfg = GPTConfig(n_heads=4, **{"drop_rate": 0.0, **sizes})
    model = GPTModel(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch, tokens = 3, cfg.context_length
    x = torch.randint(0, cfg.vocab_size, (batch, tokens))
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    estimate = 4 * cfg.num_saved_activations(batch, tokens)
    assert sum(saved.values()) >= estimate
    if cfg.drop_rate == 0:  # and not far below: without dropout little else is kept
        assert estimate > 0.9 * sum(saved.values())
