"""``qkv lm``: train a small GPT, sample from it, and look at its attention.

    qkv lm train                                   # on a corpus qkv generates itself
    qkv lm train --text story.txt --tokenizer gpt2 --bpe-dir gpt2/ --preset mini
    qkv lm generate --ckpt runs/lm --prompt "The cat" --max-new-tokens 60
    qkv lm generate --ckpt runs/smollm2 --chat --prompt "What is attention?" --top-p 0.9
    qkv lm attention --ckpt runs/lm --prompt "The cat sat" --heatmap attn.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..options import GPT_PRESETS, MAX_NEW_TOKENS, Setting
from ..tasks.settings import LM, LM_DEFAULTS, LM_UNSET
from .runs import (
    add_run_flags,
    add_save_every,
    add_settings_flags,
    check_resume_flags,
    given_settings,
    reporting_stops,
    show_value,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "lm",
        help="train a small GPT language model, generate text, draw its attention",
        description="A GPT-2 style causal language model built on qkv's multi-head attention.",
        epilog="examples:\n" + "\n".join("  " + line.strip() for line in __doc__.splitlines()
                                          if line.strip().startswith("qkv lm")),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    train = actions.add_parser(
        "train", help="train a GPT on a text file (or a built-in one)",
        description="Train a GPT language model into a run directory, from scratch or from "
                    "the weights of another run (--init).",
        epilog="examples:\n  qkv lm train\n"
               "  qkv lm train --text story.txt --preset mini --epochs 3 --run-dir runs/story")
    # The settings' flags, each from its declaration (qkv.tasks.settings).
    train.set_defaults(settings_flags=add_settings_flags(
        train, LM.values(), _default_text, defaults={"device": "auto"}))
    train.add_argument("--run-dir", type=Path, default=Path("runs/lm"),
                       help="checkpoint directory")
    add_run_flags(train)
    add_save_every(train)
    train.add_argument("--sample", default="The ",
                       help="prompt for a sample printed after training ('' to skip)")
    train.set_defaults(run=run_train)

    gen = actions.add_parser(
        "generate", help="continue a prompt with a trained model",
        description="Continue a prompt with a trained or imported model, printing the text "
                    "as it comes, then the speed.",
        epilog='examples:\n  qkv lm generate --ckpt runs/lm --prompt "The cat" '
               "--max-new-tokens 60\n"
               '  qkv lm generate --ckpt runs/smol --chat --prompt "What is attention?" '
               "--top-p 0.9")
    gen.add_argument("--ckpt", type=Path, required=True, metavar="RUN",
                     help="run directory (qkv lm train or qkv lm import)")
    gen.add_argument("--prompt", required=True,
                     help="text to continue; with --chat, the user's message")
    gen.add_argument("--chat", action="store_true",
                     help="send --prompt through the model's chat template (an "
                          "instruction-tuned open model) and print only its reply "
                          "(default: off, plain continuation)")
    gen.add_argument("--system", default=None,
                     help="system message of the chat, with --chat (default: none, or what "
                          "the template puts there)")
    gen.add_argument("--max-new-tokens", type=int, default=50,
                     help=f"most tokens to add, 0 to {MAX_NEW_TOKENS:,}, printed as they come; "
                          "an open model stops earlier at its end-of-text id")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature, >= 0: 0 = greedy, higher = more varied "
                          "(default: 0)")
    gen.add_argument("--top-k", type=int, default=None,
                     help="sample only among the K most likely tokens, K >= 1 (default: all)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="sample only among the most likely tokens whose probabilities "
                          "reach P together (nucleus), 0 < P <= 1 (default: 1, all)")
    gen.add_argument("--seed", type=int, default=None,
                     help="seed for sampling, for output that repeats (default: none)")
    gen.add_argument("--no-kv-cache", action="store_true",
                     help="recompute the whole context for every token (slower, same tokens)")
    gen.add_argument("--bpe-dir", default=None,
                     help="GPT-2's BPE files, for a run with the gpt2 tokenizer (default: "
                          "$QKV_BPE_DIR, else the run's own folder)")
    gen.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")
    gen.set_defaults(run=run_generate, prints_result=True)

    att = actions.add_parser(
        "attention", help="per-layer, per-head attention heatmaps",
        description="Draw the attention weights of every head of a model's layers on a "
                    "prompt: one row of panels per layer.",
        epilog='example:\n  qkv lm attention --ckpt runs/lm --prompt "The cat sat" '
               "--heatmap attn.png")
    att.add_argument("--ckpt", type=Path, required=True, metavar="RUN",
                     help="run directory (qkv lm train or qkv lm import)")
    att.add_argument("--prompt", required=True,
                     help="text whose tokens attend to each other (at most the model's "
                          "context)")
    att.add_argument("--heatmap", type=Path, required=True, help="PNG, PDF or SVG file")
    att.add_argument("--layers", type=int, nargs="+", default=None,
                     help="layers to draw, counted from 0 (default: all)")
    att.add_argument("--bpe-dir", default=None,
                     help="GPT-2's BPE files, for a run with the gpt2 tokenizer (default: "
                          "$QKV_BPE_DIR, else the run's own folder)")
    att.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    att.set_defaults(run=run_attention)

    imp = actions.add_parser(
        "import", help="make a run directory of an open model: a Hugging Face folder, a "
                       ".gguf file or a Hub repo id (GPT-2, Llama/SmolLM2, Mistral, Qwen2, "
                       "Qwen3, Gemma 3)",
        description="Make a run directory of an open model, for lm generate, lm attention, "
                    "qkv view and lm train --init.",
        epilog="examples:\n  qkv lm import smollm2-135m-instruct-q4_1.gguf --run-dir runs/smol"
               "\n  qkv lm import HuggingFaceTB/SmolLM2-135M-Instruct --run-dir runs/smol")
    imp.add_argument("source", metavar="SRC",
                     help="a Hugging Face folder (config.json, model.safetensors or its "
                          "shards, tokenizer.json), a .gguf file, or a repo id such as "
                          "HuggingFaceTB/SmolLM2-135M-Instruct (downloaded when online)")
    imp.add_argument("--run-dir", type=Path, required=True,
                     help="the run directory to create (refused if it holds a checkpoint, "
                          "unless --overwrite)")
    imp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="how the weights are stored and run (default: float32; "
                          "bfloat16 halves the memory)")
    imp.add_argument("--keep-quantized", action="store_true",
                     help="a .gguf file: keep its Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K "
                          "and Q6_K matrices in their blocks (the run is no larger than "
                          "the file); other tensors are stored as --dtype")
    imp.add_argument("--revision", default=None,
                     help="with a repo id: the branch, tag or commit (default: the main "
                          "branch)")
    imp.add_argument("--cache-dir", type=Path, default=None,
                     help="with a repo id: huggingface_hub's cache folder (default: its "
                          "own, $HF_HOME)")
    imp.add_argument("--bpe-dir", default=None,
                     help="GPT-2 only: the BPE files (encoder.json + vocab.bpe), if the "
                          "folder has no vocab.json/merges.txt (default: the folder's)")
    imp.add_argument("--overwrite", action="store_true",
                     help="replace a checkpoint already in --run-dir")
    imp.set_defaults(run=run_import)


# What a language-model setting without a fixed default gets.
_DEFAULT_WORDS = {
    "text": "a corpus qkv generates itself", "init": "none, from scratch",
    "bpe_dir": "$QKV_BPE_DIR", "stride": "half the window", "batch_tokens": "none",
    "eval_every": "none"}


def _default_text(setting: Setting) -> str:
    """A language-model setting's default in words; a preset's own sizes from the
    preset table."""
    name = setting.name
    if name in ("context_length", "drop_rate"):
        own = ", ".join(f"{p} {show_value(v[name])}" for p, v in GPT_PRESETS.items()
                        if name in v)
        return f"the preset's: {own}; GPT-2's for the gpt2 sizes"
    if name in LM_DEFAULTS or name in LM_UNSET:
        return show_value({**LM_DEFAULTS, **LM_UNSET}[name])
    return _DEFAULT_WORDS[name]


def run_train(args: argparse.Namespace) -> int:
    from ..tasks.lm import FROM_INIT, LMSettings, train_language_model
    from ..training import is_main_process

    given = given_settings(args, args.settings_flags)
    if args.init is not None:
        if args.resume:
            raise ValueError("--init starts a new run; --resume continues one: pass one")
        clash = [f for f in FROM_INIT if f in given]
        if clash:
            flag = "--" + clash[0].replace("_", "-")
            raise ValueError(f"{flag} comes from the run --init starts from "
                             f"({args.init}); leave it out")
    if args.resume:
        check_resume_flags(args.run_dir, "lm", given, args.settings_flags,
                           LM)
    settings = LMSettings(**given)
    if not args.resume:
        settings.resolved()  # refuse bad values before the run directory is touched
    # Also around the report: a Ctrl-C while it runs still says what is on disk.
    with reporting_stops("lm", args.run_dir, args):
        lm, _ = train_language_model(settings, args.run_dir, resume=args.resume,
                                     overwrite=args.overwrite, progress=not args.no_progress,
                                     save_every=args.save_every)
        # Under torchrun, rank 0 reports; the other ranks' work ended with training.
        if is_main_process():
            print(f"checkpoint: {args.run_dir}  (loss curve: {args.run_dir / 'loss.png'})")
            if args.sample:
                sample = lm.generate(args.sample, max_new_tokens=80)
                print(f"\nsample (greedy): {args.sample}{sample.text}")
    return 0


class _OutputGoneError(Exception):
    """Nobody reads stdout any more: generating further would be for nothing."""


def _print_piece(piece: str) -> None:
    print(piece, end="", flush=True)
    if getattr(sys.stdout, "lost", None):  # qkv's output guard: a closed pipe, a full disk
        raise _OutputGoneError


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from ..models.gpt import check_max_new_tokens, check_sampling
    from ..tasks.lm import LanguageModel

    # Before any output:
    check_max_new_tokens(args.max_new_tokens, "--max-new-tokens")
    check_sampling(args.temperature, args.top_k, args.seed, top_p=args.top_p, flags=True)
    if args.system is not None and not args.chat:
        raise ValueError("--system is the system message of a chat: pass --chat too")
    lm = LanguageModel.load(args.ckpt, device=args.device, bpe_dir=args.bpe_dir)
    try:
        # A chat prints the reply alone, not the rendered template (whose errors then come
        # before any output too); a plain prompt is printed once the tokenizer has taken it.
        if not args.chat:
            lm.encode_prompt(args.prompt)
            _print_piece(args.prompt)
        out = lm.generate(args.prompt, args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, use_cache=not args.no_kv_cache,
                          seed=args.seed, on_text=_print_piece, chat=args.chat,
                          system=args.system)
    except _OutputGoneError:
        return 0  # the command line says what became of stdout
    print()
    cache = "without" if args.no_kv_cache else "with"
    print(f"\n{out.new_tokens} tokens in {out.seconds:.2f} s: {out.tokens_per_sec:.1f} tokens/s "
          f"({cache} KV cache, {torch.get_num_threads()} threads)")
    return 0


def run_attention(args: argparse.Namespace) -> int:
    from ..tasks.lm import LanguageModel
    from ..utils.figures import check_image_path

    check_image_path(args.heatmap)
    lm = LanguageModel.load(args.ckpt, device=args.device, bpe_dir=args.bpe_dir)
    path = lm.heatmap(args.prompt, args.heatmap, layers=args.layers)
    print(f"heatmap written to {path}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ..tasks.lm import import_model

    lm = import_model(args.source, args.run_dir, dtype=args.dtype, bpe_dir=args.bpe_dir,
                      revision=args.revision, cache_dir=args.cache_dir,
                      overwrite=args.overwrite, log=print,
                      keep_quantized=args.keep_quantized)
    cfg = lm.model.cfg
    kv = f" ({cfg.kv_heads} key/value)" if cfg.kv_heads != cfg.n_heads else ""
    print(f"{cfg.n_layers} layers, {cfg.n_heads} heads{kv}, width "
          f"{cfg.emb_dim}, context {cfg.context_length:,}, {lm.tokenizer.n_vocab:,} ids; try: "
          f"qkv lm generate --ckpt {args.run_dir} --prompt \"Hello\"")
    return 0
