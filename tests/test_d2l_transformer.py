"""The attention chapters' multi-head attention and Transformer, in both books' forms.

d2l-zh 2.0 (``chapter_attention-mechanisms``) and d2l 1.0.3
(``chapter_attention-mechanisms-and-transformers``) build the same Transformer with
different signatures. Checked here: the shapes and values the chapters' cells print, the
classes against a float64 reimplementation written from the formulas (below, reading the
parameters by d2l's names), the books' parameter creation order and dropout draws (so a
seed gives the books' numbers), the dispatch between the two forms, and one-line errors.
"""

import math
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qkv import d2l

# ----------------------------------------------------------------------------
# The reference: float64, from the formulas, parameters read by d2l's names


def linear(x, p, name):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def masked_softmax_ref(scores, valid_lens):
    """Softmax over keys; keys at index >= valid_len get d2l's -1e6, so a row with
    valid_len 0 is uniform. ``valid_lens`` None, ``(b,)`` or ``(b, n_q)``."""
    if valid_lens is None:
        return torch.softmax(scores, -1)
    b, n_q, n_k = scores.shape
    lens = valid_lens[:, None].expand(b, n_q) if valid_lens.dim() == 1 else valid_lens
    keep = torch.arange(n_k)[None, None, :] < lens[:, :, None]
    return torch.softmax(torch.where(keep, scores, torch.tensor(-1e6, dtype=scores.dtype)), -1)


def mha_ref(p, pre, queries, keys, values, valid_lens, num_heads, dropout=None):
    """Head by head: ``(out, weights (b * num_heads, n_q, n_k))``, head ``j`` of example
    ``i`` at row ``i * num_heads + j``. ``dropout(weights_folded)`` in training."""
    Q, K, V = (linear(x, p, pre + n) for x, n in ((queries, "W_q"), (keys, "W_k"),
                                                   (values, "W_v")))
    d = Q.shape[-1] // num_heads
    heads = [slice(j * d, (j + 1) * d) for j in range(num_heads)]
    weights = torch.stack([masked_softmax_ref(Q[..., s] @ K[..., s].transpose(1, 2)
                                              / math.sqrt(d), valid_lens) for s in heads], 1)
    folded = weights.reshape(-1, *weights.shape[2:])
    dropped = (dropout(folded) if dropout else folded).reshape(weights.shape)
    out = torch.cat([dropped[:, j] @ V[..., s] for j, s in enumerate(heads)], -1)
    return linear(out, p, pre + "W_o"), folded


def layer_norm_ref(x, p, name, ndim):
    dims = tuple(range(-ndim, 0))
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]


def ffn_ref(p, pre, x):
    return linear(torch.relu(linear(x, p, pre + "dense1")), p, pre + "dense2")


def encoder_block_ref(p, pre, X, valid_lens, num_heads, ndim=1):
    att, w = mha_ref(p, pre + "attention.", X, X, X, valid_lens, num_heads)
    Y = layer_norm_ref(X + att, p, pre + "addnorm1.ln", ndim)
    return layer_norm_ref(Y + ffn_ref(p, pre + "ffn.", Y), p, pre + "addnorm2.ln", ndim), w


def sinusoids(T, d):
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    angle = pos / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    P = torch.zeros(T, d, dtype=torch.float64)
    P[:, 0::2], P[:, 1::2] = torch.sin(angle), torch.cos(angle)
    return P


def embed_ref(p, X, d):
    # d2l's table, and so qkv.d2l's, is computed in float32: a float64 model adds a table
    # exact to about 1e-7, hence the tolerances of the encoder and decoder tests.
    return p["embedding.weight"][X] * math.sqrt(d) + sinusoids(X.shape[1], d)


def encoder_ref(p, X, valid_lens, num_heads, num_blks):
    H = embed_ref(p, X, p["embedding.weight"].shape[1])
    weights = []
    for i in range(num_blks):
        H, w = encoder_block_ref(p, f"blks.block{i}.", H, valid_lens, num_heads)
        weights.append(w)
    return H, weights


