"""Safe checkpoints: round trips, crash safety and rejection of every kind of bad file."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from qkv.training import (
    CheckpointError,
    is_checkpoint,
    load_config,
    load_trainer_state,
    load_weights,
    save_checkpoint,
)
from qkv.training.checkpoint import STAGING


class Tiny(nn.Module):
    def __init__(self, d: int = 4, vocab: int = 7, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.emb(x)))


class Tied(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.out.weight = self.emb.weight  # (vocab, d) for both: the GPT-2 weight tying


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def _rehash(run_dir, name: str) -> None:
    """Make the manifest agree with a tampered file: what a deliberate attacker would do."""
    manifest_path = run_dir / "checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    data = (run_dir / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, model, {"d": 4, "vocab": ["<unk>", "a"]})
    return run_dir, model


def test_round_trip_and_layout(saved):
    run_dir, model = saved
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoint.json", "config.json", "model.safetensors"
    ]
    manifest = json.loads((run_dir / "checkpoint.json").read_text())
    assert manifest["format"] == "qkv-checkpoint" and manifest["version"] == 1
    for name, entry in manifest["files"].items():
        data = (run_dir / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert is_checkpoint(run_dir)
    assert load_config(run_dir) == {"d": 4, "vocab": ["<unk>", "a"]}
    fresh = Tiny()
    load_weights(run_dir, fresh)
    _assert_same(model, fresh)
    assert load_trainer_state(run_dir, None) is None  # saved without trainer state


def test_tied_weights_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    save_checkpoint(tmp_path, model, {})
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert len(stored) == len(model.state_dict()) - 1  # the tied matrix is stored once
    fresh = Tied()
    load_weights(tmp_path, fresh)
    _assert_same(model, fresh)
    assert fresh.out.weight is fresh.emb.weight  # still tied after loading
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(x), fresh(x))
    # An untied model of the same shapes also loads: the alias fills both names.
    untied = Tiny()
    load_weights(tmp_path, untied)
    assert torch.equal(untied.out.weight, model.emb.weight)


def test_overlapping_views_are_stored_as_copies(tmp_path):
    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            base = torch.arange(6.0)
            self.register_buffer("a", base[:4])
            self.register_buffer("b", base[2:])

    model = Views()
    save_checkpoint(tmp_path, model, {})
    fresh = Views()
    fresh.a.zero_()
    fresh.b.zero_()
    load_weights(tmp_path, fresh)
    assert fresh.a.tolist() == [0, 1, 2, 3] and fresh.b.tolist() == [2, 3, 4, 5]


def test_shape_mismatch_names_keys_and_shapes(tmp_path):
    save_checkpoint(tmp_path, nn.Linear(4, 3), {})
    with pytest.raises(CheckpointError) as error:
        load_weights(tmp_path, nn.Linear(4, 5))
    message = _one_line(error)
    assert "model.safetensors" in message
    assert "weight expected (5, 4)" in message and "found (3, 4)" in message
    assert "bias expected (5,)" in message and "found (3,)" in message


def test_dtype_mismatch_rejected(tmp_path):
    save_checkpoint(tmp_path, nn.Linear(2, 2), {})
    with pytest.raises(CheckpointError, match="torch.float64.*found.*torch.float32"):
        load_weights(tmp_path, nn.Linear(2, 2).double())


def test_missing_and_unexpected_keys(tmp_path):
    save_checkpoint(tmp_path, nn.Linear(2, 2), {})
    with pytest.raises(CheckpointError, match="unexpected 1 key.*: bias"):
        load_weights(tmp_path, nn.Linear(2, 2, bias=False))
    # The other direction: the model expects a bias the file lacks.
    save_checkpoint(tmp_path, nn.Linear(2, 2, bias=False), {})
    with pytest.raises(CheckpointError) as error:
        load_weights(tmp_path, nn.Linear(2, 2))
    assert "missing 1 key(s): bias" in _one_line(error)
    partial = nn.Linear(2, 2)
    load_weights(tmp_path, partial, strict=False)  # loads weight, leaves bias alone


def test_config_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="config is not JSON-serialisable"):
        save_checkpoint(tmp_path / "run", nn.Linear(1, 1), {"bad": object()})
    assert not (tmp_path / "run").exists()  # nothing written


# ---------------------------------------------------------------------------- rejections


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nope")
    assert not is_checkpoint(tmp_path / "nope")


def test_missing_manifest(saved):
    run_dir, _ = saved
    (run_dir / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="checkpoint.json: manifest missing"):
        load_weights(run_dir, Tiny())
    assert not is_checkpoint(run_dir)


def test_missing_listed_file(saved):
    run_dir, _ = saved
    (run_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        load_config(run_dir)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": "other"}, "not a qkv-checkpoint manifest"),
        ({"version": 99}, "unsupported qkv-checkpoint version 99"),
        ({"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0"}}}, "unexpected file"),
        ({"files": {}}, "does not list model.safetensors, config.json"),
    ],
)
def test_bad_manifest(saved, change, match):
    run_dir, _ = saved
    manifest = json.loads((run_dir / "checkpoint.json").read_text())
    manifest.update(change)
    (run_dir / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=match):
        load_config(run_dir)
    assert not is_checkpoint(run_dir)


def test_manifest_garbage(saved):
    run_dir, _ = saved
    (run_dir / "checkpoint.json").write_bytes(b"\x00{not json")
    with pytest.raises(CheckpointError) as error:
        load_config(run_dir)
    assert "checkpoint.json: invalid JSON" in _one_line(error)


def test_truncated_file(saved):
    run_dir, _ = saved
    path = run_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated or altered"):
        load_weights(run_dir, Tiny())
    with pytest.raises(CheckpointError, match="truncated"):
        load_config(run_dir)  # sizes of every listed file are checked up front


def test_flipped_byte(saved):
    run_dir, _ = saved
    path = run_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        load_weights(run_dir, Tiny())
    assert "SHA-256 mismatch" in _one_line(error)


def test_config_garbage(saved):
    run_dir, _ = saved
    (run_dir / "config.json").write_text("{garbage")
    with pytest.raises(CheckpointError, match="config.json: (SHA-256|truncated)"):
        load_config(run_dir)
    _rehash(run_dir, "config.json")
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        load_config(run_dir)
    (run_dir / "config.json").write_text("[1, 2]")
    _rehash(run_dir, "config.json")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        load_config(run_dir)


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_pickle_in_place_of_weights(saved, kind):
    run_dir, model = saved
    path = run_dir / "model.safetensors"
    if kind == "torch.save":
        torch.save(model.state_dict(), path)
    else:
        path.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    with pytest.raises(CheckpointError, match="SHA-256 mismatch|truncated"):
        load_weights(run_dir, Tiny())
    _rehash(run_dir, "model.safetensors")  # even with a matching manifest: never unpickled
    with pytest.raises(CheckpointError) as error:
        load_weights(run_dir, Tiny())
    assert "is a pickle / torch.save file" in _one_line(error)


def test_unparsable_safetensors(saved):
    run_dir, _ = saved
    (run_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    _rehash(run_dir, "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_weights(run_dir, Tiny())
    assert "model.safetensors: is not a valid safetensors file" in _one_line(error)


def test_load_failure_leaves_model_untouched(saved):
    run_dir, _ = saved
    path = run_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    model = Tiny()
    before = _params(model)
    with pytest.raises(CheckpointError):
        load_weights(run_dir, model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


# ---------------------------------------------------------------------------- optimizer + RNG


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randint(0, 7, (3, 5), generator=gen)
        optimizer.zero_grad()
        model(x).logsumexp(-1).mean().backward()  # dropout draws from the global RNG
        optimizer.step()


def test_adam_restore_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = Tiny(dropout=0.3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    _train_steps(model, optimizer, 3)
    save_checkpoint(tmp_path, model, {}, optimizer=optimizer, trainer_state={"epoch": 3})
    random_draw, numpy_draw = random.random(), np.random.rand()
    _train_steps(model, optimizer, 3)  # the uninterrupted run

    torch.manual_seed(123)  # a different init and RNG state, undone by loading
    random.seed(1)
    np.random.seed(1)
    fresh = Tiny(dropout=0.3)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2, betas=(0.8, 0.99))
    load_weights(tmp_path, fresh)
    assert load_trainer_state(tmp_path, fresh_optimizer) == {"epoch": 3}
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.99)  # a tuple again
    assert (random.random(), np.random.rand()) == (random_draw, numpy_draw)
    # Both runs drew once from random and NumPy after the save point; torch's RNG (dropout)
    # is where the reference run left it at the save, so training continues exactly.
    _train_steps(fresh, fresh_optimizer, 3)
    _assert_same(model, fresh)
    sa, sb = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for pid in sa:
        for name in sa[pid]:
            assert torch.equal(sa[pid][name], sb[pid][name])


def test_optimizer_mismatch_rejected_without_side_effects(tmp_path):
    model = Tiny()
    optimizer = torch.optim.Adam(model.parameters())
    _train_steps(model, optimizer, 1)
    save_checkpoint(tmp_path, model, {}, optimizer=optimizer)
    other = nn.Linear(3, 3)
    other_optimizer = torch.optim.Adam(other.parameters())
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="optimizer"):
        load_trainer_state(tmp_path, other_optimizer)
    assert torch.equal(torch.get_rng_state(), rng)
    assert other_optimizer.state_dict()["state"] == {}


def test_param_shaped_state_checked(tmp_path):
    a, b = nn.Linear(3, 2), nn.Linear(2, 3)  # same number of parameters, other shapes
    optimizer = torch.optim.Adam(a.parameters())
    _train_steps(nn.Sequential(nn.Embedding(7, 3), a), optimizer, 1)
    save_checkpoint(tmp_path, a, {}, optimizer=optimizer)
    with pytest.raises(CheckpointError, match="exp_avg of parameter 0 has shape"):
        load_trainer_state(tmp_path, torch.optim.Adam(b.parameters()))


def test_corrupt_trainer_json(tmp_path):
    model = Tiny()
    save_checkpoint(tmp_path, model, {}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (tmp_path / "trainer.json").write_text('{"optimizer": null}')
    _rehash(tmp_path, "trainer.json")
    with pytest.raises(CheckpointError, match="trainer.json: expected keys"):
        load_trainer_state(tmp_path, None)


def test_save_without_trainer_state_removes_old_trainer_files(tmp_path):
    model = Tiny()
    save_checkpoint(tmp_path, model, {}, trainer_state={"epoch": 1})
    assert (tmp_path / "trainer.json").exists()
    save_checkpoint(tmp_path, model, {})
    assert not (tmp_path / "trainer.json").exists()
    assert load_trainer_state(tmp_path, None) is None


# ---------------------------------------------------------------------------- crash safety


def _versioned_save(run_dir, version: int) -> None:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(version)
    save_checkpoint(run_dir, model, {"version": version},
                    trainer_state={"version": version} if version % 2 else None)


def _loaded_version(run_dir) -> int:
    version = load_config(run_dir)["version"]
    model = nn.Linear(2, 2)
    load_weights(run_dir, model)
    assert (model.weight == version).all() and (model.bias == version).all()
    state = load_trainer_state(run_dir, None)
    assert state == ({"version": version} if version % 2 else None)
    return version


def test_failed_replace_at_any_point_leaves_a_whole_checkpoint(tmp_path, monkeypatch):
    real_replace = os.replace
    calls = []

    def counting(src, dst):
        calls.append(dst)
        real_replace(src, dst)

    _versioned_save(tmp_path / "count", 1)
    monkeypatch.setattr(os, "replace", counting)
    _versioned_save(tmp_path / "count", 2)
    monkeypatch.setattr(os, "replace", real_replace)
    n = len(calls)
    assert n == 4  # commit (staged manifest), model, config, manifest

    for fail_at in range(n):
        run_dir = tmp_path / f"run{fail_at}"
        _versioned_save(run_dir, 1)
        count = 0

        def failing(src, dst, fail_at=fail_at):
            nonlocal count
            count += 1
            if count - 1 == fail_at:
                raise OSError("simulated crash")
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", failing)
        with pytest.raises(OSError, match="simulated crash"):
            _versioned_save(run_dir, 2)
        monkeypatch.setattr(os, "replace", real_replace)
        # Before the commit the old checkpoint is intact; after it, the new one is whole.
        assert _loaded_version(run_dir) == (1 if fail_at == 0 else 2)
        assert is_checkpoint(run_dir)
        # The next save cleans up and wins.
        _versioned_save(run_dir, 3)
        assert _loaded_version(run_dir) == 3
        assert not (run_dir / STAGING).exists()


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _versioned_save(tmp_path, 1)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        _versioned_save(tmp_path, 2)
    monkeypatch.undo()
    assert _loaded_version(tmp_path) == 1
