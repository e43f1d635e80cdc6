"""Make the benchmark models of the new layer kinds: random weights in each family's shape,
made with transformers' own classes, saved as Hugging Face folders and imported as qkv
runs (``qkv lm import``), for ``qkv bench generate --ckpt RUN``.

Seven models of about 0.3-0.6 B parameters (``--tiny``: a few hundred thousand, for a
smoke run), one per family, each with room for 8,192 + 256 tokens (the context sweep's
longest prompt and the tokens decoded after it), a vocabulary of 32,000 ids and a
word-level tokenizer over them (the benchmark's prompt is a few of its words):

- ``deepseek_v2_lite``: DeepSeek-V2-Lite's shape (27 layers of latent attention with no
  query compression, a 512-wide latent and a 64-wide RoPE key; two dense layers, then
  experts: 2 shared and 6 of 12 routed, 192 wide), written with ``DeepseekV3Config`` (the
  class qkv imports; V2's softmax router is V3's sigmoid one here);
- ``deepseek_v32``: DeepSeek-V3.2's (query compression, sparse attention: an indexer of
  8 heads picks each query's 2,048 best cached positions; experts grouped V3's way);
- ``gpt_oss``: gpt-oss's (a learned sink per head, sliding (128) and full layers
  alternating, 4 of 16 experts with biases, clamped SwiGLU);
- ``qwen3_5``: Qwen3.5's DeltaNet hybrid (three Gated DeltaNet layers to one gated
  full-attention layer turning a quarter of each 256-wide head; dense MLPs; tied);
- ``qwen3_next``: Qwen3-Next's (the same hybrid with 8 of 32 experts and a gated shared
  expert in every layer);
- ``gemma4``: Gemma 4's text model with KV sharing (five sliding (512) layers to one full,
  full layers with 512-wide heads whose values are their keys; the last third of the
  layers attend with the cache of the last earlier layer of their kind, with twice wider
  MLPs) and per-layer inputs (128 wide; transformers 5.24 fails on a KV-sharing
  Gemma 4 without them);
- ``llama``: a plain GQA Llama of the same size, the context sweep's reference.

Each model's matrices are random (transformers' initialisation, seeded), its norms moved
off 1 (so that a norm applied the wrong way could not go unseen). Nothing is downloaded.

Usage (each model takes about 2-5 GB on disk as a run; ``--keep-hf`` keeps the folders
too, as much again)::

    python scripts/make_family_models.py /tmp/fam34               # all seven
    python scripts/make_family_models.py /tmp/fam34 --only gpt_oss llama
    python scripts/make_family_models.py /tmp/fam34-tiny --tiny   # a smoke run, seconds

Then, on a quiet machine, each benchmark (batch 1, 128 new tokens, float32 and bfloat16,
beside transformers; llama.cpp where installed and written; 2 threads), with the context
sweep from 64 to 8,192 cached tokens::

    for m in deepseek_v2_lite deepseek_v32 gpt_oss qwen3_5 qwen3_next gemma4 llama; do
        OMP_NUM_THREADS=2 flock /work/notes/bench.lock qkv bench generate \\
            --ckpt /tmp/fam34/$m/run --threads 2 --repeats 3 \\
            --contexts 64 256 1024 2048 4096 8192 --out results/generate-run/$m
    done

Each writes ``generate-run.json`` and ``generate-run.png`` (the context sweep in the
right panel; for the latent-attention models a "MLA decompressed" line beside the
absorbed one). Making the seven models takes about 10 minutes and 20 GB of disk; each
benchmark 10-20 minutes on 2 cores (most of it the sweep's 4,096- and 8,192-token
prompts on the slower paths: transformers, the model forward, decompressed MLA).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qkv.bench.generate_run import PROMPT

VOCAB = 32_000
CONTEXT = 8192 + 256  # the sweep's longest prompt and what is decoded after it
PROMPT_WORDS = PROMPT.replace(",", " ,").split()  # the benchmark's prompt, word by word


def _configs(tiny: bool) -> dict[str, Callable[[], Any]]:
    """family -> a function making its transformers config (``tiny``: the same shape at a
    hundredth of the size)."""
    import transformers

    def pick(full: int, small: int) -> int:
        return small if tiny else full

    vocab = pick(VOCAB, 512)
    common = {"vocab_size": vocab, "max_position_embeddings": CONTEXT, "pad_token_id": 0,
              "eos_token_id": 1, "bos_token_id": None, "rms_norm_eps": 1e-6}
    hidden = pick(1024, 64)
    latent = {"kv_lora_rank": pick(512, 32), "qk_rope_head_dim": pick(64, 8),
              "qk_nope_head_dim": pick(128, 16), "v_head_dim": pick(128, 16)}
    hybrid = {"head_dim": pick(256, 32), "linear_num_key_heads": pick(8, 2),
              "linear_num_value_heads": pick(16, 4), "linear_key_head_dim": pick(128, 16),
              "linear_value_head_dim": pick(128, 16), "linear_conv_kernel_dim": 4,
              "num_attention_heads": pick(8, 4), "num_key_value_heads": 2,
              "hidden_size": hidden, "partial_rotary_factor": 0.25}
    layers_hybrid = pick(16, 4)
    hybrid_types = ["linear_attention" if (i + 1) % 4 else "full_attention"
                    for i in range(layers_hybrid)]
    gemma_layers = pick(18, 6)
    return {
        "deepseek_v2_lite": lambda: transformers.DeepseekV3Config(
            **common, **latent, hidden_size=hidden, intermediate_size=pick(5632, 96),
            # 27 layers, V2-Lite's: llama.cpp tells a model without q_lora_rank by them
            num_hidden_layers=pick(27, 3), num_attention_heads=pick(16, 4),
            num_key_value_heads=pick(16, 4), q_lora_rank=None,
            n_routed_experts=pick(12, 8), num_experts_per_tok=pick(6, 2),
            n_shared_experts=2, moe_intermediate_size=pick(192, 16), n_group=1,
            topk_group=1, first_k_dense_replace=pick(2, 1), norm_topk_prob=False,
            routed_scaling_factor=1.0, tie_word_embeddings=False),
        "deepseek_v32": lambda: transformers.DeepseekV32Config(
            **common, **latent, hidden_size=hidden, intermediate_size=pick(4096, 96),
            num_hidden_layers=pick(12, 3), num_attention_heads=pick(16, 4),
            num_key_value_heads=pick(16, 4), q_lora_rank=pick(384, 24),
            n_routed_experts=pick(24, 8), num_experts_per_tok=pick(4, 2),
            n_shared_experts=1, moe_intermediate_size=pick(384, 16), n_group=pick(4, 2),
            topk_group=pick(2, 1), first_k_dense_replace=pick(3, 1),
            index_n_heads=pick(8, 2), index_head_dim=pick(128, 16),
            index_topk=pick(2048, 8), tie_word_embeddings=False),
        "gpt_oss": lambda: transformers.GptOssConfig(
            **common, hidden_size=pick(768, 64), intermediate_size=pick(768, 32),
            num_hidden_layers=pick(12, 2), num_attention_heads=pick(12, 4),
            num_key_value_heads=pick(4, 2), head_dim=pick(64, 16),
            num_local_experts=pick(16, 4), num_experts_per_tok=pick(4, 2),
            sliding_window=pick(128, 8), tie_word_embeddings=False,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(pick(12, 2))],
            # YaRN's correction range rounded to whole dimensions, as llama.cpp always
            # computes it (a GGUF file cannot say otherwise): llama.cpp runs this model
            rope_parameters={**transformers.GptOssConfig().rope_parameters,
                             "truncate": True}),
        "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
            **common, **hybrid, intermediate_size=pick(3584, 96),
            num_hidden_layers=layers_hybrid, layer_types=hybrid_types,
            tie_word_embeddings=True),
        "qwen3_next": lambda: transformers.Qwen3NextConfig(
            **common, **hybrid, intermediate_size=pick(3584, 96),
            num_hidden_layers=pick(12, 4), layer_types=hybrid_types[:pick(12, 4)],
            num_experts=pick(32, 4), num_experts_per_tok=pick(8, 2),
            moe_intermediate_size=pick(256, 16), shared_expert_intermediate_size=pick(512, 32),
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
            tie_word_embeddings=False),
        "gemma4": lambda: transformers.Gemma4TextConfig(
            **common, hidden_size=hidden, intermediate_size=pick(3072, 64),
            num_hidden_layers=gemma_layers, num_attention_heads=pick(8, 4),
            num_key_value_heads=pick(2, 2), head_dim=pick(256, 16),
            global_head_dim=pick(512, 32), num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=pick(512, 6),
            layer_types=["sliding_attention" if (i + 1) % pick(6, 3) else "full_attention"
                         for i in range(gemma_layers)],
            num_kv_shared_layers=gemma_layers // 3, use_double_wide_mlp=True,
            hidden_size_per_layer_input=pick(128, 8), vocab_size_per_layer_input=vocab,
            enable_moe_block=False,
            final_logit_softcapping=30.0, tie_word_embeddings=True),
        "llama": lambda: transformers.LlamaConfig(
            **common, hidden_size=hidden, intermediate_size=pick(4096, 96),
            num_hidden_layers=pick(20, 2), num_attention_heads=pick(16, 4),
            num_key_value_heads=4 if not tiny else 2, head_dim=pick(64, 16),
            tie_word_embeddings=False),
    }


FAMILIES = ("deepseek_v2_lite", "deepseek_v32", "gpt_oss", "qwen3_5", "qwen3_next", "gemma4",
            "llama")


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of ``vocab_size`` ids: the prompt's words, then ``t{i}``."""
    import tokenizers

    words = list(dict.fromkeys(["<pad>", "<eos>", *PROMPT_WORDS]))
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(vocab), vocab_size)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=f"t{vocab_size - 1}"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tok


