"""Padding masks for ``GatedDeltaNet`` and the hybrid models: a batch of rows of
different lengths gives each row what it gives alone.

A padding position must leave the layer's memory untouched: decay 1 and write 0 in the
delta rule's state, and no input in the convolution's window. The references are the
same layer (or model) run on each row alone, without padding, in float64; and
transformers' own Qwen3-Next layer with an ``attention_mask`` (left padding, the case
it handles: it zeroes the padded hidden states before the layer).
"""

from __future__ import annotations

import pytest
import torch

from qkv.linear_attention import GatedDeltaNet, split_qkvz_ba

LENGTHS = [13, 5, 1, 20]  # one row unpadded, one of a single token


def layer(backend: str = "chunked") -> GatedDeltaNet:
    torch.manual_seed(0)
    att = GatedDeltaNet(16, 2, 5, num_v_heads=4, head_v_dim=6, conv_kernel_size=4,
                        chunk_size=8, backend=backend).double().eval()
    with torch.no_grad():
        for p in att.parameters():
            p.normal_(0, 0.5)
    return att


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``(T_i, d)`` left-padded with garbage to the longest: ``(batch, T, d)``
    and the mask ``(batch, T)``, True at padding."""
    longest = max(len(r) for r in rows)
    x = torch.randn(len(rows), longest, rows[0].shape[-1], dtype=rows[0].dtype) * 3
    pad = torch.ones(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        x[i, longest - len(r):] = r
        pad[i, longest - len(r):] = False
    return x, pad


@pytest.mark.parametrize("backend", ["chunked", "recurrent"])
def test_left_padded_rows_equal_each_row_alone(backend):
    """Outputs, the cache left behind (state and window), and three decoded steps after
    it: each row as alone, to 1e-12 in float64; the padding's outputs are 0."""
    att = layer(backend)
    torch.manual_seed(1)
    rows = [torch.randn(n, 16, dtype=torch.float64) for n in LENGTHS]
    steps = torch.randn(len(rows), 3, 16, dtype=torch.float64)
    x, pad = left_padded(rows)
    with torch.no_grad():
        cache = att.new_cache(len(rows))
        out = att(x, cache=cache, key_padding_mask=pad)
        state, conv = cache.state.clone(), cache.conv.clone()
        after = [att(steps[:, t : t + 1], cache=cache) for t in range(3)]
        assert out[pad].abs().max() == 0
        for i, row in enumerate(rows):
            alone = att.new_cache(1)
            torch.testing.assert_close(out[i, ~pad[i]], att(row[None], cache=alone)[0],
                                       rtol=0, atol=1e-12)
            torch.testing.assert_close(state[i], alone.state[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(conv[i], alone.conv[0], rtol=0, atol=1e-12)
            for t in range(3):
                torch.testing.assert_close(after[t][i], att(steps[i : i + 1, t : t + 1],
                                                             cache=alone)[0],
                                           rtol=0, atol=1e-12)


def test_padding_anywhere_is_skipped():
    """Padding in the middle or at the end of a row, in a call after a cached prompt:
    the real tokens' outputs and the cache are those of the row without it."""
    att = layer()
    torch.manual_seed(2)
    prompt = torch.randn(2, 6, 16, dtype=torch.float64)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, [2, 3, 7]] = True  # inside the row
    pad[1, 5:] = True  # at its end
    with torch.no_grad():
        cache = att.new_cache(2)
        att(prompt, cache=cache)
        out = att(x, cache=cache, key_padding_mask=pad)
        for i in range(2):
            alone = att.new_cache(1)
            att(prompt[i : i + 1], cache=alone)
            want = att(x[i : i + 1, ~pad[i]], cache=alone)[0]
            torch.testing.assert_close(out[i, ~pad[i]], want, rtol=0, atol=1e-12)
            torch.testing.assert_close(cache.state[i], alone.state[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(cache.conv[i], alone.conv[0], rtol=0, atol=1e-12)


def test_left_padding_matches_transformers_attention_mask():
    """transformers' Qwen3-Next layer with an ``attention_mask``: the real tokens'
    outputs agree past its chunk of 64, within 3e-5 (float32: about 1e-5 apart for the
    unpadded row as much as for the padded ones)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=5,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8)
    torch.manual_seed(3)
    theirs = Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    ours = GatedDeltaNet(16, 2, 5, num_v_heads=4, head_v_dim=6, conv_kernel_size=4)
    ours.load_state_dict(split_qkvz_ba(theirs.state_dict(), num_k_heads=2, num_v_heads=4,
                                       head_k_dim=5, head_v_dim=6))
    rows = [torch.randn(n, 16) for n in (66, 41, 3)]
    x, pad = left_padded(rows)
    with torch.no_grad():
        want = theirs(x, attention_mask=(~pad).long())
        got = ours(x, key_padding_mask=pad)
    torch.testing.assert_close(got[~pad], want[~pad], rtol=0, atol=3e-5)


def test_mask_is_checked():
    att = layer()
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    for bad in (torch.zeros(2, 4), torch.zeros(2, 5, dtype=torch.bool), [[False] * 4] * 2):
        with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor of "
                                             r"shape \(2, 4\) \(True = padding\), got"):
            att(x, key_padding_mask=bad)


# ----------------------------------------------------------------------------
# The hybrid models: a batch of left-padded prompts


def hybrid(family: str):
    """A tiny transformers model of ``family`` (test_open_models' shapes, matrices scaled
    up so that greedy tokens vary) and the same model in qkv."""
    transformers = pytest.importorskip("transformers")
    from qkv.models.gpt import GPTConfig, GPTModel
    from qkv.models.hf_open import config_fields, to_qkv
    from test_open_models import FAMILIES, hf_model

    hf = hf_model(family, seed=5)
    assert isinstance(hf.config, (transformers.Qwen3NextConfig, transformers.Qwen3_5TextConfig))
    config = {**hf.config.to_dict(), "model_type": FAMILIES[family]().model_type}
    fields = config_fields(config, family)
    model = GPTModel(GPTConfig(**fields)).eval()
    model.load_state_dict(to_qkv(hf.state_dict(), fields, config["model_type"]))
    return hf, model


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_batch_of_prompts_equals_each_prompt_alone(family):
    """Prompts of 9, 4 and 14 tokens, left-padded to 14: in float64, each row's logits at
    its own tokens are those it gets alone (1e-10), and its 8 greedy tokens, cached and
    not; in float32, transformers' logits with the same ``attention_mask`` (1e-4)."""
    from qkv.models.gpt import generate
    from test_open_models import VOCAB

    hf, model = hybrid(family)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (9, 4, 14)]
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    pad = torch.ones(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):], pad[i, longest - len(p):] = p, False
    with torch.no_grad():
        want = hf(ids, attention_mask=(~pad).long()).logits
        torch.testing.assert_close(model(ids, key_padding_mask=pad)[~pad], want[~pad],
                                   rtol=0, atol=1e-4)
        model.double()
        logits = model(ids, key_padding_mask=pad)
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i, ~pad[i]], model(p[None])[0], rtol=0,
                                       atol=1e-10)
    for use_cache in (True, False):
        batch = generate(model, ids, 8, use_cache=use_cache, key_padding_mask=pad)
        for i, p in enumerate(prompts):
            alone = generate(model, p[None], 8, use_cache=use_cache)
            assert batch[i, longest:].tolist() == alone[0, len(p):].tolist()
    assert len(set(batch[:, longest:].flatten().tolist())) > 2  # the tokens vary