def decoder_ref(p, X, enc, enc_lens, num_heads, num_blks, past, causal):
    """One decoder call on ``X (b, T)``; ``past[i]`` holds block i's earlier inputs (or
    None) and is extended. ``causal``: training's mask (position t sees 0 .. t)."""
    H = embed_ref(p, X, p["embedding.weight"].shape[1])
    self_w, cross_w = [], []
    for i in range(num_blks):
        pre = f"blks.block{i}."
        kv = H if past[i] is None else torch.cat((past[i], H), 1)
        past[i] = kv
        lens = torch.arange(1, H.shape[1] + 1).repeat(H.shape[0], 1) if causal else None
        a1, w1 = mha_ref(p, pre + "attention1.", H, kv, kv, lens, num_heads)
        Y = layer_norm_ref(H + a1, p, pre + "addnorm1.ln", 1)
        a2, w2 = mha_ref(p, pre + "attention2.", Y, enc, enc, enc_lens, num_heads)
        Z = layer_norm_ref(Y + a2, p, pre + "addnorm2.ln", 1)
        H = layer_norm_ref(Z + ffn_ref(p, pre + "ffn.", Z), p, pre + "addnorm3.ln", 1)
        self_w.append(w1)
        cross_w.append(w2)
    return linear(H, p, "dense"), [self_w, cross_w]


def params(module):
    return {k: v.double() for k, v in module.state_dict().items()}


def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


# The d2l-zh chapter's Transformer sizes, and d2l 1.0.3's.
ZH_ENC = dict(vocab_size=30, key_size=16, query_size=16, value_size=16, num_hiddens=16,
              norm_shape=[16], ffn_num_input=16, ffn_num_hiddens=32, num_heads=4,
              num_layers=2, dropout=0.0)
EN_ENC = dict(vocab_size=30, num_hiddens=16, ffn_num_hiddens=32, num_heads=4, num_blks=2,
              dropout=0.0)


# ----------------------------------------------------------------------------
# Multi-head attention: the chapters' cells


def test_zh_multihead_cell_shape_and_values():
    """d2l-zh: ``MultiHeadAttention(100, 100, 100, 100, 5, 0.5)`` on ones, valid lengths
    [3, 2]: ``torch.Size([2, 4, 100])``. Identical keys give uniform weights over the
    valid keys; identical values give ``W_o W_v 1`` at every position."""
    torch.manual_seed(0)
    attention = d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5)
    attention.eval()
    X, Y = torch.ones(2, 4, 100), torch.ones(2, 6, 100)
    out = attention(X, Y, Y, torch.tensor([3, 2]))
    assert out.shape == torch.Size([2, 4, 100])
    w = attention.attention.attention_weights
    assert w.shape == (10, 4, 6)
    expect = torch.zeros(10, 4, 6)
    expect[:5, :, :3], expect[5:, :, :2] = 1 / 3, 1 / 2
    torch.testing.assert_close(w, expect)
    W_v, W_o = attention.W_v.weight.double(), attention.W_o.weight.double()
    ref = W_o @ (W_v @ torch.ones(100, dtype=torch.float64))
    torch.testing.assert_close(out.double(), ref.expand(2, 4, 100), rtol=1e-5, atol=1e-6)
    # d2l's modules, names and order: the cell's `attention.eval()` prints d2l's repr
    assert [name for name, _ in attention.named_children()] == [
        "attention", "W_q", "W_k", "W_v", "W_o"]
    assert isinstance(attention.attention, d2l.DotProductAttention)
    assert repr(attention).splitlines()[1:4] == [
        "  (attention): DotProductAttention(", "    (dropout): Dropout(p=0.5, inplace=False)",
        "  )"]


