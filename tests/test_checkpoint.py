"""Safe checkpoints: round trips, crash safety and rejection of every kind of bad file."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import random
import struct

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from qkv.training import (
    CheckpointError,
    check_weights,
    is_checkpoint,
    load_config,
    load_trainer_state,
    load_weights,
    read_weights_header,
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


# ---------------------------------------------------------------------------- hostile JSON


def _write_json_text(run_dir, name: str, text: str) -> None:
    (run_dir / name).write_text(text)
    _rehash(run_dir, name)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested more than 32 levels"),  # RecursionError
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nested more than 32 levels"),  # parses
        ('{"a": 1' + "0" * 5000 + "}", "invalid JSON .*4300 digits"),
        ("\xff\xfe{", "invalid JSON"),
    ],
)
def test_hostile_config_json_is_one_line(saved, text, match):
    run_dir, _ = saved
    _write_json_text(run_dir, "config.json", text)
    with pytest.raises(CheckpointError, match=match) as error:
        load_config(run_dir)
    assert "config.json" in _one_line(error)


def test_json_values_are_left_to_the_validators(saved):
    """1e400 and NaN are valid JSON to Python (inf, nan); the fields' validators judge them."""
    run_dir, _ = saved
    _write_json_text(run_dir, "config.json", '{"a": 1e400, "b": NaN, "c": 1' + "0" * 400 + "}")
    config = load_config(run_dir)
    assert config["a"] == float("inf") and config["b"] != config["b"]
    assert config["c"] == 10**400


def test_oversized_manifest_and_json_are_refused_unread(saved, monkeypatch):
    run_dir, _ = saved
    from qkv.training import checkpoint

    monkeypatch.setattr(checkpoint, "MAX_JSON_BYTES", 10)
    with pytest.raises(CheckpointError, match="config.json: is .* bytes; a checkpoint's JSON is "
                                              "at most 10"):
        load_config(run_dir)
    monkeypatch.setattr(checkpoint, "MAX_MANIFEST_BYTES", 10)
    with pytest.raises(CheckpointError, match="checkpoint.json: is larger than 10 bytes"):
        load_config(run_dir)


@pytest.mark.parametrize("bad", [-1, True, 1.5, 10**400])
def test_manifest_sizes_must_be_counts(saved, bad):
    run_dir, _ = saved
    manifest = json.loads((run_dir / "checkpoint.json").read_text())
    manifest["files"]["config.json"]["bytes"] = bad
    (run_dir / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="checkpoint.json") as error:
        load_config(run_dir)
    _one_line(error)


# ---------------------------------------------------------------------------- weights header


