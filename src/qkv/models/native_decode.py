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
    x += ple_norm(ple_proj(gelu(ple_gate x) * p_layer));  x *= layer_scalar   (Gemma 4)

with LayerNorm or RMSNorm (Gemma's ``1 + w`` folded into a float32 scale), GELU or SiLU,
the optional pieces where the model has them, and ``x = tok_emb[token] * embed_scale
(+ pos_emb[pos])`` before (with Gemma 4's per-layer inputs ``p``, from one row of
their table) and ``logits = out_head(final_norm(x))`` after (soft-capped:
``c tanh(logits / c)``).

Each layer's kind is the module's (read by its attributes, one code path in ``decode.c``
per kind): multi-head attention with its variants (``sinks``: one more logit per head;
a query projection twice as wide: the per-head sigmoid gate, with ``rotary_dim`` for
partial RoPE; ``rope`` False: no positions; a ``kv_source``: the source layer's cache,
nothing stored; no ``W_value``: the values are the keys' projection; ``v_norm`` on each
value head), latent attention in the absorbed form (``kv_b_proj``; with an
``indexer``, DeepSeek's sparse attention) over its :class:`~qkv.kv_cache.LatentCache`,
or Gated DeltaNet (``in_proj_qkv``) over its ``DeltaNetCache`` (the state float32);
the MLP dense or a mixture of experts (``router``: only the chosen experts' rows are
read), or both side by side (Gemma 4's ``dense`` and ``moe``). It is the module
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
(``tests/test_quant_decode.py``). Any mix of types, per matrix, is fine. The prompt's
products with such layers run on the blocks too: ``QuantizedLinear``'s ``"auto"``
backend takes ``kernels/quant.c``'s matrix product, which quantizes each row alike.

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
    GLU_CLAMPED,
    GLU_GEGLU,
    GLU_SWIGLU,
    NORM_LAYER,
    NORM_NONE,
    NORM_RMS,
    SCORE_SIGMOID,
    SCORE_SOFTMAX,
    DeltaNet,
    Latent,
    Layer,
    Mat,
    Model,
    Moe,
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
# a mixture of experts' router scores and gated units (qkv.models.moe), as decode.c codes them
_SCORES = {"softmax": SCORE_SOFTMAX, "sigmoid": SCORE_SIGMOID}
_GLUS = {"swiglu": GLU_SWIGLU, "geglu": GLU_GEGLU, "clamped_swiglu": GLU_CLAMPED}


def _dense_mlp(ff: nn.Module) -> tuple[nn.Linear, nn.Linear | None, nn.Linear]:
    """A dense MLP's three layers: gated ``act(fc1 h) * fc2 h``, then ``fc3``; GPT-2's
    ``act(layers[0] h)`` (no second), then ``layers[2]``."""
    return (ff.fc1, ff.fc2, ff.fc3) if hasattr(ff, "fc1") else (ff.layers[0], None, ff.layers[2])


def _parts(ff: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """A block's feed-forward as (dense MLP, mixture of experts), either None: a MoE has
    a ``router``; Gemma 4's has both side by side (``dense``, ``moe``)."""
    if hasattr(ff, "router"):
        return None, ff
    return (ff.dense, ff.moe) if hasattr(ff, "moe") else (ff, None)


def _batch(cache: object) -> int:
    """The batch size of a layer's cache (a KVCache, LatentCache or DeltaNetCache)."""
    for name in ("kv", "keys", "state"):
        if hasattr(cache, name):
            return getattr(cache, name).shape[0]
    raise ValueError(f"caches must be the model's own (new_caches), got {cache!r}")


def _kind(att: nn.Module) -> str:
    """What decode.c runs for an attention layer: ``"latent"`` (keys and values from one
    latent per token: ``kv_b_proj``), ``"deltanet"`` (a state: ``in_proj_qkv``) or
    ``"mha"`` (multi-head attention and its variants)."""
    if hasattr(att, "kv_b_proj"):
        return "latent"
    return "deltanet" if hasattr(att, "in_proj_qkv") else "mha"


def _gated(att: nn.Module) -> bool:
    """Whether the layer's query projection carries a gate per head (twice as wide:
    each head's query, then its gate)."""
    return att.W_query.out_features == 2 * att.num_heads * att.head_dim


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
        threads: the threads each step runs on (default: PyTorch's).

    The decoder holds the addresses of the model's parameters and the caches' buffers
    (``decode.c``'s ``qkv_model``): use it only while neither is replaced or resized
    (one :func:`generate` call).
    """

    def __init__(self, model: nn.Module, caches: list[KVCache], threads: int | None = None
                 ) -> None:
        lib = decode_kernels()
        if lib is None:
            raise ValueError(f"cannot decode natively: {unavailable_reason()}")
        if len(caches) != len(model.trf_blocks):
            raise ValueError(f"need one KVCache per layer ({len(model.trf_blocks)}), "
                             f"got {len(caches)}")
        if caches and _batch(caches[0]) != 1:
            raise ValueError(f"one sequence at a time, got a batch of {_batch(caches[0])}")
        self.lib = lib
        self.model, self.caches = model, caches
        # the float dtype the model computes in (its norms', biases' and caches')
        self.dtype = model.final_norm.scale.dtype
        self.threads = torch.get_num_threads() if threads is None else threads
        cfg = model.cfg
        # The sizes of the multi-head attention layers (all alike); latent ones have
        # their own.
        mha = [block.att for block in model.trf_blocks if _kind(block.att) == "mha"]
        # The cache each layer attends over: its own, or (KV sharing) its source's.
        read = []
        for block, cache in zip(model.trf_blocks, caches, strict=True):
            source = block.spec.kv_source
            if (source is None) == (cache is None):
                raise ValueError(f"caches must be the model's own (new_caches), got {cache!r}")
            read.append(cache if source is None else caches[source])
        for block, cache in zip(model.trf_blocks, read, strict=True):
            att = block.att
            if _kind(att) == "deltanet":
                bad = (not hasattr(cache, "state") or cache.conv.dtype != self.dtype
                       or cache.state.dtype != torch.float32
                       or tuple(cache.conv.shape[1:]) != (att.conv_kernel_size - 1,
                                                          att.conv_dim))
            elif _kind(att) == "latent":
                index = getattr(cache, "index_keys", None)
                bad = (not hasattr(cache, "kv") or cache.kv.dtype != self.dtype
                       or not cache.kv.is_contiguous() or cache.kv.shape[2] !=
                       att.kv_lora_rank + att.qk_rope_head_dim
                       or (index is None) != (att.indexer is None)
                       or (index is not None and (not index.is_contiguous()
                                                  or index.dtype != self.dtype
                                                  or index.shape[2] != att.indexer.head_dim)))
            else:
                window = att.window_size
                bad = (not hasattr(cache, "keys") or cache.keys.dtype != self.dtype
                       or not cache.keys.is_contiguous()
                       or not cache.values.is_contiguous() or cache.ring != (window is not None)
                       or (window is not None and cache.max_len != window)
                       or cache.keys.shape[1] != att.num_kv_groups
                       or cache.keys.shape[3] != att.head_dim
                       or cache.values.shape[3] != att.head_dim)
            if bad or cache.pos != caches[0].pos:
                raise ValueError(f"caches must be the model's own (new_caches), got {cache!r}")
        # The last position a step may take: a full cache's length (all are one length),
        # and learned positions' table; a model of ring caches and RoPE has no end.
        full = [cache.max_len for cache, block in zip(read, model.trf_blocks, strict=True)
                if _kind(block.att) != "deltanet" and not cache.ring]
        ends = full + ([cfg.context_length] if model.pos_emb is not None else [])
        self.limit = min(ends) if ends else None
        hidden = max([_dense_mlp(_parts(block.ff)[0])[0].out_features
                      for block in model.trf_blocks if _parts(block.ff)[0] is not None],
                     default=1)
        longest = max(cache.max_len for cache, block in zip(read, model.trf_blocks,
                                                            strict=True)
                      if _kind(block.att) == "mha") if mha else 1
        gated = any(_gated(att) for att in mha)

        def widest(heads: str) -> int:  # the most values of `heads` heads of any layer
            return max([getattr(att, heads) * att.head_dim for att in mha], default=1)

        # Every tensor whose address the kernels get, kept alive with the decoder.
        self._keep: list[Tensor] = []
        self._structs: list[Moe | Latent | DeltaNet] = []  # the structs layers point to
        self._deltas: list[tuple[DeltaNet, object]] = []
        buffers = {name: self._zeros(size) for name, size in (
            ("x", cfg.emb_dim), ("o", cfg.emb_dim), ("h", cfg.emb_dim),
            ("q", (2 if gated else 1) * widest("num_heads")), ("g", widest("num_heads")),
            ("k", widest("num_kv_groups")), ("v", widest("num_kv_groups")),
            ("a", widest("num_heads")), ("f", hidden), ("logits", cfg.vocab_size),
            ("moe_x", cfg.emb_dim), ("moe_y", cfg.emb_dim),
            ("scores", max([att.num_heads for att in mha], default=1) * longest))}
        self.logits = buffers["logits"].view(1, 1, cfg.vocab_size)
        self._rope: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._rope_len = 0
        self._layers = (Layer * cfg.n_layers)(*(self._layer(b, c) for b, c in
                                                 zip(model.trf_blocks, read, strict=True)))
        embed_scale = 1.0
        if cfg.embed_scale:  # rounded to the weights' dtype, as the module path rounds it
            embed_scale = float(torch.tensor(cfg.emb_dim ** 0.5, dtype=self.dtype))
        self.struct = Model(
            dt=DTYPES[self.dtype], n_layers=cfg.n_layers, dim=cfg.emb_dim,
            vocab=cfg.vocab_size, embed_scale=embed_scale,
            tok_emb=self._weight(model.tok_emb), pos_emb=self._weight(model.pos_emb),
            head=self._weight(model.out_head), final_norm=self._norm(model.final_norm),
            layers=self._layers, logit_softcap=cfg.logit_softcap or 0.0,
            **self._per_layer_inputs(model.per_layer_inputs),
            **{name: t.data_ptr() for name, t in buffers.items()})
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
        if norm.scale is None:  # no scale (Gemma 4's value norm): a scale of ones
            scale = torch.ones(norm.dim)
        else:
            scale = _vector(norm.scale)
            if norm.gemma:
                scale = 1.0 + scale
        return Norm(kind=NORM_RMS, eps=norm.eps, scale=self._hold(scale))

    def _per_layer_inputs(self, ple: nn.Module | None) -> dict:
        """The Model fields of Gemma 4's per-layer inputs (:class:`~qkv.models.gpt.
        PerLayerInputs`, read by its attributes), with their work buffers; none without."""
        if ple is None:
            return {}
        every = ple.n_layers * ple.width
        # sqrt(width) rounded to the weights' dtype, as the module path rounds it
        scale = float(torch.tensor(ple.width ** 0.5, dtype=self.dtype))
        return dict(ple_embed=self._weight(ple.embed), ple_proj=self._weight(ple.proj),
                    ple_norm=self._norm(ple.norm), ple_width=ple.width,
                    ple_vocab=ple.embed.num_embeddings, ple_embed_scale=scale,
                    ple=self._zeros(every).data_ptr(), ple_row=self._zeros(every).data_ptr(),
                    ple_g=self._zeros(ple.width).data_ptr())

    def _moe(self, moe: nn.Module) -> Moe:
        """A mixture of experts (:class:`qkv.models.moe.MoE`, read by its attributes),
        with its work buffers."""
        ex, shared = moe.experts, moe.shared_expert
        chosen = torch.zeros(moe.top_k, dtype=torch.int32)
        self._keep.append(chosen)
        width = ex.hidden_dim
        shared_width = 0 if shared is None else shared.fc1.out_features
        fields = {}
        if shared is not None:
            for n, m in zip("123", (shared.fc1, shared.fc2, shared.fc3), strict=True):
                fields[f"shared{n}"] = self._weight(m.weight)
                fields[f"shared_b{n}"] = self._hold(_vector(m.bias))
        moe_struct = Moe(
            experts=moe.num_experts, top_k=moe.top_k, score=_SCORES[moe.score],
            norm_topk=int(moe.norm_topk_prob), n_group=moe.n_group,
            topk_group=moe.topk_group, glu=_GLUS[ex.activation], width=width,
            shared_width=shared_width, scaling=moe.routed_scaling_factor, alpha=ex.alpha,
            limit=ex.limit, router=self._weight(moe.router.weight),
            router_bias=self._hold(_vector(moe.router.bias)),
            choice_bias=self._hold(_vector(moe.e_score_correction_bias)),
            gate_up=self._weight(ex.gate_up_proj), down=self._weight(ex.down_proj),
            gate_up_bias=self._hold(_vector(ex.gate_up_proj_bias)),
            down_bias=self._hold(_vector(ex.down_proj_bias)),
            shared_gate=self._weight(None if moe.shared_expert_gate is None
                                     else moe.shared_expert_gate.weight),
            router_scale=self._hold(_vector(moe.router_scale)),
            expert_scale=self._hold(_vector(moe.per_expert_scale)),
            router_eps=moe.router_norm or 0.0, route=self._zeros(moe.d_model).data_ptr(),
            partial=self._zeros(self.threads * moe.d_model).data_ptr(),
            logits=self._zeros(moe.num_experts + 1).data_ptr(),
            weights=self._zeros(moe.top_k).data_ptr(),
            hidden=self._zeros(moe.top_k * width + shared_width).data_ptr(),
            chosen=chosen.data_ptr(), **fields)
        self._structs.append(moe_struct)
        return moe_struct

    def _torch_norm(self, norm: nn.Module) -> Norm:
        """PyTorch's ``nn.RMSNorm`` or ``nn.LayerNorm`` (latent attention's norms)."""
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        if isinstance(norm, nn.LayerNorm):
            return Norm(kind=NORM_LAYER, eps=eps, scale=self._hold(_vector(norm.weight)),
                        shift=self._hold(_vector(norm.bias)))
        return Norm(kind=NORM_RMS, eps=eps, scale=self._hold(_vector(norm.weight)))

    def _latent(self, att: nn.Module, cache: object) -> Latent:
        """A latent attention layer (:class:`qkv.latent_attention.LatentAttention` or its
        sparse kind, read by their attributes), its cache and its work buffers."""
        h, r, dr = att.num_heads, att.kv_lora_rank, att.qk_rope_head_dim
        q_rank = att.q_lora_rank or 0
        fields: dict = {}
        if q_rank:
            fields.update(wq_a=self._weight(att.q_a_proj.weight),
                          bq_a=self._hold(_vector(att.q_a_proj.bias)),
                          q_norm=self._torch_norm(att.q_a_layernorm),
                          wq=self._weight(att.q_b_proj.weight))
        else:
            fields.update(wq=self._weight(att.q_proj.weight))
        ix = att.indexer
        if ix is not None:
            fields.update(index_heads=ix.num_heads, index_dim=ix.head_dim,
                          index_topk=ix.top_k, iwq=self._weight(ix.wq_b.weight),
                          iwk=self._weight(ix.wk.weight), iww=self._weight(ix.weights_proj.weight),
                          ik_norm=self._torch_norm(ix.k_norm),
                          index_keys=self._hold(cache.index_keys))
            sel = torch.zeros(ix.top_k, dtype=torch.int32)
            self._keep.append(sel)
            fields["sel"] = sel.data_ptr()
        sizes = {"cq": q_rank, "q": h * att.qk_head_dim, "ql": h * (r + dr), "kvn": r + dr,
                 "oc": h * r, "part": self.threads * h * (r + 2), "o": h * att.v_head_dim,
                 "iq": 0 if ix is None else ix.num_heads * ix.head_dim,
                 "ik": 0 if ix is None else ix.head_dim,
                 "iw": 0 if ix is None else ix.num_heads, "iscore": cache.max_len}
        latent = Latent(
            heads=h, interleave=int(att.rope_interleave), threads=self.threads, rank=r,
            nope=att.qk_nope_head_dim, rope=dr, vdim=att.v_head_dim, q_rank=q_rank,
            scale=att.scale,
            wkv_a=self._weight(att.kv_a_proj_with_mqa.weight),
            bkv_a=self._hold(_vector(att.kv_a_proj_with_mqa.bias)),
            kv_norm=self._torch_norm(att.kv_a_layernorm), wkv_b=self._weight(att.kv_b_proj.weight),
            kv=self._hold(cache.kv),
            **{name: self._zeros(max(size, 1)).data_ptr() for name, size in sizes.items()},
            **fields)
        self._structs.append(latent)
        return latent

    def _deltanet(self, att: nn.Module, cache: object) -> DeltaNet:
        """A Gated DeltaNet layer (:class:`qkv.linear_attention.GatedDeltaNet`, read by
        its attributes), its cache (:meth:`_follow` keeps the addresses current) and its
        work buffers."""
        hv, dv = att.num_v_heads, att.head_v_dim
        delta = DeltaNet(
            k_heads=att.num_k_heads, v_heads=hv, kernel=att.conv_kernel_size,
            k_dim=att.head_k_dim, v_dim=dv, eps=att.norm.eps,
            wqkv=self._weight(att.in_proj_qkv.weight), wz=self._weight(att.in_proj_z.weight),
            wb=self._weight(att.in_proj_b.weight), wa=self._weight(att.in_proj_a.weight),
            wout=self._weight(att.out_proj.weight),
            taps=self._hold(_vector(att.conv1d.weight[:, 0, :])),
            a_log=self._hold(_vector(att.A_log)), dt_bias=self._hold(_vector(att.dt_bias)),
            norm=self._hold(_vector(att.norm.weight)),
            **{name: self._zeros(size).data_ptr() for name, size in (
                ("m", att.conv_dim), ("z", hv * dv), ("b", hv), ("a", hv), ("o", hv * dv))})
        self._structs.append(delta)
        self._deltas.append((delta, cache))
        return delta

    def _follow(self) -> None:
        """Point each Gated DeltaNet layer at its cache's current window and state: the
        module path replaces those tensors (a prompt, a re-fill) rather than writing
        into them."""
        for delta, cache in self._deltas:
            for name in ("conv", "state"):
                if not getattr(cache, name).is_contiguous():
                    setattr(cache, name, getattr(cache, name).contiguous())
            delta.window, delta.state = cache.conv.data_ptr(), cache.state.data_ptr()

    def _layer(self, block: nn.Module, cache: KVCache) -> Layer:
        att = block.att
        dense, experts = _parts(block.ff)
        moe = None if experts is None else self._moe(experts)
        mlp = (None, None, None) if dense is None else _dense_mlp(dense)
        if _kind(att) == "deltanet":
            delta = self._deltanet(att, cache)
            return Layer(**self._mlp(block, mlp, moe), deltanet=ctypes.pointer(delta))
        if _kind(att) == "latent":
            latent = self._latent(att, cache)
            return Layer(
                wo=self._weight(att.o_proj.weight), bo=self._hold(_vector(att.o_proj.bias)),
                **self._mlp(block, mlp, moe), rotary_dim=att.qk_rope_head_dim,
                latent=ctypes.pointer(latent))
        shared = block.spec.kv_source is not None  # no keys or values of its own
        from_keys = not shared and getattr(att, "W_value", None) is None
        linears = dict(zip(("q", "k", "v", "o", "1", "2", "3"),
                           (att.W_query, getattr(att, "W_key", None),
                            getattr(att, "W_value", None), att.out_proj, *mlp), strict=True))
        sinks = getattr(att, "sinks", None)
        return Layer(
            **{f"w{n}": self._weight(m) for n, m in list(linears.items())[:4]},
            **{f"b{n}": None if m is None else self._hold(_vector(m.bias))
               for n, m in list(linears.items())[:4]},
            **self._mlp(block, mlp, moe),
            q_norm=self._norm(att.q_norm), k_norm=self._norm(getattr(att, "k_norm", None)),
            values_from_keys=int(from_keys), v_norm=self._norm(getattr(att, "v_norm", None)),
            sinks=self._hold(_vector(sinks)),
            gated=int(_gated(att)), shared=int(shared),
            rotary_dim=getattr(att, "rotary_dim", att.head_dim), heads=att.num_heads,
            kv_heads=att.num_kv_groups, head_dim=att.head_dim,
            scale=att.scale if att.scale is not None else 1.0 / math.sqrt(att.head_dim),
            keys=self._hold(cache.keys), values=self._hold(cache.values),
            cache_len=cache.max_len, ring=int(cache.ring))

    def _mlp(self, block: nn.Module, mlp: tuple, moe: Moe | None) -> dict:
        """The Layer fields of a block's norms, feed-forward (dense or experts) and
        Gemma 4's end of the block (per-layer input, layer scalar)."""
        ff, ple = _parts(block.ff)[0], block.ple
        end = {} if ple is None else dict(ple_gate=self._weight(ple.gate),
                                          ple_proj=self._weight(ple.proj),
                                          ple_norm=self._norm(ple.norm))
        if hasattr(block.ff, "moe"):  # Gemma 4's dense MLP and experts side by side
            end.update({name: self._norm(getattr(block.ff, name))
                        for name in ("post_dense_norm", "moe_norm", "post_moe_norm")})
        return dict(
            **end, layer_scalar=self._hold(_vector(block.layer_scalar)),
            **{f"w{n}": self._weight(m) for n, m in zip("123", mlp, strict=True)},
            **{f"b{n}": None if m is None else self._hold(_vector(m.bias))
               for n, m in zip("123", mlp, strict=True)},
            norm1=self._norm(block.norm1), norm2=self._norm(block.norm2),
            post_norm1=self._norm(block.post_norm1), post_norm2=self._norm(block.post_norm2),
            act=ACT_SILU if isinstance(getattr(ff, "act", None), nn.SiLU) else ACT_GELU,
            hidden=0 if mlp[0] is None else mlp[0].out_features,
            moe=None if moe is None else ctypes.pointer(moe))

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
            if not getattr(att, "rope", _kind(att) == "latent"):  # (latent always turns)
                continue
            width = layer.rotary_dim  # partial RoPE, latent attention's RoPE part: fewer
            key = (att.rope_base, repr(att.rope_scaling), width)
            if key not in self._rope:
                cos, sin = rope_angles(torch.arange(n), width, att.rope_base,
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
        if self.struct.ple_width and token >= self.struct.ple_vocab:
            raise ValueError(f"token id {token} is past the per-layer input table's "
                             f"{self.struct.ple_vocab} rows")
        self._grow_rope(pos + 1)
        self._follow()
        self.lib.qkv_step(ctypes.byref(self.struct), token, pos, self.threads)
        for cache in self.caches:
            if cache is not None:
                cache.pos = pos + 1
        return self.logits