def test_self_attention_cell_shape():
    """d2l-zh's self-attention section: ``attention(X, X, X, valid_lens).shape``."""
    attention = d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
    X = torch.ones(2, 4, 100)
    assert attention(X, X, X, torch.tensor([3, 2])).shape == torch.Size([2, 4, 100])


@pytest.mark.parametrize("form", ["zh", "en"])
@pytest.mark.parametrize("valid_lens", [None, [3, 0], [[1, 6, 2, 0], [5, 1, 0, 3]]],
                         ids=["none", "1d", "2d"])
def test_multihead_against_reference(form, valid_lens):
    torch.manual_seed(1)
    m = (d2l.MultiHeadAttention(5, 3, 7, 12, 3, 0.0, True) if form == "zh"
         else d2l.MultiHeadAttention(12, 3, 0.0, True))
    q = torch.randn(2, 4, 3 if form == "zh" else 5, dtype=torch.float64)
    k = torch.randn(2, 6, 5 if form == "zh" else 4, dtype=torch.float64)
    v = torch.randn(2, 6, 7 if form == "zh" else 9, dtype=torch.float64)
    lens = None if valid_lens is None else torch.tensor(valid_lens)
    m = m.double().eval()
    out = m(q, k, v, lens)
    expect, weights = mha_ref(params(m), "", q, k, v, lens, 3)
    torch.testing.assert_close(out, expect, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(m.attention.attention_weights, weights, atol=1e-12, rtol=0)
    # the same numbers in qkv's (batch, num_heads, n_q, n_k)
    assert torch.equal(m.attention_weights.reshape(6, 4, 6), m.attention.attention_weights)


def test_multihead_weights_are_there_after_every_forward():
    m = d2l.MultiHeadAttention(8, 8, 8, 8, 2, 0.0).eval()
    for n_k in (3, 5):
        m(torch.randn(1, 1, 8), torch.randn(1, n_k, 8), torch.randn(1, n_k, 8), None)
        assert m.attention.attention_weights.shape == (2, 1, n_k)


def test_zh_form_draws_d2l_parameters_in_order():
    """d2l-zh creates W_q, W_k, W_v, W_o as nn.Linear(query/key/value/num_hiddens,
    num_hiddens) in that order: the same seed gives the same weights."""
    torch.manual_seed(7)
    m = d2l.MultiHeadAttention(3, 5, 7, 8, 2, 0.0, True)
    torch.manual_seed(7)
    expect = [nn.Linear(5, 8), nn.Linear(3, 8), nn.Linear(7, 8), nn.Linear(8, 8)]
    for layer, ref in zip((m.W_q, m.W_k, m.W_v, m.W_o), expect, strict=True):
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    assert list(m.state_dict()) == [f"W_{n}.{t}" for n in "qkvo" for t in ("weight", "bias")]


def test_en_form_is_lazy_and_draws_on_the_first_call_in_d2l_order():
    """d2l 1.0.3's projections are LazyLinear, initialised when the first call reaches
    them: W_q, W_k, W_v, then W_o."""
    torch.manual_seed(8)
    m = d2l.MultiHeadAttention(8, 2, 0.0)
    assert all(isinstance(layer, nn.LazyLinear) for layer in (m.W_q, m.W_k, m.W_v, m.W_o))
    q, kv = torch.ones(2, 3, 5), torch.ones(2, 4, 6)
    m(q, kv, kv, None)
    torch.manual_seed(8)
    ref = [nn.LazyLinear(8, bias=False) for _ in range(4)]
    ref[0](q), ref[1](kv), ref[2](kv), ref[3](torch.ones(1, 8))
    for layer, r in zip((m.W_q, m.W_k, m.W_v, m.W_o), ref, strict=True):
        assert type(layer) is nn.Linear and torch.equal(layer.weight, r.weight)
    assert (m.W_q.in_features, m.W_k.in_features, m.W_v.in_features) == (5, 6, 6)


def test_en_form_loads_a_d2l_state_dict_before_any_call():
    torch.manual_seed(9)
    sized = d2l.MultiHeadAttention(8, 8, 8, 8, 2).eval()
    lazy = d2l.MultiHeadAttention(8, 2).eval()
    lazy.load_state_dict(sized.state_dict())
    x = torch.randn(1, 3, 8)
    torch.testing.assert_close(lazy(x, x, x, None), sized(x, x, x, None))


def test_transpose_qkv_and_output():
    X = torch.randn(2, 5, 12)
    folded = d2l.transpose_qkv(X, 3)
    assert folded.shape == (6, 5, 4)
    for i in range(2):
        for j in range(3):
            assert torch.equal(folded[i * 3 + j], X[i, :, j * 4:(j + 1) * 4])
    assert torch.equal(d2l.transpose_output(folded, 3), X)
    m = d2l.MultiHeadAttention(12, 3)
    assert torch.equal(m.transpose_qkv(X), folded)  # d2l 1.0.3's methods
    assert torch.equal(m.transpose_output(folded), X)


# ----------------------------------------------------------------------------
# The Transformer: the chapters' cells


def test_zh_ffn_and_addnorm_cells():
    torch.manual_seed(0)
    ffn = d2l.PositionWiseFFN(4, 4, 8)
    ffn.eval()
    out = ffn(torch.ones(2, 3, 4))[0]
    assert out.shape == (3, 8)
    # the same MLP at every position: equal inputs, equal rows
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
    torch.testing.assert_close(out.double(), ffn_ref(params(ffn), "", torch.ones(3, 4,
                                                                             dtype=torch.float64)))
    assert type(ffn.dense1) is nn.Linear and ffn.dense1.in_features == 4
    add_norm = d2l.AddNorm([3, 4], 0.5)
    add_norm.eval()
    out = add_norm(torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert out.shape == torch.Size([2, 3, 4])
    assert torch.equal(out, torch.zeros(2, 3, 4))  # constant input: normalised to 0


def test_en_ffn_and_addnorm_cells():
    ffn = d2l.PositionWiseFFN(4, 8)
    assert isinstance(ffn.dense1, nn.LazyLinear) and isinstance(ffn.dense2, nn.LazyLinear)
    ffn.eval()
    assert ffn(torch.ones(2, 3, 4))[0].shape == (3, 8)
    assert ffn.dense1.in_features == 4
    add_norm = d2l.AddNorm(4, 0.5)
    assert add_norm(torch.ones(2, 3, 4), torch.ones(2, 3, 4)).shape == (2, 3, 4)
    assert d2l.AddNorm(norm_shape=4, dropout=0.5).ln.normalized_shape == (4,)
    assert d2l.AddNorm(normalized_shape=[3, 4], dropout=0.5).ln.normalized_shape == (3, 4)


def test_zh_encoder_cells():
    X, valid_lens = torch.ones(2, 100, 24), torch.tensor([3, 2])
    encoder_blk = d2l.EncoderBlock(24, 24, 24, 24, [100, 24], 24, 48, 8, 0.5)
    encoder_blk.eval()
    assert encoder_blk(X, valid_lens).shape == torch.Size([2, 100, 24])
    encoder = d2l.TransformerEncoder(200, 24, 24, 24, 24, [100, 24], 24, 48, 8, 2, 0.5)
    encoder.eval()
    assert encoder(torch.ones((2, 100), dtype=torch.long), valid_lens).shape == (2, 100, 24)
    assert [w.shape for w in encoder.attention_weights] == [(16, 100, 100)] * 2
    assert isinstance(encoder, d2l.Encoder)


def test_zh_decoder_block_cell():
    torch.manual_seed(0)
    X, valid_lens = torch.ones(2, 100, 24), torch.tensor([3, 2])
    encoder_blk = d2l.EncoderBlock(24, 24, 24, 24, [100, 24], 24, 48, 8, 0.5).eval()
    decoder_blk = d2l.DecoderBlock(24, 24, 24, 24, [100, 24], 24, 48, 8, 0.5, 0)
    decoder_blk.eval()
    state = [encoder_blk(X, valid_lens), valid_lens, [None]]
    assert decoder_blk(X, state)[0].shape == torch.Size([2, 100, 24])
    assert state[2][0] is X  # the block's inputs, kept for the next step


def test_en_encoder_and_decoder_cells():
    X, valid_lens = torch.ones(2, 100, 24), torch.tensor([3, 2])
    encoder_blk = d2l.TransformerEncoderBlock(24, 48, 8, 0.5)
    encoder_blk.eval()
    assert encoder_blk(X, valid_lens).shape == X.shape
    encoder = d2l.TransformerEncoder(200, 24, 48, 8, 2, 0.5)
    assert encoder(torch.ones((2, 100), dtype=torch.long), valid_lens).shape == (2, 100, 24)
    decoder_blk = d2l.TransformerDecoderBlock(24, 48, 8, 0.5, 0)
    state = [encoder_blk(X, valid_lens), valid_lens, [None]]
    assert decoder_blk(X, state)[0].shape == X.shape


@pytest.mark.parametrize("form", ["zh", "en"])
def test_encoder_against_reference(form):
    torch.manual_seed(2)
    encoder = d2l.TransformerEncoder(**(ZH_ENC if form == "zh" else EN_ENC))
    X, lens = torch.randint(0, 30, (2, 7)), torch.tensor([7, 3])
    encoder(X, lens)  # sizes the lazy layers of the d2l 1.0.3 form
    encoder = encoder.double().eval()
    out = encoder(X, lens)
    expect, weights = encoder_ref(params(encoder), X, lens, 4, 2)
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=0)
    for got, want in zip(encoder.attention_weights, weights, strict=True):
        assert got.shape == (8, 7, 7)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["zh", "en"])
