"""Masked losses and the Trainer: exact resume, Ctrl-C, clipping, logging, loss plot."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkv.training import (
    CheckpointError,
    MaskedSoftmaxCELoss,
    TrainConfig,
    Trainer,
    epoch_seed,
    load_config,
    load_trainer_state,
    masked_cross_entropy,
    resolve_device,
    seed_everything,
)

# ---------------------------------------------------------------------------- losses


def test_masked_cross_entropy_counts_valid_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    targets = torch.randint(0, 5, (2, 4))
    valid_len = torch.tensor([3, 1])
    loss_sum, num_tokens = masked_cross_entropy(logits, targets, valid_len)
    per_token = F.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1), reduction="none")
    expected = per_token.view(2, 4)[0, :3].sum() + per_token.view(2, 4)[1, :1].sum()
    assert num_tokens.item() == 4 and num_tokens.dtype == torch.int64
    torch.testing.assert_close(loss_sum, expected)
    # Padding is invisible: change every padded logit and target, same loss and gradient.
    logits2, targets2 = logits.clone().requires_grad_(), targets.clone()
    with torch.no_grad():
        logits2[0, 3] = 1e4
        logits2[1, 1:] = -1e4
    targets2[0, 3], targets2[1, 1:] = 0, 4
    loss2, _ = masked_cross_entropy(logits2, targets2, valid_len)
    torch.testing.assert_close(loss2, expected)
    loss2.backward()
    assert (logits2.grad[0, 3] == 0).all() and (logits2.grad[1, 1:] == 0).all()


def test_masked_cross_entropy_per_token_normalisation_differs_from_d2l():
    # d2l's example: uniform logits over 10 classes, valid lengths 4, 2, 0 out of 4 steps.
    logits = torch.ones(3, 4, 10)
    targets = torch.ones(3, 4, dtype=torch.long)
    loss_sum, num_tokens = masked_cross_entropy(logits, targets, torch.tensor([4, 2, 0]))
    torch.testing.assert_close(loss_sum / num_tokens, torch.tensor(math.log(10)))
    per_seq = MaskedSoftmaxCELoss()(logits, targets, torch.tensor([4, 2, 0]))
    # d2l prints [2.3026, 1.1513, 0.0000]: it divides the second by 4 steps, not 2 tokens.
    torch.testing.assert_close(per_seq, torch.tensor([math.log(10), math.log(10), 0.0]))


def test_masked_losses_check_shapes():
    with pytest.raises(ValueError, match="valid_len must have shape"):
        masked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long),
                             torch.tensor([1]))
    with pytest.raises(ValueError, match="expected logits"):
        MaskedSoftmaxCELoss()(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long),
                              torch.tensor([1, 1]))


# ---------------------------------------------------------------------------- helpers


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_config_validation():
    with pytest.raises(ValueError, match="clip_norm"):
        TrainConfig(clip_norm=0.0)
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=-1)


def test_epoch_seed_is_a_pure_function():
    assert epoch_seed(0, 3) == epoch_seed(0, 3)
    assert len({epoch_seed(s, e) for s in range(3) for e in range(3)}) == 9
    assert 0 <= epoch_seed(-5, 10**9) < 2**63


# ---------------------------------------------------------------------------- trainer

VOCAB, STEPS, N = 11, 6, 24


class TinyLM(nn.Module):
    """Embedding -> dropout -> linear: small, but with dropout so RNG state matters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.emb(x)))


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(42)
    x = torch.randint(0, VOCAB, (N, STEPS), generator=gen)
    valid_len = torch.randint(1, STEPS + 1, (N,), generator=gen)
    return TensorDataset(x, (x + 1) % VOCAB, valid_len)


def _loss_fn(model, batch):
    x, y, valid_len = batch
    return masked_cross_entropy(model(x), y, valid_len)


def _data(generator):
    return DataLoader(_dataset(), batch_size=8, shuffle=True, generator=generator)


def _trainer(epochs, run_dir=None, *, loss_fn=_loss_fn, log=None, **kwargs) -> Trainer:
    config = TrainConfig(epochs=epochs, lr=1e-2, device="cpu", progress=False, **kwargs)
    return Trainer(TinyLM(), loss_fn, _data, config, run_dir=run_dir,
                   checkpoint_config={"model": "TinyLM"}, log=log or (lambda line: None))


def _uninterrupted(epochs: int) -> dict[str, torch.Tensor]:
    seed_everything(0)
    trainer = _trainer(epochs)
    trainer.fit()
    return trainer.model.state_dict()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fit_learns_and_logs_the_reference_line(tmp_path):
    seed_everything(0)
    lines: list[str] = []
    trainer = _trainer(6, tmp_path, log=lines.append, log_every=2)
    history = trainer.fit()
    assert history["epoch"] == [1, 2, 3, 4, 5, 6]
    assert history["loss"][-1] < history["loss"][0]
    assert all(t > 0 for t in history["tokens_per_sec"])
    assert [line.split(":")[0] for line in lines[:-1]] == ["epoch 2/6", "epoch 4/6", "epoch 6/6"]
    assert re.fullmatch(r"loss [0-9.]+, [0-9.]+ tokens/sec on cpu", lines[-1])
    assert lines[-1].startswith(f"loss {history['loss'][-1]:.3f}, ")
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    from matplotlib.image import imread

    assert imread(tmp_path / "loss.png").ndim == 3  # decodes as an image
    assert load_config(tmp_path) == {"model": "TinyLM"}
    state = load_trainer_state(tmp_path, None)
    assert state["epoch"] == 6 and state["history"]["loss"] == history["loss"]


