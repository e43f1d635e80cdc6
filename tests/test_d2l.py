"""d2l's scoring functions, multi-head form and positional encoding."""

import math
import re

import pytest
import torch
from torch import nn

import qkv
from qkv import d2l

# d2l's demo: identical keys give uniform weights over the valid keys, so the
# result is the mean of the first 2 (first example) or 6 (second) value rows.
KEYS = torch.ones(2, 10, 2)
VALUES = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
VALID_LENS = torch.tensor([2, 6])
EXPECTED = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])


def test_additive_attention_demo():
    torch.manual_seed(0)
    attn = qkv.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    queries = torch.normal(0, 1, (2, 1, 20))
    out = attn(queries, KEYS, VALUES, VALID_LENS)
    torch.testing.assert_close(out, EXPECTED)
    assert attn.attention_weights.shape == (2, 1, 10)


def test_dot_product_attention_demo():
    torch.manual_seed(0)
    attn = qkv.DotProductAttention(dropout=0.5).eval()
    queries = torch.normal(0, 1, (2, 1, 2))
    torch.testing.assert_close(attn(queries, KEYS, VALUES, VALID_LENS), EXPECTED)


def test_additive_attention_against_formula_and_projected_keys():
    torch.manual_seed(1)
    attn = qkv.AdditiveAttention(3, 5, 7).eval()
    q, k, v = torch.randn(2, 4, 5), torch.randn(2, 6, 3), torch.randn(2, 6, 2)
    lens = torch.tensor([6, 3])
    out = attn(q, k, v, lens)
    # float64 loop reference
    Wq, Wk, wv = (m.weight.double() for m in (attn.W_q, attn.W_k, attn.w_v))
    for b in range(2):
        for i in range(4):
            scores = torch.stack(
                [(wv @ torch.tanh(Wq @ q[b, i].double() + Wk @ k[b, j].double()))[0]
                 for j in range(int(lens[b]))]
            )
            expected = torch.softmax(scores, 0) @ v[b, : int(lens[b])].double()
            torch.testing.assert_close(out[b, i].double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attn(q, k, v, lens, projected_keys=attn.project_keys(k)), out)


def test_zero_valid_len_gives_zeros_not_uniform():
    attn = qkv.DotProductAttention().eval()
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    out = attn(q, k, v, torch.tensor([0, 5]))
    assert (out[0] == 0).all() and (attn.attention_weights[0] == 0).all()


def test_dot_product_attention_2d_valid_lens():
    attn = qkv.DotProductAttention().eval()
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 6)
    attn(q, k, v, torch.tensor([[1, 5]]))
    w = attn.attention_weights
    torch.testing.assert_close(w[0, 0], torch.tensor([1.0, 0, 0, 0, 0]))
    torch.testing.assert_close(w[0, 1], torch.softmax(q[0, 1] @ k[0].T / 2, dim=-1))


def plain_masked_softmax(X, valid_lens):
    """d2l's masked_softmax re-derived: scores at key index >= valid length become -1e6
    (so a row with valid length 0 is all -1e6 and comes out uniform), then softmax."""
    if valid_lens is None:
        return torch.softmax(X, dim=-1)
    lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(X.shape[:2])
    masked = X.clone()
    for b in range(X.shape[0]):
        for i in range(X.shape[1]):
            masked[b, i, int(lens[b, i]):] = -1e6
    return torch.softmax(masked, dim=-1)