def make(family: str, out: Path, tiny: bool, keep_hf: bool, seed: int) -> dict[str, Any]:
    """Make ``family``'s model under ``out / family`` (``hf/``, ``run/``); returns its
    parameter counts."""
    import transformers

    from qkv.cli import main
    from qkv.models.moe import MoE
    from qkv.tasks.lm import LanguageModel

    root = out / family
    if (root / "run").exists():
        raise FileExistsError(f"{root / 'run'}: exists; remove it or name another directory")
    config = _configs(tiny)[family]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf = root / "hf"
    model.save_pretrained(hf)
    del model
    word_tokenizer(config.vocab_size).save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>",
                                                          "pad_token": "<pad>"}))
    if main(["lm", "import", str(hf), "--run-dir", str(root / "run")]) != 0:
        raise RuntimeError(f"{family}: qkv lm import failed")
    if not keep_hf:
        shutil.rmtree(hf)
    qkv_model = LanguageModel.load(str(root / "run")).model
    total = sum(p.numel() for p in qkv_model.parameters())
    moe = [m for m in qkv_model.modules() if isinstance(m, MoE)]
    active = total - sum(sum(p.numel() for p in m.parameters()) - m.active_parameters()
                         for m in moe)
    return {"family": family, "parameters": total, "active_parameters": active,
            "context": qkv_model.cfg.context_length}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to make the models in")
    parser.add_argument("--only", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--tiny", action="store_true",
                        help="each family's shape at a tiny size (a smoke run)")
    parser.add_argument("--keep-hf", action="store_true",
                        help="keep the Hugging Face folders beside the runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.only:
        facts = make(family, args.out, args.tiny, args.keep_hf, args.seed)
        print(f"{family}: {facts['parameters']:,} parameters "
              f"({facts['active_parameters']:,} active per token), context "
              f"{facts['context']:,} -> {args.out / family / 'run'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
