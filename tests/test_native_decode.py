"""qkv.kernels (decode.c) and qkv.models.native_decode against float64 references.

Each kernel is compared with the definition computed in float64 by PyTorch; the decoder's
logits with the float64 model's; generate()'s native steps with its module path. Where
the kernels cannot be built here, the tests that need them skip and the fallback is
checked instead.
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from qkv.kernels import ACT_GELU, ACT_SILU, Mat, decode_kernels, unavailable_reason
from qkv.kv_cache import KVCache
from qkv.models.gpt import GPTConfig, GPTModel, generate
from qkv.models.gpt import native_unsupported as unsupported
from qkv.models.native_decode import NativeDecoder
from qkv.positional import apply_rope, rope_angles

LIB = decode_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"no native kernels: "
                                   f"{unavailable_reason()}")
DT = {torch.float32: 0, torch.bfloat16: 1}


def ptr(t):
    return None if t is None else t.data_ptr()


def mat(w):
    """A weight matrix as the kernels take it (by reference)."""
    return ctypes.byref(Mat() if w is None else Mat(data=w.data_ptr(), type=DT[w.dtype]))


def tiny(dtype=torch.float32, **overrides) -> GPTModel:
    cfg = dict(vocab_size=61, context_length=24, emb_dim=32, n_heads=4, n_layers=2,
               drop_rate=0.0)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # norms away from their ones and zeros, so they count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(dtype)


# One tiny model of each family qkv imports: the fields hf_open maps them to.
OPEN = dict(rope=True, norm="rmsnorm", mlp="swiglu", hidden_dim=48, out_bias=False,
            mlp_bias=False)
FAMILIES = {
    "gpt2": {},
    "llama": {**OPEN, "n_kv_groups": 2, "tie_weights": True},
    "llama3": {**OPEN, "n_kv_groups": 1, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
    "qwen2": {**OPEN, "n_kv_groups": 2, "qkv_bias": True, "rope_base": 1e6},
    "qwen3": {**OPEN, "n_kv_groups": 2, "head_dim": 16, "qk_norm": True},
    "gemma3": {**OPEN, "norm": "gemma_rmsnorm", "mlp": "geglu", "n_kv_groups": 1,
               "head_dim": 16, "qk_norm": True, "post_norms": True, "embed_scale": True,
               "query_scale": 0.2, "n_layers": 3, "window_size": 5,
               "layer_types": ["sliding", "full", "sliding"], "rope_local_base": 1e4,
               "rope_base": 1e6},
}


def as_float64(model: GPTModel) -> GPTModel:
    copy = GPTModel(model.cfg).eval()
    copy.load_state_dict(model.state_dict())
    return copy.double()


# ----------------------------------------------------------------------------
# the kernels, one by one


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(7, 40), (64, 48), (33, 19), (1, 8), (5, 3072)])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_kernel(dtype, rows, n, mode, bias):
    g = torch.Generator().manual_seed(rows * n + mode)
    w = torch.randn(rows, n, generator=g).to(dtype)  # rows and n with tails of every kind
    x = torch.randn(n, generator=g)
    b = torch.randn(rows, generator=g) if bias else None
    y = torch.randn(rows, generator=g)
    before = y.clone()
    LIB.qkv_linear(mat(w), ptr(x), ptr(b), ptr(y), rows, n, mode, 2)
    ref = w.double() @ x.double() + (b.double() if bias else 0)
    if mode == 1:
        ref = before.double() + ref
    # float32 sums of n products of the (exactly widened) weights
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * math.sqrt(n))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [ACT_GELU, ACT_SILU])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_kernel(dtype, act, gated):
    g = torch.Generator().manual_seed(act + 2 * gated)
    rows, n = 45, 70
    w1, w2 = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
    b1, b2 = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    x, f = torch.randn(n, generator=g), torch.empty(rows)
    LIB.qkv_gated(mat(w1), ptr(b1), mat(w2 if gated else None), ptr(b2) if gated else None,
                  ptr(x), ptr(f), rows, n, act, 2)
    pre = w1.double() @ x.double() + b1.double()
    ref = F.silu(pre) if act == ACT_SILU else F.gelu(pre, approximate="tanh")
    if gated:
        ref = ref * (w2.double() @ x.double() + b2.double())
    assert torch.allclose(f.double(), ref, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_norm_rope_and_embed_kernels():
    g = torch.Generator().manual_seed(0)
    x, scale, shift = (torch.randn(37, generator=g) for _ in range(3))
    y = torch.empty(37)
    LIB.qkv_layer_norm(ptr(x), ptr(scale), ptr(shift), ptr(y), 37, 1e-5)
    ref = F.layer_norm(x.double(), (37,), scale.double(), shift.double(), 1e-5)
    assert torch.allclose(y.double(), ref, atol=1e-6)
    LIB.qkv_rms_norm(ptr(x), ptr(scale), ptr(y), 37, 1e-6)
    ref = F.rms_norm(x.double(), (37,), scale.double(), 1e-6)
    assert torch.allclose(y.double(), ref, atol=1e-6)
    for dtype in DT:
        tok, pos = (torch.randn(5, 37, generator=g).to(dtype) for _ in range(2))
        LIB.qkv_embed(mat(tok), 3, mat(pos), 4, 1.0, ptr(y), 37)
        assert torch.equal(y, tok[3].float() + pos[4].float())
        LIB.qkv_embed(mat(tok), 2, mat(None), 0, 2.5, ptr(y), 37)
        assert torch.equal(y, tok[2].float() * 2.5)
    # RoPE at position 11 of three heads, against apply_rope in float64
    heads, hd = 3, 10
    cos, sin = rope_angles(torch.arange(16), hd, 500.0)
    v = torch.randn(heads, hd, generator=g)
    got = v.clone()
    cos32, sin32 = cos.float().contiguous(), sin.float().contiguous()
    LIB.qkv_rope(ptr(got), ptr(cos32[11]), ptr(sin32[11]), heads, hd)
    ref = apply_rope(v.double()[:, None], cos[11:12], sin[11:12])[:, 0]
    assert torch.allclose(got.double(), ref, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 12])
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
@pytest.mark.parametrize("slot, n", [(6, 7), (3, 10)], ids=["full", "ring"])
def test_attend_kernel_writes_the_cache_and_attends_to_every_slot(dtype, head_dim, kv_heads,
                                                                  slot, n):
    heads, cache_len = 6, 10
    g = torch.Generator().manual_seed(head_dim + kv_heads)
    cache = KVCache(1, kv_heads, cache_len, head_dim, dtype=dtype)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=g))
    cache.values.copy_(torch.randn(cache.values.shape, generator=g))
    q = torch.randn(heads * head_dim, generator=g)
    k, v = (torch.randn(kv_heads * head_dim, generator=g) for _ in range(2))
    out, scores = torch.empty(heads * head_dim), torch.empty(heads * cache_len)
    scale = 1 / math.sqrt(head_dim)
    LIB.qkv_attend(ptr(q), ptr(k), ptr(v), ptr(cache.keys), ptr(cache.values), DT[dtype],
                   ptr(out), heads, kv_heads, head_dim, cache_len, slot, n, scale,
                   ptr(scores), 2)
    # the new key and value, rounded to the cache's dtype as a tensor copy rounds them
    assert torch.equal(cache.keys[0, :, slot], k.view(kv_heads, head_dim).to(dtype))
    assert torch.equal(cache.values[0, :, slot], v.view(kv_heads, head_dim).to(dtype))
    # query head h reads key/value head h // (heads / kv_heads), slots 0 .. n - 1
    group = heads // kv_heads
    keys = cache.keys[0, :, :n].double().repeat_interleave(group, dim=0)
    values = cache.values[0, :, :n].double().repeat_interleave(group, dim=0)
    weights = torch.softmax(keys @ q.view(heads, head_dim, 1).double() * scale, dim=1)
    ref = (weights.transpose(1, 2) @ values).reshape(-1)
    assert torch.allclose(out.double(), ref, atol=1e-5)


# ----------------------------------------------------------------------------
# the decoder


def greedy_logits(model, ids, prompt_len, context):
    """The model's last logits behind each token of ``ids (1, T)`` after the prompt,
    without a cache, over the last ``context`` tokens -> ``(T - prompt_len, vocab)``."""
    with torch.no_grad():
        return torch.stack([model(ids[:, max(0, t - context) : t])[0, -1]
                            for t in range(prompt_len, ids.shape[1])])


def step_logits(model, ids, prefix, native, threads=None):
    """Logits behind each token of ``ids`` after ``prefix``, one cached step at a time
    (``threads``: the native decoder's, default torch's)."""
    caches = model.new_caches(1)
    out = []
    with torch.no_grad():
        model(ids[:, :prefix], caches=caches)
        decoder = NativeDecoder(model, caches, threads=threads) if native else None
        for t in range(prefix, ids.shape[1]):
            if native:
                out.append(decoder.step(int(ids[0, t]))[0, 0].clone())
            else:
                out.append(model(ids[:, t : t + 1], caches=caches)[0, 0])
    return torch.stack(out).double()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True}, {"tie_weights": True}],
                         ids=["plain", "qkv_bias", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_steps_match_the_float64_model(family, dtype, overrides):
    model = tiny(dtype, **{**FAMILIES[family], **overrides})
    # 20 tokens: past Gemma's window of 5, and Llama 3's original context of 8
    ids = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = as_float64(model)(ids)[0, 4:]
    native = step_logits(model, ids, 4, native=True)
    module = step_logits(model, ids, 4, native=False)
    native_err = (native - ref).abs().max().item()
    module_err = (module - ref).abs().max().item()
    if dtype == torch.float32:
        assert native_err < 1e-5 and module_err < 1e-5
    else:
        # Both read the same bfloat16 weights; the native steps keep float32
        # activations where the module rounds each to bfloat16, so they are closer.
        assert native_err < 0.05 and native_err <= module_err + 1e-3


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_generates_the_same_tokens_on_both_paths(family):
    model = tiny(**FAMILIES[family])
    idx = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    assert unsupported(model) is None
    # 40 tokens through a 24-token context: steps, then re-fills (or, for rings and RoPE
    # alone, steps without end)
    native = generate(model, idx, 40, native=True)
    module = generate(model, idx, 40, native=False)
    assert torch.equal(native, module)


@needs_kernels
def test_generate_native_and_module_paths_give_the_same_tokens():
    model = tiny()
    idx = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    # 40 tokens through a 24-token context: steps, then a re-fill at every step
    native = generate(model, idx, 40, native=True)
    module = generate(model, idx, 40, native=False)
    top2 = greedy_logits(as_float64(model), native, 5, 24).topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no near-tie for rounding to flip
    assert torch.equal(native, module)
    assert torch.equal(generate(model, idx, 40), native)  # native=None picks the kernels


@needs_kernels
def test_bfloat16_native_tokens_are_the_float64_models_greedy_choices():
    # In bfloat16 the two paths round differently (the native steps keep float32
    # activations), so near-ties may go either way; every clear choice must agree.
    model = tiny(torch.bfloat16)
    idx = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    native = generate(model, idx, 40, native=True)
    logits = greedy_logits(as_float64(model), native, 5, 24)
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02
    assert clear.sum() > 30
    assert torch.equal(native[0, 5:][clear], logits.argmax(-1)[clear])


@needs_kernels
def test_decoder_leaves_the_model_alone_and_checks_its_caches():
    model = tiny()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, torch.tensor([[1, 2, 3]]), 10, native=True)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    caches = model.new_caches(1)
    with pytest.raises(ValueError, match="one KVCache per layer"):
        NativeDecoder(model, caches[:1])
    caches[0] = KVCache(1, 4, 24, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="caches must be the model's own"):
        NativeDecoder(model, caches)
    caches = model.new_caches(1, 3)
    decoder = NativeDecoder(model, caches)
    for t in range(3):
        decoder.step(t)
    with pytest.raises(ValueError, match="full"):
        decoder.step(0)


def test_unsupported_models_fall_back_to_the_module_path():
    model = tiny()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert "batch of 2" in unsupported(model, 2)
    assert "float32 or bfloat16" in unsupported(tiny().double())

    class Sub(GPTModel):
        pass

    assert "plain GPTModel" in unsupported(Sub(model.cfg))
    mixed = tiny()
    mixed.trf_blocks[1].att.num_kv_groups = 2
    assert "same heads as it says" in unsupported(mixed)
    cross = tiny()
    cross.trf_blocks[0].att.causal = False
    assert "causal self-attention" in unsupported(cross)
    hooked, calls = tiny(), []
    handle = hooked.trf_blocks[1].ff.register_forward_hook(lambda *_: calls.append(1))
    assert "hooks" in unsupported(hooked)
    generate(hooked, idx[:1], 4)
    assert len(calls) == 4  # the prompt and three one-token steps, all through forward
    handle.remove()
    assert unsupported(hooked) == unsupported(model)
    # a batch of two decodes through the module path, as each row alone does
    out = generate(model, idx, 6)
    for row in range(2):
        assert torch.equal(out[row : row + 1], generate(model, idx[row : row + 1], 6,
                                                        native=False))
    with pytest.raises(ValueError, match="native=True, but .*batch of 2"):
        generate(model, idx, 2, native=True)
    with pytest.raises(ValueError, match="needs use_cache=True"):
        generate(model, idx[:1], 2, native=True, use_cache=False)


def test_switched_off_kernels_say_so(monkeypatch):
    import qkv.kernels as kernels

    monkeypatch.setenv("QKV_NATIVE", "0")
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.decode_kernels() is None
    assert "QKV_NATIVE=0" in kernels.unavailable_reason()
    model = tiny()
    assert "QKV_NATIVE=0" in unsupported(model)
    idx = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(model, idx, 5), generate(model, idx, 5, native=False))


@needs_kernels
def test_kernels_share_pytorchs_openmp_runtime():
    # one libgomp in the process: the kernels and PyTorch use the same threads
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp
    assert isinstance(LIB, ctypes.CDLL)


@needs_kernels
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512"
                    or os.environ.get("QKV_NATIVE_AVX512") == "0",
                    reason="the AVX2 build is the one these tests ran")
def test_the_avx2_build_passes_the_same_tests(tmp_path):
    # This CPU builds the AVX-512 dot products; a CPU without them runs the AVX2 ones,
    # built here by switching the wide ones off, and checked by the same tests (and the
    # block products' tests, whose AVX2 code differs most).
    env = {**os.environ, "QKV_NATIVE_AVX512": "0", "QKV_KERNEL_DIR": str(tmp_path)}
    blocks = [os.path.join(os.path.dirname(__file__), name)
              for name in ("test_quant_kernels.py", "test_quant_decode.py")]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         *blocks, "-k", "kernel and not avx2 or float64"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "passed" in proc.stdout
    built = list(tmp_path.glob("decode-*.so"))
    assert len(built) == 1  # the AVX2 build, on its own key


def test_prefetch_is_chosen_per_vendor_and_by_its_setting(monkeypatch):
    from qkv import kernels
    with open("/proc/cpuinfo") as f:
        intel = any(line.split(":")[0].strip() == "vendor_id" and "GenuineIntel" in line
                    for line in f)
    for setting, on in (("auto", intel), ("1", True), ("0", False)):
        monkeypatch.setenv("QKV_NATIVE_PREFETCH", setting)
        assert ("-DQKV_PREFETCH=1" in kernels.flags()) == on, setting
    monkeypatch.setenv("QKV_NATIVE_PREFETCH", "yes")
    with pytest.raises(ValueError, match="QKV_NATIVE_PREFETCH must be auto, 0 or 1, got 'yes'"):
        kernels.flags()


@needs_kernels
def test_the_other_prefetch_build_gives_the_same_products(tmp_path, monkeypatch):
    # Prefetching asks for lines early and changes no arithmetic: the build this CPU
    # does not choose gives the same bits, in both weight dtypes and every row tail.
    from qkv import kernels
    other = "0" if "-DQKV_PREFETCH=1" in kernels.flags() else "1"
    monkeypatch.setenv("QKV_NATIVE_PREFETCH", other)
    monkeypatch.setenv("QKV_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {})
    lib = kernels.decode_kernels()
    assert lib is not None and list(tmp_path.glob("decode-*.so"))
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n in ((37, 3000), (9, 1029)):
            w, x = torch.randn(rows, n, generator=g).to(dtype), torch.randn(n, generator=g)
            y, y_other = torch.empty(rows), torch.empty(rows)
            LIB.qkv_linear(mat(w), ptr(x), None, ptr(y), rows, n, 0, 2)
            lib.qkv_linear(mat(w), ptr(x), None, ptr(y_other), rows, n, 0, 2)
            assert torch.equal(y, y_other), (dtype, rows, n)


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_logits_to_keep_gives_the_last_positions_logits(family):
    model = tiny(**FAMILIES[family])
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)
        for n in (1, 3, 9, 20):
            torch.testing.assert_close(model(ids, logits_to_keep=n), full[:, -n:])
        caches = model.new_caches(2, 9)
        torch.testing.assert_close(model(ids, caches=caches, logits_to_keep=1), full[:, -1:])
    with pytest.raises(ValueError, match="logits_to_keep must be an integer >= 0"):
        model(ids, logits_to_keep=-1)
