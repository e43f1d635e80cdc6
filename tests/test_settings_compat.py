"""Run directories written before settings were declared once still load and resume.

tests/fixtures/runs-2026-11 holds the ``config.json`` and trainer state of four runs as
qkv wrote them at commit 81da7cf (see its README). Each test rebuilds such a run
directory: the saved config and trainer state, and a model of the saved shape.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from qkv.models import GPTConfig, GPTModel, Seq2SeqConfig, build_model
from qkv.tasks.lm import LanguageModel, LMSettings, param_groups, train_language_model
from qkv.tasks.translate import TranslateSettings, Translator, train_translator
from qkv.training import checkpoint_progress, load_config, read_history, save_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "runs-2026-11"
TRANSLATE_RUNS = ["translate-dates", "translate-corpus", "translate-d2l"]


def old_run(name: str, tmp_path: Path) -> tuple[Path, dict]:
    """``tmp_path/name``: the fixture's config and trainer state with fresh weights; the
    corpora in ``tmp_path/CORPUS``, where the config says they are."""
    corpus = tmp_path / "CORPUS"
    corpus.mkdir(exist_ok=True)
    for text in ("pairs.txt", "story.txt"):
        shutil.copy(FIXTURES / text, corpus / text)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    settings = config["settings"]
    for key in ("data", "text"):
        if isinstance(settings.get(key), str) and settings[key].startswith("CORPUS/"):
            settings[key] = str(tmp_path / settings[key])
    torch.manual_seed(0)
    if config["task"] == "translate":
        model = build_model(Seq2SeqConfig.from_dict(config["model"]))
        optimizer = torch.optim.Adam(model.parameters())
    else:
        model = GPTModel(GPTConfig.from_dict(config["model"]))
        optimizer = torch.optim.AdamW(param_groups(model, settings["weight_decay"]))
    state = json.loads((FIXTURES / name / "trainer_state.json").read_text())["trainer_state"]
    run_dir = tmp_path / name
    save_checkpoint(run_dir, model, config, optimizer=optimizer, trainer_state=state)
    return run_dir, config


@pytest.mark.parametrize("name", TRANSLATE_RUNS)
def test_an_old_translator_loads_with_its_settings(name, tmp_path):
    run_dir, config = old_run(name, tmp_path)
    translator = Translator.load(run_dir)
    saved = config["settings"]
    loaded = dataclasses.asdict(translator.settings)
    assert {k: loaded[k] for k in saved} == saved
    assert translator.translate(["go ."])[0].tokens is not None
    history = read_history(run_dir)  # the trainer state, train_config included, is valid
    assert len(history["loss"]) == checkpoint_progress(run_dir)[0]


def test_an_old_corpus_run_resumes_with_its_recipe(tmp_path):
    run_dir, config = old_run("translate-corpus", tmp_path)
    assert checkpoint_progress(run_dir) == (2, 2)
    translator, history = train_translator(TranslateSettings(epochs=3), run_dir, resume=True,
                                           progress=False, log=lambda _: None)
    assert checkpoint_progress(run_dir) == (3, 3) and len(history["loss"]) == 3
    saved = load_config(run_dir, task="translate")["settings"]
    # Everything but the new total stays as the old run chose it.
    assert {**config["settings"], "epochs": 3} == {k: saved[k] for k in config["settings"]}


def test_an_old_language_model_loads_and_resumes(tmp_path):
    run_dir, config = old_run("lm-text", tmp_path)
    lm = LanguageModel.load(run_dir)
    saved = config["settings"]
    assert {k: v for k, v in dataclasses.asdict(lm.settings).items() if k in saved} == saved
    assert lm.generate("the ", max_new_tokens=2).new_tokens == 2
    _, history = train_language_model(LMSettings(epochs=2), run_dir, resume=True,
                                      progress=False, log=lambda _: None)
    assert checkpoint_progress(run_dir) == (2, 2) and len(history["loss"]) == 2
    resumed = load_config(run_dir, task="lm")["settings"]
    assert resumed["accumulate"] == saved["accumulate"] == 2
    assert resumed["text_sha256"] == saved["text_sha256"]
