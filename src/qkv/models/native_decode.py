"""One-token decoding steps of a :class:`~qkv.models.gpt.GPTModel` on qkv's C kernels.

With a KV cache, each step of :func:`qkv.models.gpt.generate` feeds one token through
the model, which multiplies it by every weight matrix once: the step's time is the time
to stream the weights from memory. The module path (``model(ids, caches=...)``) loses
about half of that to PyTorch's matrix-vector kernels on the CPU (MKL's reads 768-wide
rows at 50-75 % of the rate a plain ``sum`` streams memory at, and its bfloat16 path is
slower than float32 on a CPU without bfloat16 instructions) and a little to issuing
some 20 operations per layer. :class:`NativeDecoder` runs the same maths as 10 calls
per layer into :mod:`qkv.kernels` (``decode.c``): the weights are read where the model
keeps them, float32 or bfloat16, and the activations stay float32. Nothing is copied
but the few small vectors (biases, LayerNorm) of a bfloat16 model, widened to float32.

The step, per layer, with ``x`` the residual stream (float32, ``emb_dim``):

    h = LayerNorm1(x);  q, k, v = W_q h (+b), W_k h (+b), W_v h (+b)
    write k, v into the layer's KVCache at its position; a = softmax(q K^T / sqrt(d)) V
    x += out_proj(a);   h = LayerNorm2(x);  f = gelu_tanh(W_1 h + b_1);  x += W_2 f + b_2

then ``logits = out_head(final_norm(x))``. It is the module path's maths in another
summation order, so logits agree to rounding (``tests/test_native_decode.py`` checks
both against the float64 model). Only the one-token steps run here: the prompt, and
the re-fill of a full cache, go through the module path and the same caches.

:func:`unsupported` says why a model cannot be decoded here (None when it can): the
kernels must load (:func:`qkv.kernels.unavailable_reason`), and the model must be a
plain ``GPTModel`` (its own block, attention, feed-forward and norm classes, full
multi-head attention without RoPE or a window) on the CPU in float32 or bfloat16, at
batch 1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..kernels import decode_kernels, unavailable_reason
from ..kv_cache import KVCache
from ..multihead import MultiHeadAttention
from .gpt import GELU, FeedForward, GPTModel, LayerNorm, TransformerBlock

__all__ = ["NativeDecoder", "unsupported"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_STORE, _ADD, _GELU = 0, 1, 2


def unsupported(model: nn.Module, batch_size: int = 1) -> str | None:
    """Why :class:`NativeDecoder` cannot run ``model`` (None when it can)."""
    if type(model) is not GPTModel:
        return f"a plain GPTModel is needed, got {type(model).__name__}"
    weight = model.out_head.weight
    if weight.device.type != "cpu":
        return f"the kernels run on the CPU, the model is on {weight.device}"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or weight.dtype not in _DTYPES:
        return f"float32 or bfloat16 parameters are needed, got {sorted(map(str, dtypes))}"
    if batch_size != 1:
        return f"one sequence at a time, got a batch of {batch_size}"
    for block in model.trf_blocks:
        if type(block) is not TransformerBlock:
            return f"a block of type {type(block).__name__}"
        att, ff = block.att, block.ff
        if type(att) is not MultiHeadAttention or type(ff) is not FeedForward:
            return "attention and feed-forward must be qkv's MultiHeadAttention and FeedForward"
        if (att.num_kv_groups != att.num_heads or att.window_size is not None or att.rope
                or not att.causal or att.d_in != att.d_out):
            return "plain causal multi-head attention is needed (no GQA, window or RoPE)"
        if [type(m) for m in ff.layers] != [nn.Linear, GELU, nn.Linear]:
            return "the feed-forward must be Linear, GELU, Linear"
        if type(block.norm1) is not LayerNorm or type(block.norm2) is not LayerNorm:
            return "the norms must be qkv's LayerNorm"
    if type(model.final_norm) is not LayerNorm:
        return "the final norm must be qkv's LayerNorm"
    return unavailable_reason()


def _vector(t: Tensor | None) -> Tensor | None:
    """A float32 contiguous copy of a small parameter (the parameter itself if it is one)."""
    return None if t is None else t.detach().float().contiguous()


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecoder:
    """Decode one token at a time through ``caches`` with the C kernels.

    Args:
        model: a model :func:`unsupported` accepts (in eval mode: no dropout here).
        caches: the model's caches (:meth:`GPTModel.new_caches` at batch 1), filled by
            the module path with the tokens so far; :meth:`step` appends to them.

    The decoder holds pointers into the model's parameters and the caches' buffers:
    use it only while neither is replaced or resized (one :func:`generate` call).
    """

    def __init__(self, model: GPTModel, caches: list[KVCache]) -> None:
        reason = unsupported(model, caches[0].keys.shape[0] if caches else 1)
        if reason is not None:
            raise ValueError(f"cannot decode natively: {reason}")
        if len(caches) != len(model.trf_blocks):
            raise ValueError(f"need one KVCache per layer ({len(model.trf_blocks)}), "
                             f"got {len(caches)}")
        self.lib = decode_kernels()
        self.model, self.caches = model, caches
        self.dtype = model.out_head.weight.dtype
        self.dt = _DTYPES[self.dtype]
        self.threads = torch.get_num_threads()
        cfg = model.cfg
        d = self.dim = cfg.emb_dim
        self.vocab = cfg.vocab_size
        att0 = model.trf_blocks[0].att
        self.heads, self.head_dim = att0.num_heads, att0.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        for cache in caches:
            if (cache.keys.dtype != self.dtype or not cache.keys.is_contiguous()
                    or not cache.values.is_contiguous() or cache.ring
                    or cache.keys.shape[1] != self.heads or cache.keys.shape[3] != self.head_dim
                    or cache.values.shape[3] != self.head_dim):
                raise ValueError(f"caches must be the model's own (new_caches), got {cache!r}")
        f32 = {"dtype": torch.float32}
        self.x, self.h = torch.zeros(d, **f32), torch.zeros(d, **f32)
        self.q, self.k, self.v = (torch.zeros(d, **f32) for _ in range(3))
        self.a = torch.zeros(d, **f32)
        self.f = torch.zeros(model.trf_blocks[0].ff.layers[0].out_features, **f32)
        self.logits = torch.zeros(1, 1, self.vocab, **f32)
        self.scores = torch.zeros(self.heads * caches[0].max_len, **f32)
        # Keep every tensor whose address the kernels get (float32 copies included).
        self._keep: list[Tensor] = []
        self.layers = [self._layer(block) for block in model.trf_blocks]
        self.final = self._norm(model.final_norm)
        self.head = self._weight(model.out_head.weight)

    # -- parameters as (pointer, ...) -------------------------------------------

    def _hold(self, t: Tensor | None) -> int | None:
        if t is not None:
            self._keep.append(t)
        return _ptr(t)

    def _weight(self, w: Tensor) -> int:
        if not w.is_contiguous():
            raise ValueError("weights must be contiguous (nn.Linear's (out, in) layout)")
        return self._hold(w.detach())  # type: ignore[return-value]

    def _norm(self, norm: LayerNorm) -> tuple[int, int, float]:
        return self._hold(_vector(norm.scale)), self._hold(_vector(norm.shift)), norm.eps

    def _linear(self, m: nn.Linear) -> tuple[int, int | None, int, int]:
        return (self._weight(m.weight), self._hold(_vector(m.bias)), m.out_features,
                m.in_features)

    def _layer(self, block: TransformerBlock) -> dict[str, tuple]:
        att = block.att
        return {
            "norm1": self._norm(block.norm1), "norm2": self._norm(block.norm2),
            "q": self._linear(att.W_query), "k": self._linear(att.W_key),
            "v": self._linear(att.W_value), "o": self._linear(att.out_proj),
            "ff1": self._linear(block.ff.layers[0]), "ff2": self._linear(block.ff.layers[2]),
        }

    # -- one step ---------------------------------------------------------------

    def _run_linear(self, linear: tuple, x: Tensor, y: Tensor, mode: int) -> None:
        w, b, rows, n = linear
        self.lib.qkv_linear(w, self.dt, x.data_ptr(), b, y.data_ptr(), rows, n, mode,
                            self.threads)

    def _run_norm(self, norm: tuple, x: Tensor, y: Tensor) -> None:
        scale, shift, eps = norm
        self.lib.qkv_layer_norm(x.data_ptr(), scale, shift, y.data_ptr(), self.dim, eps)

    def step(self, token: int) -> Tensor:
        """Append ``token`` at the caches' position; its next-token logits ``(1, 1, vocab)``
        (float32, a buffer reused by the next step)."""
        pos = self.caches[0].pos
        limit = min(self.caches[0].max_len, self.model.cfg.context_length)
        if pos >= limit:
            raise ValueError(f"the caches are full ({pos} of {limit} positions)")
        if not 0 <= token < self.vocab:
            raise ValueError(f"token id {token} is outside the vocabulary of {self.vocab}")
        lib, x, h = self.lib, self.x, self.h
        tok, pos_emb = self.model.tok_emb.weight, self.model.pos_emb.weight
        lib.qkv_embed(tok[token].data_ptr(), pos_emb[pos].data_ptr(), self.dt, x.data_ptr(),
                      self.dim)
        for layer, cache in zip(self.layers, self.caches, strict=True):
            self._run_norm(layer["norm1"], x, h)
            self._run_linear(layer["q"], h, self.q, _STORE)
            self._run_linear(layer["k"], h, self.k, _STORE)
            self._run_linear(layer["v"], h, self.v, _STORE)
            lib.qkv_attend(self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(),
                           cache.keys.data_ptr(), cache.values.data_ptr(), self.dt,
                           self.a.data_ptr(), self.heads, self.head_dim,
                           cache.max_len * self.head_dim, pos, self.scale,
                           self.scores.data_ptr(), self.threads)
            cache.pos = pos + 1
            self._run_linear(layer["o"], self.a, x, _ADD)
            self._run_norm(layer["norm2"], x, h)
            self._run_linear(layer["ff1"], h, self.f, _GELU)
            self._run_linear(layer["ff2"], self.f, x, _ADD)
        self._run_norm(self.final, x, h)
        self._run_linear((self.head, None, self.vocab, self.dim), h, self.logits, _STORE)
        return self.logits
