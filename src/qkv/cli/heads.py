"""``qkv heads``: what each head of a language model does, and whether it matters.

    qkv heads --ckpt runs/smollm2 --json heads.json --csv heads.csv --heatmaps heads/
    qkv heads --ckpt runs/smollm2 --ablate 4.11 --prompt "Mary and John: John" --good " Mary"
    qkv heads --ckpt runs/lm --ablate 0.1 1.2 --how mean --reference-text "A text." --prompt "A"
    qkv heads --ckpt runs/lm --patch 1.2 --prompt "Mary and John: John" --corrupted "Al and Jo: Jo"
    qkv heads --induction-demo --run-dir runs/induction --steps 800

The catalogue scores every head on the induction protocol (BOS + random tokens,
repeated; its seed and sizes are printed); docs/heads.md defines each score. See
:mod:`qkv.heads`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..utils.fileio import check_writable

HELP = "score every head of a language model (induction, previous-token, sinks, ...), " \
       "ablate heads, or watch an induction head form"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "heads", help=HELP,
        description="A catalogue of every attention head of a run (qkv lm train or lm "
                    "import): entropy, sink mass and Gu et al.'s Sink metric, previous-token, "
                    "duplicate-token, induction, local and distance scores, as a table, CSV, "
                    "JSON and a layers x heads heatmap per score. With --ablate, the change "
                    "in a logit difference when heads are removed; with --patch, when a "
                    "layer's input or a head's output comes from a clean prompt, position "
                    "by position. With --induction-demo, "
                    "train a 2-layer attention-only transformer and watch an induction head "
                    "form. docs/heads.md defines the scores.",
        epilog="examples:\n" + "\n".join("  " + line.strip() for line in __doc__.splitlines()
                                          if line.strip().startswith("qkv heads")),
    )
    parser.add_argument("--ckpt", type=Path, metavar="RUN", default=None,
                        help="run directory of qkv lm train or lm import (default: none; "
                             "needed unless --induction-demo)")
    parser.add_argument("--length", type=int, default=50,
                        help="induction protocol: random tokens per copy (default 50)")
    parser.add_argument("--batch", type=int, default=10,
                        help="induction protocol: sequences (default 10)")
    parser.add_argument("--seed", type=int, default=0,
                        help="induction protocol's seed; with --induction-demo, training's "
                             "(default 0)")
    parser.add_argument("--csv", type=Path, default=None, metavar="PATH",
                        help="also write the table as CSV (default: none)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the table as JSON, a list of {layer, head, "
                             "score...}, 0-based (default: none)")
    parser.add_argument("--heatmaps", type=Path, default=None, metavar="DIR",
                        help="write DIR/heads-SCORE.png, a layers x heads heatmap per score "
                             "(default: none)")
    parser.add_argument("--ablate", nargs="+", default=None, metavar="LAYER.HEAD",
                        help="heads to remove (0-based, e.g. 4.11), with --prompt: the logit "
                             "difference with and without them (default: none)")
    parser.add_argument("--how", choices=("zero", "mean"), default="zero",
                        help="ablation: replace each head's output by zero or by its mean "
                             "over --reference-text (default zero)")
    parser.add_argument("--reference-text", default=None, metavar="TEXT",
                        help="text whose mean head outputs --how mean uses (default: none)")
    parser.add_argument("--prompt", default=None,
                        help="the text whose last position's logits --ablate reads "
                             "(default: none)")
    parser.add_argument("--good", default=None, metavar="TOKEN",
                        help="the token whose logit is measured, one token of the "
                             "tokenizer (default: the model's own next token)")
    parser.add_argument("--bad", default=None, metavar="TOKEN",
                        help="the token subtracted: logit[good] - logit[bad] (default: none)")
    parser.add_argument("--patch", default=None, metavar="LAYER[.HEAD]",
                        help="activation patching: run --corrupted with the residual stream "
                             "entering LAYER (or head LAYER.HEAD's output) at each position "
                             "taken from --prompt's run, and print the logit difference "
                             "(default: none)")
    parser.add_argument("--corrupted", default=None, metavar="TEXT",
                        help="with --patch: the corrupted prompt, as many tokens as --prompt "
                             "(default: none)")
    parser.add_argument("--induction-demo", action="store_true",
                        help="train a 2-layer attention-only transformer on repeated random "
                             "segments into --run-dir, scoring its heads as it learns")
    parser.add_argument("--run-dir", type=Path, default=None, metavar="RUN",
                        help="with --induction-demo: where heads-history.json and "
                             "heads-history.png go (default: none)")
    parser.add_argument("--steps", type=int, default=800,
                        help="with --induction-demo: training steps (default 800)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    parser.add_argument("--bpe-dir", default=None,
                        help="GPT-2's BPE files, for a run with the gpt2 tokenizer (default: "
                             "$QKV_BPE_DIR, else the run's own folder)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.induction_demo:
        return _demo(args)
    if args.ckpt is None:
        raise ValueError("qkv heads needs --ckpt RUN (or --induction-demo --run-dir RUN)")
    if args.run_dir is not None:
        raise ValueError("--run-dir goes with --induction-demo; the catalogue reads --ckpt")
    for flag, path in (("--csv", args.csv), ("--json", args.json)):
        if path is not None:
            if path.suffix.lower() != "." + flag[2:]:
                raise ValueError(f"{flag} {path}: give a file name ending in .{flag[2:]}")
            check_writable(path)
    if args.heatmaps is not None and args.heatmaps.exists() and not args.heatmaps.is_dir():
        raise ValueError(f"--heatmaps {args.heatmaps}: not a folder")
    if args.ablate is not None and args.patch is not None:
        raise ValueError("--ablate and --patch are two experiments: pass one of them")
    if args.patch is not None and (args.prompt is None or args.corrupted is None):
        raise ValueError("--patch needs --prompt (the clean run) and --corrupted")
    if args.corrupted is not None and args.patch is None:
        raise ValueError("--corrupted goes with --patch LAYER[.HEAD]")
    if args.ablate is not None:
        if args.prompt is None:
            raise ValueError("--ablate needs --prompt, the text whose logits it reads")
        if args.how == "mean" and args.reference_text is None:
            raise ValueError("--how mean needs --reference-text, the text each head's output "
                             "is averaged over")
    from ..heads.interventions import parse_heads
    from ..heads.scores import InductionProtocol

    heads = parse_heads(args.ablate) if args.ablate is not None else None
    patched = _patch_spec(args.patch) if args.patch is not None else None
    protocol = InductionProtocol(args.length, args.batch, args.seed)
    from ..tasks.lm import LanguageModel

    lm = LanguageModel.load(args.ckpt, device=args.device, bpe_dir=args.bpe_dir)
    if heads is not None:
        return _ablate(lm, heads, args)
    if patched is not None:
        return _patch(lm, *patched, args)
    return _catalogue(lm, protocol, args)


def _bos_id(lm) -> int:
    """The id a sequence starts with: the tokenizer's BOS, else its end-of-text (GPT-2's
    <|endoftext|>), else 0."""
    for name in ("bos_token_id", "eot_token"):
        value = getattr(lm.tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _catalogue(lm, protocol, args: argparse.Namespace) -> int:
    import time

    from ..heads.scores import (
        format_table,
        head_scores,
        plot_score_maps,
        scored_layers,
        sink_metric,
        write_table,
    )

    vocab = lm.model.cfg.vocab_size
    protocol.bos_id = _bos_id(lm)
    context = lm.model.cfg.context_length
    if 2 * protocol.length + 1 > context:
        raise ValueError(f"--length {protocol.length}: 2 x length + 1 tokens must fit the "
                         f"model's context_length {context}")
    print(protocol.describe(vocab))
    scored = scored_layers(lm.model)
    skipped = [i for i in range(len(lm.model.trf_blocks)) if i not in scored]
    if skipped:
        print(f"layers {', '.join(map(str, skipped))} skipped: no per-head softmax weights "
              f"to score (Gated DeltaNet: a recurrence, not attention over keys)")
    start = time.perf_counter()
    table = head_scores(lm.model, protocol.ids(vocab), repeat=protocol.length)
    seconds = time.perf_counter() - start
    print(format_table(table))
    print(f"{len(table)} heads of {lm.title} scored in {seconds:.2f} s; Gu et al.'s Sink_1 "
          f"(epsilon 0.3): {sink_metric(table):.1f}% of heads")
    for path in (args.csv, args.json):
        if path is not None:
            print(f"written to {write_table(table, path)}")
    if args.heatmaps is not None:
        paths = plot_score_maps(table, args.heatmaps, lm.title)
        print(f"{len(paths)} heatmaps written to {args.heatmaps}")
    return 0


def _token(lm, text: str, flag: str) -> int:
    ids = lm.tokenizer.encode(text, add_special_tokens=False) \
        if hasattr(lm.tokenizer, "chat_prompt") else lm.tokenizer.encode(text)
    if len(ids) != 1:
        raise ValueError(f"{flag} {text!r} is {len(ids)} tokens for this tokenizer; give "
                         "text that is exactly one token (often with its leading space)")
    return ids[0]


def _ablate(lm, heads: list[tuple[int, int]], args: argparse.Namespace) -> int:
    from ..heads.interventions import ablate

    ids = lm.encode_prompt(args.prompt)
    good, bad, what = _targets(lm, ids, args)
    reference = lm.encode_prompt(args.reference_text) if args.how == "mean" else None
    effect = ablate(lm.model, ids, heads, good, bad, how=args.how, reference=reference)
    names = ", ".join(f"{layer}.{head}" for layer, head in heads)
    print(f"{what} at the last position of the prompt ({ids.shape[1]} tokens)")
    print(f"  model as it is:          {effect.before:+.4f}")
    print(f"  heads {names} ablated ({args.how}): {effect.after:+.4f}")
    print(f"  change:                  {effect.change:+.4f}")
    return 0


def _patch_spec(text: str) -> tuple[int, int | None]:
    """``"3"`` -> (3, None): the residual stream entering layer 3; ``"3.1"`` -> (3, 1)."""
    layer, dot, head = text.partition(".")
    if not layer.isdigit() or (dot and not head.isdigit()):
        raise ValueError(f"--patch is LAYER (the residual stream entering it) or LAYER.HEAD "
                         f"(that head's output), counted from 0; got {text!r}")
    return int(layer), int(head) if dot else None


def _targets(lm, ids, args: argparse.Namespace) -> tuple[int, int | None, str]:
    """The logit difference's tokens (``--good``, default the model's next token on
    ``ids``; ``--bad``) and its name."""
    import torch

    with torch.no_grad():
        next_id = int(lm.model(ids)[0, -1].argmax())
    good = _token(lm, args.good, "--good") if args.good is not None else next_id
    bad = _token(lm, args.bad, "--bad") if args.bad is not None else None
    what = f"logit[{lm.tokenizer.decode([good])!r}]"
    if bad is not None:
        what += f" - logit[{lm.tokenizer.decode([bad])!r}]"
    return good, bad, what


def _patch(lm, layer: int, head: int | None, args: argparse.Namespace) -> int:
    from ..heads.interventions import patch

    clean = lm.encode_prompt(args.prompt)
    corrupted = lm.encode_prompt(args.corrupted)
    if clean.shape != corrupted.shape:
        raise ValueError(f"--prompt has {clean.shape[1]} tokens and --corrupted "
                         f"{corrupted.shape[1]}; patching needs the same number")
    good, bad, what = _targets(lm, clean, args)
    point = "resid_pre" if head is None else "head_out"
    where = (f"the residual stream entering layer {layer}" if head is None
             else f"head {layer}.{head}'s output")
    print(f"{what} at the last position; {where} patched from --prompt into --corrupted")
    effects = [patch(lm.model, clean, corrupted, point=point, layer=layer, position=p,
                     good=good, bad=bad, head=head) for p in range(clean.shape[1])]
    itself = patch(lm.model, clean, clean, point=point, layer=layer, position=0, good=good,
                   bad=bad, head=head)
    print(f"  clean run:      {itself.before:+.4f}")
    print(f"  corrupted run:  {effects[0].before:+.4f}")
    for p, effect in enumerate(effects):
        token = lm.tokenizer.decode([int(corrupted[0, p])])
        print(f"  patched at {p:3d} {token!r:>14}: {effect.after:+.4f} ({effect.change:+.4f})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.run_dir is None:
        raise ValueError("--induction-demo needs --run-dir RUN, where its history goes")
    if args.ckpt is not None:
        raise ValueError("--induction-demo trains its own model; drop --ckpt")
    if not 1 <= args.steps <= 1_000_000:
        raise ValueError(f"--steps must be in 1..1000000, got {args.steps}")
    check_writable(args.run_dir, directory=True)
    from ..heads.induction import plot_history, train_induction

    history = train_induction(args.run_dir, steps=args.steps, seed=args.seed,
                              every=max(1, min(50, args.steps // 10)), log=print)
    path = plot_history(history, args.run_dir / "heads-history.png")
    print(f"history written to {args.run_dir / 'heads-history.json'}, plot to {path}")
    return 0
