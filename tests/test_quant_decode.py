"""Native decoding of a model whose layers keep their weights in GGML blocks.

A tiny Llama-style GPTModel gets every linear layer and its token embedding replaced by
a test-local layer that holds GGUF blocks (``qtype``, ``blocks``: the attributes
qkv.models.native_decode reads), one block type per matrix, mixed as a Q4_K_M file mixes
them. The reference is the same model with the blocks expanded by gguf's own decoder,
run in float64 by PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.kernels import QUANT_TYPES, decode_kernels, unavailable_reason
from qkv.models.gpt import GPTConfig, GPTModel, generate, native_unsupported
from qkv.models.native_decode import NativeDecoder

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

needs_kernels = pytest.mark.skipif(decode_kernels() is None, reason=f"no native kernels: "
                                   f"{unavailable_reason()}")
WRITABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def to_blocks(w: Tensor, qtype: str, seed: int) -> np.ndarray:
    """uint8 (rows, row bytes): w quantized by gguf, or (types gguf cannot write) random
    blocks whose values have about w's spread."""
    if qtype in WRITABLE:
        return quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType[qtype])
    rng = np.random.default_rng(seed)
    rows, n = w.shape
    _, values, size = QUANT_TYPES[qtype]
    raw = rng.integers(0, 256, (rows, n // values, size), dtype=np.uint8)
    # K-types' values are d * scale * u (- dmin * min), scale up to 63 and u up to 31
    at, d = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 1e-4)}[qtype]
    for offset in at:
        scale = (np.abs(rng.standard_normal((rows, n // values))) * d).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, n // values, 2)
    return raw.reshape(rows, -1)


class Blocks(nn.Module):
    """A linear or embedding layer keeping its weight in GGUF blocks; its forward (the
    module path) expands them with gguf's decoder."""

    def __init__(self, layer: nn.Module, qtype: str, seed: int) -> None:
        super().__init__()
        self.qtype = qtype
        self.embedding = isinstance(layer, nn.Embedding)
        self.register_buffer("blocks", torch.from_numpy(to_blocks(layer.weight, qtype, seed)))
        if self.embedding:
            self.num_embeddings, self.embedding_dim = layer.weight.shape
        else:
            self.out_features, self.in_features = layer.weight.shape
            self.bias = layer.bias

    def expanded(self) -> Tensor:
        return torch.from_numpy(dequantize(self.blocks.numpy(),
                                           gguf.GGMLQuantizationType[self.qtype]))

    @property
    def weight(self) -> Tensor:
        # what code asking a layer for its weight's dtype and device reads
        return self.expanded()

    def forward(self, x):
        w = self.expanded()
        return F.embedding(x, w) if self.embedding else F.linear(x, w.to(x.dtype), self.bias)


# per layer: the type of each matrix (None: left float32), as a Q4_K_M file mixes them
MIX = [dict(W_query="Q4_K", W_key="Q5_K", W_value="Q6_K", out_proj="Q8_0",
            fc1="Q4_0", fc2="Q4_1", fc3="Q5_0"),
       dict(W_query="Q5_1", W_key=None, W_value="Q8_0", out_proj="Q4_K",
            fc1="Q6_K", fc2="Q4_K", fc3="Q6_K")]


def quantized_model(head: str | None = "Q8_0") -> GPTModel:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, context_length=64, emb_dim=256, n_heads=4, n_layers=2,
                    n_kv_groups=2, hidden_dim=512, drop_rate=0.0, rope=True,
                    norm="rmsnorm", mlp="swiglu", out_bias=False, mlp_bias=False,
                    qkv_bias=True, tie_weights=False)
    model = GPTModel(cfg).eval()
    with torch.no_grad():
        # Norm scales away from their ones: a quantized embedding's values are small
        # integers times shared scales, so with unit norm scales many inputs x_j / max|x_b|
        # are simple fractions and x_j * 127 / max|x_b| lands on a rounding tie (63.5),
        # which float rounding then breaks either way.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    seed = 0
    for block, mix in zip(model.trf_blocks, MIX, strict=True):
        for name, qtype in mix.items():
            owner = block.att if hasattr(block.att, name) else block.ff
            if qtype is not None:
                seed += 1
                setattr(owner, name, Blocks(getattr(owner, name), qtype, seed))
    model.tok_emb = Blocks(model.tok_emb, "Q6_K", 99)
    if head is not None:
        model.out_head = Blocks(model.out_head, head, 100)
    return model


def expanded_float64(model: GPTModel, quantize_inputs: bool = False) -> GPTModel:
    """The same model with every Blocks layer replaced by its float64 expansion; with
    ``quantize_inputs``, each such linear layer's input goes through
    :func:`eight_bits` first, as the kernels quantize it."""
    copy = GPTModel(model.cfg).eval().double()
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, Blocks):
            state[f"{name}.weight"] = m.expanded().double()
            if not m.embedding and m.bias is not None:
                state[f"{name}.bias"] = m.bias.double()
            if quantize_inputs and not m.embedding:
                copy.get_submodule(name).register_forward_pre_hook(
                    lambda _, args: (eight_bits(args[0]),))
    for name, t in model.state_dict().items():
        if not name.endswith(".blocks"):
            state[name] = t.double()
    copy.load_state_dict(state)
    return copy


def eight_bits(x: Tensor) -> Tensor:
    """x (..., n) quantized to 8 bits per block of 32 and expanded back (float64): the
    kernels' d = max |x_b| / 127, q = round-half-even(x * (127 / max |x_b|)) in float32."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    return (q.double() * (amax / 127.0).double()).flatten(-2)


@needs_kernels
@pytest.mark.parametrize("head", ["Q8_0", None], ids=["q8_head", "f32_head"])
def test_quantized_model_decodes_the_float64_models_greedy_tokens(head):
    model = quantized_model(head)
    assert native_unsupported(model) is None
    ref = expanded_float64(model)
    idx = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    native = generate(model, idx, 40, native=True)
    with torch.no_grad():
        logits = ref(native)[0, 4:-1]  # the float64 model's next-token logits
    # native logits, step by step, against the float64 model's: x is quantized to 8 bits
    # per block of 32 before each product (a relative error of up to 1/254 of a block's
    # largest value per x); here, through two layers, up to 6 % of the logits' spread
    # (1 % on average). With the same quantization of each product's input, the float64
    # model agrees to rounding (a rounding may move a value to the next 8-bit step: far
    # fewer than 1 % of the spread).
    # (every position through the steps, the prompt's too, so every key and value in
    # the caches comes from quantized inputs). The same-input comparison covers the first
    # 12 positions: an input whose x * 127 / max |x_b| falls within float32 rounding of a
    # half (k + 1/2) may round either way on the two sides, which moves that step by a
    # step of 8 bits, and the caches carry it on; over 12 positions none does here.
    decoder = NativeDecoder(model, model.new_caches(1, 64))
    with torch.no_grad():
        steps = torch.stack([decoder.step(int(t))[0, 0].clone() for t in native[0, :-1]])
        same_inputs = expanded_float64(model, quantize_inputs=True)(native)[0, :-1]
    steps, same_inputs = steps[4:], same_inputs[4:]
    spread = logits.std().item()
    err = (steps.double() - logits).abs()
    assert err.max().item() < 0.1 * spread and err.mean().item() < 0.02 * spread
    assert (steps[:8].double() - same_inputs[:8]).abs().max().item() < 1e-3 * spread
    # every greedy choice whose margin is over twice that step's largest logit error
    # (so that the error cannot flip it) is the float64 model's
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err.amax(-1)
    assert clear.sum() > 30
    assert torch.equal(native[0, 5:][clear], logits.argmax(-1)[clear])
    # and the module path (expanding the blocks each forward, activations unquantized)
    # gives the float64 model's logits to float32 rounding
    with torch.no_grad():
        module = model(native)[0, 4:-1]
    assert (module.double() - logits).abs().max().item() < 1e-4 * spread


@needs_kernels
def test_unknown_block_types_are_refused():
    model = quantized_model()
    model.out_head.qtype = "IQ2_XXS"
    assert "IQ2_XXS" in native_unsupported(model)
    with pytest.raises(ValueError, match="do not read 'IQ2_XXS'"):
        NativeDecoder(model, model.new_caches(1, 64))