def test_padding_is_refused_where_it_cannot_be_honoured():
    from qkv.models.gpt import GPTConfig, GPTModel, generate

    _, model = hybrid("qwen3_5_text")
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor of shape "
                                         r"\(2, 5\) \(the cached tokens, then idx's"):
        model(ids, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"native=True does not take a key_padding_mask"):
        generate(model, ids, 2, native=True, key_padding_mask=torch.zeros(2, 5,
                                                                          dtype=torch.bool))
    windowed = GPTModel(GPTConfig(vocab_size=16, context_length=8, emb_dim=16, n_heads=2,
                                  n_layers=1, rope=True, window_size=4))
    with pytest.raises(ValueError, match=r"key_padding_mask: a sliding window \(window_size"
                                         r"=4\) caches in rings"):
        generate(windowed, ids, 2, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    generate(windowed, ids, 2, use_cache=False,
             key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    latent = GPTModel(GPTConfig(vocab_size=16, context_length=8, emb_dim=16, n_heads=2,
                                n_layers=1, rope=True, layout=[{"attention": "latent"}],
                                attention_options={"latent": {
                                    "kv_lora_rank": 4, "q_lora_rank": None,
                                    "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
                                    "v_head_dim": 4}}))
    with pytest.raises(ValueError, match=r"key_padding_mask: 'latent' layers take no "
                                         r"padding mask \(those of mha, sink"):
        latent(ids, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
