"""A setting is declared once (qkv.options, qkv.tasks.settings): the settings dataclasses,
the trainer's configuration, the checkpoint reader and the command line all follow
from the declaration."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkv.cli import main
from qkv.options import LOOP, TRAINING
from qkv.tasks.lm import LMSettings
from qkv.tasks.pipeline import TRAINED, train_config
from qkv.tasks.settings import (
    LM,
    LM_DEFAULTS,
    LM_UNSET,
    TRANSLATE,
    TRANSLATE_DEFAULTS,
    recipe_values,
)
from qkv.tasks.translate import TranslateSettings
from qkv.training import CheckpointError, TrainConfig, read_history, save_checkpoint


@pytest.mark.parametrize(("cls", "declared", "defaults"), [
    (TranslateSettings, TRANSLATE, TRANSLATE_DEFAULTS), (LMSettings, LM, LM_DEFAULTS)])
def test_the_settings_dataclass_is_its_declarations(cls, declared, defaults):
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields] == list(declared)
    made = cls()
    for name in declared:
        assert getattr(made, name) == defaults.get(name), name


def test_both_tasks_train_with_the_one_declaration_of_each_shared_setting():
    shared = TRANSLATE.keys() & LM.keys() & TRAINING.keys()
    assert {"epochs", "lr", "batch_size", "clip_norm", "warmup_steps", "decay", "accumulate",
            "patience", "dtype", "compile", "seed", "device"} <= shared
    for name in shared:  # the same rule, up to whether None means "the recipe's"
        for task in (TRANSLATE, LM):
            assert dataclasses.replace(task[name], optional=False) == \
                dataclasses.replace(TRAINING[name], optional=False), name


@pytest.mark.parametrize(("name", "bad"), [("accumulate", 0), ("dtype", "float16"),
                                           ("lr", float("nan")), ("compile", "yes")])
def test_a_declared_rule_is_enforced_everywhere(name, bad, tmp_path, capsys):
    message = f"{name} must be"
    with pytest.raises(ValueError, match=message):
        TranslateSettings(**{name: bad}).resolved()
    with pytest.raises(ValueError, match=message):
        LMSettings(**{name: bad}).resolved()
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{name: bad})
    # A checkpoint whose trainer state says so is refused, naming the field.
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "run", model, {"task": "x"}, optimizer=torch.optim.Adam(
        model.parameters()), trainer_state={"epoch": 1, "history": {},
                                            "train_config": {name: bad}})
    with pytest.raises(CheckpointError, match=f"train_config.{name} must be"):
        read_history(tmp_path / "run")
    if name != "compile":  # a flag of its own kind: --compile / --no-compile
        # Refused by the flag's choices (argparse) or by the check, before any work.
        try:
            code = main(["lm", "train", f"--{name}", str(bad), "--run-dir",
                         str(tmp_path / "r")])
        except SystemExit as stop:
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2 and name in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "r").exists()


def test_the_trainer_is_configured_from_the_resolved_settings():
    settings = TranslateSettings(data="pairs.txt", model="transformer").resolved()
    settings = settings.for_corpus(1000, 12)
    config = train_config(settings, early_stopping=True, log_every=1, progress=False)
    for name in TRAINED:
        if hasattr(settings, name):
            assert getattr(config, name) == getattr(settings, name), name
    corpus = recipe_values("corpus", "transformer")
    assert config.schedule.warmup_steps == corpus["warmup_steps"]
    assert config.schedule.decay == corpus["decay"]
    assert config.early_stopping.patience == corpus["patience"]
    assert config.strategy == "ddp"  # the translator has no strategy: the trainer's own
    lm = LMSettings(patience=2).resolved()
    config = train_config(lm, early_stopping=False, log_every=1, progress=False)
    assert config.early_stopping is None  # no held-out set to watch
    assert (config.dtype, config.compile, config.strategy, config.epochs) == (
        LM_UNSET["dtype"], LM_UNSET["compile"], LM_UNSET["strategy"], LM_UNSET["epochs"])


def test_the_trainer_and_the_checkpoint_reader_check_the_same_declarations():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    declared = fields & (TRAINING.keys() | LOOP.keys())
    # Everything but the schedule and early stopping objects, which check themselves.
    assert fields - declared == {"schedule", "early_stopping"}


def test_corpus_choices_are_made_once_and_recorded_as_made():
    given = TranslateSettings(data="pairs.txt")
    recipe = given.resolved()
    assert (recipe.num_steps, recipe.held_out, recipe.epochs) == (None, None, None)
    run = recipe.for_corpus(2000, 9, sha256="ab" * 32)
    assert (run.num_steps, run.data_sha256) == (10, "ab" * 32)
    assert run.held_out == 128 and run.epochs >= 3  # 5 % is 100: raised to one batch
    assert given.num_steps is None and recipe.num_steps is None  # nothing written back
    lm = LMSettings(batch_tokens=1024, batch_size=4).resolved().for_text(None, 64)
    assert (lm.accumulate, lm.batch_tokens) == (4, None)
