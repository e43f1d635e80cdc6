"""``qkv bench``: measure every attention path against its peers.

    qkv bench attention                # batch 8 x 1,024 tokens x 768 dims, 12 heads
    qkv bench attention --sweep        # plus 128 ... 8,192 tokens at batch 1, eager vs fused
    qkv bench generate                 # GPT-2 small, 200 tokens, with and without KV cache,
                                       # float32 and bfloat16, % of the bandwidth ceiling
    qkv bench translate                # Bahdanau training against d2l's algorithm
    qkv bench data                     # sliding-window dataset against a list of tensors
    qkv bench flops                    # attention TFLOP/s at 8,192 tokens vs the matmul rate
    qkv bench train                    # GPT training tokens/s and MFU, with and without
                                       # bfloat16, torch.compile, eager attention
    qkv bench save                     # what a periodic checkpoint costs a training run
    qkv bench gguf                     # importing a 135M-parameter GGUF file of each
                                       # tensor type (Q4_K, Q5_0, IQ4_XS, MXFP4, ...)
    qkv bench linear                   # the gated delta rule, chunked and recurrent, beside
                                       # transformers' (and fla's) PyTorch forms
    qkv bench variants                 # sinks, gates, MLA, DSA and MoE: fast vs readable
                                       # path vs transformers, prompt and decoding
    qkv bench quality --ckpt RUN [RUN ...] --ref RUN_F32 --text FILE
                                       # a run's next-token distributions against a
                                       # reference run's: KL, perplexity, top-1 agreement
    qkv bench all --quick              # every suite on small shapes, in under two minutes

Each suite prints markdown tables (medians, min-max, ratios, targets) and writes
``SUITE.json`` and ``SUITE.png`` into ``--out``. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..checks import check_threads, show
from ..options import BENCH_DTYPES, MEMORY_MODES
from ..utils.fileio import check_writable

SUITES = ("attention", "generate", "translate", "data", "flops", "train", "save", "gguf",
          "linear", "variants")
# Most timed (or warm-up) runs per case: a median over more moves by less than the
# machine's own noise, while each run costs the case's whole time again.
MAX_REPEATS = 10_000


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmark attention paths, KV-cache generation, translator and GPT training, "
             "datasets",
        description="Time (median, min-max over interleaved repeats) and measure the peak "
                    "memory of qkv against its peers; write JSON and PNG files.",
        epilog="examples:\n" + "\n".join("  " + line.strip() for line in __doc__.splitlines()
                                          if line.strip().startswith("qkv bench")),
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true",
                        help="small shapes that run in seconds (smoke test, CI)")
    common.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per case (default: the suite's; at most "
                             f"{MAX_REPEATS:,})")
    common.add_argument("--warmup", type=int, default=None,
                        help="untimed runs per case first (default: the suite's)")
    common.add_argument("--device", default="auto",
                        help="auto (CUDA if available), cpu, cuda or cuda:N")
    common.add_argument("--dtype", choices=BENCH_DTYPES, default="auto",
                        help="auto: bfloat16 on CUDA, float32 on the CPU")
    common.add_argument("--memory", choices=MEMORY_MODES, default="isolated",
                        help="CPU peak memory: one fresh process per case (default, exact), "
                             "in this process (faster) or off")
    common.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    common.add_argument("--out", type=Path, default=Path("runs/bench"),
                        help="folder for SUITE.json and SUITE.png (default: runs/bench)")
    sweep_flag = argparse.ArgumentParser(add_help=False)
    sweep_flag.add_argument("--sweep", action="store_true",
                            help="also sweep 128 ... 8,192 tokens (batch 1, forward): "
                                 "time and memory of eager vs fused")
    compile_flag = argparse.ArgumentParser(add_help=False)
    compile_flag.add_argument("--no-compile", action="store_true",
                              help="run FlexAttention uncompiled (no C++ compiler or Triton "
                                   "needed; it then materialises the scores)")
    generate_flags = argparse.ArgumentParser(add_help=False)
    generate_flags.add_argument("--no-native", action="store_true",
                                help="run the cached steps through the model's forward "
                                     "(the readable path) instead of qkv's C kernels")
    generate_flags.add_argument("--ckpt", metavar="RUN", default=None,
                                help="decode this run's model (an imported open model or a "
                                     "trained GPT) with qkv in float32 and bfloat16 and with "
                                     "its peers, transformers and llama.cpp, where installed "
                                     "(default: the book's untrained GPT-2 small)")
    generate_flags.add_argument("--no-peers", action="store_true",
                                help="with --ckpt: time qkv's paths only")
    generate_flags.add_argument("--new-tokens", type=int, default=None, metavar="N",
                                help="tokens per timed call (default: 128 with --ckpt, "
                                     "200 without)")
    generate_flags.add_argument("--contexts", type=int, nargs="+", default=None, metavar="N",
                                help="with --ckpt: prompt lengths of the context sweep "
                                     "(default: 64 256 1024 2048)")
    train_flags = argparse.ArgumentParser(add_help=False)
    train_flags.add_argument("--presets", nargs="+", metavar="NAME", default=None,
                             help="GPT presets to train (default: tiny mini gpt2-small on "
                                  "the CPU, gpt2-small on CUDA)")
    train_flags.add_argument("--batch-size", type=int, default=None,
                             help="windows per step (default: 2 on the CPU, 16 on CUDA)")
    train_flags.add_argument("--context-length", type=int, default=None,
                             help="tokens per window (default: the preset's, at most 128 "
                                  "on the CPU)")
    train_flags.add_argument("--steps", type=int, default=None,
                             help="optimizer steps per timed epoch (default: about 1e11 "
                                  "model FLOPs on the CPU, 4e14 on CUDA)")
    train_flags.add_argument("--options", nargs="+", metavar="SET", default=None,
                             help="option sets, the first the baseline: 'default' or "
                                  "'+'-joined float32|bfloat16, compile, eager-attn, e.g. "
                                  "bfloat16+compile (default on the CPU: default bfloat16 "
                                  "compile eager-attn; on CUDA: default compile)")
    train_flags.add_argument("--max-seconds", type=float, default=None,
                             help="time budget of one case's timed epochs; at least one "
                                  "runs (default: 60)")
    train_flags.add_argument("--vocab-size", type=int, default=None,
                             help="vocabulary of every preset (default: GPT-2's 50,257)")

    gguf_flags = argparse.ArgumentParser(add_help=False)
    gguf_flags.add_argument("--types", nargs="+", default=None, metavar="TYPE",
                            help="GGML types to time, e.g. Q4_K Q5_0 IQ4_XS (default: every "
                                 "type qkv reads with the installed gguf package)")

    variants_flags = argparse.ArgumentParser(add_help=False)
    variants_flags.add_argument("--mechanisms", nargs="+", metavar="NAME", default=None,
                                help="which to time: mha sink gated latent sparse_latent moe "
                                     "(default: all)")
    variants_flags.add_argument("--tokens", type=int, default=None, metavar="N",
                                help="prompt length, and the tokens cached before a decoding "
                                     "step (default: 512)")
    variants_flags.add_argument("--long-cache", type=int, default=None, metavar="N",
                                help="tokens cached before MLA's long decoding step, 0: none "
                                     "(default: 4,096)")
    variants_flags.add_argument("--no-peers", action="store_true",
                                help="time qkv's paths only, not transformers' modules")

    quality_flags = argparse.ArgumentParser(add_help=False)
    quality_flags.add_argument("--ckpt", metavar="RUN", required=True, nargs="+",
                               help="the runs measured, each against --ref (e.g. qkv lm "
                                    "import --keep-quantized of each file)")
    quality_flags.add_argument("--ref", metavar="RUN_F32", required=True,
                               help="the reference run (the float32 import of the same model)")
    quality_flags.add_argument("--text", metavar="FILE", required=True,
                               help="a UTF-8 text of at least --tokens tokens")
    quality_flags.add_argument("--tokens", type=int, default=4096,
                               help="tokens of the text read (default: 4,096)")
    quality_flags.add_argument("--window", type=int, default=None,
                               help="tokens per chunk, the second half scored (default: "
                                    "512 or the context)")
    quality_flags.add_argument("--llama-cpp", action="store_true",
                               help="also compute them from llama.cpp's logits on the GGUF "
                                    "files the runs were imported from (llama-cpp-python)")

    suites = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    helps = {
        "attention": "ten attention paths: forward and forward+backward time, peak memory",
        "generate": "greedy decoding against the memory-bandwidth ceiling: GPT-2 small "
                    "with and without the KV cache, float32 and bfloat16; with --ckpt RUN, "
                    "the run's model beside transformers and llama.cpp",
        "translate": "Bahdanau translator training tokens/s against d2l's algorithm",
        "data": "sliding-window GPT dataset against a list of tensors: build time, memory",
        "flops": "attention TFLOP/s (SDPA backends, FlexAttention, qkv) at 8,192 tokens, "
                 "head dim 128, against the device's measured matmul rate",
        "train": "GPT presets trained through qkv's Trainer: tokens/s and % of the measured "
                 "matmul rate (MFU), with and without bfloat16, torch.compile and eager "
                 "attention",
        "save": "Trainer.save of GPT presets with AdamW state: seconds, MiB/s and the share "
                "of training a periodic checkpoint costs",
        "gguf": "qkv lm import of a 135M-parameter GGUF file of each tensor type: "
                "seconds, and qkv's decoders against the gguf package's",
        "linear": "Gated DeltaNet's delta rule, chunked and recurrent, against "
                  "transformers' and fla's PyTorch forms: time and peak memory, 512 to "
                  "32,768 tokens",
        "variants": "sinks, gated outputs, latent (MLA) and sparse (DSA) attention and "
                    "mixture-of-experts: each fast path against its readable one and "
                    "transformers' module on the same weights, over a prompt and one "
                    "decoding step; MLA decoding at 4,096 cached tokens",
        "quality": "a run against a reference run on a text, as llama-perplexity "
                   "--kl-divergence measures it: per-position KL divergence of the "
                   "next-token distributions (mean, 99th percentile), both perplexities, "
                   "top-1 agreement",
        "all": "every suite, one after the other (quality aside: it needs two runs)",
    }
    extra_flags = {"attention": [sweep_flag, compile_flag], "all": [sweep_flag, compile_flag],
                   "flops": [compile_flag], "train": [train_flags],
                   "generate": [generate_flags], "gguf": [gguf_flags],
                   "variants": [variants_flags], "quality": [quality_flags]}
    for name, text in helps.items():
        parents = [common, *extra_flags.get(name, [])]
        suite = suites.add_parser(name, parents=parents, help=text, description=text,
                                  epilog=f"example:\n  qkv bench {name} --quick")
        suite.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    for flag, lo in (("repeats", 1), ("warmup", 0)):
        value = getattr(args, flag)
        if value is not None and not lo <= value <= MAX_REPEATS:
            raise ValueError(f"--{flag} must be an integer in [{lo}, {MAX_REPEATS:,}], got "
                             f"{show(value)} (a median over more runs moves by less than "
                             "the machine's noise; each run costs the case's time again)")
    if args.threads is not None:
        check_threads(args.threads, "--threads")
    # Minutes of measuring must not end in a folder that cannot be written.
    check_writable(args.out, directory=True)


def _overrides(args: argparse.Namespace, *, warmup: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.repeats is not None:
        out["repeats"] = args.repeats
    if warmup and args.warmup is not None:
        out["warmup"] = args.warmup
    return out


def run_suite(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build the suite's config from the flags and run it; returns its report."""
    if name == "attention":
        from ..bench.attention import AttentionConfig, run_attention

        kwargs = {**_overrides(args), "device": args.device, "dtype": args.dtype,
                  "memory": args.memory, "sweep": args.sweep,
                  "compile_flex": not args.no_compile}
        config = AttentionConfig.quick(**kwargs) if args.quick else AttentionConfig(**kwargs)
        return run_attention(config, args.out)
    if name == "generate" and getattr(args, "ckpt", None):
        from ..bench.generate_run import RunGenerateConfig, run_generate_run

        if args.device not in ("auto", "cpu") or args.dtype != "auto":
            raise ValueError("--ckpt decodes on the CPU in float32 and bfloat16 (both, beside "
                             "the peers): leave --device and --dtype out")
        kwargs = {**_overrides(args), "ckpt": args.ckpt, "peers": not args.no_peers}
        if args.new_tokens is not None:
            kwargs["new_tokens"] = args.new_tokens
        if args.contexts is not None:
            kwargs["contexts"] = tuple(args.contexts)
        return run_generate_run(RunGenerateConfig(**kwargs), args.out)
    if name == "generate":
        from ..bench.lm import GenerateConfig, run_generate

        kwargs = {**_overrides(args), "device": args.device, "dtype": args.dtype}
        if getattr(args, "new_tokens", None) is not None:
            kwargs["new_tokens"] = args.new_tokens
        if getattr(args, "no_native", False):  # (absent under "all")
            kwargs["native"] = False
        config = GenerateConfig.quick(**kwargs) if args.quick else GenerateConfig(**kwargs)
        return run_generate(config, args.out)
    if name == "translate":
        from ..bench.translate import TranslateBenchConfig, run_translate

        if args.dtype not in ("auto", "float32"):
            raise ValueError(f"the translate suite trains in float32 as qkv's trainer does; "
                             f"--dtype {args.dtype} is not supported")
        kwargs = {**_overrides(args), "device": args.device}
        config = (TranslateBenchConfig.quick(**kwargs) if args.quick
                  else TranslateBenchConfig(**kwargs))
        return run_translate(config, args.out)
    if name == "flops":
        from ..bench.flops import FlopsConfig, run_flops

        # --memory does not apply: this suite measures rates, not memory. FlexAttention
        # compiles unless --no-compile (--quick alone keeps it uncompiled: seconds).
        kwargs = {**_overrides(args), "device": args.device, "dtype": args.dtype}
        if args.no_compile:
            kwargs["compile_flex"] = False
        config = FlopsConfig.quick(**kwargs) if args.quick else FlopsConfig(**kwargs)
        return run_flops(config, args.out)
    if name == "train":
        from ..bench.train import TrainBenchConfig, run_train

        # --memory does not apply (the memory check is a lower bound, not a measurement).
        # Under "all", the train-only flags are absent: the suite's defaults.
        kwargs = {**_overrides(args), "device": args.device, "dtype": args.dtype}
        for flag in ("presets", "batch_size", "context_length", "steps", "options",
                     "max_seconds", "vocab_size"):
            value = getattr(args, flag, None)
            if value is not None:
                kwargs[flag] = tuple(value) if isinstance(value, list) else value
        config = TrainBenchConfig.quick(**kwargs) if args.quick else TrainBenchConfig(**kwargs)
        return run_train(config, args.out)
    if name == "save":
        from ..bench.save import SaveBenchConfig, run_save

        # The CPU's copy of the state is what is written, whatever --device says.
        kwargs = _overrides(args, warmup=False)
        config = SaveBenchConfig.quick(**kwargs) if args.quick else SaveBenchConfig(**kwargs)
        return run_save(config, args.out)
    if name == "gguf":
        from ..bench.gguf_import import GGUFImportConfig, run_gguf_import

        # A file is read and imported on the CPU, in float32 (the decoders' own type).
        kwargs = _overrides(args)
        if getattr(args, "types", None):  # (absent under "all")
            kwargs["types"] = tuple(args.types)
        config = GGUFImportConfig.quick(**kwargs) if args.quick else GGUFImportConfig(**kwargs)
        return run_gguf_import(config, args.out)
    if name == "linear":
        from ..bench.linear_attention import LinearBenchConfig, run_linear

        # CPU float32, the families' head shapes; --memory picks how peaks are measured.
        kwargs = {**_overrides(args), "memory": args.memory}
        config = LinearBenchConfig.quick(**kwargs) if args.quick else LinearBenchConfig(**kwargs)
        return run_linear(config, args.out)
    if name == "quality":
        from ..bench.quality import QualityConfig, run_quality

        # CPU, each run in its stored dtype, logits compared in float64.
        return run_quality(QualityConfig(ckpt=args.ckpt, ref=args.ref, text=args.text,
                                         tokens=args.tokens, window=args.window,
                                         llama_cpp=args.llama_cpp), args.out)
    if name == "variants":
        from ..bench.variants import VariantsConfig, run_variants

        # CPU float32: the comparison the suite exists for (under "all" too); --memory
        # does not apply.
        if args.suite == "variants" and (args.device not in ("auto", "cpu")
                                         or args.dtype not in ("auto", "float32")):
            raise ValueError("the variants suite times float32 on the CPU: leave --device "
                             "and --dtype out")
        kwargs = _overrides(args)
        if "repeats" in kwargs:
            kwargs["decode_repeats"] = kwargs["repeats"]
        # Under "all", the variants-only flags are absent: the suite's defaults.
        for flag, field in (("mechanisms", "mechanisms"), ("tokens", "tokens"),
                            ("long_cache", "long_cache")):
            value = getattr(args, flag, None)
            if value is not None:
                kwargs[field] = tuple(value) if isinstance(value, list) else value
        if getattr(args, "no_peers", False):
            kwargs["peers"] = False
        config = VariantsConfig.quick(**kwargs) if args.quick else VariantsConfig(**kwargs)
        return run_variants(config, args.out)
    from ..bench.data import DataBenchConfig, run_data

    # Building a dataset is CPU work whatever --device says; there is no warm-up either:
    # every build runs in a fresh process, which is the point.
    kwargs = {**_overrides(args, warmup=False), "memory": args.memory}
    config = DataBenchConfig.quick(**kwargs) if args.quick else DataBenchConfig(**kwargs)
    return run_data(config, args.out)


def run(args: argparse.Namespace) -> int:
    import torch

    _check(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = SUITES if args.suite == "all" else (args.suite,)
    reports = {}
    for i, name in enumerate(names):
        if i:
            print()
        reports[name] = run_suite(name, args)
    if len(names) > 1:
        note = " (--quick shapes: the targets are defined for the default sizes)"
        print(f"\nall targets{note if args.quick else ''}:")
        for name, report in reports.items():
            for target in report.get("targets", []):
                print(f"  {'MET   ' if target['met'] else 'MISSED'} [{name}] {target['name']}: "
                      f"{target['value_text']}")
    return 0