def test_decoder_against_reference_in_training_and_step_by_step(form):
    torch.manual_seed(3)
    enc_args = ZH_ENC if form == "zh" else EN_ENC
    dec_args = {k: v for k, v in enc_args.items() if k != "use_bias"}
    encoder, decoder = d2l.TransformerEncoder(**enc_args), d2l.TransformerDecoder(**dec_args)
    X, lens, Y = torch.randint(0, 30, (2, 6)), torch.tensor([6, 2]), torch.randint(0, 30, (2, 5))
    decoder(Y, decoder.init_state(encoder(X, lens), lens))  # size the lazy layers
    encoder, decoder = encoder.double().eval(), decoder.double()
    enc = encoder(X, lens)
    p = params(decoder)
    # training: the whole target at once, position t attending to 0 .. t
    decoder.train()
    out, state = decoder(Y, decoder.init_state(enc, lens))
    expect, weights = decoder_ref(p, Y, enc, lens, 4, 2, [None, None], causal=True)
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=0)
    assert len(state) == 3 and len(state[2]) == 2
    # decoding: one token at a time, each step attending to the steps so far
    decoder.eval()
    state, past = decoder.init_state(enc, lens), [None, None]
    for t in range(5):
        out, state = decoder(Y[:, t:t + 1], state)
        expect, weights = decoder_ref(p, Y[:, t:t + 1], enc, lens, 4, 2, past, causal=False)
        torch.testing.assert_close(out, expect, atol=1e-6, rtol=0)
        self_w, cross_w = decoder.attention_weights
        assert [w.shape for w in self_w] == [(8, 1, t + 1)] * 2
        assert [w.shape for w in cross_w] == [(8, 1, 6)] * 2
        for got, want in zip(self_w + cross_w, weights[0] + weights[1], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert state[2][0].shape == (2, 5, 16)


def test_zh_encoder_draws_d2l_parameters_in_order():
    """d2l-zh's order: embedding, then per block W_q, W_k, W_v, W_o, LayerNorm, dense1,
    dense2, LayerNorm."""
    torch.manual_seed(4)
    encoder = d2l.TransformerEncoder(**ZH_ENC)
    torch.manual_seed(4)
    expect = [nn.Embedding(30, 16)]
    for _ in range(2):
        expect += [nn.Linear(16, 16, bias=False) for _ in range(4)]
        expect += [nn.LayerNorm([16]), nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm([16])]
    want = [t for m in expect for t in m.state_dict().values()]
    got = list(encoder.state_dict().values())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    names = list(encoder.state_dict())
    assert names[:12] == [
        "embedding.weight", "blks.block0.attention.W_q.weight",
        "blks.block0.attention.W_k.weight", "blks.block0.attention.W_v.weight",
        "blks.block0.attention.W_o.weight", "blks.block0.addnorm1.ln.weight",
        "blks.block0.addnorm1.ln.bias", "blks.block0.ffn.dense1.weight",
        "blks.block0.ffn.dense1.bias", "blks.block0.ffn.dense2.weight",
        "blks.block0.ffn.dense2.bias", "blks.block0.addnorm2.ln.weight"]


def test_encoder_block_dropout_draws_as_d2l():
    """In training, dropout falls where d2l's does and draws in d2l's order: on the
    folded attention weights, then on each sublayer's output before its AddNorm."""
    torch.manual_seed(5)
    blk = d2l.EncoderBlock(8, 8, 8, 8, [8], 8, 16, 2, 0.5, True)
    X, lens = torch.randn(2, 5, 8), torch.tensor([5, 3])
    p = dict(blk.state_dict())
    blk.train()
    torch.manual_seed(6)
    out = blk(X, lens)
    torch.manual_seed(6)
    att, _ = mha_ref(p, "attention.", X, X, X, lens, 2, dropout=lambda w: F.dropout(w, 0.5))
    Y = layer_norm_ref(X + F.dropout(att, 0.5), p, "addnorm1.ln", 1)
    expect = layer_norm_ref(Y + F.dropout(ffn_ref(p, "ffn.", Y), 0.5), p, "addnorm2.ln", 1)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_decoder_dense_and_depth_per_form():
    zh = d2l.TransformerDecoder(**{k: v for k, v in ZH_ENC.items()})
    en = d2l.TransformerDecoder(**EN_ENC)
    assert type(zh.dense) is nn.Linear and isinstance(en.dense, nn.LazyLinear)
    assert zh.num_layers == zh.num_blks == en.num_blks == 2
    assert isinstance(zh.blks.block1, d2l.DecoderBlock) and zh.blks.block1.i == 1
    assert type(en.blks.block0) is d2l.TransformerDecoderBlock
    assert isinstance(zh, d2l.AttentionDecoder)
    assert d2l.TransformerDecoder(**EN_ENC).init_state("enc", "lens") == ["enc", "lens",
                                                                          [None, None]]


# ----------------------------------------------------------------------------
# The d2l-zh Transformer section end to end: train_seq2seq, predict_seq2seq, weights

PAIRS = [("Go.", "Va !"), ("I lost.", "J'ai perdu."), ("He's calm.", "Il est calme."),
         ("I'm home.", "Je suis chez moi."), ("Hi.", "Salut."), ("I won.", "J'ai gagné.")]


def test_zh_transformer_section_end_to_end(tmp_path, monkeypatch):
    corpus = tmp_path / "fra.txt"
    corpus.write_text("".join(f"{en}\t{fr}\n" for en, fr in PAIRS * 3), encoding="utf-8")
    monkeypatch.setenv("QKV_FRA_ENG", str(corpus))
    monkeypatch.chdir(tmp_path)  # the loss curve goes to a file here
    torch.manual_seed(0)
    num_hiddens, num_layers, dropout, batch_size, num_steps = 32, 2, 0.1, 6, 10
    num_heads = 4
    train_iter, src_vocab, tgt_vocab = d2l.load_data_nmt(batch_size, num_steps)
    args = (32, 32, 32, num_hiddens, [32], 32, 64, num_heads, num_layers, dropout)
    net = d2l.EncoderDecoder(d2l.TransformerEncoder(len(src_vocab), *args),
                             d2l.TransformerDecoder(len(tgt_vocab), *args))
    d2l.train_seq2seq(net, train_iter, 0.005, 60, tgt_vocab, "cpu")
    translations = []
    for eng, _ in PAIRS[:4]:
        translation, dec_attention_weight_seq = d2l.predict_seq2seq(
            net, eng.lower().replace(".", " ."), src_vocab, tgt_vocab, num_steps, "cpu", True)
        translations.append(translation)
    assert translations == ["va !", "j'ai perdu .", "il est calme .", "je suis chez moi ."]
    # The section's weight plots: the encoder's (num_layers, num_heads, steps, steps) ...
    enc_weights = torch.cat(net.encoder.attention_weights, 0).reshape(
        num_layers, num_heads, -1, num_steps)
    assert enc_weights.shape == (2, 4, 10, 10)
    # ... and the decoder's, one query per step, padded with zeros to num_steps keys.
    rows = [head[0].tolist() for step in dec_attention_weight_seq
            for attn in step for blk in attn for head in blk]
    filled = torch.tensor([r + [0.0] * (num_steps - len(r)) for r in rows])
    dec = filled.reshape(-1, 2, num_layers, num_heads, num_steps).permute(1, 2, 3, 0, 4)
    steps = len(translations[-1].split()) + 1  # with <eos>
    assert dec[0].shape == dec[1].shape == (2, 4, steps, 10)
    # self-attention at step t sees t + 1 keys, each row a distribution
    later = torch.ones(steps, num_steps).triu(1).bool()  # key k > step t
    assert (dec[0][..., later] == 0).all()
    torch.testing.assert_close(dec.sum(-1), torch.ones(2, 2, 4, steps, dtype=dec.dtype))


# ----------------------------------------------------------------------------
# Dispatch and errors


def test_dispatch_between_the_editions():
    zh = d2l.MultiHeadAttention(key_size=3, query_size=4, value_size=5, num_hiddens=8,
                                num_heads=2, dropout=0.1)
    assert (zh.W_q.in_features, zh.W_k.in_features, zh.W_v.in_features) == (4, 3, 5)
    assert type(d2l.MultiHeadAttention(3, 4, 5, 8, 2).W_q) is nn.Linear  # dropout 0
    assert isinstance(d2l.MultiHeadAttention(8, 2, 0.1, True).W_q, nn.LazyLinear)
    sized = d2l.MultiHeadAttention(8, 2, query_size=3)  # qkv's keyword sizes
    assert (sized.W_q.in_features, sized.W_k.in_features) == (3, 8)
    blk = d2l.TransformerEncoderBlock(key_size=8, query_size=8, value_size=8, num_hiddens=8,
                                      norm_shape=[8], ffn_num_input=8, ffn_num_hiddens=16,
                                      num_heads=2, dropout=0.0)
    assert type(blk.ffn.dense1) is nn.Linear and type(blk.attention.W_q) is nn.Linear
    blk = d2l.EncoderBlock(8, 16, 2, 0.0)  # either name takes either form
    assert isinstance(blk.ffn.dense1, nn.LazyLinear)
    assert blk.addnorm1.ln.normalized_shape == (8,)
    encoder = d2l.TransformerEncoder(30, 8, 16, 2, 3, 0.0, True)
    assert len(encoder.blks) == 3 and type(encoder.blks.block0) is d2l.TransformerEncoderBlock
    assert encoder.blks.block2.attention.W_q.bias is not None  # use_bias
    assert isinstance(d2l.TransformerEncoder(**ZH_ENC).blks.block0, d2l.EncoderBlock)


SIGNATURE = re.escape("it takes (num_hiddens, num_heads, dropout=0.0, bias=False, *, "
                      "query_size=None, key_size=None, value_size=None) (d2l) or (key_size, "
                      "query_size, value_size, num_hiddens, num_heads, dropout=0.0, "
                      "bias=False) (d2l-zh)")


def test_wrong_signatures_are_one_line_errors():
    raises_one_line(TypeError, r"^MultiHeadAttention\(\) too many positional arguments; "
                    + SIGNATURE, d2l.MultiHeadAttention, 1, 2, 3, 4, 5, 6, 7, 8)
    raises_one_line(TypeError, r"^MultiHeadAttention\(\) missing a required argument: "
                    r"'num_heads'", d2l.MultiHeadAttention, 8)
    raises_one_line(TypeError, r"^MultiHeadAttention\(\) got an unexpected keyword argument "
                    r"'heads'", d2l.MultiHeadAttention, 8, heads=2)
    raises_one_line(TypeError, r"^PositionWiseFFN\(\) too many positional arguments; it takes "
                    r"\(ffn_num_hiddens, ffn_num_outputs\) \(d2l\) or \(ffn_num_input, "
                    r"ffn_num_hiddens, ffn_num_outputs\) \(d2l-zh\)$",
                    d2l.PositionWiseFFN, 1, 2, 3, 4)
    raises_one_line(TypeError, r"^TransformerEncoder\(\) missing a required argument: "
                    r"'num_layers'", d2l.TransformerEncoder, 30, 8, 8, 8, 8, [8], 8, 16, 2,
                    dropout=0.1)
    raises_one_line(TypeError, r"^DecoderBlock\(\) missing a required argument: 'i'",
                    d2l.DecoderBlock, 8, 16, 2, 0.0)
    raises_one_line(TypeError, r"^AddNorm\(\) got an unexpected keyword argument 'shape'",
                    d2l.AddNorm, shape=4)


def test_wrong_values_are_one_line_errors_before_anything_is_built():
    raises_one_line(ValueError, r"^num_hiddens \(10\) must be divisible by num_heads \(3\)",
                    d2l.MultiHeadAttention, 10, 10, 10, 10, 3, 0.0)
    raises_one_line(TypeError, r"^key_size must be a positive integer, got None",
                    d2l.MultiHeadAttention, None, 4, 4, 4, 2)
    raises_one_line(ValueError, r"^EncoderBlock: query_size \(20\) must equal num_hiddens "
                    r"\(24\)", d2l.EncoderBlock, 24, 20, 24, 24, [24], 24, 48, 8, 0.5)
    raises_one_line(ValueError, r"^TransformerDecoder: ffn_num_input \(16\) must equal "
                    r"num_hiddens \(8\)", d2l.TransformerDecoder, 30, 8, 8, 8, 8, [8], 16, 16,
                    2, 2, 0.0)
    raises_one_line(ValueError, r"^num_hiddens \(24\) must be divisible by num_heads \(5\)",
                    d2l.TransformerEncoder, 200, 24, 48, 5, 2, 0.5)
    raises_one_line(ValueError, r"^num_blks must be a positive integer, got 0",
                    d2l.TransformerEncoder, 200, 24, 48, 8, 0, 0.5)
    raises_one_line(ValueError, r"^dropout must be a probability in \[0, 1\), got 1.5",
                    d2l.AddNorm, 4, 1.5)
    raises_one_line(TypeError, r"^norm_shape must be a positive integer or a list of them, "
                    r"got 'x' of type str", d2l.AddNorm, "x", 0.1)
    raises_one_line(ValueError, r"^normalized_shape must be a positive integer, got 0",
                    d2l.AddNorm, normalized_shape=[3, 0], dropout=0.1)
    raises_one_line(ValueError, r"^ffn_num_hiddens must be a positive integer, got -1",
                    d2l.PositionWiseFFN, -1, 4)
    raises_one_line(ValueError, r"^i \(the block's index\) must be an integer in \[0, ",
                    d2l.TransformerDecoderBlock, 8, 16, 2, 0.0, -1)
