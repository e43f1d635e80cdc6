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
    outputs agree past its chunk of 64, within 3e-5: both layers are given float64,
    but transformers' chunked rule computes in float32 (its error here is about 1e-5,
    for the unpadded row as much as for the padded ones)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=5,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8)
    torch.manual_seed(3)
    theirs = Qwen3NextGatedDeltaNet(config, 0).double().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    ours = GatedDeltaNet(16, 2, 5, num_v_heads=4, head_v_dim=6, conv_kernel_size=4)
    ours.load_state_dict(split_qkvz_ba(theirs.state_dict(), num_k_heads=2, num_v_heads=4,
                                       head_k_dim=5, head_v_dim=6))
    ours.double()
    rows = [torch.randn(n, 16, dtype=torch.float64) for n in (70, 41, 3)]
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