def test_header_matches_what_safetensors_reads(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path, Tied(), {})
    header = read_weights_header(tmp_path)
    # independent reference: the safetensors library's own reading of the file
    with safetensors.safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        reference = {k: ("F32", tuple(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
    assert header.tensors == reference
    assert header.aliases == {"out.weight": "emb.weight"}
    assert header.shapes() == {k: ("F32", tuple(v.shape)) for k, v in Tied().state_dict().items()}
    assert header.num_elements() == sum(p.numel() for p in Tied().parameters())


def _header_bytes(run_dir) -> tuple[bytes, dict, bytes]:
    data = (run_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[:8], json.loads(data[8:8 + n]), data[8 + n:]


def _write_header(run_dir, header: dict, body: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    prefix = struct.pack("<Q", len(raw) if length is None else length)
    (run_dir / "model.safetensors").write_bytes(prefix + raw + body)
    _rehash(run_dir, "model.safetensors")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda h: h["emb.weight"].update(dtype="F31"), "dtype 'F31'; valid: BOOL"),
        (lambda h: h["emb.weight"].update(shape=[7, 5]), r"is \(7, 5\) F32, 140 bytes, but"),
        (lambda h: h["emb.weight"].update(shape=[7, -4]), "expected a list of sizes"),
        (lambda h: h["emb.weight"].update(shape=[7, True]), "expected a list of sizes"),
        (lambda h: h["emb.weight"].update(data_offsets=[0, 10**12]), "within the"),
        (lambda h: h["out.bias"].update(data_offsets=h["emb.weight"]["data_offsets"][:1] * 2),
         "data_offsets span 0"),
        (lambda h: h.update(extra=1), "needs exactly 'dtype', 'shape' and 'data_offsets'"),
        (lambda h: h.update(__metadata__=[1]), "'__metadata__' must map strings"),
        (lambda h: h["__metadata__"].update({"qkv.aliases": '{"x": "nope"}'}),
         "alias 'x' points to missing tensor 'nope'"),
        (lambda h: h["__metadata__"].update({"qkv.aliases": "[" * 50 + "]" * 50}),
         "nested more than 32"),
    ],
)
def test_hostile_headers_are_one_line(saved, edit, match):
    run_dir, _ = saved
    _, header, body = _header_bytes(run_dir)
    edit(header)
    _write_header(run_dir, header, body)
    with pytest.raises(CheckpointError, match=match) as error:
        read_weights_header(run_dir)
    assert "model.safetensors: " in _one_line(error)
    with pytest.raises(CheckpointError) as error:  # the safetensors library says it its way
        load_weights(run_dir, Tiny())
    assert "model.safetensors" in _one_line(error)


def test_overlapping_tensors_are_refused(saved):
    run_dir, _ = saved
    _, header, body = _header_bytes(run_dir)
    # two tensors of the same size swap in the file: fine; one pointing into the other: not
    a, b = header["out.bias"]["data_offsets"], header["emb.weight"]["data_offsets"]
    header["out.bias"]["data_offsets"] = [b[0], b[0] + a[1] - a[0]]
    _write_header(run_dir, header, body)
    with pytest.raises(CheckpointError, match="overlap or leave gaps"):
        read_weights_header(run_dir)


@pytest.mark.parametrize("length", [2**63, 10**6, 17 * 2**20])
def test_header_length_is_bounded_by_the_file(saved, length, monkeypatch):
    run_dir, _ = saved
    _, header, body = _header_bytes(run_dir)
    _write_header(run_dir, header, body + b" " * (17 * 2**20 if length == 17 * 2**20 else 0),
                  length=length)
    with pytest.raises(CheckpointError, match="header length .* exceeds") as error:
        read_weights_header(run_dir)
    _one_line(error)


def test_a_corrupt_header_is_reported_as_corruption(saved):
    run_dir, _ = saved
    path = run_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[12] ^= 0xFF  # inside the JSON header, manifest not updated
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        read_weights_header(run_dir)


def test_pickle_is_named_from_the_header_too(saved):
    run_dir, model = saved
    torch.save(model.state_dict(), run_dir / "model.safetensors")
    _rehash(run_dir, "model.safetensors")
    with pytest.raises(CheckpointError, match="is a pickle / torch.save file"):
        read_weights_header(run_dir)


def _tiny_shapes(d: int = 4, vocab: int = 7):
    yield "emb.weight", (vocab, d)
    yield "out.weight", (vocab, d)
    yield "out.bias", (vocab,)


def test_check_weights_compares_config_and_header(saved):
    run_dir, _ = saved
    n = 7 * 4 * 2 + 7
    size = (run_dir / "model.safetensors").stat().st_size
    assert check_weights(run_dir, _tiny_shapes(), n) == size
    with pytest.raises(CheckpointError) as error:
        check_weights(run_dir, _tiny_shapes(d=10**6), n)
    assert _one_line(error).endswith(
        "model.safetensors: config.json says emb.weight is (7, 1000000), the weights say (7, 4)"
    )
    with pytest.raises(CheckpointError, match=r"says the model has extra.weight \(1,\), the "
                                              "weights do not hold it"):
        check_weights(run_dir, itertools.chain(_tiny_shapes(), [("extra.weight", (1,))]), n)
    with pytest.raises(CheckpointError, match="the weights hold out.bias, which config.json does "
                                              "not describe"):
        check_weights(run_dir, itertools.islice(_tiny_shapes(), 2), n)
    with pytest.raises(CheckpointError, match="says the model has 1,000 parameters, the weights "
                                              "hold 63"):
        check_weights(run_dir, _tiny_shapes(), 1000)
    with pytest.raises(CheckpointError, match="emb.weight is stored as F32; the model is F16"):
        check_weights(run_dir, _tiny_shapes(), n, dtype="F16")


def test_check_weights_reads_no_more_of_the_config_than_the_file_holds(saved):
    """A config claiming a billion layers: its shapes are drawn only as far as needed."""
    run_dir, _ = saved
    drawn = []

    def billion_layers():
        yield from _tiny_shapes()
        for i in range(10**9):
            drawn.append(i)
            yield f"layer.{i}.weight", (4, 4)

    with pytest.raises(CheckpointError, match="layer.0.weight"):
        check_weights(run_dir, billion_layers(), 10**12)
    assert drawn == [0]


def test_tied_config_and_untied_weights_disagree(tmp_path):
    save_checkpoint(tmp_path, Tiny(), {})  # stores out.weight separately
    tied = 7 * 4 + 7  # a tied model's parameters: emb.weight once, out.bias
    with pytest.raises(CheckpointError, match="says the model has 35 parameters, the weights "
                                              "hold 63"):
        check_weights(tmp_path, _tiny_shapes(), tied)


# ---------------------------------------------------------------------------- hostile trainer.json


def _adam_checkpoint(run_dir) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_steps(model, optimizer, 1)
    save_checkpoint(run_dir, model, {}, optimizer=optimizer,
                    trainer_state={"epoch": 1, "step": 1, "history": {"epoch": [1], "loss": [2.5]},
                                   "train_config": {"lr": 0.01, "clip_norm": None}})
    return model, optimizer


def _edit_trainer_json(run_dir, edit) -> None:
    saved = json.loads((run_dir / "trainer.json").read_text())
    edit(saved)
    (run_dir / "trainer.json").write_text(json.dumps(saved))
    _rehash(run_dir, "trainer.json")


def _group(saved):
    return saved["optimizer"]["param_groups"][0]


def _state(saved):
    return saved["optimizer"]["state"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: _group(s).update(lr=float("nan")), r"param_groups\[0\].lr must be a finite "
                                                       r"number in \[0.0, inf\), got nan"),
        (lambda s: _group(s).update(lr=-1), r"lr must be a finite number in \[0.0, inf\), got -1"),
        (lambda s: _group(s).update(lr="fast"), "lr must be a finite number .* got 'fast'"),
        (lambda s: _group(s).update(lr=10**400), "lr must be .* about 401 digits"),
        (lambda s: _group(s).update(betas=[1.0, 0.9]), r"betas\[0\] must be a finite number in "
                                                        r"\[0.0, 1.0\), got 1.0"),
        (lambda s: _group(s).update(betas=[0.9]), "betas must be a list of 2 numbers"),
        (lambda s: _group(s).update(eps=-1e-8), "eps must be a finite number"),
        (lambda s: _group(s).update(weight_decay=float("inf")), "weight_decay must be"),
        (lambda s: _group(s).update(amsgrad=1), "amsgrad must be true or false, got 1"),
        (lambda s: _group(s).pop("lr"), r"param_groups\[0\] has no 'lr'"),
        (lambda s: _group(s).update(params=[0, 0, 1]), "repeats parameter id 0"),
        (lambda s: _group(s).update(params=3), "parameter groups do not match"),
        # int() would read the Arabic-Indic digit one as 1
        (lambda s: _state(s).update({"\u0661": _state(s)["1"]}), "unknown parameter '\u0661'"),
        (lambda s: _state(s).update({"0": [1, 2]}), "state of parameter 0 must be an object"),
        (lambda s: _state(s)["0"].update(step=-3.0), "'step' of parameter 0 must be a finite "
                                                     "number >= 0"),
        (lambda s: _state(s)["0"].update(step=_state(s)["0"]["exp_avg"]), "'step' of parameter 0"),
        (lambda s: _state(s)["0"].update(exp_avg="zeros"), "'exp_avg' of parameter 0 must be a "
                                                           "tensor, got 'zeros'"),
        (lambda s: s["trainer_state"].update(epoch=-1), r"trainer_state.epoch must be an integer "
                                                        r"in \[0, 9223372036854775807\], got -1"),
        (lambda s: s["trainer_state"].update(epoch=True), "trainer_state.epoch .* got True"),
        (lambda s: s["trainer_state"].update(step=1.5), "trainer_state.step .* got 1.5"),
        (lambda s: s["trainer_state"].update(history=[1]), "history must be an object"),
        (lambda s: s["trainer_state"]["history"].update(loss=3.0), r"history\['loss'\] must be a "
                                                                   "list"),
        (lambda s: s["trainer_state"]["history"].update(loss=[1, 2]), "lists differ in length"),
        (lambda s: s["trainer_state"]["history"].update(loss=["x"]), "numbers or null, found 'x'"),
        (lambda s: s["trainer_state"]["train_config"].update(lr=0), "train_config.lr must be a "
                                                                    r"finite number in \(0.0"),
        (lambda s: s["trainer_state"].update(train_config=[]), "train_config must be an object"),
        (lambda s: s["rng"].update(python=[3, [10**400] * 625, None]), "invalid RNG state"),
        (lambda s: s.update(trainer_state=[1]), "trainer_state must be a JSON object"),
    ],
)
def test_hostile_trainer_json_is_one_line(tmp_path, edit, match):
    model, _ = _adam_checkpoint(tmp_path)
    _edit_trainer_json(tmp_path, edit)
    fresh = torch.optim.Adam(Tiny().parameters(), lr=1e-2)
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=match) as error:
        load_trainer_state(tmp_path, fresh)
    assert "trainer.json" in _one_line(error)
    assert torch.equal(torch.get_rng_state(), rng) and fresh.state_dict()["state"] == {}


