"""qkv.models.gpt: the book's GPTModel, its config, the KV cache path and generate()."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from qkv.kv_cache import KVCache
from qkv.models.gpt import (
    PRESETS,
    GPTConfig,
    GPTModel,
    LayerNorm,
    TransformerBlock,
    generate,
    generate_text_simple,
)

# LLMs-from-scratch chapter 4
GPT_CONFIG_124M = {
    "vocab_size": 50257,
    "context_length": 1024,
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}



def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


def tiny(**overrides) -> GPTModel:
    cfg = dict(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
               drop_rate=0.0)
    torch.manual_seed(0)
    return GPTModel(GPTConfig(**{**cfg, **overrides})).double().eval()


def prompt(batch=2, length=5, vocab=50, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def greedy_margins(model, ids: torch.Tensor, prompt_len: int, context: int) -> torch.Tensor:
    """Gap between the two largest logits behind each token after the prompt in
    ``ids (batch, T)``, recomputed without a cache -> ``(batch, T - prompt_len)``.

    Two decoders that round differently can only disagree where this gap is within
    their rounding: a test of identical tokens first checks it is not."""
    gaps = []
    with torch.no_grad():
        for t in range(prompt_len, ids.shape[1]):
            top2 = model(ids[:, max(0, t - context) : t])[:, -1].topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
    return torch.stack(gaps, dim=1)


# ----------------------------------------------------------------------------
# Config


def test_config_round_trip_presets_and_book_dict():
    cfg = GPTConfig.preset("tiny", vocab_size=257, tie_weights=True)
    assert (cfg.vocab_size, cfg.emb_dim, cfg.tie_weights) == (257, 64, True)
    assert GPTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert GPTConfig.from_dict(GPT_CONFIG_124M) == GPTConfig() == GPTConfig.preset("gpt2-small")
    assert cfg["emb_dim"] == 64  # the book's classes read cfg["..."]
    assert {"gpt2-small", "tiny", "mini"} <= set(PRESETS)
    for name in PRESETS:
        GPTConfig.preset(name)  # every preset is valid


def test_config_errors_are_one_line():
    raises_one_line(ValueError, r"emb_dim \(10\) must be divisible by num_heads \(4\)",
                    GPTConfig, emb_dim=10, n_heads=4)
    raises_one_line(ValueError, r"dropout must be a probability in \[0, 1\), got 1.0",
                    GPTConfig, drop_rate=1.0)
    raises_one_line(ValueError,
                    r"GPTConfig.n_layers must be an integer in \[1, 2147483647\], got 0",
                    GPTConfig, n_layers=0)
    raises_one_line(ValueError, "GPTConfig.emb_dim must be an integer in .* got True",
                    GPTConfig, emb_dim=True)
    raises_one_line(ValueError, "GPTConfig.vocab_size .* got an integer of about 401 digits",
                    GPTConfig, vocab_size=10**400)
    raises_one_line(ValueError, "GPTConfig.drop_rate must be a finite number, got nan",
                    GPTConfig, drop_rate=float("nan"))
    # a width that does not split into the heads: a quick message even at 2**31 - 2
    # (= 2 * 3**2 * 7 * 11 * 31 * 151 * 331, whose smallest divisors are listed)
    raises_one_line(ValueError, r"num_heads in \[1, 2, 3, 6, 7, 9, 11, 14\]",
                    GPTConfig, emb_dim=2**31 - 2, n_heads=4)
    raises_one_line(ValueError, "GPTConfig.tie_weights must be True or False",
                    GPTConfig, tie_weights="yes")
    raises_one_line(ValueError, r"unknown GPTConfig field\(s\) \['emb_size'\]",
                    GPTConfig.from_dict, {"emb_size": 4})
    raises_one_line(ValueError, "unknown GPT preset 'huge'; choose one of: gpt2-small",
                    GPTConfig.preset, "huge")
    raises_one_line(ValueError, r"unknown GPTConfig field\(s\) \['layers'\]",
                    GPTConfig.preset, "tiny", layers=3)


# ----------------------------------------------------------------------------
# Model


def test_parameter_counts_of_gpt2_small():
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        untied = GPTModel(GPT_CONFIG_124M)
        tied = GPTModel(GPTConfig(tie_weights=True))
    assert n_params(untied) == 163_009_536
    assert untied.out_head.weight.numel() == 38_597_376
    assert n_params(tied) == 124_412_160
    assert n_params(untied.trf_blocks[0].att) == 2_360_064


@pytest.mark.parametrize("tie_weights", [False, True])
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("sizes", [dict(vocab_size=11, context_length=5, emb_dim=8, n_heads=2,
                                        n_layers=1),
                                   dict(vocab_size=257, context_length=16, emb_dim=12,
                                        n_heads=3, n_layers=3)])
@pytest.mark.parametrize("modern", [{}, {"n_kv_groups": 1, "rope": True},
                                    {"window_size": 2}])
def test_sizes_from_the_config_match_the_built_model(sizes, qkv_bias, tie_weights, modern):
    """Parameter count and state_dict shapes, by arithmetic, against the real model (a tied
    head is one parameter listed under two names)."""
    if modern.get("rope") and sizes["emb_dim"] // sizes["n_heads"] % 2:
        modern = {**modern, "rope": False}  # rotary embeddings need an even head size
    cfg = GPTConfig(**sizes, qkv_bias=qkv_bias, tie_weights=tie_weights, **modern)
    model = GPTModel(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    assert list(model.buffers()) == []
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert list(cfg.parameter_shapes()) == shapes


def test_parameter_count_of_the_presets():
    # GPT-2 small with the book's separate head (its §4.6 number) and OpenAI's tied 124M
    assert GPTConfig().num_parameters() == 163_009_536
    assert GPTConfig(tie_weights=True).num_parameters() == 124_412_160
    # the larger presets, counted without building them (the book's exercise 4.1 numbers)
    assert GPTConfig.preset("gpt2-medium").num_parameters() == 406_212_608
    assert GPTConfig.preset("gpt2-large").num_parameters() == 838_220_800
    assert GPTConfig.preset("gpt2-xl").num_parameters() == 1_637_792_000


def test_book_names_and_shapes():
    model = tiny()
    names = set(model.state_dict())
    assert {"tok_emb.weight", "pos_emb.weight", "trf_blocks.0.att.W_query.weight",
            "trf_blocks.1.att.out_proj.bias", "trf_blocks.0.ff.layers.0.weight",
            "trf_blocks.0.ff.layers.2.bias", "trf_blocks.0.norm1.scale",
            "trf_blocks.1.norm2.shift", "final_norm.scale", "out_head.weight"} <= names
    # a checkpoint of the book's model also holds each layer's causal-mask buffer
    book_state = {**model.state_dict(), "trf_blocks.0.att.mask": torch.ones(16, 16).triu(1),
                  "trf_blocks.1.att.mask": torch.ones(16, 16).triu(1)}
    tiny().load_state_dict(book_state, strict=True)
    assert model(prompt()).shape == (2, 5, 50)
    block = TransformerBlock(model.cfg).double()
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    assert block(x).shape == (3, 7, 32)
    ln = LayerNorm(32).double()
    assert torch.allclose(ln(x), torch.nn.functional.layer_norm(x, (32,)))
    raises_one_line(ValueError, "sequence of 17 tokens is longer than context_length=16",
                    model, prompt(length=17))


def test_seeded_model_reproduces_the_book():
    # LLMs-from-scratch §4.7: torch.manual_seed(123), untrained 124M model, "Hello, I am"
    torch.manual_seed(123)
    model = GPTModel(GPT_CONFIG_124M)
    model.eval()
    out = generate_text_simple(model, torch.tensor([[15496, 11, 314, 716]]), 6, 1024)
    # The book's tokens came from other kernels on another CPU; they must match exactly,
    # which is meaningful because no choice is a near-tie (closest gap 0.02, while float32
    # rounding moves these logits by ~1e-5 at most).
    assert greedy_margins(model, out, 4, 1024).min() > 1e-3
    assert out.tolist() == [[15496, 11, 314, 716, 27018, 24086, 47843, 30961, 42348, 7267]]


def test_tied_weights_share_storage():
    model = tiny(tie_weights=True)
    assert model.out_head.weight is model.tok_emb.weight
    assert model.out_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    untied = tiny()
    assert n_params(untied) - n_params(model) == 50 * 32
    # one update reaches both uses
    model(prompt()).sum().backward()
    with torch.no_grad():
        model.tok_emb.weight -= 0.1 * model.tok_emb.weight.grad
    assert torch.equal(model.out_head.weight, model.tok_emb.weight)
    # a saved state dict loads back into a tied model and stays tied
    again = tiny(tie_weights=True)
    again.load_state_dict(model.state_dict())
    assert again.out_head.weight is again.tok_emb.weight
    assert torch.equal(again.tok_emb.weight, model.tok_emb.weight)


def layouts(model) -> dict[str, tuple]:
    """Where and how every parameter is stored: (data pointer, strides, contiguous)."""
    return {name: (p.data_ptr(), p.stride(), p.is_contiguous())
            for name, p in model.named_parameters()}


def test_train_and_eval_only_switch_modes(tmp_path):
    from safetensors.torch import load_file, save_file

    from qkv.training.checkpoint import load_weights, save_checkpoint

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4,
                               n_layers=2, drop_rate=0.1))
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    stored = layouts(model)
    assert all(contiguous for _, _, contiguous in stored.values())
    state = model.state_dict()

    for switch in (model.eval, model.train, model.eval, model.train, model.eval):
        switch()
        assert layouts(model) == stored  # no copy, no new layout
        for name, p in model.named_parameters():
            assert p is params[name]
            assert torch.equal(p, before[name])
    assert not model.training

    # after .eval(), state_dict() holds the parameters' own contiguous tensors
    after = model.state_dict()
    assert list(after) == list(state)
    for name, t in after.items():
        assert t.is_contiguous(), name
        assert t.data_ptr() == params[name].data_ptr(), name
    save_file(after, str(tmp_path / "model.safetensors"))  # refuses non-contiguous tensors
    for name, t in load_file(str(tmp_path / "model.safetensors")).items():
        assert torch.equal(t, before[name])

    # a checkpoint written in eval mode loads into a fresh model, values intact
    save_checkpoint(tmp_path / "ckpt", model, {"task": "lm"})
    fresh = GPTModel(model.cfg)
    load_weights(tmp_path / "ckpt", fresh)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, before[name])


def naive_greedy(model, idx: torch.Tensor, steps: int, context: int) -> torch.Tensor:
    """The book's generate_text_simple: full forward over the cropped window, argmax."""
    ids = idx.clone()
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids[:, -context:])[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat((ids, nxt), dim=1)
    return ids


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cached_generation_equals_a_naive_loop_and_changes_no_parameter(dtype):
    model = tiny().to(dtype)
    idx = prompt(length=5)
    expected = naive_greedy(model, idx, 30, 16)  # 35 tokens through a 16-token context
    # the paths sum in different orders; identical tokens hold because no choice is a tie
    assert greedy_margins(model, expected, 5, 16).min() > 1e-4
    stored = layouts(model)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    assert torch.equal(generate(model, idx, 30), expected)
    assert torch.equal(generate_text_simple(model, idx, 30, 16), expected)
    assert layouts(model) == stored
    for name, t in model.state_dict().items():
        assert t.is_contiguous() and torch.equal(t, state[name]), name


def test_need_weights_are_causal_distributions():
    model = tiny()
    logits, weights = model(prompt(length=9), need_weights=True)
    assert torch.allclose(logits, model(prompt(length=9)))
    assert len(weights) == 2
    for w in weights:
        assert w.shape == (2, 4, 9, 9)
        assert torch.allclose(w.sum(-1), torch.ones(2, 4, 9, dtype=w.dtype))
        assert torch.all(w.triu(diagonal=1) == 0)


def test_cached_forward_matches_the_full_forward():
    model = tiny().float()
    idx = prompt(length=12)
    full = model(idx)
    caches = model.new_caches(2)
    assert len(caches) == 2 and all(isinstance(c, KVCache) for c in caches)
    parts = [model(idx[:, :7], caches=caches)]
    parts += [model(idx[:, t : t + 1], caches=caches) for t in range(7, 12)]
    assert caches[0].pos == 12
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)
    raises_one_line(ValueError, r"need one KVCache per layer \(2\), got 1",
                    model, idx, caches=caches[:1])
    raises_one_line(ValueError, r"max_len must be in \[1, context_length=16\], got 17",
                    model.new_caches, 1, 17)


