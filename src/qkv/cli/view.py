"""``qkv view``: what a trained model attends to, as a page for the browser.

    qkv view --ckpt runs/lm --text "The cat sat" --html cat.html
    qkv view --ckpt runs/translate --text "i am cold ." --text "go ." --html fr.html
    qkv view --ckpt runs/lm --text "The cat" --generate 20 --html cat.html
    qkv view --ckpt runs/lm --serve --port 8000      # a text box; the page redraws

The page is one self-contained file (no network, ever): a head view, a model view of
every layer x head, a matrix view, a colour scale (linear, log, or per row with the first
token aside) and PNG and SVG export; ``--generate N`` adds a language model's greedy
continuation, marked. See :mod:`qkv.viz`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..utils.fileio import check_writable


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "view",
        help="explore a model's attention in the browser (an offline HTML page or a local "
             "server)",
        description="Run a trained qkv model (language model or translator) on some text "
                    "and show every layer's and head's attention in an interactive page.",
        epilog="examples:\n" + "\n".join("  " + line.strip() for line in __doc__.splitlines()
                                          if line.strip().startswith("qkv view")),
    )
    parser.add_argument("--ckpt", type=Path, required=True, metavar="RUN",
                        help="run directory of qkv lm train, lm import or translate train")
    parser.add_argument("--text", action="append", default=None, metavar="TEXT",
                        help="input text (repeat for several; each gets its own tab; "
                             "default: none, with --serve type it in the page)")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--html", type=Path, metavar="OUT.html",
                     help="write one self-contained page here (this or --serve)")
    out.add_argument("--serve", action="store_true",
                     help="serve the page on 127.0.0.1 with a text box, until Ctrl-C "
                          "(exit status 130) or SIGTERM (143)")
    parser.add_argument("--port", type=int, default=8000,
                        help="with --serve: the port (default 8000; 0 picks a free one)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="language models: continue each text greedily by N tokens and "
                             "show the attention of prompt and continuation (default 0; "
                             "prompt + N must fit the model's context)")
    parser.add_argument("--beam", type=int, default=1,
                        help="translators: beam size (default 1, greedy)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    parser.add_argument("--bpe-dir", default=None,
                        help="language models with a GPT-2 tokenizer: its files' folder "
                             "(default: $QKV_BPE_DIR, else the run's own)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..models.decoding import check_beam
    from ..models.gpt import check_max_new_tokens
    from ..tasks.translate import Translator
    from ..viz.data import check_translator_generate
    from ..viz.explore import explore, load_target
    from ..viz.server import serve

    check_beam(args.beam, "--beam")
    check_max_new_tokens(args.generate, "--generate")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.html is not None:
        if not args.text:
            raise ValueError("--html needs at least one --text")
        if args.html.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"--html {args.html}: give a file name ending in .html")
        check_writable(args.html)  # before the model is loaded and run
        page = explore(args.ckpt, args.text, device=args.device, beam=args.beam,
                       bpe_dir=args.bpe_dir, generate=args.generate)
        path = page.save(args.html)
        size = path.stat().st_size
        print(f"{page!r}\nwritten to {path} ({size / 2**20:.1f} MiB); open it in a browser")
        return 0
    target = load_target(args.ckpt, device=args.device, bpe_dir=args.bpe_dir)
    if isinstance(target, Translator):
        check_translator_generate(args.generate, "--generate")
    serve(target, port=args.port, texts=args.text or (), beam=args.beam,
          generate=args.generate, title=f"qkv attention: {args.ckpt.name}")
    return 0
