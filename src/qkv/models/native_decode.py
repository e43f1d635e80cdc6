"""One-token decoding steps of a :class:`~qkv.models.gpt.GPTModel` on qkv's C kernels.

With a KV cache, each step of :func:`qkv.models.gpt.generate` feeds one token through
the model, which multiplies it by every weight matrix once: the step's time is the time
to stream the weights from memory. On the CPU the module path (``model(ids,
caches=...)``) falls well short of that: PyTorch's matrix-vector kernels stream the
weights slower than memory allows (and in bfloat16, on a CPU without bfloat16
instructions, slower than in float32), and each layer issues some 20 to 40 operations
from Python. :class:`NativeDecoder` runs the same maths as one call per token into
:mod:`qkv.kernels` (``decode.c``'s ``qkv_step``): the weights are read where the model
keeps them, float32 or bfloat16, and the activations stay float32. Nothing is copied
but the few small vectors (biases, norm scales) of a bfloat16 model, widened to float32,
and each RoPE layer's cos/sin table, kept in float32. ``docs/benchmarks.md``
("Generation") has the measurements.

The step, per layer, with ``x`` the residual stream (float32, ``emb_dim``), is the
block's forward for one token (:class:`~qkv.models.gpt.TransformerBlock`):

    h = norm1(x);  q, k, v = W_q h (+b), W_k h (+b), W_v h (+b)
    q, k = q_norm(q), k_norm(k) per head;  rotate q, k to the token's position (RoPE)
    write k, v into the layer's KVCache (a ring for a sliding-window layer)
    a = softmax(q K^T * scale) V, each query head on its key/value group's cache (GQA)
    x += post_norm1(W_o a (+b));  h = norm2(x)
    x += post_norm2(W_3 (act(W_1 h) [* W_2 h]))

with LayerNorm or RMSNorm (Gemma's ``1 + w`` folded into a float32 scale), GELU or SiLU,
the optional pieces where the model has them, and ``x = tok_emb[token] * embed_scale
(+ pos_emb[pos])`` before and ``logits = out_head(final_norm(x))`` after. It is the module
path's maths in another summation order, so logits agree to rounding
(``tests/test_native_decode.py`` checks both against the float64 model). Only the
one-token steps run here: the prompt (as matrix products), and the re-fill of a full
cache, go through the module path and the same caches.

A layer may keep its weight in GGML's quantized blocks, as a GGUF file stores them (a
module with ``qtype``, the type's name, and ``blocks``, uint8 ``(rows, row bytes)``:
:class:`~qkv.models.quantized.QuantizedLinear` and ``QuantizedEmbedding``). The kernels
then read the blocks in place, with the activations quantized to 8 bits per block of 32
for each product (``kernels/quant.c``): logits agree with the float64 model on the
dequantized weights to that quantization, not to rounding
(``tests/test_quant_decode.py``). Any mix of types, per matrix, is fine.

:func:`qkv.models.gpt.native_unsupported` says why a model cannot be decoded here (None
when it can): the kernels must load (:func:`qkv.kernels.unavailable_reason`), and the
model must be a plain ``GPTModel`` built from its own classes (no forward hooks), on
the CPU in float32 or bfloat16, at batch 1. This module reads the model by its attribute
names and knows nothing else of it (``gpt.py`` imports it, not the other way round).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor, nn

from ..kernels import (
    ACT_GELU,
    ACT_SILU,
    NORM_LAYER,
    NORM_NONE,
    NORM_RMS,
    Layer,
    Mat,
    Model,
    Norm,
    decode_kernels,
    quant_type_code,
    unavailable_reason,
)
from ..kv_cache import KVCache
from ..positional import rope_angles

__all__ = ["DTYPES", "NativeDecoder"]

# the weight dtypes the kernels read, and their codes in decode.c
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _vector(t: Tensor | None) -> Tensor | None:
    """A float32 contiguous copy of a small parameter (the parameter itself if it is one)."""
    return None if t is None else t.detach().float().contiguous()


class NativeDecoder:
    """Decode one token at a time through ``caches`` with the C kernels.

    Args:
        model: a :class:`~qkv.models.gpt.GPTModel` that
            :func:`~qkv.models.gpt.native_unsupported` accepts (in eval mode: no dropout
            here).
        caches: the model's caches (:meth:`GPTModel.new_caches` at batch 1), filled by
            the module path with the tokens so far; :meth:`step` appends to them.

    The decoder holds the addresses of the model's parameters and the caches' buffers
    (``decode.c``'s ``qkv_model``): use it only while neither is replaced or resized
    (one :func:`generate` call).
    """

    def __init__(self, model: nn.Module, caches: list[KVCache]) -> None:
        lib = decode_kernels()
        if lib is None:
            raise ValueError(f"cannot decode natively: {unavailable_reason()}")
        if caches and caches[0].keys.shape[0] != 1:
            raise ValueError(f"one sequence at a time, got a batch of {caches[0].keys.shape[0]}")
        if len(caches) != len(model.trf_blocks):
            raise ValueError(f"need one KVCache per layer ({len(model.trf_blocks)}), "
                             f"got {len(caches)}")
        self.lib = lib
        self.model, self.caches = model, caches
        # the float dtype the model computes in (its norms', biases' and caches')
        self.dtype = model.final_norm.scale.dtype
        self.threads = torch.get_num_threads()
        cfg = model.cfg
        att0 = model.trf_blocks[0].att
        heads, kv_heads, head_dim = att0.num_heads, att0.num_kv_groups, att0.head_dim
        for block, cache in zip(model.trf_blocks, caches, strict=True):
            window = block.att.window_size
            if (cache.keys.dtype != self.dtype or not cache.keys.is_contiguous()
                    or not cache.values.is_contiguous() or cache.ring != (window is not None)
                    or (window is not None and cache.max_len != window)
                    or cache.keys.shape[1] != kv_heads
                    or cache.keys.shape[3] != head_dim or cache.values.shape[3] != head_dim
                    or cache.pos != caches[0].pos):
                raise ValueError(f"caches must be the model's own (new_caches), got {cache!r}")
        # The last position a step may take: a full cache's length (all are one length),
        # and learned positions' table; a model of ring caches and RoPE has no end.
        full = [cache.max_len for cache in caches if not cache.ring]
        ends = full + ([cfg.context_length] if model.pos_emb is not None else [])
        self.limit = min(ends) if ends else None
        first = model.trf_blocks[0].ff
        hidden = (first.fc1 if hasattr(first, "fc1") else first.layers[0]).out_features
        longest = max(cache.max_len for cache in caches)
        # Every tensor whose address the kernels get, kept alive with the decoder.
        self._keep: list[Tensor] = []
        buffers = {name: self._zeros(size) for name, size in (
            ("x", cfg.emb_dim), ("o", cfg.emb_dim), ("h", cfg.emb_dim),
            ("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim),
            ("a", heads * head_dim), ("f", hidden), ("logits", cfg.vocab_size),
            ("scores", heads * longest))}
        self.logits = buffers["logits"].view(1, 1, cfg.vocab_size)
        self._rope: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._rope_len = 0
        self._layers = (Layer * cfg.n_layers)(*(self._layer(b, c) for b, c in
                                                 zip(model.trf_blocks, caches, strict=True)))
        embed_scale = 1.0
        if cfg.embed_scale:  # rounded to the weights' dtype, as the module path rounds it
            embed_scale = float(torch.tensor(cfg.emb_dim ** 0.5, dtype=self.dtype))
        scale = att0.scale if att0.scale is not None else 1.0 / math.sqrt(head_dim)
        act = ACT_SILU if isinstance(getattr(first, "act", None), nn.SiLU) else ACT_GELU
        self.struct = Model(
            dt=DTYPES[self.dtype], n_layers=cfg.n_layers, act=act, dim=cfg.emb_dim,
            hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            vocab=cfg.vocab_size, scale=scale, embed_scale=embed_scale,
            tok_emb=self._weight(model.tok_emb), pos_emb=self._weight(model.pos_emb),
            head=self._weight(model.out_head), final_norm=self._norm(model.final_norm),
            layers=self._layers, **{name: t.data_ptr() for name, t in buffers.items()})
        self._grow_rope(caches[0].pos + 1)

    # -- addresses of parameters and buffers ----------------------------------------

    def _zeros(self, size: int) -> Tensor:
        t = torch.zeros(size, dtype=torch.float32)
        self._keep.append(t)
        return t

    def _hold(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        self._keep.append(t)
        return t.data_ptr()

    def _weight(self, layer: nn.Module | Tensor | None) -> Mat:
        """A linear or embedding layer's weight matrix (or a bare weight tensor) as the
        kernels read it: its address and type (``Mat()``, no matrix, for None). A layer
        with ``blocks`` is read in its GGML blocks (its ``weight``, if it has one, would
        expand them)."""
        if layer is None:
            return Mat()
        blocks = None if isinstance(layer, Tensor) else getattr(layer, "blocks", None)
        if blocks is not None:
            columns = getattr(layer, "in_features", None) or layer.embedding_dim
            code = quant_type_code(layer.qtype, columns)
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
                raise ValueError(f"blocks must be contiguous uint8 (rows, row bytes), got "
                                 f"{blocks.dtype} {tuple(blocks.shape)}")
            return Mat(data=self._hold(blocks), type=code)
        w = layer if isinstance(layer, Tensor) else layer.weight
        if not w.is_contiguous():
            raise ValueError("weights must be contiguous (nn.Linear's (out, in) layout)")
        return Mat(data=self._hold(w.detach()), type=DTYPES[w.dtype])

    def _norm(self, norm: nn.Module | None) -> Norm:
        """A norm module read by its attributes: ``shift`` makes it a LayerNorm, ``gemma``
        an RMSNorm whose scale is ``1 + w``."""
        if norm is None:
            return Norm(kind=NORM_NONE)
        if hasattr(norm, "shift"):
            return Norm(kind=NORM_LAYER, eps=norm.eps, scale=self._hold(_vector(norm.scale)),
                        shift=self._hold(_vector(norm.shift)))
        scale = _vector(norm.scale)
        if norm.gemma:
            scale = 1.0 + scale
        return Norm(kind=NORM_RMS, eps=norm.eps, scale=self._hold(scale))

    def _layer(self, block: nn.Module, cache: KVCache) -> Layer:
        att, ff = block.att, block.ff
        # gated: act(fc1 h) * fc2 h, then fc3; GPT-2's: act(layers[0] h), then layers[2]
        mlp = (ff.fc1, ff.fc2, ff.fc3) if hasattr(ff, "fc1") else \
            (ff.layers[0], None, ff.layers[2])
        linears = dict(zip(("q", "k", "v", "o", "1", "2", "3"),
                           (att.W_query, att.W_key, att.W_value, att.out_proj, *mlp),
                           strict=True))
        return Layer(
            **{f"w{n}": self._weight(m) for n, m in linears.items()},
            **{f"b{n}": None if m is None else self._hold(_vector(m.bias))
               for n, m in linears.items()},
            norm1=self._norm(block.norm1), norm2=self._norm(block.norm2),
            post_norm1=self._norm(block.post_norm1), post_norm2=self._norm(block.post_norm2),
            q_norm=self._norm(att.q_norm), k_norm=self._norm(att.k_norm),
            keys=self._hold(cache.keys), values=self._hold(cache.values),
            cache_len=cache.max_len, ring=int(cache.ring))

    def _grow_rope(self, length: int) -> None:
        """Give every RoPE layer a float32 cos/sin table of at least ``length`` positions
        (one table per distinct base and scaling, doubled on growth)."""
        if length <= self._rope_len:
            return
        n = max(length, 2 * self._rope_len, 256)
        if self.limit is not None:
            n = max(length, min(n, self.limit))
        self._rope = {}
        for block, layer in zip(self.model.trf_blocks, self._layers, strict=True):
            att = block.att
            if not att.rope:
                continue
            key = (att.rope_base, repr(att.rope_scaling))
            if key not in self._rope:
                cos, sin = rope_angles(torch.arange(n), att.head_dim, att.rope_base,
                                       att.rope_scaling)
                self._rope[key] = (cos.float().contiguous(), sin.float().contiguous())
            cos, sin = self._rope[key]
            layer.rope_cos, layer.rope_sin = cos.data_ptr(), sin.data_ptr()
        self._rope_len = n

    # -- one step -------------------------------------------------------------------

    def step(self, token: int) -> Tensor:
        """Append ``token`` at the caches' position; its next-token logits ``(1, 1, vocab)``
        (float32, a buffer the next step overwrites)."""
        pos = self.caches[0].pos
        if self.limit is not None and pos >= self.limit:
            raise ValueError(f"the caches are full ({pos} of {self.limit} positions)")
        if not 0 <= token < self.struct.vocab:
            raise ValueError(f"token id {token} is outside the vocabulary of "
                             f"{self.struct.vocab}")
        self._grow_rope(pos + 1)
        self.lib.qkv_step(ctypes.byref(self.struct), token, pos, self.threads)
        for cache in self.caches:
            cache.pos = pos + 1
        return self.logits
