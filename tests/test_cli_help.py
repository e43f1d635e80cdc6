"""Every flag of every command explains itself, and every command has a description and
an example; the training settings' flags come from their declarations, with their
defaults read from the recipe tables."""

from __future__ import annotations

import argparse

import pytest

from qkv.cli import build_parser
from qkv.options import GPT_PRESETS, TRAINING
from qkv.tasks.settings import LM, LM_DEFAULTS, PRESETS, TRANSLATE, recipe_values


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("qkv",)):
    """``(command words, its parser, the one-line help its parent lists)`` for every
    command and sub-command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, listed.get(name)
                yield from commands(sub, (*path, name))


COMMANDS = list(commands(build_parser()))
IDS = [" ".join(words) for words, _, _ in COMMANDS]


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as ``--help`` prints it (defaults filled in), on one line."""
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split())


def test_every_command_is_listed():
    assert len(COMMANDS) >= 20
    assert {"translate", "lm", "view", "bench", "walkthrough"} <= {w[1] for w, _, _ in COMMANDS}


@pytest.mark.parametrize(("words", "parser", "listed"), COMMANDS, ids=IDS)
def test_every_command_has_a_line_a_description_and_an_example(words, parser, listed):
    assert listed and "\n" not in listed, f"{' '.join(words)} has no one-line help"
    assert parser.description, f"{' '.join(words)} has no description"
    assert parser.epilog and parser.epilog.startswith("example"), words
    examples = [line.strip() for line in parser.epilog.splitlines()[1:]]
    assert examples and all(line.startswith(" ".join(words[:2])) for line in examples), \
        parser.epilog


@pytest.mark.parametrize(("words", "parser", "listed"), COMMANDS, ids=IDS)
def test_every_flag_has_help_that_states_its_default(words, parser, listed):
    required_groups = [g for g in parser._mutually_exclusive_groups if g.required]
    for action in flags(parser):
        name = action.option_strings[0] if action.option_strings else action.dest
        text = rendered_help(parser, action)
        assert text.strip(), f"{' '.join(words)} {name} has no help"
        takes_value = action.nargs != 0
        required = action.required or any(action in g._group_actions for g in required_groups)
        if action.option_strings and takes_value and not required:
            assert "default" in text, f"{' '.join(words)} {name}: {text}"


def train_flags(task: str) -> dict[str, str]:
    """``{flag: its rendered help}`` of ``qkv TASK train``."""
    parser = next(p for w, p, _ in COMMANDS if w == ("qkv", task, "train"))
    return {a.option_strings[0]: rendered_help(parser, a) for a in flags(parser)
            if a.option_strings}


@pytest.mark.parametrize(("task", "settings"), [("translate", TRANSLATE), ("lm", LM)])
def test_each_declared_setting_is_a_flag_with_its_help_and_valid_values(task, settings):
    shown = train_flags(task)
    for setting in settings.values():
        if not setting.flag_name:
            continue
        text = shown[setting.flag_name]
        assert setting.help.split(";")[0] in text
        assert setting.describe() in text
        if setting.choices:
            assert all(c in text or c in repr(setting.choices) for c in setting.choices)


def test_translate_defaults_are_the_recipe_tables():
    shown = train_flags("translate")
    # Each recipe's own value, as the table declares it.
    assert "d2l 250, dates 10" in shown["--epochs"]
    assert "d2l 600, dates 10,000, corpus all" in shown["--num-examples"]
    corpus = PRESETS["corpus"]
    assert (f"corpus {corpus['bahdanau']['num_hiddens']} (bahdanau) / "
            f"{corpus['transformer']['num_hiddens']} (transformer)") in shown["--num-hiddens"]
    assert f"corpus {recipe_values('corpus', 'bahdanau')['split_by']}" in shown["--split-by"]
    # A setting every recipe gives the same value says so once.
    assert f"{recipe_values('d2l', 'bahdanau')['num_layers']} in every recipe" in \
        shown["--num-layers"]


def test_lm_defaults_are_the_settings_defaults_and_the_gpt_presets():
    shown = train_flags("lm")
    assert f"default: {LM_DEFAULTS['batch_size']})" in shown["--batch-size"]
    assert f"mini {GPT_PRESETS['mini']['context_length']}" in shown["--context-length"]
    assert "with --resume, the run's own" in shown["--lr"]


def test_shared_training_settings_are_one_declaration():
    # The same name in both tasks is the same setting, up to whether None is allowed.
    for name in TRANSLATE.keys() & LM.keys() & TRAINING.keys():
        assert TRANSLATE[name].help == LM[name].help == TRAINING[name].help, name
        assert TRANSLATE[name].describe() == LM[name].describe(), name
