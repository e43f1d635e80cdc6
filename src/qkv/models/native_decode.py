"""One-token decoding steps of a :class:`~qkv.models.gpt.GPTModel` on qkv's C kernels.

With a KV cache, each step of :func:`qkv.models.gpt.generate` feeds one token through
the model, which multiplies it by every weight matrix once: the step's time is the time
to stream the weights from memory. On the CPU the module path (``model(ids,
caches=...)``) falls well short of that: PyTorch's matrix-vector kernels stream the
weights slower than memory allows (and in bfloat16, on a CPU without bfloat16
instructions, slower than in float32), and each layer issues some 20 operations from
Python. :class:`NativeDecoder` runs the same maths as one call per token into
:mod:`qkv.kernels` (``decode.c``'s ``qkv_step``): the weights are read where the model
keeps them, float32 or bfloat16, and the activations stay float32. Nothing is copied
but the few small vectors (biases, LayerNorm) of a bfloat16 model, widened to float32.
``docs/benchmarks.md`` ("Generation") has the measurements.

The step, per layer, with ``x`` the residual stream (float32, ``emb_dim``):

    h = LayerNorm1(x);  q, k, v = W_q h (+b), W_k h (+b), W_v h (+b)
    write k, v into the layer's KVCache at its position; a = softmax(q K^T / sqrt(d)) V
    x += out_proj(a);   h = LayerNorm2(x);  f = gelu_tanh(W_1 h + b_1);  x += W_2 f + b_2

then ``logits = out_head(final_norm(x))``. It is the module path's maths in another
summation order, so logits agree to rounding (``tests/test_native_decode.py`` checks
both against the float64 model). Only the one-token steps run here: the prompt, and
the re-fill of a full cache, go through the module path and the same caches.

:func:`qkv.models.gpt.native_unsupported` says why a model cannot be decoded here (None
when it can): the kernels must load (:func:`qkv.kernels.unavailable_reason`), and the
model must be a plain ``GPTModel`` (its own block, attention, feed-forward and norm
classes, full multi-head attention without RoPE or a window, no forward hooks) on the
CPU in float32 or bfloat16, at batch 1. This module reads the model by its attribute
names and knows nothing else of it (``gpt.py`` imports it, not the other way round).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor, nn

from ..kernels import Layer, Model, decode_kernels, unavailable_reason
from ..kv_cache import KVCache

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
        self.dtype = model.out_head.weight.dtype
        self.threads = torch.get_num_threads()
        cfg = model.cfg
        att0 = model.trf_blocks[0].att
        heads, head_dim = att0.num_heads, att0.head_dim
        max_len = caches[0].max_len
        for cache in caches:
            if (cache.keys.dtype != self.dtype or not cache.keys.is_contiguous()
                    or not cache.values.is_contiguous() or cache.ring
                    or cache.max_len != max_len or cache.keys.shape[1] != heads
                    or cache.keys.shape[3] != head_dim or cache.values.shape[3] != head_dim):
                raise ValueError(f"caches must be the model's own (new_caches), got {cache!r}")
        self.limit = min(max_len, cfg.context_length)
        hidden = model.trf_blocks[0].ff.layers[0].out_features
        # Every tensor whose address the kernels get, kept alive with the decoder.
        self._keep: list[Tensor] = []
        buffers = {name: self._zeros(size) for name, size in (
            ("x", cfg.emb_dim), ("h", cfg.emb_dim), ("q", cfg.emb_dim), ("k", cfg.emb_dim),
            ("v", cfg.emb_dim), ("a", cfg.emb_dim), ("f", hidden),
            ("logits", cfg.vocab_size), ("scores", heads * max_len))}
        self.logits = buffers["logits"].view(1, 1, cfg.vocab_size)
        layers = (Layer * cfg.n_layers)(*(self._layer(b, c)
                                          for b, c in zip(model.trf_blocks, caches,
                                                          strict=True)))
        self._layers = layers
        final_scale, final_shift, final_eps = self._norm(model.final_norm)
        self.struct = Model(
            dt=DTYPES[self.dtype], n_layers=cfg.n_layers, dim=cfg.emb_dim, hidden=hidden,
            heads=heads, head_dim=head_dim, vocab=cfg.vocab_size, max_len=max_len,
            scale=1.0 / math.sqrt(head_dim),
            tok_emb=self._weight(model.tok_emb.weight),
            pos_emb=self._weight(model.pos_emb.weight),
            head=self._weight(model.out_head.weight),
            final_scale=final_scale, final_shift=final_shift, final_eps=final_eps,
            layers=layers, **{name: t.data_ptr() for name, t in buffers.items()})

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

    def _weight(self, w: Tensor) -> int:
        if not w.is_contiguous():
            raise ValueError("weights must be contiguous (nn.Linear's (out, in) layout)")
        return self._hold(w.detach())  # type: ignore[return-value]

    def _norm(self, norm: nn.Module) -> tuple[int | None, int | None, float]:
        return self._hold(_vector(norm.scale)), self._hold(_vector(norm.shift)), norm.eps

    def _layer(self, block: nn.Module, cache: KVCache) -> Layer:
        att, ff = block.att, block.ff
        linears = (att.W_query, att.W_key, att.W_value, att.out_proj, ff.layers[0],
                   ff.layers[2])
        s1, b1, e1 = self._norm(block.norm1)
        s2, b2, e2 = self._norm(block.norm2)
        return Layer(w=(ctypes.c_void_p * 6)(*(self._weight(m.weight) for m in linears)),
                     b=(ctypes.c_void_p * 6)(*(self._hold(_vector(m.bias)) for m in linears)),
                     norm1_scale=s1, norm1_shift=b1, norm1_eps=e1,
                     norm2_scale=s2, norm2_shift=b2, norm2_eps=e2,
                     keys=self._hold(cache.keys), values=self._hold(cache.values))

    # -- one step -------------------------------------------------------------------

    def step(self, token: int) -> Tensor:
        """Append ``token`` at the caches' position; its next-token logits ``(1, 1, vocab)``
        (float32, a buffer the next step overwrites)."""
        pos = self.caches[0].pos
        if pos >= self.limit:
            raise ValueError(f"the caches are full ({pos} of {self.limit} positions)")
        if not 0 <= token < self.struct.vocab:
            raise ValueError(f"token id {token} is outside the vocabulary of "
                             f"{self.struct.vocab}")
        self.lib.qkv_step(ctypes.byref(self.struct), token, pos, self.threads)
        for cache in self.caches:
            cache.pos = pos + 1
        return self.logits