def test_default_log_prints_to_stdout(capsys):
    seed_everything(0)
    config = TrainConfig(epochs=1, device="cpu", progress=False)
    Trainer(TinyLM(), _loss_fn, _data, config).fit()
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"loss [0-9.]+, [0-9.]+ tokens/sec on cpu", out[-1])


def test_progress_bar_goes_to_stderr(capsys):
    seed_everything(0)
    config = TrainConfig(epochs=2, device="cpu", progress=True)
    Trainer(TinyLM(), _loss_fn, _data, config, log=lambda line: None).fit()
    captured = capsys.readouterr()
    assert "train" in captured.err and "6/6" in captured.err  # 3 batches x 2 epochs
    assert captured.out == ""


def test_resume_is_bit_identical(tmp_path):
    expected = _uninterrupted(5)

    seed_everything(0)
    first = _trainer(2, tmp_path)
    first.fit()

    seed_everything(999)  # a fresh process would start from another RNG state
    second = _trainer(5, tmp_path)
    second.resume()
    assert second.epoch == 2 and second.step == 6
    history = second.fit()
    assert history["epoch"] == [1, 2, 3, 4, 5]
    _assert_same(second.model.state_dict(), expected)


def test_keyboard_interrupt_saves_last_completed_epoch(tmp_path):
    expected = _uninterrupted(4)
    calls = 0

    def interrupting(model, batch):
        nonlocal calls
        calls += 1
        if calls == 3 + 2:  # second batch of epoch 2: one step of epoch 2 already taken
            raise KeyboardInterrupt
        return _loss_fn(model, batch)

    seed_everything(0)
    lines: list[str] = []
    trainer = _trainer(4, tmp_path, loss_fn=interrupting, log=lines.append)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert "interrupted" in lines[-1]
    state = load_trainer_state(tmp_path, None)
    assert state["epoch"] == 1 and state["step"] == 3
    assert state["history"]["epoch"] == [1]
    # The in-memory trainer was rolled back too, so fit() can simply be called again.
    assert trainer.epoch == 1

    seed_everything(7)
    resumed = _trainer(4, tmp_path)
    resumed.resume()
    resumed.fit()
    _assert_same(resumed.model.state_dict(), expected)


def test_interrupt_in_first_epoch_without_run_dir_just_raises():
    def interrupting(model, batch):
        raise KeyboardInterrupt

    trainer = _trainer(2, loss_fn=interrupting)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()


def test_checkpoint_every(tmp_path, monkeypatch):
    saves: list[int] = []
    seed_everything(0)
    trainer = _trainer(5, tmp_path, checkpoint_every=2)
    real_save = trainer.save
    monkeypatch.setattr(trainer, "save", lambda: (saves.append(trainer.epoch), real_save()))
    trainer.fit()
    assert saves == [2, 4, 5]


class _NormRecordingSGD(torch.optim.SGD):
    """Records the global gradient norm the optimizer actually sees."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=1e-3)
        self.norms: list[float] = []

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        self.norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])).item())
        return super().step(closure)


@pytest.mark.parametrize("clip_norm", [0.5, None])
def test_gradient_clipping(clip_norm):
    model = nn.Linear(3, 1)
    optimizer = _NormRecordingSGD(model.parameters())

    def huge_loss(model, batch):
        (x,) = batch
        return 1e6 * model(x).pow(2).sum(), torch.tensor(1)

    data = [(torch.randn(4, 3) + 5,)]
    config = TrainConfig(epochs=2, clip_norm=clip_norm, device="cpu", progress=False)
    Trainer(model, huge_loss, lambda g: data, config, optimizer=optimizer,
            log=lambda line: None).fit()
    if clip_norm is None:
        assert min(optimizer.norms) > 1e3  # the loss really is huge
    else:
        assert max(optimizer.norms) <= clip_norm * (1 + 1e-5)


def test_validate_runs_in_eval_mode_and_enters_history():
    modes: list[bool] = []

    def validate(model):
        modes.append(model.training)
        assert not torch.is_grad_enabled()
        return {"loss": 1.5, "bleu": 0.25}

    seed_everything(0)
    config = TrainConfig(epochs=2, device="cpu", progress=False)
    trainer = Trainer(TinyLM(), _loss_fn, _data, config, validate=validate,
                      log=lambda line: None)
    history = trainer.fit()
    assert modes == [False, False]
    assert history["valid_loss"] == [1.5, 1.5] and history["valid_bleu"] == [0.25, 0.25]
    assert trainer.model.training


def test_resume_errors(tmp_path):
    with pytest.raises(ValueError, match="needs a run_dir"):
        _trainer(1).resume()
    with pytest.raises(CheckpointError, match="does not exist"):
        _trainer(1, tmp_path / "missing").resume()


def test_empty_data_is_an_error():
    config = TrainConfig(epochs=1, device="cpu", progress=False)
    trainer = Trainer(TinyLM(), _loss_fn, lambda g: [], config, log=lambda line: None)
    with pytest.raises(ValueError, match="no tokens"):
        trainer.fit()
