"""Make a random Llama of about 3B parameters as GGUF files, for issue 35's large model.

    PYTHONPATH=src:LCP LLAMA_CPP_LIB_PATH=LCP python scripts/make_3b_llama.py DIR TOKENIZER.gguf

Llama-3.2-3B's shape (28 layers, d 3072, 24 query heads and 8 key/value heads of 128,
SwiGLU MLP of 8192, RoPE theta 500,000, tied embedding), but the vocabulary of
``TOKENIZER.gguf`` (SmolLM2's 49,152 tokens rather than Llama 3's 128,256: llama.cpp and
``qkv lm import`` need a tokenizer with one token per embedding row, and the timing is
about the 28 blocks, 2.82B of the 2.97B parameters). Writes in ``DIR``:

- ``model-F32.gguf`` (11.9 GB), by qkv's own writer
  (:func:`qkv.models.gguf_model.write_gguf`) from the names and shapes of transformers'
  ``LlamaForCausalLM`` built on the meta device;
- ``model-{Q8_0,Q4_0,Q4_1,Q4_K_M,Q6_K}.gguf``, by llama.cpp's quantizer
  (``llama_model_quantize`` of llama-cpp-python) from the F32 file.

The weights are random and never all in memory: each 2-D tensor is a view into one
pool of normal values (std 0.02, transformers' ``initializer_range``) at its own
offset, so the whole state dict takes the pool's 0.8 GB; norms are ones. What is
measured on it (decode rate, memory) does not depend on the values, and the quantizers
see a Gaussian spread, as they see trained weights.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from bench_quant_decode import QUANTIZE, quantize_files  # this folder's

from qkv.models.gguf_model import write_gguf


def llama_3b_config(vocab_size: int) -> dict:
    """config.json of a Llama-3.2-3B-shaped model with ``vocab_size`` rows."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
            "bos_token_id": 1, "eos_token_id": 2}


def random_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face name -> tensor for ``config``: the names and shapes of transformers'
    ``LlamaForCausalLM`` (built on the meta device, nothing allocated); 2-D tensors are
    views into one shared pool of normal values, each at its own random offset."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if k != "lm_head.weight"}
    largest = max(torch.Size(s).numel() for s in shapes.values())
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(largest + 2**24, generator=generator) * config["initializer_range"]
    out = {}
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        if len(shape) == 1:
            out[name] = torch.ones(shape)
            continue
        start = int(torch.randint(0, len(pool) - numel + 1, (), generator=generator))
        out[name] = pool[start:start + numel].view(shape)
    return out


def main(folder: str, tokenizer: str) -> None:
    import gguf
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(gguf.GGUFReader(tokenizer).fields["tokenizer.ggml.tokens"].data)
    config = llama_3b_config(vocab)
    f32 = out / "model-F32.gguf"
    if not f32.exists():
        start = time.perf_counter()
        state = random_state_dict(config)
        params = sum(t.numel() for t in state.values())
        write_gguf(f32, config, state, "F32", tokenizer=tokenizer)
        print(f"{f32}: {params / 1e9:.3f}B parameters, {f32.stat().st_size / 1e9:.2f} GB "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        del state
    quantize_files(f32, out, {**QUANTIZE, "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"})

if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: make_3b_llama.py DIR TOKENIZER.gguf")
    main(*sys.argv[1:])
