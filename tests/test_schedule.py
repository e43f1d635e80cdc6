"""Learning-rate schedules, label smoothing and early stopping, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkv.training import (
    BEST_DIR,
    EarlyStopping,
    LRSchedule,
    TrainConfig,
    Trainer,
    load_weights,
    masked_cross_entropy,
)

# ---------------------------------------------------------------------------- schedules


def test_warmup_then_cosine_by_hand():
    s = LRSchedule(warmup_steps=4, decay="cosine", total_steps=14, min_factor=0.1)
    # warm-up: 1/4, 2/4, 3/4, 4/4
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # decay over steps 4..14: p = (step - 4) / 10
    assert s.factor(4) == pytest.approx(1.0)
    assert s.factor(9) == pytest.approx(0.1 + 0.9 * 0.5)  # p = 0.5: cos(pi/2) = 0
    assert s.factor(14) == pytest.approx(0.1)
    assert s.factor(1000) == pytest.approx(0.1)  # clamped past the end


def test_linear_and_inverse_sqrt_by_hand():
    lin = LRSchedule(warmup_steps=0, decay="linear", total_steps=10)
    assert [round(lin.factor(i), 10) for i in (0, 5, 10, 11)] == [1.0, 0.5, 0.0, 0.0]
    inv = LRSchedule(warmup_steps=100, decay="inverse_sqrt")
    assert inv.factor(99) == 1.0
    assert inv.factor(399) == pytest.approx(0.5)  # sqrt(100 / 400)
    assert LRSchedule().factor(12345) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"decay": "step"}, "decay must be one of"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"min_factor": 1.5}, "min_factor"),
    ({"decay": "inverse_sqrt"}, "needs warmup_steps"),
    ({"total_steps": 0}, "total_steps"),
])
def test_bad_schedules_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        LRSchedule(**kwargs)
    assert "\n" not in str(info.value)


def _regression(n: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def _mse(model: nn.Module, batch):
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).sum(), torch.tensor(len(y))


def test_trainer_applies_the_schedule_at_every_step():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = _regression()
    schedule = LRSchedule(warmup_steps=3, decay="linear", min_factor=0.0)
    seen = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    trainer = Trainer(model, _mse, lambda g: DataLoader(data, batch_size=8, generator=g),
                      TrainConfig(epochs=2, lr=0.1, device="cpu", progress=False,
                                  schedule=schedule),
                      optimizer=optimizer, log=lambda s: None)
    trainer.fit()
    # 4 batches x 2 epochs = 8 steps (0..7): warm-up 1/3, 2/3, 1; then linear from 1 at
    # step 3 towards 0 at step 8 (total_steps), which is never taken.
    expected = [0.1 * f for f in (1 / 3, 2 / 3, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2)]
    assert seen == pytest.approx(expected)


# ---------------------------------------------------------------------------- smoothing


def test_label_smoothing_matches_a_float64_hand_computation():
    torch.manual_seed(1)
    V, eps = 7, 0.1
    logits = torch.randn(2, 3, V, dtype=torch.float64)
    targets = torch.randint(0, V, (2, 3))
    valid_len = torch.tensor([3, 2])
    loss_sum, n = masked_cross_entropy(logits, targets, valid_len, label_smoothing=eps)
    expected = 0.0
    for b in range(2):
        for t in range(int(valid_len[b])):
            logp = logits[b, t] - torch.logsumexp(logits[b, t], 0)
            q = torch.full((V,), eps / V, dtype=torch.float64)
            q[targets[b, t]] += 1 - eps
            expected += -(q * logp).sum().item()
    assert int(n) == 5
    assert loss_sum.item() == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------- early stop


class _Scripted:
    """A validate() that reports a fixed sequence of values, one per epoch."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0

    def __call__(self, model):
        value = self.values[self.calls]
        self.calls += 1
        return {"loss": value}


