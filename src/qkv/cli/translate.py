"""``qkv translate``: train, evaluate and run attention translators.

    qkv translate train                       # dates -> ISO on the embedded corpus
    qkv translate train --data fra-eng --run-dir runs/fra
    qkv translate run --ckpt runs/translate-dates --text "3 mar 21" --heatmap a.png
    qkv translate eval --ckpt runs/translate-dates
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

from ..checks import check_threads
from ..options import BACKENDS, MAX_BEAM, MODEL_NAMES, Setting
from ..tasks.settings import (
    CORPUS_EPOCHS,
    CORPUS_HELD_OUT,
    CORPUS_STEPS,
    MODEL_ONLY,
    PRESET_NAMES,
    TRANSLATE,
    TRANSLATE_DEFAULTS,
    TRANSLATE_UNSET,
    recipe_values,
)
from .runs import (
    add_run_flags,
    add_save_every,
    add_settings_flags,
    check_resume_flags,
    given_settings,
    reporting_stops,
    show_value,
)

# d2l's four test sentences: the default input for an English->French model.
FRA_ENG_EXAMPLES = ["go .", "i lost .", "he's calm .", "i'm home ."]
DATE_EXAMPLES = [
    "tuesday, march 3, 2021",
    "3 mar 21",
    "03/03/2021",
    "the 4th of july, 1976",
    "dec 25, 1999",
    "2049 january 1",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "translate",
        help="train, evaluate and run seq2seq translators with attention",
        description="Sequence-to-sequence translation with Bahdanau or Transformer attention.",
        epilog=EXAMPLES,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    train = actions.add_parser(
        "train", help="train a translator (default: dates -> ISO)",
        description="Train a translator into a run directory. Each setting left out takes "
                    "its recipe's value (--preset; shown per recipe below).",
        epilog="examples:\n  qkv translate train\n"
               "  qkv translate train --data pairs.tsv --model transformer --run-dir runs/mine")
    # The settings' flags, each from its declaration (qkv.tasks.settings).
    train.set_defaults(settings_flags=add_settings_flags(
        train, TRANSLATE.values(), _default_text, defaults={"device": "auto"}))
    train.add_argument("--run-dir", type=Path, default=None,
                       help="checkpoint directory (default: runs/translate-DATA, DATA the "
                            "--data file's name without its extension)")
    add_run_flags(train)
    train.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch, 1 to 1,024 (default: 1 for the d2l and "
                            "dates recipes, whose models are too small to gain from a second "
                            "thread; every core, up to 8, for the corpus recipe)")
    add_save_every(train)
    train.add_argument("--trace", action="store_true",
                       help="log decoder tensor shapes per step and first-batch norms")
    train.set_defaults(run=run_train)

    run = actions.add_parser(
        "run", help="translate sentences with a trained checkpoint",
        description="Translate sentences with a trained checkpoint, greedy or by beam search, "
                    "and optionally draw what the decoder attended to.",
        epilog='example:\n  qkv translate run --ckpt runs/translate-dates --text "3 mar 21" '
               "--heatmap a.png")
    run.add_argument("--ckpt", type=Path, required=True, metavar="RUN",
                     help="run directory of qkv translate train")
    run.add_argument("--text", nargs="+", default=None,
                     help="sentences to translate (default: a few examples for the run's "
                          "data)")
    run.add_argument("--num-steps", "--num_steps", type=int, default=None,
                     help="most tokens read of a sentence and written of its translation, "
                          "2 to 100,000 (default: the checkpoint's)")
    run.add_argument("--ref", nargs="+", default=None,
                     help="reference translations, one per --text: adds BLEU (d2l, k=2) "
                          "(default: none)")
    run.add_argument("--beam", type=int, default=1,
                     help=f"beam size, 1 to {MAX_BEAM:,} (1: greedy)")
    run.add_argument("--heatmap", type=Path, default=None,
                     help="save target-vs-source attention to this PNG, PDF or SVG file "
                          "(default: none)")
    run.add_argument("--backend", choices=BACKENDS, default=None,
                     help=f"{TRANSLATE['backend'].help} (default: the checkpoint's)")
    run.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    run.set_defaults(run=run_translate, prints_result=True)

    evaluate = actions.add_parser(
        "eval", help="BLEU and exact match of a checkpoint",
        description="Score a trained translator: exact match, d2l's BLEU and sacreBLEU on "
                    "the run's held-out pairs or on other data.",
        epilog="example:\n  qkv translate eval --ckpt runs/translate-dates --beam 4")
    evaluate.add_argument("--ckpt", type=Path, required=True, metavar="RUN",
                          help="run directory of qkv translate train")
    evaluate.add_argument("--data", default=None,
                          help="evaluate on this data ('dates', 'fra-eng' or a "
                               "source<TAB>target file) instead of the run's held-out split "
                               "(default: the held-out split)")
    evaluate.add_argument("--num-examples", type=int, default=None,
                          help="with --data: pairs to read, 1 to 10,000,000 (default: the "
                               "run's)")
    evaluate.add_argument("--beam", type=int, default=None,
                          help=f"beam size, 1 to {MAX_BEAM:,} (1: greedy; default: the "
                               "run's report's)")
    evaluate.add_argument("--backend", choices=BACKENDS, default=None,
                          help=f"{TRANSLATE['backend'].help} (default: the checkpoint's)")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    evaluate.set_defaults(run=run_eval, prints_result=True)

    curves = actions.add_parser(
        "curves", help="plot held-out scores of trained runs against minutes of training",
        description="Plot held-out scores recorded after each epoch of several runs against "
                    "their minutes of training, one line per run.",
        epilog="example:\n  qkv translate curves runs/a runs/b --out curves.png")
    curves.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                        help="run directories (one line each)")
    curves.add_argument("--out", type=Path, required=True, help="PNG, PDF or SVG file to write")
    curves.add_argument("--metric", choices=CURVE_METRICS, default="sacrebleu",
                        help="held-out greedy sacreBLEU, exact match or loss, as recorded "
                             "after each epoch")
    curves.set_defaults(run=run_curves)


CURVE_METRICS = {"sacrebleu": "held-out sacreBLEU (greedy)",
                 "exact_match": "held-out exact match (greedy)",
                 "loss": "held-out loss per token"}

EXAMPLES = """examples:
  qkv translate train                       # dates -> ISO on the embedded corpus
  qkv translate train --data fra-eng --run-dir runs/fra
  qkv translate run --ckpt runs/translate-dates --text "3 mar 21" --heatmap a.png
  qkv translate eval --ckpt runs/translate-dates"""


def _default_text(setting: Setting) -> str:
    """A translator setting's default in words: per recipe, from the recipe table, or
    the one default it has outside the recipes."""
    name = setting.name
    if name == "preset":
        return "follows --data: dates for dates, d2l for fra-eng, corpus for a file"
    if name in TRANSLATE_DEFAULTS or name in TRANSLATE_UNSET:
        return show_value({**TRANSLATE_DEFAULTS, **TRANSLATE_UNSET}[name])
    models = [MODEL_ONLY[name]] if name in MODEL_ONLY else list(MODEL_NAMES)
    per_recipe = {}
    for recipe in PRESET_NAMES:
        values = {m: _recipe_value(name, recipe_values(recipe, m)[name], m) for m in models}
        per_recipe[recipe] = (next(iter(values.values())) if len(set(values.values())) == 1
                              else " / ".join(f"{v} ({m})" for m, v in values.items()))
    if len(set(per_recipe.values())) == 1:
        return f"{per_recipe[PRESET_NAMES[0]]} in every recipe"
    return ", ".join(f"{recipe} {value}" for recipe, value in per_recipe.items())


def _recipe_value(name: str, value: Any, model: str) -> str:
    """A recipe's value; None is the corpus recipe's choice made from the corpus."""
    if value is not None:
        return show_value(value)
    fraction, most = CORPUS_HELD_OUT
    lo, hi = CORPUS_EPOCHS
    return {"num_examples": "all",
            "num_steps": "fitted to the corpus's sentences (at most 128)",
            "held_out": f"{fraction:.0%} of the pairs (at least a batch, at most {most:,})",
            "epochs": f"about {CORPUS_STEPS[model]:,} optimizer steps' worth ({lo} to {hi})",
            }[name]


def _print_translations(translations, refs: list[str] | None = None) -> None:
    from ..training.metrics import bleu

    for i, t in enumerate(translations):
        extra = "" if refs is None else f", bleu {bleu(' '.join(t.tokens), refs[i], k=2):.3f}"
        if t.score is not None:
            extra += f"   (score {t.score:.3f})"
        print(f"{t.source} => {t.text}{extra}")


def _print_metrics(label: str, metrics: dict[str, float | None]) -> None:
    sacre = metrics["sacrebleu"]
    sacre_text = ("n/a (pip install 'qkv[bleu]')" if sacre is None
                  else f"{sacre:.1f} (13a, detokenized)")
    beam = int(metrics.get("beam") or 1)
    how = "greedy" if beam == 1 else f"beam {beam}"
    n, pairs = int(metrics["n"]), int(metrics.get("references") or metrics["n"])
    cases = f"{n} pairs" if n == pairs else f"{n} sentences, {pairs} references"
    print(f"{label} ({cases}, {how}): exact match "
          f"{metrics['exact_match']:.1%}, BLEU (d2l, k=2) {metrics['bleu']:.3f}, "
          f"sacreBLEU {sacre_text}")


def run_train(args: argparse.Namespace) -> int:
    import torch

    from ..tasks.translate import ATTENTION_PLOT, TranslateSettings, train_translator
    from ..training import is_main_process

    given = given_settings(args, args.settings_flags)
    run_dir = args.run_dir or Path("runs") / f"translate-{Path(args.data or 'dates').stem}"
    threads = args.threads
    if threads is None:
        recipe = _recipe(given, run_dir, args.resume)
        threads = 1 if recipe in ("d2l", "dates") else min(os.cpu_count() or 1, 8)
    check_threads(threads, "--threads")
    torch.set_num_threads(threads)
    if args.resume:
        check_resume_flags(run_dir, "translate", given, args.settings_flags,
                           TRANSLATE)
    settings = TranslateSettings(**given)
    if not args.resume:
        settings.resolved()  # refuse bad values before the run directory is touched
    heatmap = run_dir / ATTENTION_PLOT  # checked writable with the run directory
    # Also around the report: a Ctrl-C while it runs still says what is on disk.
    with reporting_stops("translate", run_dir, args):
        translator, _ = train_translator(
            settings, run_dir, resume=args.resume, overwrite=args.overwrite,
            progress=not args.no_progress, trace=print if args.trace else None,
            save_every=args.save_every,
        )
        # Under torchrun, rank 0 reports; the other ranks' work ended with training.
        if is_main_process():
            _report_training(translator, run_dir, heatmap)
    return 0


def _recipe(given: dict, run_dir: Path, resume: bool) -> str:
    """The recipe of the run about to train: a resume's is the saved run's (its flags
    name only what changes), a new run's follows from the flags."""
    from ..tasks.translate import TranslateSettings

    if resume:
        from ..training import load_config

        # An unreadable checkpoint is reported, in one line, by the training call itself.
        with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
            saved = load_config(run_dir, task="translate")["settings"]
            return TranslateSettings.from_dict(saved).recipe
    return TranslateSettings(**given).recipe


