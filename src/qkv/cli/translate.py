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

import torch

from ..checks import check_threads
from ..data.translate import SPLIT_BY
from ..functional import BACKENDS
from ..models.decoding import MAX_BEAM, check_beam
from ..tasks.translate import PRESET_NAMES, TranslateSettings, group_references
from ..training import DECAYS, DTYPES
from .runs import add_save_every, check_resume_flags, given_settings, reporting_stops

# TranslateSettings field -> the argparse destination of its flag.
SETTINGS_FLAGS = {name: name for name in (
    "data", "model", "num_examples", "num_steps", "held_out", "min_freq", "embed_size",
    "num_hiddens", "num_layers", "dropout", "num_heads", "ffn_num_hiddens", "batch_size",
    "lr", "epochs", "clip_norm", "seed", "device", "backend", "preset", "warmup_steps",
    "decay", "label_smoothing", "patience", "beam", "accumulate", "dtype", "compile",
    "split_by", "skip_padding", "ban_unk",
)}

# What --backend changes: the computation, never the weights, so any checkpoint runs
# under either.
BACKEND_HELP = ("how the model computes: 'fused' kernels or 'eager' (the Bahdanau model's "
                "d2l loop, the Transformer's explicit attention weights); the same weights "
                "and, up to float rounding, the same results")

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
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    # Settings flags default to None: a new run takes TranslateSettings' defaults (shown
    # in the help), and --resume can tell a flag the user gave from one left alone.
    train = actions.add_parser("train", help="train a translator (default: dates -> ISO)")
    train.add_argument("--data", default=None,
                       help="'dates' (embedded, default), 'fra-eng' (downloaded) or a "
                            "source<TAB>target file (read as a stream; one whose pairs "
                            "cannot fit in memory is refused before it is read)")
    train.add_argument("--model", choices=["bahdanau", "transformer"], default=None,
                       help="default: bahdanau")
    train.add_argument("--run-dir", type=Path, default=None,
                       help="checkpoint directory (default: runs/translate-DATA)")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir (to its own target, or --epochs)")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run in a --run-dir that holds a checkpoint (kept "
                            "until the new run saves)")
    train.add_argument("--epochs", type=int, default=None,
                       help="total epochs (default: 10 for dates, 250 otherwise)")
    train.add_argument("--num-examples", type=int, default=None,
                       help="pairs to read (default: 10000 for dates, 600 otherwise)")
    train.add_argument("--num-steps", "--num_steps", type=int, default=None,
                       help="tokens per sentence after truncation/padding")
    train.add_argument("--held-out", type=_fraction_or_count, default=None,
                       help="held out for evaluation: a fraction (0.1) or a count of pairs "
                            "(default: 0.1 dates, 0 fra-eng, 5%% of a file, at least one "
                            "batch, at most 5000)")
    train.add_argument("--skip-padding", action=argparse.BooleanOptionalAction, default=None,
                       help="bahdanau: start the decoder from the encoder's state after each "
                            "sentence's last real token, not after its padding as d2l does "
                            "(default: on for a file, off otherwise)")
    train.add_argument("--ban-unk", action=argparse.BooleanOptionalAction, default=None,
                       help="never output <unk>: decode the most likely real word instead "
                            "(default: on for a file, off otherwise)")
    train.add_argument("--split-by", choices=SPLIT_BY, default=None,
                       help="hold out random pairs, or random source sentences with all "
                            "their translations, so no held-out sentence is trained on "
                            "(default: source for a file, pair otherwise)")
    train.add_argument("--preset", choices=PRESET_NAMES, default=None,
                       help="a known recipe: 'd2l' (the book's, for 600 pairs), 'dates', or "
                            "'corpus' (for your own pairs: sizes, schedule, smoothing, early "
                            "stopping and beam chosen for them). Default: dates for dates, "
                            "d2l for fra-eng, corpus for a file. Flags override it")
    for flag, kind, note in (
        ("--min-freq", int, "default: 2"), ("--embed-size", int, "bahdanau only"),
        ("--num-hiddens", int, ""), ("--num-layers", int, ""), ("--dropout", float, ""),
        ("--num-heads", int, "transformer only"),
        ("--ffn-num-hiddens", int, "transformer only"), ("--batch-size", int, ""),
        ("--clip-norm", float, "default: 1"), ("--seed", int, "default: 0"),
        ("--warmup-steps", int, "learning-rate warm-up, in optimizer steps"),
        ("--label-smoothing", float, "in [0, 1)"),
        ("--patience", int, "stop after this many epochs without a better held-out loss "
                            "and keep the best weights; 0: never"),
        ("--beam", int, "beam size of the held-out report after training (1: greedy)"),
    ):
        help_text = f"{note}{'; ' if note else ''}default: the preset's" \
            if "default" not in note else note
        train.add_argument(flag, type=kind, default=None, help=help_text)
    train.add_argument("--decay", choices=DECAYS, default=None,
                       help="learning-rate decay after warm-up (default: the preset's)")
    train.add_argument("--accumulate", type=int, default=None,
                       help="micro-batches per optimizer step (gradient accumulation; "
                            "default 1)")
    train.add_argument("--dtype", choices=DTYPES, default=None,
                       help="forward precision: bfloat16 runs under autocast (default "
                            "float32)")
    train.add_argument("--compile", action="store_const", const=True, default=None,
                       help="train through torch.compile")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate (default: the preset's; with --resume, the "
                            "run's own)")
    train.add_argument("--backend", choices=BACKENDS, default=None,
                       help=f"{BACKEND_HELP} (default: fused; with --resume, the run's own)")
    train.add_argument("--device", default="auto", help="auto, cpu or cuda")
    train.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch (default: 1 for the d2l and dates "
                            "recipes, whose models are too small to gain from a second "
                            "thread; every core, up to 8, for the corpus recipe)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_save_every(train)
    train.add_argument("--trace", action="store_true",
                       help="log decoder tensor shapes per step and first-batch norms")
    train.set_defaults(run=run_train)

    run = actions.add_parser("run", help="translate sentences with a trained checkpoint")
    run.add_argument("--ckpt", type=Path, required=True, help="run directory of a checkpoint")
    run.add_argument("--text", nargs="+", default=None, help="sentences to translate")
    run.add_argument("--num-steps", "--num_steps", type=int, default=None,
                     help="default: the checkpoint's")
    run.add_argument("--ref", nargs="+", default=None,
                     help="reference translations, one per --text: adds BLEU (d2l, k=2)")
    run.add_argument("--beam", type=int, default=1,
                     help=f"beam size (1 = greedy; at most {MAX_BEAM:,})")
    run.add_argument("--heatmap", type=Path, default=None,
                     help="save target-vs-source attention to this PNG/PDF/SVG")
    run.add_argument("--backend", choices=BACKENDS, default=None,
                     help=f"{BACKEND_HELP} (default: the checkpoint's)")
    run.add_argument("--device", default="cpu")
    run.set_defaults(run=run_translate, prints_result=True)

    evaluate = actions.add_parser("eval", help="BLEU and exact match of a checkpoint")
    evaluate.add_argument("--ckpt", type=Path, required=True)
    evaluate.add_argument("--data", default=None,
                          help="evaluate on this data instead of the run's held-out split")
    evaluate.add_argument("--num-examples", type=int, default=None)
    evaluate.add_argument("--beam", type=int, default=None,
                          help="beam size (1 = greedy; default: the run's report's)")
    evaluate.add_argument("--backend", choices=BACKENDS, default=None,
                          help=f"{BACKEND_HELP} (default: the checkpoint's)")
    evaluate.add_argument("--device", default="cpu")
    evaluate.set_defaults(run=run_eval, prints_result=True)

    curves = actions.add_parser(
        "curves", help="plot held-out scores of trained runs against minutes of training")
    curves.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                        help="run directories (one line each)")
    curves.add_argument("--out", type=Path, required=True, help="PNG/PDF/SVG to write")
    curves.add_argument("--metric", choices=CURVE_METRICS, default="sacrebleu",
                        help="held-out greedy sacreBLEU (default), exact match or loss, as "
                             "recorded after each epoch")
    curves.set_defaults(run=run_curves)


CURVE_METRICS = {"sacrebleu": "held-out sacreBLEU (greedy)",
                 "exact_match": "held-out exact match (greedy)",
                 "loss": "held-out loss per token"}


def _fraction_or_count(text: str) -> float | int:
    """``--held-out``: ``0.05`` is a fraction, ``500`` a number of pairs."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in [0, 1) or a count of pairs, got {text!r}") from None


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
    from ..tasks.translate import ATTENTION_PLOT, train_translator
    from ..training import is_main_process

    given = given_settings(args, SETTINGS_FLAGS)
    run_dir = args.run_dir or Path("runs") / f"translate-{Path(args.data or 'dates').stem}"
    threads = args.threads
    if threads is None:
        recipe = _recipe(given, run_dir, args.resume)
        threads = 1 if recipe in ("d2l", "dates") else min(os.cpu_count() or 1, 8)
    check_threads(threads, "--threads")
    torch.set_num_threads(threads)
    if args.resume:
        check_resume_flags(run_dir, "translate", given, SETTINGS_FLAGS)
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