def d2l_reference_mha(m, queries, keys, values, valid_lens):
    """d2l's algorithm: fold the heads into the batch and repeat valid_lens."""
    h = m.num_heads

    def fold(x):  # (b, n, h*d) -> (b*h, n, d)
        b, n, _ = x.shape
        return x.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)

    def linear(x, layer):
        return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)

    q = fold(linear(queries, m.W_query))
    k = fold(linear(keys, m.W_key))
    v = fold(linear(values, m.W_value))
    lens = torch.repeat_interleave(valid_lens, repeats=h, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    weights = plain_masked_softmax(scores, lens)
    out = weights @ v  # (b*h, n_q, d)
    b = queries.shape[0]
    out = out.reshape(b, h, out.shape[1], -1).permute(0, 2, 1, 3).reshape(b, out.shape[1], -1)
    return linear(out, m.out_proj), weights


def test_d2l_multihead_example_and_reference():
    torch.manual_seed(2)
    m = d2l.MultiHeadAttention(100, 5, 0.5).eval()
    queries, kv = torch.randn(2, 4, 100), torch.randn(2, 6, 100)
    valid_lens = torch.tensor([3, 2])
    out = m(queries, kv, kv, valid_lens)
    assert out.shape == (2, 4, 100)
    expected, ref_w = d2l_reference_mha(m, queries, kv, kv, valid_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.attention_weights.reshape(10, 4, 6), ref_w, atol=1e-6, rtol=0)
    assert m.out_proj.bias is None and m.W_query.bias is None  # bias-free by default
    assert isinstance(m, qkv.MultiHeadAttention)  # one implementation, not two


@pytest.mark.parametrize("backend", ["d2l", "qkv"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "valid_lens", [[0, 3], [[0, 6, 2, 0], [1, 0, 6, 3]], [0, 0]], ids=["1d", "2d", "all-empty"]
)
def test_d2l_multihead_zero_valid_len_is_uniform_as_d2l(bias, valid_lens, backend):
    """A query with valid length 0 attends uniformly to all keys (d2l's -1e6 fill), in
    float64 against the folded-heads reference, on both backends."""
    torch.manual_seed(3)
    m = d2l.MultiHeadAttention(12, 3, 0.0, bias=bias).double().eval()
    m.backend = backend
    queries = torch.randn(2, 4, 12, dtype=torch.float64)
    keys, values = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 6, 12,
                                                                         dtype=torch.float64)
    lens = torch.tensor(valid_lens)
    out = m(queries, keys, values, lens)
    expected, ref_w = d2l_reference_mha(m, queries, keys, values, lens)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(m.attention_weights.reshape(6, 4, 6), ref_w, atol=1e-12, rtol=0)
    empty = (lens == 0) if lens.dim() == 2 else (lens == 0)[:, None].expand(2, 4)
    assert (m.attention_weights[empty.nonzero(as_tuple=True)[0], :,
                                empty.nonzero(as_tuple=True)[1]] == 1 / 6).all()


def test_d2l_multihead_zero_valid_len_gradients_and_training_dropout():
    torch.manual_seed(4)
    m = d2l.MultiHeadAttention(8, 2, 0.5)
    x = torch.randn(2, 3, 8, requires_grad=True)
    m.train()
    out = m(x, x, x, torch.tensor([0, 2]))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # the weights are kept before dropout, as d2l keeps them
    torch.testing.assert_close(m.attention_weights[0], torch.full((2, 3, 3), 1 / 3))


@pytest.mark.parametrize("form", ["d2l", "zh"])
def test_d2l_multihead_backends_agree_and_draw_the_same_dropout(form):
    torch.manual_seed(5)
    m = d2l.MultiHeadAttention(12, 3, 0.3) if form == "d2l" else \
        d2l.MultiHeadAttention(5, 7, 9, 12, 3, 0.3, True)
    q, k, v = torch.randn(2, 4, 7 if form == "zh" else 12), torch.randn(
        2, 6, 5 if form == "zh" else 12), torch.randn(2, 6, 9 if form == "zh" else 12)
    for train in (False, True):
        # (the qkv backend draws its own dropout for rows of valid length 0: none here
        # in training)
        lens = torch.tensor([[int(train), 6, 2, 1], [3, 1, 6, 5]])
        m.train(train)
        outs = {}
        for backend in ("d2l", "qkv"):
            m.backend = backend
            torch.manual_seed(9)
            outs[backend] = (m(q, k, v, lens), m.attention_weights,
                             m.attention.attention_weights)
        for a, b in zip(outs["d2l"], outs["qkv"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    m.backend = "fast"
    with pytest.raises(ValueError, match="backend must be 'd2l' or 'qkv', got 'fast'"):
        m(q, k, v, lens)


def test_d2l_multihead_other_widths():
    m = d2l.MultiHeadAttention(8, 2, 0.0, query_size=3, key_size=5, value_size=7).eval()
    out = m(torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.randn(2, 6, 7), torch.tensor([6, 1]))
    assert out.shape == (2, 4, 8)
    with pytest.raises(ValueError, match="num_hiddens \\(10\\) must be divisible by num_heads"):
        d2l.MultiHeadAttention(10, 3, 0.0)


def test_positional_encoding_formula():
    pe = qkv.PositionalEncoding(32, 0.0, max_len=60).eval()
    X = torch.zeros(1, 60, 32)
    P = pe(X)[0].double()
    pos = torch.arange(60, dtype=torch.float64)[:, None]
    for j in range(16):
        angle = pos[:, 0] / 10000 ** (2 * j / 32)
        torch.testing.assert_close(P[:, 2 * j], torch.sin(angle), atol=1e-5, rtol=0)
        torch.testing.assert_close(P[:, 2 * j + 1], torch.cos(angle), atol=1e-5, rtol=0)
    X = torch.randn(3, 10, 32)
    torch.testing.assert_close(pe(X), X + pe.P[:, :10])


def test_positional_encoding_odd_width_dropout_and_errors():
    pe = qkv.PositionalEncoding(7, 0.5, max_len=20)
    assert pe.P.shape == (1, 20, 7)
    pe.train()
    out = pe(torch.zeros(4, 20, 7))
    assert (out == 0).any()  # dropout is on in training
    pe.eval()
    torch.testing.assert_close(pe(torch.zeros(1, 20, 7)), pe.P)
    with pytest.raises(ValueError, match="longer than max_len=20"):
        pe(torch.zeros(1, 21, 7))
    with pytest.raises(ValueError, match=r"shape \(batch, tokens, 7\)"):
        pe(torch.zeros(21, 7))


def test_d2l_names_are_exported():
    for name in ("masked_softmax", "DotProductAttention", "AdditiveAttention",
                 "MultiHeadAttention", "PositionalEncoding"):
        assert hasattr(d2l, name)
    assert isinstance(d2l.PositionalEncoding(4, 0.0), nn.Module)


# ----------------------------------------------------------------------------
# The translator chapter's names (d2l's documented outputs and shapes)


def test_d2l_scoring_modules_give_uniform_rows_for_zero_valid_len():
    torch.manual_seed(0)
    v = torch.randn(2, 5, 3)
    lens = torch.tensor([0, 2])
    dot = d2l.DotProductAttention(0.0).eval()
    out = dot(torch.randn(2, 1, 4), torch.randn(2, 5, 4), v, lens)
    torch.testing.assert_close(dot.attention_weights[0], torch.full((1, 5), 0.2))
    torch.testing.assert_close(out[0, 0], v[0].mean(0))
    assert (dot.attention_weights[1, 0, 2:] == 0).all()
    add = d2l.AdditiveAttention(4, 6, 8, 0.0).eval()
    out = add(torch.randn(2, 1, 6), torch.randn(2, 5, 4), v, lens)
    torch.testing.assert_close(add.attention_weights[0], torch.full((1, 5), 0.2))
    torch.testing.assert_close(out[0, 0], v[0].mean(0))


def test_d2l_additive_attention_demo():
    torch.manual_seed(0)
    attn = d2l.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    out = attn(torch.normal(0, 1, (2, 1, 20)), KEYS, VALUES, VALID_LENS)
    torch.testing.assert_close(out, EXPECTED)
    dot = d2l.DotProductAttention(dropout=0.5).eval()
    torch.testing.assert_close(dot(torch.normal(0, 1, (2, 1, 2)), KEYS, VALUES, VALID_LENS),
                               EXPECTED)


def test_masked_softmax_uniform_row_as_d2l():
    w = d2l.masked_softmax(torch.rand(2, 2, 4), torch.tensor([0, 3]))
    torch.testing.assert_close(w[0], torch.full((2, 4), 0.25))
    assert (w[1, :, 3] == 0).all()
    torch.testing.assert_close(w[1].sum(-1), torch.ones(2))


def test_sequence_mask_d2l_examples():
    X = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = d2l.sequence_mask(X, torch.tensor([1, 2]))
    assert out.tolist() == [[1, 0, 0], [4, 5, 0]]
    assert out is X  # in place, as d2l
    Y = d2l.sequence_mask(torch.ones(2, 3, 4), torch.tensor([1, 2]), value=-1)
    assert Y[0].tolist() == [[1.0] * 4, [-1.0] * 4, [-1.0] * 4]
    assert Y[1].tolist() == [[1.0] * 4, [1.0] * 4, [-1.0] * 4]


def test_masked_softmax_ce_loss_d2l_printed_values():
    loss = d2l.MaskedSoftmaxCELoss()
    out = loss(torch.ones(3, 4, 10), torch.ones((3, 4), dtype=torch.long), torch.tensor([4, 2, 0]))
    # d2l prints tensor([2.3026, 1.1513, 0.0000]): ln 10 times valid / num_steps
    torch.testing.assert_close(out, torch.tensor([math.log(10), math.log(10) / 2, 0.0]))


def test_grad_clipping_against_float64_norm():
    net = nn.Linear(3, 2)
    grads = [torch.tensor([[1.0, 2.0, 2.0], [0.0, 4.0, 0.0]]), torch.tensor([0.0, 2.0])]
    for p, g in zip(net.parameters(), grads, strict=True):
        p.grad = g.clone()
    norm = math.sqrt(1 + 4 + 4 + 16 + 4)  # sqrt(29)
    d2l.grad_clipping(net, 1.0)
    for p, g in zip(net.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad.double(), g.double() / norm)
    before = [p.grad.clone() for p in net.parameters()]
    d2l.grad_clipping(net, 10.0)  # norm 1 < 10: untouched
    for p, b in zip(net.parameters(), before, strict=True):
        assert torch.equal(p.grad, b)

    class Params:  # d2l's from-scratch models carry a params list
        params = [torch.zeros(2, requires_grad=True)]

    Params.params[0].grad = torch.tensor([3.0, 4.0])
    d2l.grad_clipping(Params(), 1.0)
    torch.testing.assert_close(Params.params[0].grad, torch.tensor([0.6, 0.8]))


def test_accumulator_and_timer():
    acc = d2l.Accumulator(2)
    acc.add(1, 2)
    acc.add(torch.tensor(3.0), 4)
    assert (acc[0], acc[1]) == (4.0, 6.0)
    acc.reset()
    assert acc.data == [0.0, 0.0]
    timer = d2l.Timer()
    first = timer.stop()
    timer.start()
    second = timer.stop()
    assert first >= 0 and second >= 0
    assert timer.sum() == pytest.approx(first + second)
    assert timer.avg() == pytest.approx((first + second) / 2)
    assert timer.cumsum() == pytest.approx([first, first + second])


def test_try_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert d2l.try_gpu() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert d2l.try_gpu(1) == torch.device("cuda:1")
    assert d2l.try_gpu(2) == torch.device("cpu")


def test_truncate_pad_and_bleu():
    assert d2l.truncate_pad([47, 4], 10, 1) == [47, 4, 1, 1, 1, 1, 1, 1, 1, 1]
    assert d2l.truncate_pad(list(range(12)), 10, 1) == list(range(10))
    # d2l's printed scores: "he's calm . => il est riche ., bleu 0.658" against "il est calme ."
    assert d2l.bleu("il est riche .", "il est calme .", k=2) == pytest.approx(
        (3 / 4) ** 0.5 * (1 / 3) ** 0.25)
    assert round(d2l.bleu("il est riche .", "il est calme .", k=2), 3) == 0.658
    assert d2l.bleu("va !", "va !", k=2) == 1.0


NMT_TEXT = "Go.\tVa !\nHi.\tSalut !\nRun!\tCours\u202f!\nRun!\tCourez\u202f!\nWho?\tQui ?\tx\n"


def test_preprocess_and_tokenize_nmt():
    text = d2l.preprocess_nmt(NMT_TEXT)
    assert text.startswith("go .\tva !\nhi .\tsalut !\nrun !\tcours !\n")
    source, target = d2l.tokenize_nmt(text)
    # the three-column line is skipped, as in d2l
    assert source == [["go", "."], ["hi", "."], ["run", "!"], ["run", "!"]]
    assert target[2] == ["cours", "!"]
    # d2l's loop reads lines 0 .. num_examples: one pair more than asked
    assert len(d2l.tokenize_nmt(text, 2)[0]) == 3


def test_vocab_and_build_array_nmt():
    source = [["go", "."], ["hi", "."], ["run", "!"], ["run", "!"]]
    vocab = d2l.Vocab(source, min_freq=2, reserved_tokens=["<pad>", "<bos>", "<eos>"])
    # d2l 1.0.3: the sorted set of <unk>, the reserved and the kept tokens
    assert vocab.idx_to_token == ["!", ".", "<bos>", "<eos>", "<pad>", "<unk>", "run"]
    assert vocab["go"] == vocab.unk == 5
    assert vocab.to_tokens([6, 0]) == ["run", "!"]
    assert len(d2l.Vocab()) == 1
    array, valid_len = d2l.build_array_nmt(source + [["run"] * 12], vocab, 4)
    assert array.tolist()[0] == [5, 1, 3, 4]  # go(<unk>) . <eos> <pad>
    assert array.tolist()[4] == [6, 6, 6, 6]  # truncated, <eos> cut off
    assert valid_len.dtype == torch.int64
    assert valid_len.tolist() == [3, 3, 3, 3, 4]


def test_load_data_nmt_from_env_file_and_replaced_reader(tmp_path, monkeypatch):
    corpus = tmp_path / "fra.txt"
    corpus.write_text(NMT_TEXT, encoding="utf-8")
    monkeypatch.setenv("QKV_FRA_ENG", str(corpus))
    assert d2l.read_data_nmt() == NMT_TEXT
    train_iter, src_vocab, tgt_vocab = d2l.load_data_nmt(batch_size=2, num_steps=5)
    batches = list(train_iter)
    assert len(batches) == 2  # 4 pairs in batches of 2
    X, X_valid_len, Y, Y_valid_len = batches[0]
    assert X.shape == Y.shape == (2, 5) and X.dtype == torch.int64
    assert X_valid_len.shape == Y_valid_len.shape == (2,)
    # d2l-zh's order: <unk>, the reserved tokens, then by count (ties as first seen)
    assert src_vocab.idx_to_token == ["<unk>", "<pad>", "<bos>", "<eos>", ".", "run", "!"]
    assert tgt_vocab.idx_to_token == ["<unk>", "<pad>", "<bos>", "<eos>", "!"]
    assert type(src_vocab) is d2l.Vocab and src_vocab.unk == 0 and src_vocab["hi"] == 0
    # a replaced reader is what load_data_nmt reads, as with d2l
    monkeypatch.setattr(d2l, "read_data_nmt", lambda: "A.\tB.\nA.\tB.\n")
    _, src_vocab, _ = d2l.load_data_nmt(2, 5)
    assert src_vocab.idx_to_token == ["<unk>", "<pad>", "<bos>", "<eos>", "a", "."]


def test_read_data_nmt_from_qkv_cache_without_network(tmp_path, monkeypatch):
    monkeypatch.delenv("QKV_FRA_ENG", raising=False)
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    (tmp_path / "fra-eng").mkdir()
    (tmp_path / "fra-eng" / "fra.txt").write_text("Go.\tVa !\n", encoding="utf-8")
    assert d2l.read_data_nmt() == "Go.\tVa !\n"


def test_seq2seq_encoder_shapes_and_encoder_decoder():
    # d2l's example: output (7, 4, 16), state (2, 4, 16)
    encoder = d2l.Seq2SeqEncoder(vocab_size=10, embed_size=8, num_hiddens=16, num_layers=2)
    encoder.eval()
    assert isinstance(encoder, d2l.Encoder)
    output, state = encoder(torch.zeros((4, 7), dtype=torch.long), torch.tensor([7, 7, 7, 7]))
    assert output.shape == (7, 4, 16) and state.shape == (2, 4, 16)
    torch.testing.assert_close(output[-1], state[-1])  # the top layer's last step

    class Echo(d2l.Decoder):
        def init_state(self, enc_all_outputs, *args):
            return enc_all_outputs[1], args

        def forward(self, X, state):
            return X.float() * 2, state

    net = d2l.EncoderDecoder(encoder, Echo())
    out = net(torch.zeros((4, 7), dtype=torch.long), torch.ones(4, 3, dtype=torch.long))
    assert torch.equal(out, torch.full((4, 3), 2.0))  # the decoder's output only
    with pytest.raises(NotImplementedError):
        d2l.AttentionDecoder().attention_weights  # noqa: B018


class ScriptedDecoder(d2l.AttentionDecoder):
    """Emits the ids of ``script`` one step at a time, whatever it reads."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.script, self.vocab_size = script, vocab_size

    def init_state(self, enc_all_outputs, enc_valid_len):
        self.seen_valid_len = enc_valid_len
        return 0

    def forward(self, X, state):
        Y = torch.zeros(1, 1, self.vocab_size)
        Y[0, 0, self.script[min(state, len(self.script) - 1)]] = 1.0
        return Y, state + 1

    @property
    def attention_weights(self):
        return "w"


def test_predict_seq2seq_greedy_stops_at_eos():
    src_vocab = d2l.Vocab([["go", "."]] * 2, reserved_tokens=["<pad>", "<bos>", "<eos>"])
    tgt_vocab = d2l.Vocab([["va", "!"]] * 2, reserved_tokens=["<pad>", "<bos>", "<eos>"])
    va, bang, eos = tgt_vocab["va"], tgt_vocab["!"], tgt_vocab["<eos>"]
    encoder = d2l.Seq2SeqEncoder(len(src_vocab), 4, 4, 1)
    decoder = ScriptedDecoder([va, bang, eos, va], len(tgt_vocab))
    net = d2l.EncoderDecoder(encoder, decoder)
    out, weights = d2l.predict_seq2seq(net, "Go .", src_vocab, tgt_vocab, 10, "cpu", True)
    assert out == "va !" and weights == ["w", "w", "w"]
    assert decoder.seen_valid_len.tolist() == [3]  # go . <eos>
    # no <eos>: stops after num_steps tokens
    net.decoder = ScriptedDecoder([va], len(tgt_vocab))
    out, weights = d2l.predict_seq2seq(net, "go .", src_vocab, tgt_vocab, 3, "cpu")
    assert out == "va va va" and weights == []


def test_train_seq2seq_prints_d2l_line_and_saves_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # as on a machine without a display, whatever this one has
    monkeypatch.setattr(d2l.plt, "get_backend", lambda: "agg")
    torch.manual_seed(0)
    vocab = d2l.Vocab([["a", "b"]] * 2, reserved_tokens=["<pad>", "<bos>", "<eos>"])
    X = torch.tensor([[4, 5, 3, 1]] * 4)
    lens = torch.tensor([3, 3, 3, 3], dtype=torch.int32)
    data_iter = d2l.load_array((X, lens, X, lens), 2)

    class Decoder(d2l.Decoder):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(len(vocab), 8)
            self.dense = nn.Linear(8, len(vocab))

        def init_state(self, enc_all_outputs, *args):
            return enc_all_outputs[1]

        def forward(self, X, state):
            return self.dense(self.embedding(X) + state[-1][:, None]), state

    net = d2l.EncoderDecoder(d2l.Seq2SeqEncoder(len(vocab), 8, 8, 1), Decoder())
    d2l.train_seq2seq(net, data_iter, 0.05, 20, vocab, d2l.try_gpu())
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"loss \d+\.\d{3}, \d+\.\d tokens/sec on (cpu|cuda:0)", line), line
    assert float(line.split()[1].rstrip(",")) < 0.5  # learnt a 3-token sequence
    assert (tmp_path / "seq2seq_loss.png").stat().st_size > 0
    d2l.plt.close("all")


# ----------------------------------------------------------------------------
# AdditiveAttention in both of d2l's forms; the scoring functions' empty rows


def plain_additive(W_q, W_k, w_v, queries, keys, values, valid_lens):
    """float64 loop: score(q, k) = w_v . tanh(W_q q + W_k k), d2l's masked softmax, @ V."""
    W_q, W_k, w_v = W_q.double(), W_k.double(), w_v.double()
    b, n_q, n_k = queries.shape[0], queries.shape[1], keys.shape[1]
    scores = torch.empty(b, n_q, n_k, dtype=torch.float64)
    for i in range(b):
        for j in range(n_q):
            for t in range(n_k):
                feat = torch.tanh(W_q @ queries[i, j].double() + W_k @ keys[i, t].double())
                scores[i, j, t] = (w_v @ feat)[0]
    weights = plain_masked_softmax(scores, valid_lens)
    return weights @ values.double(), weights


def test_d2l_additive_attention_lazy_form_as_d2l_1_0_3():
    torch.manual_seed(5)
    attn = d2l.AdditiveAttention(8, 0.1)
    # d2l 1.0.3: three bias-free LazyLinear layers, sized on the first call
    for layer, width in ((attn.W_k, 8), (attn.W_q, 8), (attn.w_v, 1)):
        assert isinstance(layer, nn.LazyLinear) and layer.has_uninitialized_params()
        assert layer.out_features == width and layer.bias is None
    assert attn.dropout.p == 0.1
    assert isinstance(attn, qkv.AdditiveAttention)
    attn.eval()
    # d2l's demo: identical keys, so uniform weights over the valid keys
    torch.testing.assert_close(attn(torch.normal(0, 1, (2, 1, 20)), KEYS, VALUES, VALID_LENS),
                               EXPECTED)
    assert attn.W_q.weight.shape == (8, 20) and attn.W_k.weight.shape == (8, 2)
    assert attn.w_v.weight.shape == (1, 8)
    q, k, v = torch.randn(2, 3, 20), torch.randn(2, 5, 2), torch.randn(2, 5, 4)
    lens = torch.tensor([[5, 0, 2], [1, 3, 0]])
    out = attn(q, k, v, lens)
    expected, weights = plain_additive(attn.W_q.weight, attn.W_k.weight, attn.w_v.weight,
                                       q, k, v, lens)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attn.attention_weights.double(), weights, atol=1e-6, rtol=0)
    torch.testing.assert_close(attn.attention_weights[0, 1], torch.full((5,), 0.2))


def test_d2l_additive_attention_forms_by_arguments():
    lazy = d2l.AdditiveAttention(num_hiddens=6, dropout=0.2)
    assert isinstance(lazy.W_k, nn.LazyLinear) and lazy.dropout.p == 0.2
    assert isinstance(d2l.AdditiveAttention(6).W_q, nn.LazyLinear)  # dropout defaults to 0
    for explicit in (d2l.AdditiveAttention(3, 5, 6, 0.2), d2l.AdditiveAttention(3, 5, 6),
                     d2l.AdditiveAttention(key_size=3, query_size=5, num_hiddens=6),
                     d2l.AdditiveAttention(3, query_size=5, num_hiddens=6, dropout=0.2)):
        assert type(explicit.W_k) is nn.Linear and explicit.W_k.weight.shape == (6, 3)
        assert explicit.W_q.weight.shape == (6, 5) and explicit.w_v.weight.shape == (1, 6)
    with pytest.raises(TypeError, match=r"AdditiveAttention\(\) got an unexpected keyword"):
        d2l.AdditiveAttention(6, 0.0, size=3)
    with pytest.raises(ValueError, match="num_hiddens"):
        d2l.AdditiveAttention(0, 0.0)
    with pytest.raises(ValueError, match="dropout"):
        d2l.AdditiveAttention(6, 1.5)


def test_d2l_additive_attention_lazy_form_loads_a_state_dict():
    """What the inference script does: a fresh lazy module takes trained weights."""
    torch.manual_seed(6)
    trained = d2l.AdditiveAttention(3, 5, 6, 0.0).eval()
    fresh = d2l.AdditiveAttention(6, 0.0).eval()
    fresh.load_state_dict(trained.state_dict())
    q, k, v = torch.randn(2, 1, 5), torch.randn(2, 4, 3), torch.randn(2, 4, 2)
    lens = torch.tensor([4, 2])
    torch.testing.assert_close(fresh(q, k, v, lens), trained(q, k, v, lens))
    assert fresh.state_dict().keys() == trained.state_dict().keys()


def test_d2l_train_seq2seq_leaves_lazy_layers_to_their_own_init(capsys):
    """d2l's init picks exact nn.Linear / nn.GRU types: an attention layer not yet sized is
    skipped (not an error) and is sized by the first batch."""
    torch.manual_seed(7)
    vocab = d2l.Vocab([["a", "b"]] * 2, reserved_tokens=["<pad>", "<bos>", "<eos>"])
    X = torch.tensor([[4, 5, 3, 1]] * 4)
    lens = torch.tensor([3, 3, 3, 3])

    class Decoder(d2l.AttentionDecoder):
        def __init__(self):
            super().__init__()
            self.attention = d2l.AdditiveAttention(8, 0.0)
            self.embedding = nn.Embedding(len(vocab), 8)
            self.dense = nn.Linear(16, len(vocab))

        def init_state(self, enc_all_outputs, enc_valid_lens):
            return enc_all_outputs[0].permute(1, 0, 2), enc_valid_lens

        def forward(self, X, state):
            enc, enc_lens = state
            emb = self.embedding(X)
            context = self.attention(emb, enc, enc, enc_lens)
            return self.dense(torch.cat((emb, context), -1)), state

    decoder = Decoder()
    net = d2l.EncoderDecoder(d2l.Seq2SeqEncoder(len(vocab), 8, 8, 1), decoder)
    dense_before = decoder.dense.weight.detach().clone()
    d2l.train_seq2seq(net, d2l.load_array((X, lens, X, lens), 2), 0.0, 1, vocab, "cpu")
    assert "tokens/sec on cpu" in capsys.readouterr().out
    assert type(decoder.attention.W_k) is nn.Linear  # sized by the first batch
    assert decoder.attention.W_k.weight.shape == (8, 8)
    # lr 0: what is there is the init; the exact nn.Linear was re-drawn Xavier-uniform
    bound = math.sqrt(6 / (16 + len(vocab)))
    assert not torch.equal(decoder.dense.weight, dense_before)
    assert decoder.dense.weight.abs().max() <= bound
    d2l.plt.close("all")


@pytest.mark.parametrize("valid_lens", [[0, 3], [[0, 4, 1], [2, 0, 4]]], ids=["1d", "2d"])
def test_d2l_masked_softmax_and_dot_product_against_plain_reference(valid_lens):
    torch.manual_seed(8)
    lens = torch.tensor(valid_lens)
    scores = torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(d2l.masked_softmax(scores, lens),
                               plain_masked_softmax(scores, lens), atol=1e-12, rtol=0)
    q, k, v = (torch.randn(2, 3, 5), torch.randn(2, 4, 5), torch.randn(2, 4, 2))
    dot = d2l.DotProductAttention(0.0).eval()
    out = dot(q, k, v, lens)
    weights = plain_masked_softmax(q.double() @ k.double().transpose(1, 2) / math.sqrt(5), lens)
    torch.testing.assert_close(dot.attention_weights.double(), weights, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), weights @ v.double(), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------
# Vocab: d2l 1.0.3's token order, re-derived


def plain_vocab_1_0_3(lines, min_freq, reserved):
    """d2l 1.0.3's rule in plain steps: count (flattening when the first item is a list),
    order the counts by descending count (ties in first-seen order), and number the
    sorted set of <unk>, the reserved tokens and the tokens counted >= min_freq times."""
    flat = [tok for line in lines for tok in line] if lines and isinstance(lines[0], list) \
        else list(lines)
    counts = {}
    for tok in flat:  # a dict keeps insertion (first-seen) order
        counts[tok] = counts.get(tok, 0) + 1
    by_count = sorted(counts.items(), key=lambda kv: -kv[1])
    kept = [tok for tok, n in by_count if n >= min_freq]
    return sorted(set(["<unk>", *reserved, *kept])), by_count


RESERVED_CASES = [
    [],
    ["<pad>", "<bos>", "<eos>"],
    ["<eos>", "<bos>", "<pad>"],  # the order given does not matter
    ["zz", "<pad>", "AA"],  # "AA" and "zz" sort after "<unk>" ("<" is 60, "A" 65)
    ["<pad>", "<unk>", "<pad>"],  # 1.0.3 takes a set: one id each
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_freq", [0, 1, 2, 3])
@pytest.mark.parametrize("reserved", RESERVED_CASES)
def test_d2l_vocab_against_plain_1_0_3_rederivation(seed, min_freq, reserved):
    import random

    rng = random.Random(seed)
    # Tokens either side of "<unk>" in code-point order: punctuation and "<..." before
    # it, "<zz>", capitals, lower case and non-ASCII after it.
    words = ["zeta", "alpha", "mu", "beta", ".", "!", "<pad>", "<zz>", "Omega", "été",
             "a", "''", "<a>", "kappa", "1"]
    words = rng.sample(words, rng.randint(3, len(words)))
    lines = [[rng.choice(words) for _ in range(rng.randint(0, 7))] for _ in range(15)]
    vocab = d2l.Vocab(lines, min_freq=min_freq, reserved_tokens=reserved)
    order, by_count = plain_vocab_1_0_3(lines, min_freq, reserved)
    assert vocab.idx_to_token == order
    assert vocab.token_to_idx == {tok: i for i, tok in enumerate(order)}
    assert vocab.token_freqs == by_count
    assert len(vocab) == len(order)
    assert vocab.unk == order.index("<unk>")
    # every token maps to its own id, or (dropped by min_freq or never seen) to <unk>
    for tok in [*words, "never-seen", "<UNK>"]:
        assert vocab[tok] == (order.index(tok) if tok in order else vocab.unk)
    flat = [tok for line in lines for tok in line]
    assert vocab[lines] == [[vocab[tok] for tok in line] for line in lines]
    assert vocab.to_tokens(vocab[flat]) == [tok if tok in order else "<unk>" for tok in flat]
    # the flat form of the same corpus gives the same vocabulary
    assert d2l.Vocab(flat, min_freq, reserved).idx_to_token == order


def test_d2l_vocab_unk_not_first_and_lookups():
    # "!" and "." sort before "<unk>"; zeta and alpha both twice, alpha sorts first
    lines = [["zeta", "alpha", "mu", "!"], ["alpha", "zeta", "zeta2", "!", "."], ["."]]
    vocab = d2l.Vocab(lines, min_freq=2, reserved_tokens=["<pad>"])
    assert vocab.idx_to_token == ["!", ".", "<pad>", "<unk>", "alpha", "zeta"]
    assert vocab.unk == 3 and vocab["<unk>"] == 3
    assert vocab["mu"] == vocab["zeta2"] == vocab["never"] == 3  # rare or unseen: <unk>
    assert vocab.token_freqs[:4] == [("zeta", 2), ("alpha", 2), ("!", 2), (".", 2)]
    # lists and tuples map element-wise (nested too); anything else is one token
    assert vocab[["alpha", "nope"]] == [4, 3]
    assert vocab[("zeta", ["alpha", "mu"])] == [5, [4, 3]]
    assert vocab[5] == 3
    # to_tokens: one id (Python indexing) or a list, tuple or tensor of ids
    assert vocab.to_tokens(4) == "alpha" and vocab.to_tokens(-1) == "zeta"
    assert vocab.to_tokens([5, 4]) == ["zeta", "alpha"]
    assert vocab.to_tokens((3,)) == ["<unk>"]
    assert vocab.to_tokens(torch.tensor([0, 1])) == ["!", "."]
    assert vocab.to_tokens(torch.tensor(2)) == "<pad>"
    with pytest.raises(IndexError):
        vocab.to_tokens(6)
    # to_dict / from_dict keep the ids, <unk> where it was
    again = d2l.Vocab.from_dict(vocab.to_dict())
    assert type(again) is d2l.Vocab and again.unk == 3
    assert again.idx_to_token == vocab.idx_to_token and again.token_freqs == vocab.token_freqs
    with pytest.raises(ValueError, match="<unk>"):
        d2l.Vocab.from_dict({"idx_to_token": ["a", "b"]})
    with pytest.raises(ValueError, match="duplicate"):
        d2l.Vocab.from_dict(["a", "<unk>", "a"])


def test_d2l_vocab_flat_tokens_defaults_and_reserved():
    # a flat list of tokens (d2l flattens only when the first item is a list)
    vocab = d2l.Vocab(list("abracadabra"))
    assert vocab.idx_to_token == ["<unk>", "a", "b", "c", "d", "r"]
    assert vocab.token_freqs == [("a", 5), ("b", 2), ("r", 2), ("c", 1), ("d", 1)]
    assert d2l.Vocab().idx_to_token == ["<unk>"] and d2l.Vocab([]).token_freqs == []
    # min_freq 0 and 1 keep everything; a reserved token is kept whatever its count
    vocab = d2l.Vocab([["x", "<eos>", "x"]], min_freq=3, reserved_tokens=["<eos>"])
    assert vocab.idx_to_token == ["<eos>", "<unk>"]
    assert vocab.token_freqs == [("x", 2), ("<eos>", 1)]
    # 1.0.3 takes a set: a reserved <unk> or a token reserved twice gets one id
    vocab = d2l.Vocab([["a"]], reserved_tokens=["<unk>", "<pad>", "<pad>"])
    assert vocab.idx_to_token == ["<pad>", "<unk>", "a"] and vocab.unk == 1
    # 1.0.3 sorts the tokens with "<unk>": they must be strings
    with pytest.raises(TypeError, match="strings"):
        d2l.Vocab([1, 2, 2])
    assert isinstance(vocab, qkv.data.translate.Vocab)
    # qkv's own vocabulary keeps its order (<unk> at 0) and its reserved-token checks
    own = qkv.data.translate.Vocab([["x", "!", "x"]], reserved_tokens=["<pad>"])
    assert own.idx_to_token == ["<unk>", "<pad>", "x", "!"] and own.unk == 0
    with pytest.raises(ValueError, match="<unk>"):
        qkv.data.translate.Vocab([["a"]], reserved_tokens=["<unk>"])


def test_d2l_multihead_refuses_other_widths_in_one_line():
    m = d2l.MultiHeadAttention(5, 7, 9, 12, 3, 0.0)
    with pytest.raises(ValueError, match=r"^query vectors must be 7 wide \(this layer's "
                                         r"query_size\), got shape \(2, 4, 5\)$"):
        m(torch.rand(2, 4, 5), torch.rand(2, 3, 5), torch.rand(2, 3, 9))
    lazy = d2l.MultiHeadAttention(12, 3, 0.0)
    lazy(torch.rand(2, 4, 5), torch.rand(2, 3, 6), torch.rand(2, 3, 9))  # sized by this call
    with pytest.raises(ValueError, match=r"^key vectors must be 6 wide"):
        lazy(torch.rand(2, 4, 5), torch.rand(2, 3, 7), torch.rand(2, 3, 9))