def _report_training(translator, run_dir: Path, heatmap: Path) -> None:
    print(f"checkpoint: {run_dir}  (loss curve: {run_dir / 'loss.png'})")
    examples = DATE_EXAMPLES if translator.settings.data == "dates" else FRA_ENG_EXAMPLES
    translations = translator.translate(examples)
    print("\nsample translations:")
    _print_translations(translations)
    translator.heatmap(translations[:4], heatmap)
    if translator.held_out:
        print()
        _report_scores(translator, translator.held_out, "held-out",
                       translator.settings.beam or 1)
    print(f"attention heatmap written to {heatmap}")


def _report_scores(translator, pairs: list, label: str, beam: int) -> None:
    """Scores of the pairs' distinct sentences against all of their references, then
    the first five with their translations."""
    from ..tasks.translate import group_references

    src, refs = group_references([s for s, _ in pairs], [t for _, t in pairs])
    outputs = translator.predict(src, beam=beam)
    _print_metrics(label, translator.score(outputs, refs, beam=beam))
    print(f"{label} examples:")
    for s, o, r in zip(src[:5], outputs[:5], refs[:5], strict=False):
        others = f" and {len(r) - 1} more" if len(r) > 1 else ""
        print(f"  {' '.join(s)} => {translator.detokenize(o)}   "
              f"(reference: {translator.detokenize(r[0])}{others})")