def _trainer(tmp_path, values, epochs, patience, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = _regression()
    return Trainer(model, _mse, lambda g: DataLoader(data, batch_size=8, generator=g),
                   TrainConfig(epochs=epochs, lr=0.05, device="cpu", progress=False,
                               early_stopping=EarlyStopping(patience=patience, **kwargs)),
                   run_dir=tmp_path, checkpoint_config={"task": "test"},
                   validate=_Scripted(values), log=lambda s: None)


def test_early_stopping_stops_after_patience_and_keeps_the_best(tmp_path):
    # best at epoch 2 (0.5); epochs 3 and 4 do not improve by more than min_delta
    trainer = _trainer(tmp_path, [0.9, 0.5, 0.49, 0.7, 0.1, 0.1], epochs=6, patience=2,
                       min_delta=0.02)
    weights = {}
    real_track = trainer._track_best

    def spy(record):  # remember each epoch's weights as they were when validated
        weights[trainer.epoch] = {k: v.clone() for k, v in trainer.module.state_dict().items()}
        real_track(record)

    trainer._track_best = spy
    history = trainer.fit()
    assert history["epoch"] == [1, 2, 3, 4] and trainer.stopped_early
    assert trainer.best == {"metric": "valid_loss", "epoch": 2, "value": 0.5}
    # The model returns holding epoch 2's weights, and run_dir/best holds them too ...
    for k, v in trainer.module.state_dict().items():
        assert torch.equal(v, weights[2][k])
    saved = nn.Linear(3, 1)
    load_weights(tmp_path / BEST_DIR, saved)
    for k, v in saved.state_dict().items():
        assert torch.equal(v, weights[2][k])
    # ... while run_dir itself is the last epoch's state, resumable.
    last = nn.Linear(3, 1)
    load_weights(tmp_path, last)
    assert torch.equal(last.weight, weights[4]["weight"])


def test_early_stopping_maximises_a_metric_and_survives_resume(tmp_path):
    trainer = _trainer(tmp_path, [1.0, 3.0, 2.0], epochs=3, patience=5, mode="max")
    trainer.fit()
    assert trainer.best["epoch"] == 2 and not trainer.stopped_early
    # A fresh trainer resumes the best record from the checkpoint and goes on.
    again = _trainer(tmp_path, [2.5, 2.9, 3.5], epochs=6, patience=2, mode="max")
    again.resume()
    assert again.best == {"metric": "valid_loss", "epoch": 2, "value": 3.0}
    history = again.fit()
    # epochs 3 (before the resume) and 4 did not beat 3.0: patience 2 is spent
    assert history["epoch"] == [1, 2, 3, 4] and again.stopped_early
    assert again.best["epoch"] == 2


def test_early_stopping_names_a_metric_validation_does_not_give(tmp_path):
    trainer = _trainer(tmp_path, [1.0], epochs=1, patience=1, metric="valid_bleu")
    with pytest.raises(ValueError, match=r"watches 'valid_bleu'.*valid_loss"):
        trainer.fit()


@pytest.mark.parametrize("kwargs", [{"metric": "loss"}, {"mode": "up"}, {"patience": -1},
                                    {"min_delta": math.nan}])
def test_bad_early_stopping_is_one_line(kwargs):
    with pytest.raises(ValueError) as info:
        EarlyStopping(**kwargs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------- accumulation


def _weighted(model: nn.Module, batch):
    # A loss whose token count varies per row, so that batches weigh differently.
    x, y, tokens = batch
    per_row = (model(x).squeeze(-1) - y) ** 2 * tokens
    return per_row.sum(), tokens.sum()


def _weighted_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = torch.randn(20, generator=g, dtype=torch.float64)
    tokens = torch.randint(1, 9, (20,), generator=g)
    return TensorDataset(x, y, tokens)


def _train_once(batch_size: int, accumulate: int, epochs: int = 2):
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    data = _weighted_data()
    trainer = Trainer(model, _weighted, lambda g: DataLoader(data, batch_size=batch_size),
                      TrainConfig(epochs=epochs, lr=0.1, device="cpu", progress=False,
                                  clip_norm=None, accumulate=accumulate),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      log=lambda s: None)
    history = trainer.fit()
    return model, history, trainer.step


def test_accumulation_steps_as_one_big_batch_would():
    # 20 rows: batches of 4 accumulated 5 at a time == one batch of 20, per-token mean.
    big, big_history, big_steps = _train_once(20, 1)
    acc, acc_history, acc_steps = _train_once(4, 5)
    assert big_steps == acc_steps == 2
    torch.testing.assert_close(acc.weight, big.weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc.bias, big.bias, rtol=1e-12, atol=1e-12)
    assert acc_history["loss"] == pytest.approx(big_history["loss"], rel=1e-12)


def test_accumulation_with_a_short_last_group():
    # 20 rows in batches of 8: groups of 2 batches are (8 + 8) and (4): two steps per
    # epoch, the second over its 4 rows only, as batches of 16 and 4 would give.
    ref, _, ref_steps = _train_once(16, 1)
    acc, _, acc_steps = _train_once(8, 2)
    assert ref_steps == acc_steps == 4
    torch.testing.assert_close(acc.weight, ref.weight, rtol=1e-12, atol=1e-12)


def test_bfloat16_autocast_trains_close_to_float32():
    def run(dtype):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
        data = _regression(64)
        trainer = Trainer(model, _mse, lambda g: DataLoader(data, batch_size=16, generator=g),
                          TrainConfig(epochs=3, lr=0.01, device="cpu", progress=False,
                                      dtype=dtype), log=lambda s: None)
        return trainer.fit()["loss"], model

    fp32, _ = run("float32")
    bf16, model = run("bfloat16")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast, not a cast
    assert bf16 != fp32  # bfloat16 really ran ...
    assert bf16 == pytest.approx(fp32, rel=0.05)  # ... and learned the same thing


@pytest.mark.parametrize("kwargs, match", [({"accumulate": 0}, "accumulate"),
                                           ({"dtype": "float16"}, "dtype must be one of"),
                                           ({"compile": "yes"}, "compile")])
def test_bad_train_config_is_one_line(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        TrainConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_compiled_training_matches_eager_and_saves_the_plain_model(tmp_path):
    def run(compile_, run_dir):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        data = _regression(32)
        trainer = Trainer(model, _mse, lambda g: DataLoader(data, batch_size=8, generator=g),
                          TrainConfig(epochs=2, lr=0.01, device="cpu", progress=False,
                                      compile=compile_),
                          run_dir=run_dir, checkpoint_config={"task": "test"},
                          log=lambda s: None)
        return trainer.fit()["loss"], trainer

    eager, _ = run(False, tmp_path / "eager")
    compiled, trainer = run(True, tmp_path / "compiled")
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert trainer.model is not trainer.module  # it really trained through a wrapper
    plain = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    load_weights(tmp_path / "compiled", plain)  # strict: no '_orig_mod.' prefixes
