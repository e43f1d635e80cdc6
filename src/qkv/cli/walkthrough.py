"""``qkv walkthrough``: print LLMs-from-scratch §3.3-3.6 step by step, then the
attention of 2025-26 models (latent, absorbed, sparse, sinks, shared keys and values).

Examples::

    qkv walkthrough                        # the book's example and numbers, then each mechanism
    qkv walkthrough --steps                # just the list of steps
    qkv walkthrough --only 3.5.1           # one section (or a prefix: --only 3.5)
    qkv walkthrough --only mla             # one mechanism: mla, absorbed, dsa, sinks, kvshare
    qkv walkthrough --text "the cat sat on the mat" --seed 7 --heatmap wt.png
"""

from __future__ import annotations

import argparse

from ..options import BOOK_TEXT, WALKTHROUGH_MECHANISMS
from ..options import MAX_WALKTHROUGH_TOKENS as MAX_TOKENS

HELP = ("walk through self-attention step by step (LLMs-from-scratch §3.3-3.6), then the "
        "attention of 2025-26 models")


def _description() -> str:
    mechanisms = "; ".join(f"'{name}' shows {text}"
                           for name, text in WALKTHROUGH_MECHANISMS.items())
    return (f"{HELP[0].upper()}{HELP[1:]}. Every step of the book prints the tensors the "
            "book prints, with the same numbers for the book's example. After the book's "
            "sections (3.3.1 to 3.6.2) come the mechanisms', each run by qkv's own classes "
            "on a toy input of the same words, every step printing its tensors' shapes and "
            "what the cache holds, token by token (--only NAME; steps NAME.1, NAME.2, ...). "
            f"{mechanisms}.")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "walkthrough",
        help=HELP,
        description=_description(),
        epilog="examples:\n" + "\n".join("  " + line.strip() for line in __doc__.splitlines()
                                          if line.strip().startswith("qkv walkthrough")),
    )
    parser.add_argument(
        "--text",
        metavar="TEXT",
        help=f"your own words instead of '{BOOK_TEXT}': split on whitespace (1 to "
        f"{MAX_TOKENS} tokens), each distinct word gets a seeded random embedding, 3-d "
        "for the book's steps and 8-d for the mechanisms' (default: the book's sentence "
        "and embeddings)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=123,
        help="replaces the book's torch.manual_seed(123); SelfAttention_v2 uses SEED + 666 "
        "(the book's 789) (default: %(default)s)",
    )
    parser.add_argument(
        "--heatmap",
        metavar="FILE",
        help="also save the attention weights of the main steps as a labelled figure "
        "(.png, .pdf or .svg; default: none)",
    )
    parser.add_argument("--steps", action="store_true", help="list the steps' titles only")
    parser.add_argument(
        "--only",
        metavar="SECTION",
        help="show one section, e.g. 3.5.1 or mla.2, or all steps under a prefix, e.g. "
        f"3.5, 3 (the book's) or a mechanism: {', '.join(WALKTHROUGH_MECHANISMS)} "
        "(default: every step)",
    )
    parser.set_defaults(run=run, prints_result=True)
    return parser


def run(args: argparse.Namespace) -> int:
    from ..book.walkthrough import heatmap_panels, select_steps, walkthrough_steps
    from ..book.walkthrough_variants import variant_steps

    # Validate the output path before any work so a typo fails at once.
    if args.heatmap:
        from ..utils.figures import check_image_path

        check_image_path(args.heatmap)

    all_steps = walkthrough_steps(args.text, seed=args.seed) + variant_steps(
        args.text, seed=args.seed)
    steps = select_steps(all_steps, args.only) if args.only else all_steps

    panels = heatmap_panels(steps) if args.heatmap else None
    if panels is not None and not panels[0]:
        drawable = [s.section for s in all_steps if s.weights is not None]
        raise ValueError(
            f"section {args.only} has no attention-weight matrix to draw; "
            f"sections with one: {', '.join(drawable)}"
        )

    if args.steps:
        for step in steps:
            print(f"{step.section}  {step.title}")
    else:
        print("\n\n".join(step.render() for step in steps))

    if panels is not None:
        from ..utils.figures import plot_attention_grid

        matrices, titles, tokens = panels
        source = BOOK_TEXT if args.text is None else " ".join(args.text.split())
        if len(source) > 60:
            source = source[:57] + "..."
        path = plot_attention_grid(
            matrices,
            titles=titles,
            row_labels=tokens,
            col_labels=tokens,
            path=args.heatmap,
            suptitle=f'Attention weights for "{source}" (seed {args.seed})',
        )
        if not args.steps:
            print()
        print(f"heatmap written to {path}")
    return 0