def _load(args: argparse.Namespace):
    from ..tasks.translate import Translator

    return Translator.load(args.ckpt, device=args.device, backend=args.backend)


def run_translate(args: argparse.Namespace) -> int:
    from ..models.decoding import check_beam
    from ..utils.figures import check_image_path

    if args.heatmap is not None:
        check_image_path(args.heatmap)
    check_beam(args.beam, "--beam")  # before the checkpoint is read
    translator = _load(args)
    texts = args.text
    if texts is None:
        texts = DATE_EXAMPLES if translator.settings.data == "dates" else FRA_ENG_EXAMPLES
    refs = args.ref
    if refs is not None:
        if len(refs) != len(texts):
            raise ValueError(f"--ref has {len(refs)} sentences but there are {len(texts)} "
                             "to translate; give one reference per --text")
        refs = [" ".join(translator.tokenize_target(r)) for r in refs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        translations = translator.translate(texts, beam=args.beam, num_steps=args.num_steps)
    for w in caught:
        print(f"warning: {w.message}")
    _print_translations(translations, refs)
    if args.heatmap is not None:
        print(f"heatmap written to {translator.heatmap(translations, args.heatmap)}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import dataclasses

    from ..models.decoding import check_beam
    from ..tasks.translate import load_pairs, prepare_data

    if args.beam is not None:
        check_beam(args.beam, "--beam")  # before the checkpoint is read
    translator = _load(args)
    settings = translator.settings
    if args.data is None:
        data = prepare_data(settings, translator.src_vocab, translator.tgt_vocab)
        pairs, label = data.valid_pairs, "held-out"
        if not pairs:
            raise ValueError(f"{args.ckpt} was trained without a held-out split; pass --data")
        src, tgt = [s for s, _ in pairs], [t for _, t in pairs]
    else:
        other = dataclasses.replace(settings, data=args.data, num_examples=args.num_examples)
        if other.num_examples is None:
            other = dataclasses.replace(other, num_examples=settings.num_examples)
        src, tgt = load_pairs(other)
        label = args.data
    beam = (translator.settings.beam or 1) if args.beam is None else args.beam
    _report_scores(translator, list(zip(src, tgt, strict=True)), label, beam)
    return 0


def run_curves(args: argparse.Namespace) -> int:
    from ..tasks.translate import TranslateSettings
    from ..training import load_config, plot_progress, read_history
    from ..utils.figures import check_image_path

    check_image_path(args.out)
    histories = {}
    for run in args.runs:
        settings = TranslateSettings.from_dict(load_config(run, task="translate")["settings"])
        label = f"{run.name} ({settings.model})"
        if label in histories:  # two runs of the same name in different folders
            label = f"{run} ({settings.model})"
        histories[label] = read_history(run)
    key = f"valid_{args.metric}"
    path = plot_progress(histories, key, args.out, ylabel=CURVE_METRICS[args.metric])
    for label, history in histories.items():
        minutes = sum(history["seconds"]) / 60
        values = [v for v in history[key] if v is not None]
        print(f"{label}: {len(history['seconds'])} epochs, {minutes:.1f} min, last "
              f"{args.metric} {values[-1]:.3f}")
    print(f"written to {path}")
    return 0
