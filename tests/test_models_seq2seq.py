"""Translation models: shapes, masks, init, config, KV-cache decoding, beam search, and
overfitting a tiny corpus with both the Bahdanau GRU model and the Transformer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from qkv.data.translate import BOS, EOS, PAD, TranslationData
from qkv.models import (
    BahdanauSeq2Seq,
    EncoderDecoder,
    Seq2SeqAttentionDecoder,
    Seq2SeqConfig,
    Seq2SeqEncoder,
    beam_search,
    build_model,
    greedy_decode,
    num_parameters,
    score_sequence,
    teacher_forcing_input,
)

# Twenty English -> French pairs, already tokenised the way `preprocess` would.
TINY_CORPUS = """\
go .\tva !
hi .\tsalut .
run !\tcours !
who ?\tqui ?
wow !\tça alors !
i lost .\tj'ai perdu .
i'm home .\tje suis chez moi .
he's calm .\til est calme .
i'm ok .\tje vais bien .
help !\tà l'aide !
stop !\tarrête !
wait !\tattends !
go on .\tpoursuis .
i see .\tje comprends .
i won !\tj'ai gagné !
we won .\tnous avons gagné .
she ran .\telle a couru .
be calm .\tsois calme .
he is ok .\til va bien .
come home .\trentre à la maison ."""

NUM_STEPS = 8



def tiny_data() -> TranslationData:
    pairs = [line.split("\t") for line in TINY_CORPUS.splitlines()]
    src = [s.split() for s, _ in pairs]
    tgt = [t.split() for _, t in pairs]
    return TranslationData.from_pairs(src, tgt, num_steps=NUM_STEPS, min_freq=1)


def small_config(model: str, **overrides) -> Seq2SeqConfig:
    kwargs = dict(
        model=model,
        src_vocab_size=11,
        tgt_vocab_size=13,
        embed_size=16,
        num_hiddens=16,
        num_layers=2,
        dropout=0.0,
        num_heads=4,
        ffn_num_hiddens=32,
        max_len=64,
    )
    kwargs.update(overrides)
    return Seq2SeqConfig(**kwargs)


def random_batch(config: Seq2SeqConfig, batch: int = 3, src_len: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, config.src_vocab_size, (batch, src_len), generator=g)
    valid = torch.tensor([src_len, 4, 2, 5, 1, 3][:batch])
    return src, valid


def masked_ce(logits: torch.Tensor, target: torch.Tensor, valid_len: torch.Tensor):
    """Cross-entropy averaged over the valid (non-pad) target tokens."""
    loss = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    mask = torch.arange(target.shape[1])[None] < valid_len[:, None]
    return (loss * mask).sum() / mask.sum()


# ----------------------------------------------------------------------------
# Shapes and attention weights


def test_encoder_shapes_are_time_major():
    enc = Seq2SeqEncoder(vocab_size=10, embed_size=8, num_hiddens=16, num_layers=2)
    outputs, state = enc(torch.zeros(4, 7, dtype=torch.long))
    assert outputs.shape == (7, 4, 16)
    assert state.shape == (2, 4, 16)
    assert torch.allclose(outputs[-1], state[-1])  # top layer's last step


def test_decoder_shapes_and_attention_rows():
    enc = Seq2SeqEncoder(10, 8, 16, 2)
    dec = Seq2SeqAttentionDecoder(12, 8, 16, 2)
    src = torch.randint(0, 10, (3, 7))
    valid = torch.tensor([7, 3, 1])
    state = dec.init_state(*enc(src), valid)
    logits, state = dec(torch.randint(0, 12, (3, 5)), state)
    assert logits.shape == (3, 5, 12)
    assert state.hidden.shape == (2, 3, 16)
    w = dec.attention_weights
    assert w.shape == (3, 5, 7)  # (batch, steps, src_len)
    keep = torch.arange(7)[None, None] < valid[:, None, None]
    assert torch.allclose(w.sum(-1), torch.ones(3, 5))
    assert (w[~keep.expand_as(w)] == 0).all()


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_model_interface_shapes(model_name):
    config = small_config(model_name)
    model = build_model(config).eval()
    assert isinstance(model, EncoderDecoder)
    src, valid = random_batch(config)
    dec_input = torch.randint(0, config.tgt_vocab_size, (3, 6))
    assert model(src, valid, dec_input).shape == (3, 6, config.tgt_vocab_size)
    state = model.encode(src, valid, max_steps=5)
    logits, state, attn = model.decode_step(torch.full((3,), 2), state)
    assert logits.shape == (3, config.tgt_vocab_size)
    assert attn.shape == (3, 7)
    assert torch.allclose(attn.sum(-1), torch.ones(3))
    beyond = torch.arange(7)[None] >= valid[:, None]
    assert (attn[beyond] == 0).all()


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_reorder_state_selects_rows(model_name):
    config = small_config(model_name)
    torch.manual_seed(0)
    model = build_model(config).eval()
    src, valid = random_batch(config)
    with torch.no_grad():
        state = model.encode(src, valid, max_steps=4)
        _, state, _ = model.decode_step(torch.tensor([2, 5, 7]), state)
        index = torch.tensor([2, 0, 0])
        picked = model.reorder_state(state, index)
        want, _, want_attn = model.decode_step(torch.tensor([3, 3, 3]), state)
        got, _, got_attn = model.decode_step(torch.tensor([3, 3, 3]), picked)
    torch.testing.assert_close(got, want[index])
    torch.testing.assert_close(got_attn, want_attn[index])


# ----------------------------------------------------------------------------
# Performance: keys projected once per sentence


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_keys_projected_once_per_forward(backend):
    config = small_config("bahdanau", backend=backend)
    model = build_model(config)
    calls = []
    model.decoder.attention.W_k.register_forward_hook(lambda *_: calls.append(1))
    src, valid = random_batch(config)
    model(src, valid, torch.randint(0, config.tgt_vocab_size, (3, 9)))  # 9 decoder steps
    assert len(calls) == 1


# ----------------------------------------------------------------------------
# Initialisation


def test_xavier_init_applied_biases_untouched():
    config = small_config("bahdanau", num_hiddens=64, embed_size=32)
    torch.manual_seed(0)
    plain = BahdanauSeq2Seq(config)
    torch.manual_seed(0)
    model = build_model(config)
    gru = model.decoder.rnn
    for name, param in gru.named_parameters():
        if name.startswith("weight_"):
            fan_out, fan_in = param.shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            assert param.abs().max() <= bound
            # uniform(-a, a) has std a / sqrt(3); the default init's bound differs a lot
            assert param.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
        else:
            assert torch.equal(param, dict(plain.decoder.rnn.named_parameters())[name])
    dense = model.decoder.dense
    bound = math.sqrt(6.0 / sum(dense.weight.shape))
    assert dense.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    assert torch.equal(dense.bias, plain.decoder.dense.bias)


def test_num_parameters_counts_trainable_only():
    model = build_model(small_config("bahdanau"))
    total = sum(p.numel() for p in model.parameters())
    assert num_parameters(model) == total
    model.encoder.embedding.weight.requires_grad_(False)
    assert num_parameters(model) == total - model.encoder.embedding.weight.numel()


def test_teacher_forcing_input():
    tgt = torch.tensor([[5, 6, 2, 1], [7, 2, 1, 1]])
    assert teacher_forcing_input(tgt, bos_id=9).tolist() == [[9, 5, 6, 2], [9, 7, 2, 1]]


# ----------------------------------------------------------------------------
# Config


def test_config_round_trip():
    config = small_config("transformer", dropout=0.25)
    assert Seq2SeqConfig.from_dict(config.to_dict()) == config
    # ints are accepted for float fields (JSON writes 0.0 as 0 in some tools)
    assert Seq2SeqConfig.from_dict({**config.to_dict(), "dropout": 0}).dropout == 0.0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"colour": 1}, "unknown config key 'colour'; valid keys: model"),
        ({"num_layers": "2"}, "'num_layers' must be of type int"),
        ({"num_layers": True}, "'num_layers' must be of type int"),
        ({"dropout": "0.1"}, "'dropout' must be of type float"),
        ({"num_hiddens": 0}, r"'num_hiddens' must be an integer in \[1, 2147483647\], got 0"),
        ({"tgt_vocab_size": -3}, "'tgt_vocab_size' must be an integer in .* got -3"),
        ({"num_layers": 2**31}, "'num_layers' must be an integer in .* got 2147483648"),
        ({"max_len": 10**400}, "'max_len' must be an integer in .* about 401 digits"),
        ({"dropout": 10**400}, "'dropout' must be of type float"),
        ({"dropout": float("nan")}, "'dropout': dropout must be a finite number"),
        ({"dropout": 1.0}, "'dropout'"),
        ({"model": "lstm"}, "'model' must be one of bahdanau, transformer"),
        ({"backend": "cuda"}, "^config key 'backend' must be one of fused, eager, got 'cuda'$"),
        ({"backend": 1}, "'backend' must be of type str"),
        ({"model": "transformer", "embed_size": 8}, "'embed_size' must equal num_hiddens"),
        ({"model": "transformer", "num_heads": 3}, "'num_heads' must divide num_hiddens"),
    ],
)
def test_config_errors(change, match):
    d = {**small_config("bahdanau").to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        Seq2SeqConfig.from_dict(d)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(model="bahdanau"),
        dict(model="bahdanau", num_layers=1, embed_size=5, num_hiddens=7),
        dict(model="bahdanau", num_layers=3, src_vocab_size=2, tgt_vocab_size=40),
        dict(model="bahdanau", backend="eager"),
        dict(model="transformer"),
        dict(model="transformer", num_layers=1, embed_size=12, num_hiddens=12, num_heads=3,
             ffn_num_hiddens=5, max_len=9),
        dict(model="transformer", num_layers=3, src_vocab_size=50, tgt_vocab_size=3),
    ],
)
def test_sizes_from_the_config_match_the_built_model(overrides):
    """Parameter count, buffer size and state_dict shapes, by arithmetic, against the real
    model (the independent reference)."""
    config = small_config(**overrides)
    model = build_model(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert config.num_buffer_elements() == sum(b.numel() for b in model.buffers())
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert list(config.parameter_shapes()) == shapes


def test_sizes_of_a_huge_config_cost_nothing():
    # a billion layers of width 2**31 - 1: counted, never built (and the shapes generator
    # can be stopped after a few entries)
    config = small_config("transformer", num_layers=10**9, embed_size=2**31 - 1,
                          num_hiddens=2**31 - 1, num_heads=1)
    config.validate()
    assert config.num_parameters() > 10**27
    first = next(iter(config.parameter_shapes()))
    assert first == ("src_embedding.weight", (11, 2**31 - 1))


def test_default_config_is_a_template_build_rejects_it():
    with pytest.raises(ValueError, match="'src_vocab_size' must be an integer in"):
        build_model(Seq2SeqConfig())


# ----------------------------------------------------------------------------
# Tracing


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_trace_logs_shapes_every_step_and_norms_once(backend):
    config = small_config("bahdanau", backend=backend)
    model = build_model(config)
    src, valid = random_batch(config)
    dec_input = torch.randint(0, config.tgt_vocab_size, (3, 4))
    model(src, valid, dec_input)  # tracing off: nothing to record
    lines: list[str] = []
    model.trace = lines.append
    model(src, valid, dec_input)
    assert sum("decoder step" in line for line in lines) == 4
    assert (
        "query (3, 1, 16), context (3, 1, 16), GRU output (3, 16), hidden (2, 3, 16)"
        in (lines[0])
    )
    assert sum("|h_after - h_before|" in line for line in lines) == 4
    lines.clear()
    model(src, valid, dec_input)  # second batch: shapes only
    assert len(lines) == 4 and not any("|context|" in line for line in lines)
    model.trace = None
    lines.clear()
    model(src, valid, dec_input)
    assert lines == []


# ----------------------------------------------------------------------------
# Transformer: KV-cache decoding matches full recomputation


def full_recompute_greedy(model, src, valid, bos_id, eos_id, max_steps):
    """Greedy decoding the slow way: re-run the teacher-forced forward on the prefix."""
    tokens, all_logits = [], []
    with torch.no_grad():
        for row in range(src.shape[0]):
            prefix = [bos_id]
            out, row_logits = [], []
            for _ in range(max_steps):
                logits = model(src[row : row + 1], valid[row : row + 1], torch.tensor([prefix]))
                row_logits.append(logits[0, -1])
                tok = logits[0, -1].argmax().item()
                if tok == eos_id:
                    break
                out.append(tok)
                prefix.append(tok)
            tokens.append(out)
            all_logits.append(torch.stack(row_logits))
    return tokens, all_logits


def top2_gap(logits: torch.Tensor) -> float:
    """Smallest gap between the two largest entries of the rows of ``logits (..., V)``."""
    top2 = logits.topk(2, dim=-1).values
    return float((top2[..., 0] - top2[..., 1]).min())


def test_transformer_cached_greedy_equals_full_recompute():
    config = small_config("transformer", tgt_vocab_size=20)
    torch.manual_seed(1)
    model = build_model(config).eval()
    src, valid = random_batch(config, batch=4, seed=3)
    bos_id, eos_id, max_steps = 2, 3, 12
    want, want_logits = full_recompute_greedy(model, src, valid, bos_id, eos_id, max_steps)
    got, _ = greedy_decode(model, src, valid, bos_id=bos_id, eos_id=eos_id, max_steps=max_steps)
    # The cached logits equal the full forward's to 1e-5 (checked below), not bit for bit;
    # identical tokens follow, because no greedy choice here is that close to a tie.
    assert min(top2_gap(logits) for logits in want_logits) > 1e-4  # 1.5e-3 here
    assert got == want
    assert max(len(t) for t in got) > 3  # the test exercises several cached steps
    # Step by step, the cached logits are the full forward's last-position logits.
    with torch.no_grad():
        for row, toks in enumerate(want):
            state = model.encode(src[row : row + 1], valid[row : row + 1], max_steps=max_steps)
            for t, tok in enumerate([bos_id, *toks][: len(want_logits[row])]):
                logits, state, _ = model.decode_step(torch.tensor([tok]), state)
                torch.testing.assert_close(logits[0], want_logits[row][t], atol=1e-5, rtol=1e-5)


def test_transformer_cache_is_bounded_by_max_steps():
    config = small_config("transformer")
    model = build_model(config).eval()
    src, valid = random_batch(config, batch=1)
    state = model.encode(src, valid, max_steps=2)
    assert state.caches[0].keys.shape == (1, 4, 2, 4)
    with torch.no_grad():
        for _ in range(2):
            _, state, _ = model.decode_step(torch.tensor([2]), state)
        with pytest.raises(ValueError, match="pass a larger max_steps"):
            model.decode_step(torch.tensor([2]), state)
    with pytest.raises(ValueError, match="max_steps must be in 1..max_len=64"):
        model.encode(src, valid, max_steps=65)


# ----------------------------------------------------------------------------
# Decoding helpers


@pytest.mark.parametrize("model_name, backend",
                         [("bahdanau", "fused"), ("bahdanau", "eager"), ("transformer", "fused")])
def test_greedy_restores_training_mode_and_shapes(model_name, backend):
    config = small_config(model_name, dropout=0.5, backend=backend)
    model = build_model(config)  # training mode: decoding must not be random
    src, valid = random_batch(config, batch=3)
    a = greedy_decode(model, src, valid, bos_id=2, eos_id=3, max_steps=6)
    b = greedy_decode(model, src, valid, bos_id=2, eos_id=3, max_steps=6)
    assert model.training
    assert a[0] == b[0]
    for toks, attn in zip(*a, strict=True):
        assert attn.shape[1] == 7 and attn.shape[0] in (len(toks), len(toks) + 1)
        assert len(toks) <= 6


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_beam_size_one_is_greedy(model_name):
    config = small_config(model_name, tgt_vocab_size=20)
    torch.manual_seed(2)
    model = build_model(config).eval()
    src, valid = random_batch(config, batch=5, seed=4)
    greedy, greedy_attn = greedy_decode(model, src, valid, bos_id=2, eos_id=3, max_steps=10)
    # One sentence at a time through beam search vs the whole batch greedily: float32
    # logits that differ in the last bits, so first check that no choice is a near-tie.
    want, logits = full_recompute_greedy(model, src, valid, 2, 3, 10)
    assert min(top2_gap(step) for step in logits) > 1e-4  # 6e-4 and 0.07 here
    assert want == greedy
    for i in range(5):
        toks, attn, _ = beam_search(
            model, src[i : i + 1], valid[i : i + 1], bos_id=2, eos_id=3, max_steps=10, beam_size=1
        )
        assert toks == greedy[i]
        torch.testing.assert_close(attn, greedy_attn[i])


# ----------------------------------------------------------------------------
# Overfitting a tiny corpus, then decoding it back


def overfit(model_name: str, steps: int, **overrides):
    torch.manual_seed(0)
    data = tiny_data()
    src, src_len, tgt, tgt_len = data.train
    config = small_config(
        model_name,
        src_vocab_size=len(data.src_vocab),
        tgt_vocab_size=len(data.tgt_vocab),
        **overrides,
    )
    model = build_model(config)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    dec_input = teacher_forcing_input(tgt, data.tgt_vocab[BOS])
    model.train()
    for _ in range(steps):
        loss = masked_ce(model(src, src_len, dec_input), tgt, tgt_len)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval(), data, loss.item()


@pytest.mark.parametrize(
    "model_name, steps, overrides",
    [
        ("bahdanau", 200, {"embed_size": 32, "num_hiddens": 32}),
        ("transformer", 150, {"embed_size": 32, "num_hiddens": 32}),
    ],
)
def test_overfit_tiny_corpus_then_decode(model_name, steps, overrides):
    model, data, loss = overfit(model_name, steps, **overrides)
    assert loss < 0.05
    src, src_len, _, _ = data.train
    bos, eos = data.tgt_vocab[BOS], data.tgt_vocab[EOS]
    assert data.tgt_vocab[PAD] not in (bos, eos)
    tokens, attention = greedy_decode(
        model, src, src_len, bos_id=bos, eos_id=eos, max_steps=NUM_STEPS
    )
    for (_, target), toks, attn in zip(data.train_pairs, tokens, attention, strict=True):
        assert data.tgt_vocab.to_tokens(toks) == target
        assert attn.shape == (len(target) + 1, NUM_STEPS)  # + the <eos> step

    # Beam search finds the same translations, scoring at least as well as greedy.
    for i in range(0, 20, 4):
        args = (model, src[i : i + 1], src_len[i : i + 1])
        beam, _, score = beam_search(*args, bos_id=bos, eos_id=eos, max_steps=NUM_STEPS)
        greedy_score = score_sequence(*args, tokens[i] + [eos], bos_id=bos)
        assert score >= greedy_score - 1e-4
        assert beam == tokens[i]


def test_beam_score_at_least_greedy_on_random_model():
    config = small_config("transformer", tgt_vocab_size=12)
    torch.manual_seed(5)
    model = build_model(config).eval()
    src, valid = random_batch(config, batch=4, seed=6)
    greedy, attn = greedy_decode(model, src, valid, bos_id=2, eos_id=3, max_steps=8)
    for i in range(4):
        args = (model, src[i : i + 1], valid[i : i + 1])
        toks, _, score = beam_search(*args, bos_id=2, eos_id=3, max_steps=8, beam_size=4)
        ended = attn[i].shape[0] > len(greedy[i])
        greedy_seq = greedy[i] + ([3] if ended else [])
        assert score >= score_sequence(*args, greedy_seq, bos_id=2) - 1e-4
        # the reported score is the score of the returned sequence
        ended = len(toks) < 8
        beam_seq = toks + ([3] if ended else [])
        assert score == pytest.approx(score_sequence(*args, beam_seq, bos_id=2), abs=1e-4)


# ----------------------------------------------------------------------------
# The fused backend's hand-written backwards (qkv.models.bahdanau_kernels)


def _reference_decoder(embs, values, keys, hidden, keep, W_q, w_v, layers, attn_keep,
                       layer_keep):
    """The same recurrence written with autograd: torch.gru_cell and a masked softmax."""
    from qkv.functional import softmax_with_mask

    state = list(hidden.unbind(0))
    tops = []
    for t in range(embs.shape[0]):
        q = state[-1] @ W_q.t()
        scores = (torch.tanh(keys + q[:, None]) * w_v[0]).sum(-1)
        weights = softmax_with_mask(scores, keep)
        context = ((weights * attn_keep[t])[:, :, None] * values).sum(1)
        new = []
        for i, (W_ih, b_ih, W_hh, b_hh) in enumerate(layers):
            x = torch.cat([context, embs[t]], -1) if i == 0 else new[-1] * layer_keep[t, i - 1]
            new.append(torch.gru_cell(x, state[i], W_ih, W_hh, b_ih, b_hh))
        state = new
        tops.append(new[-1])
    return torch.stack(tops), torch.stack(state)


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_attention_gru_values_and_gradients_match_autograd_float64(num_layers):
    from qkv.models.bahdanau_kernels import GRULayer, attention_gru, score_bias

    g = torch.Generator().manual_seed(num_layers)
    T, B, S, H, E = 4, 3, 5, 6, 7
    dt = torch.float64

    def rand(*shape):
        return (torch.randn(*shape, generator=g, dtype=dt) * 0.5).requires_grad_()

    embs, values, keys, hidden = rand(T, B, E), rand(B, S, H), rand(B, S, H), rand(
        num_layers, B, H)
    W_q, w_v = rand(H, H), rand(1, H)
    layers = [(rand(3 * H, H + E if i == 0 else H), rand(3 * H), rand(3 * H, H), rand(3 * H))
              for i in range(num_layers)]
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    bias, row_ok = score_bias(keep, dt)
    assert row_ok is not None  # the empty second row must be guarded

    p, seed = 0.3, 11
    top, last, weights, _, _ = attention_gru(
        embs, values, keys, hidden, bias, row_ok, W_q, w_v, [GRULayer(*x) for x in layers],
        attn_dropout=p, layer_dropout=p, training=True,
        generator=torch.Generator().manual_seed(seed))
    # the same dropout draws by hand, in attention_gru's order: weights, then layers
    draw = torch.Generator().manual_seed(seed)
    attn_keep = (torch.rand((T, B, S), generator=draw) < 1 - p).to(dt) / (1 - p)
    layer_keep = (torch.rand((T, num_layers - 1, B, H), generator=draw) < 1 - p).to(dt) / (
        1 - p)
    assert 0 < (attn_keep == 0).sum() < attn_keep.numel()  # some dropped, some kept
    flat = [x for layer in layers for x in layer]
    ref_top, ref_last = _reference_decoder(embs, values, keys, hidden, keep, W_q, w_v,
                                           layers, attn_keep, layer_keep)
    torch.testing.assert_close(top, ref_top)
    torch.testing.assert_close(last, ref_last)
    assert torch.equal(weights[:, 1], torch.zeros(T, S, dtype=dt))  # empty source: zeros
    assert weights[:, 0, 3:].eq(0).all() and weights[:, 0, :3].gt(0).all()  # padding

    inputs = [embs, values, keys, hidden, W_q, w_v, *flat]
    d_top, d_last = torch.randn_like(top), torch.randn_like(last)
    ours = torch.autograd.grad((top * d_top).sum() + (last * d_last).sum(), inputs)
    ref = torch.autograd.grad((ref_top * d_top).sum() + (ref_last * d_last).sum(), inputs)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
        assert torch.isfinite(a).all()


def test_attention_gru_passes_gradcheck():
    from qkv.models.bahdanau_kernels import GRULayer, attention_gru, score_bias

    g = torch.Generator().manual_seed(0)
    T, B, S, H, E = 3, 2, 3, 2, 2

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    bias, row_ok = score_bias(torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
                              torch.float64)
    args = (rand(T, B, E), rand(B, S, H), rand(B, S, H), rand(2, B, H), rand(H, H),
            rand(1, H),
            rand(3 * H, H + E), rand(3 * H), rand(3 * H, H), rand(3 * H),
            rand(3 * H, H), rand(3 * H), rand(3 * H, H), rand(3 * H))

    def first_two(embs, values, keys, hidden, W_q, w_v, *flat):
        layers = [GRULayer(*flat[i : i + 4]) for i in range(0, len(flat), 4)]
        return attention_gru(embs, values, keys, hidden, bias, row_ok, W_q, w_v, layers)[:2]

    assert torch.autograd.gradcheck(first_two, args)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_gru_equals_nn_gru_values_and_gradients_float64(num_layers):
    from qkv.models.bahdanau_kernels import gru

    torch.manual_seed(num_layers)
    rnn = nn.GRU(4, 6, num_layers).double()
    x = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(num_layers, 3, 6, dtype=torch.float64, requires_grad=True)
    ref_out, ref_last = rnn(x, h0)
    out, last = gru(x, rnn, h0)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(last, ref_last)
    d_out, d_last = torch.randn_like(out), torch.randn_like(last)
    inputs = [x, h0, *rnn.parameters()]
    ours = torch.autograd.grad((out * d_out).sum() + (last * d_last).sum(), inputs)
    ref = torch.autograd.grad((ref_out * d_out).sum() + (ref_last * d_last).sum(), inputs)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_gru_dropout_between_layers_matches_nn_gru_layer_by_layer():
    from qkv.models.bahdanau_kernels import gru

    torch.manual_seed(0)
    rnn = nn.GRU(4, 6, 2, dropout=0.5).double()
    x = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(gru(x, rnn)[0], rnn.eval()(x)[0])  # eval: no dropout
    out, _ = gru(x, rnn, training=True, generator=torch.Generator().manual_seed(1))
    # the same draw by hand: layer 1 reads layer 0's outputs, half zeroed, the rest doubled
    keep = (torch.rand((3, 1, 2, 6), generator=torch.Generator().manual_seed(1)) < 0.5) * 2.0
    first, second = nn.GRU(4, 6).double(), nn.GRU(6, 6).double()
    first.load_state_dict({k[:-1] + "0": v for k, v in rnn.state_dict().items()
                           if k.endswith("l0")})
    second.load_state_dict({k[:-1] + "0": v for k, v in rnn.state_dict().items()
                            if k.endswith("l1")})
    ref = second(first(x)[0] * keep[:, 0])[0]
    torch.testing.assert_close(out, ref)
    d = torch.randn_like(out)
    ours = torch.autograd.grad((out * d).sum(), [x, *rnn.parameters()])
    theirs = torch.autograd.grad((ref * d).sum(), [x, *first.parameters(),
                                                   *second.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------
# Backends: the fused kernels against the eager loop. The eager backend is d2l's loop
# over the nn.GRU and AdditiveAttention modules, so it is an independent reference.


def twin_models(**overrides):
    """The same weights under both backends (float64): built fused, loaded into eager."""
    config = small_config("bahdanau", **overrides)
    torch.manual_seed(0)
    fused = build_model(config).double()
    eager = build_model(dataclasses.replace(config, backend="eager")).double()
    eager.load_state_dict(fused.state_dict())  # same names and shapes: one checkpoint format
    assert (fused.encoder.backend, eager.decoder.backend) == ("fused", "eager")
    return fused, eager


def assert_same(a, b):
    """Equal to float64 rounding: the backends order the same arithmetic differently."""
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("num_layers", [1, 2, 3])
@pytest.mark.parametrize("valid", [None, [7, 4, 0, 2]], ids=["no-padding", "padding"])
def test_backends_agree_on_outputs_weights_and_gradients_float64(num_layers, valid):
    fused, eager = twin_models(num_layers=num_layers)
    src, _ = random_batch(fused.config, batch=4, seed=num_layers)
    valid = torch.full((4,), 7) if valid is None else torch.tensor(valid)
    dec_input = torch.randint(0, fused.config.tgt_vocab_size, (4, 6))
    d_logits = torch.randn(4, 6, fused.config.tgt_vocab_size, dtype=torch.float64)
    results = []
    for model in (fused, eager):  # training mode; dropout is 0 here
        logits = model(src, valid, dec_input)
        # every parameter must be reached (autograd.grad refuses an unused one)
        grads = torch.autograd.grad((logits * d_logits).sum(), list(model.parameters()))
        results.append((logits, model.decoder.attention_weights, grads))
    (logits, weights, grads), (ref_logits, ref_weights, ref_grads) = results
    assert_same(logits, ref_logits)
    assert_same(weights, ref_weights)
    assert weights.shape == (4, 6, 7)
    beyond = torch.arange(7) >= valid[:, None, None]
    assert (weights[beyond.expand_as(weights)] == 0).all()
    names = [name for name, _ in fused.named_parameters()]
    for name, g, ref in zip(names, grads, ref_grads, strict=True):
        assert ref.abs().sum() > 0, name
        torch.testing.assert_close(g, ref, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_encoder_backends_agree_float64(num_layers):
    torch.manual_seed(num_layers)
    fused = Seq2SeqEncoder(10, 5, 6, num_layers).double()
    eager = Seq2SeqEncoder(10, 5, 6, num_layers, backend="eager").double()
    eager.load_state_dict(fused.state_dict())
    X = torch.randint(0, 10, (3, 7))
    d_out = torch.randn(7, 3, 6, dtype=torch.float64)
    d_state = torch.randn(num_layers, 3, 6, dtype=torch.float64)
    results = []
    for encoder in (fused, eager):
        outputs, state = encoder(X)
        loss = (outputs * d_out).sum() + (state * d_state).sum()
        results.append((outputs, state, torch.autograd.grad(loss, list(encoder.parameters()))))
    for a, b in zip(results[0][:2], results[1][:2], strict=True):
        assert_same(a, b)
    for a, b in zip(results[0][2], results[1][2], strict=True):
        assert_same(a, b)


def test_dropout_is_off_in_eval_under_both_backends():
    fused, eager = twin_models(dropout=0.5, num_layers=2)
    src, valid = random_batch(fused.config)
    dec_input = torch.randint(0, fused.config.tgt_vocab_size, (3, 5))
    for model in (fused, eager):  # training: dropout changes the outputs
        torch.manual_seed(1)
        first = model(src, valid, dec_input)
        torch.manual_seed(2)
        assert not torch.allclose(model(src, valid, dec_input), first)
    with torch.no_grad():
        outs = [model.eval()(src, valid, dec_input) for model in (fused, eager, fused, eager)]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert_same(outs[0], outs[1])


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_decode_step_equals_forward_under_each_backend(backend):
    config = small_config("bahdanau", backend=backend)
    model = build_model(config).double().eval()
    src, valid = random_batch(config)
    dec_input = torch.randint(0, config.tgt_vocab_size, (3, 6))
    full = model(src, valid, dec_input)
    full_weights = model.decoder.attention_weights
    state = model.encode(src, valid)
    steps = [model.decode_step(dec_input[:, t], state) for t in range(6)]
    assert_same(torch.stack([logits for logits, _, _ in steps], 1), full)
    assert_same(torch.stack([attn for _, _, attn in steps], 1), full_weights)
    assert state.step == 6


def test_greedy_and_beam_give_the_same_tokens_under_both_backends():
    trained, data, _ = overfit("bahdanau", 60)  # trained under the default, fused
    assert trained.config.backend == "fused"
    fused = trained.double()
    eager = build_model(dataclasses.replace(trained.config, backend="eager")).double().eval()
    eager.load_state_dict(fused.state_dict())
    src, src_len, _, _ = data.train
    bos, eos = data.tgt_vocab[BOS], data.tgt_vocab[EOS]
    args = dict(bos_id=bos, eos_id=eos, max_steps=NUM_STEPS)
    tokens, attention = greedy_decode(fused, src, src_len, **args)
    ref_tokens, ref_attention = greedy_decode(eager, src, src_len, **args)
    assert tokens == ref_tokens
    assert sum(len(t) > 1 for t in tokens) > 10  # a trained model, not one repeated token
    for a, b in zip(attention, ref_attention, strict=True):
        assert_same(a, b)
    for i in range(0, 20, 3):
        beams = [beam_search(model, src[i : i + 1], src_len[i : i + 1], beam_size=3, **args)
                 for model in (fused, eager)]
        assert beams[0][0] == beams[1][0]
        assert beams[0][2] == pytest.approx(beams[1][2], abs=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Seq2SeqEncoder(10, 4, 4, 1, backend="cuda"),
        lambda: Seq2SeqAttentionDecoder(10, 4, 4, 1, backend="cuda"),
    ],
    ids=["encoder", "decoder"],
)
def test_bad_backend_is_a_one_line_error(make):
    with pytest.raises(ValueError, match=r"^backend must be one of \('fused', 'eager'\), "
                                         r"got 'cuda'$"):
        make()


def test_config_backend_reaches_the_modules_and_old_configs_load():
    config = small_config("bahdanau", backend="eager")
    model = build_model(config)
    assert (model.encoder.backend, model.decoder.backend) == ("eager", "eager")
    assert Seq2SeqConfig.from_dict(config.to_dict()) == config
    saved = small_config("bahdanau").to_dict()
    del saved["backend"]  # a config saved before the field existed
    assert Seq2SeqConfig.from_dict(saved).backend == "fused"


# ----------------------------------------------------------------------------
# skip_padding: the GRU encoder's final state after each sentence's last real token


@pytest.mark.parametrize("num_layers", [1, 3])
def test_gru_final_states_at_each_rows_length_equal_nn_gru_on_the_unpadded_rows(num_layers):
    from qkv.models.bahdanau_kernels import gru

    torch.manual_seed(num_layers)
    rnn = nn.GRU(4, 6, num_layers).double()
    lengths = torch.tensor([5, 2, 1, 4])
    x = torch.randn(5, 4, 4, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(num_layers, 4, 6, dtype=torch.float64, requires_grad=True)
    out, last = gru(x, rnn, h0, lengths=lengths)
    # outputs past a row's length are states after padding, which no caller uses: the
    # loss weighs only real steps and the final states
    real = (torch.arange(5)[:, None] < lengths[None, :])[..., None]
    d_out, d_last = torch.randn_like(out) * real, torch.randn_like(last)
    inputs = [x, h0, *rnn.parameters()]
    ours = torch.autograd.grad((out * d_out).sum() + (last * d_last).sum(), inputs)
    # the reference: nn.GRU on each row alone, cut to its length (no padding at all)
    ref_loss = 0
    for b, n in enumerate(lengths.tolist()):
        row_out, row_last = rnn(x[:n, b : b + 1], h0[:, b : b + 1])
        torch.testing.assert_close(out[:n, b : b + 1], row_out)
        torch.testing.assert_close(last[:, b : b + 1], row_last)
        ref_loss = ref_loss + (row_out * d_out[:n, b : b + 1]).sum() + (
            row_last * d_last[:, b : b + 1]).sum()
    ref = torch.autograd.grad(ref_loss, inputs)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert (ours[0] * ~real).abs().sum() == 0  # padding inputs change nothing used


@pytest.mark.parametrize("num_layers", [1, 2])
def test_skip_padding_backends_agree_and_padding_changes_nothing(num_layers):
    fused, eager = twin_models(num_layers=num_layers, skip_padding=True)
    src, _ = random_batch(fused.config, batch=4, seed=num_layers)
    valid = torch.tensor([7, 4, 1, 2])
    dec_input = torch.randint(0, fused.config.tgt_vocab_size, (4, 6))
    d_logits = torch.randn(4, 6, fused.config.tgt_vocab_size, dtype=torch.float64)
    results = []
    for model in (fused, eager):
        logits = model(src, valid, dec_input)
        grads = torch.autograd.grad((logits * d_logits).sum(), list(model.parameters()))
        results.append((logits, grads))
    assert_same(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    # each sentence alone, with no padding, gives the same logits (the default, d2l's
    # encoder, reads the padding and so does not)
    for b, n in enumerate(valid.tolist()):
        alone = fused(src[b : b + 1, :n], valid[b : b + 1], dec_input[b : b + 1])
        assert_same(alone, results[0][0][b : b + 1])
    d2l_style = build_model(dataclasses.replace(fused.config, skip_padding=False)).double()
    d2l_style.load_state_dict(fused.state_dict())
    padded = d2l_style(src[2:3], valid[2:3], dec_input[2:3])
    alone = d2l_style(src[2:3, :1], valid[2:3], dec_input[2:3])
    assert not torch.allclose(padded, alone)


@pytest.mark.parametrize("model_name", ["bahdanau", "transformer"])
def test_banned_ids_are_never_decoded_and_the_next_best_is_taken(model_name):
    config = small_config(model_name, tgt_vocab_size=20)
    torch.manual_seed(2)
    model = build_model(config).eval()
    src, valid = random_batch(config, batch=5, seed=4)
    # ban the two tokens (not <eos>) the model likes best at the first step
    with torch.no_grad():
        first = model(src, valid, torch.full((5, 1), 2))[:, 0]
    first[:, 3] = float("-inf")
    banned = first.mean(0).topk(2).indices.tolist()
    got, _ = greedy_decode(model, src, valid, bos_id=2, eos_id=3, max_steps=8,
                           banned_ids=banned)
    # the reference: re-run the whole prefix each step, the banned logits set to -inf
    with torch.no_grad():
        for row in range(5):
            prefix, want = [2], []
            for _ in range(8):
                logits = model(src[row : row + 1], valid[row : row + 1],
                               torch.tensor([prefix]))[0, -1].clone()
                logits[banned] = float("-inf")
                tok = int(logits.argmax())
                if tok == 3:
                    break
                want.append(tok)
                prefix.append(tok)
            assert got[row] == want
            toks, _, _ = beam_search(model, src[row : row + 1], valid[row : row + 1],
                                     bos_id=2, eos_id=3, max_steps=8, beam_size=1,
                                     banned_ids=banned)
            assert toks == want
            toks, _, _ = beam_search(model, src[row : row + 1], valid[row : row + 1],
                                     bos_id=2, eos_id=3, max_steps=8, beam_size=4,
                                     banned_ids=banned)
            assert not set(toks) & set(banned)
    with pytest.raises(ValueError, match=r"banned_ids must not hold eos_id \(3\)"):
        greedy_decode(model, src, valid, bos_id=2, eos_id=3, max_steps=8, banned_ids=[3])