def test_diverged_history_and_scheduler_keys_still_load(tmp_path):
    """NaN losses are an honest record, and keys torch added (initial_lr) pass."""
    _adam_checkpoint(tmp_path)

    def edit(s):
        s["trainer_state"]["history"]["loss"] = [float("nan")]
        _group(s)["initial_lr"] = 0.01

    _edit_trainer_json(tmp_path, edit)
    fresh = torch.optim.Adam(Tiny().parameters(), lr=1e-2)
    state = load_trainer_state(tmp_path, fresh)
    assert state["history"]["loss"][0] != state["history"]["loss"][0]
    assert fresh.param_groups[0]["initial_lr"] == 0.01


def test_weights_written_from_tensor_memory_are_what_safetensors_reads(tmp_path):
    """The model file is laid out by qkv (no in-memory copy of the weights); the
    safetensors library itself must read back every dtype and shape exactly."""
    import safetensors.torch

    from qkv.training import save_checkpoint

    torch.manual_seed(0)
    base = torch.randn(6, 4)
    tensors = {
        "f32": base, "f64": torch.randn(3, dtype=torch.float64),
        "bf16": torch.randn(5, 3).to(torch.bfloat16), "f16": torch.randn(7).half(),
        "i64": torch.arange(-4, 5), "i32": torch.arange(9, dtype=torch.int32).view(3, 3),
        "u8": torch.arange(250, 256, dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
        "transposed": base.t(),  # shares base's storage: stored as a copy
        "tied": base,  # the same tensor: stored once, an alias
    }
    save_checkpoint(tmp_path, tensors, {"task": "test"})
    read = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert set(read) == set(tensors) - {"tied"}
    for name, value in read.items():
        assert value.dtype == tensors[name].dtype and torch.equal(value, tensors[name]), name
    # qkv's own loader resolves the alias and checks the manifest's digest.
    model = nn.Module()
    for name, value in tensors.items():
        model.register_buffer(name, torch.zeros_like(value))
    load_weights(tmp_path, model)
    for name, value in tensors.items():
        assert torch.equal(getattr(model, name), value), name