def test_init_weights():
    model = tiny().float().init_weights()
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.003
    assert abs(model.trf_blocks[0].ff.layers[2].weight.std().item() - 0.01) < 0.002
    assert torch.all(model.trf_blocks[0].ff.layers[0].bias == 0)


# ----------------------------------------------------------------------------
# Generation


def test_greedy_with_cache_equals_without_past_the_context():
    model = tiny()
    idx = prompt(length=5)
    cached = generate(model, idx, 40)  # 45 tokens through a 16-token context
    plain = generate(model, idx, 40, use_cache=False)
    assert cached.shape == (2, 45)
    # Cache and full recompute sum in different orders, so their float64 logits agree to
    # ~1e-15, not bit for bit. Identical tokens are the promise; it holds because no
    # greedy choice here is anywhere near a tie (closest gap 6e-4).
    assert greedy_margins(model, plain, 5, 16).min() > 1e-9
    assert torch.equal(cached, plain)
    assert torch.equal(cached[:, :5], idx)
    # a prompt longer than the context is cropped the same way on both paths
    long = prompt(length=30)
    long_plain = generate(model, long, 8, use_cache=False)
    assert greedy_margins(model, long_plain, 30, 16).min() > 1e-9
    assert torch.equal(generate(model, long, 8), long_plain)
    # and the book's crop, done by hand, runs the same kernels as use_cache=False: same tokens
    ids = idx.clone()
    with torch.no_grad():
        for _ in range(40):
            nxt = model(ids[:, -16:])[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat((ids, nxt), dim=1)
    assert torch.equal(ids, plain)


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = tiny()
    idx = prompt()

    def sample(seed, **kw):
        return generate(model, idx, 20, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(7), sample(7))
    assert not torch.equal(sample(7), sample(8))
    # float64 probabilities of the two paths differ by ~1e-16: a token could only change
    # if the seeded draw fell that close to the edge between two tokens.
    assert torch.equal(sample(7), sample(7, use_cache=False))
    greedy = generate(model, idx, 20)
    assert torch.equal(sample(3, top_k=1), greedy)
    # top_k restricts every sampled token to the k most likely
    out = generate(model, idx[:1], 1, temperature=5.0, top_k=3,
                   generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top3 = model(idx[:1])[0, -1].topk(3).indices
    assert out[0, -1] in top3


def test_generate_runs_in_eval_mode_and_restores_it():
    model = tiny(drop_rate=0.5)
    idx = prompt()
    expected = generate(model, idx, 10)
    model.train()
    assert torch.equal(generate(model, idx, 10), expected)
    assert model.training


def test_eos_stops_and_pads():
    model = tiny()
    idx = prompt()
    greedy = generate(model, idx, 10)
    eos = int(greedy[0, 5])  # the first token row 0 generates
    out = generate(model, idx, 10, eos_id=eos)
    assert torch.equal(out[0, 5:], torch.full_like(out[0, 5:], eos))
    row1 = greedy[1, 5:].tolist()
    if eos in row1:  # stops when the last row reaches eos
        assert out.shape[1] == 5 + row1.index(eos) + 1
    else:
        assert torch.equal(out[1], greedy[1])


def test_generate_argument_errors():
    model = tiny()
    idx = prompt()
    raises_one_line(ValueError, "temperature must be a finite number >= 0", generate,
                    model, idx, 3, temperature=-1.0)
    raises_one_line(ValueError, "temperature must be a finite number >= 0", generate,
                    model, idx, 3, temperature=math.nan)
    raises_one_line(ValueError, "top_k must be a positive integer or None, got 0", generate,
                    model, idx, 3, top_k=0)
    raises_one_line(ValueError, r"max_new_tokens must be an integer in \[0, 100,000\], got -1",
                    generate, model, idx, -1)
    raises_one_line(ValueError, r"idx must be integer ids of shape \(batch, T >= 1\)",
                    generate, model, idx[0], 3)
    raises_one_line(ValueError, r"context_size must be in \[1, context_length=16\], got 32",
                    generate, model, idx, 3, context_size=32)
    assert torch.equal(generate(model, idx, 0), idx)


def test_the_modern_preset_decodes_past_its_context_the_same_with_and_without_cache():
    from qkv.models.gpt import generate

    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny-modern", vocab_size=50, context_length=16, window_size=8)
    model = GPTModel(cfg).init_weights().eval()
    assert model.pos_emb is None and model.trf_blocks[0].att.num_kv_groups == 2
    prompt = torch.randint(0, 50, (2, 5))
    cached = generate(model, prompt, 40, use_cache=True)  # 45 tokens, context 16
    # The reference: the same weights (a RoPE model's shapes do not depend on its
    # context) reading the whole sequence at once, each step, no cache, no crop.
    whole = GPTModel(dataclasses.replace(cfg, context_length=64)).eval()
    whole.load_state_dict(model.state_dict())
    assert torch.equal(cached, generate(whole, prompt, 40, use_cache=False))
    # Without the cache, the 16-token crop re-read from position 0 is the same here:
    # RoPE sees differences of positions, and two layers of 8-token windows reach back
    # 15 tokens, inside the crop.
    assert torch.equal(cached, generate(model, prompt, 40, use_cache=False))
    caches = model.new_caches(2)
    assert [tuple(c.keys.shape) for c in caches] == [(2, 2, 8, 16)] * cfg.n_layers
    held = sum(c.keys.numel() + c.values.numel() for c in caches) * 4
    assert held == cfg.kv_cache_bytes(2, 45)


def test_kv_cache_bytes_of_gpt2_small_for_mha_gqa_and_a_window():
    cfg = GPTConfig.preset("gpt2-small")
    assert cfg.kv_cache_bytes(1, 1024) == 12 * 2 * 12 * 64 * 1024 * 4  # 72 MiB
    gqa = GPTConfig.preset("gpt2-small", n_kv_groups=4)
    assert gqa.kv_cache_bytes(1, 1024) == cfg.kv_cache_bytes(1, 1024) // 3
    windowed = GPTConfig.preset("gpt2-small", window_size=256)
    assert windowed.kv_cache_bytes(1, 32_768) == cfg.kv_cache_bytes(1, 256)
