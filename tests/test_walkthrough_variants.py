"""``qkv walkthrough``'s sections on the attention of 2025-26 models (mla, absorbed, dsa,
sinks, kvshare).

Every number the steps show is checked against a float64 computation written here from
the mechanisms' equations, with the weights of the layers each step ran (``step.modules``)
and nothing of qkv's computing; cache sizes against counts worked out by hand; and the
printed text against both.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from qkv.book.walkthrough import SECTIONS, format_tensor
from qkv.book.walkthrough_variants import (
    D_MODEL,
    LATENT,
    MECHANISMS,
    SINKS,
    SPARSE,
    VARIANT_SECTIONS,
    variant_steps,
)
from qkv.cli import main
from qkv.options import BOOK_TEXT

T = len(BOOK_TEXT.split())  # 6 tokens
H = 2  # the toy layers' heads
R, Q_RANK = LATENT["kv_lora_rank"], LATENT["q_lora_rank"]
D_N, D_R, D_V = LATENT["qk_nope_head_dim"], LATENT["qk_rope_head_dim"], LATENT["v_head_dim"]
INDEX_HEADS, D_I, TOP_K = SPARSE["index_n_heads"], SPARSE["index_head_dim"], SPARSE["index_topk"]
EPS = 1e-6  # the RMSNorms and the indexer's LayerNorm of DeepSeek's attention
ATOL = 1e-5  # float32 against float64


@pytest.fixture(scope="module")
def steps():
    return {step.section: step for step in variant_steps()}


@pytest.fixture(scope="module")
def printed():
    """``qkv walkthrough --only NAME``'s output for every mechanism."""
    out = {}
    for name in MECHANISMS:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(["walkthrough", "--only", name]) == 0
        out[name] = buffer.getvalue()
    return out


def block(output: str, header: str) -> list[list[float]]:
    """The rows of numbers printed under ``header`` (e.g. ``cache.kv  (6, 6)``), each
    row's leading label dropped."""
    start = output.index(f"\n{header}\n") + len(header) + 2
    end = output.find("\n\n", start)
    rows = []
    for line in output[start : None if end < 0 else end].splitlines():
        numbers, words = [], line.split()
        if words[:1] == ["head"]:  # a row label of two words: "head 1"
            words = words[2:]
        for word in words:
            try:
                numbers.append(float(word))
            except ValueError:
                numbers = []  # a label: the numbers come after it
        if numbers:
            rows.append(numbers)
    return rows


def printed_close(rows: list[list[float]], want: torch.Tensor) -> None:
    """Printed rows equal ``want`` to the 4 decimals printed (one unit of the last)."""
    got = torch.tensor(rows, dtype=torch.float64).flatten()
    torch.testing.assert_close(got, want.flatten().to(torch.float64), atol=1.5e-4, rtol=0)


def f64(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.float64) for k, v in module.state_dict().items()}


def x64(steps) -> torch.Tensor:
    return steps["mla.1"].tensors["x"].to(torch.float64)  # (T, D_MODEL)


# ---------------------------------------------------------------------------
# The equations, in float64
# ---------------------------------------------------------------------------


def angles(num_tokens: int, dim: int, base: float = 10_000.0) -> torch.Tensor:
    """``(T, dim / 2)``: pair i of a ``dim``-wide vector at position p turns by
    ``p * base^(-2i / dim)``."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    return torch.arange(num_tokens, dtype=torch.float64)[:, None] * base ** (-2 * i / dim)


def rope_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Pairs (2i, 2i + 1) of ``x (..., T, d)`` turned by their angle."""
    theta = angles(x.shape[-2], x.shape[-1])
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * theta.cos() - b * theta.sin()
    out[..., 1::2] = b * theta.cos() + a * theta.sin()
    return out


def rope_half(x: torch.Tensor) -> torch.Tensor:
    """Pairs (i, i + d/2) of ``x (..., T, d)`` turned by their angle."""
    half = x.shape[-1] // 2
    theta = angles(x.shape[-2], x.shape[-1])
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * theta.cos() - b * theta.sin(), b * theta.cos() + a * theta.sin()),
                     dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + EPS) * weight


def causal_softmax(scores: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the keys ``u <= t`` of ``scores (..., T, T)``; a ``sink`` logit per head
    ``(heads,)`` joins each denominator."""
    t = scores.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    e = torch.exp(scores.masked_fill(future, -math.inf))
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink)[:, None, None]
    return e / total


def mla_reference(w: dict[str, torch.Tensor], x: torch.Tensor,
                  keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Multi-head latent attention from its equations; ``keep (T, T)``: the keys each
    query may use besides the causal mask (sparse attention)."""
    c_q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])
    q = (c_q @ w["q_b_proj.weight"].T).view(T, H, D_N + D_R).transpose(0, 1)
    q_n, q_r = q[..., :D_N], rope_interleaved(q[..., D_N:])
    kva = x @ w["kv_a_proj_with_mqa.weight"].T
    c = rms_norm(kva[:, :R], w["kv_a_layernorm.weight"])
    k_r = rope_interleaved(kva[:, R:])
    kv = (c @ w["kv_b_proj.weight"].T).view(T, H, D_N + D_V).transpose(0, 1)
    k_n, v = kv[..., :D_N], kv[..., D_N:]
    scores = (q_n @ k_n.transpose(-2, -1) + q_r @ k_r.T) / math.sqrt(D_N + D_R)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    weights = causal_softmax(scores)
    o = (weights @ v).transpose(0, 1).reshape(T, H * D_V)
    return dict(c_q=c_q, q_n=q_n, q_r=q_r, c=c, k_r=k_r, k=torch.cat(
        (k_n, k_r.expand(H, T, D_R)), dim=-1), v=v, scores=scores, weights=weights,
        out=o @ w["o_proj.weight"].T)


def index_reference(w: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The lightning indexer from its equations: keys, queries, head weights, scores."""
    c_q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])
    k = x @ w["indexer.wk.weight"].T
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True)
                                                    + EPS)
    k = k * w["indexer.k_norm.weight"] + w["indexer.k_norm.bias"]
    k = torch.cat((rope_half(k[:, :D_R]), k[:, D_R:]), dim=-1)
    q = (c_q @ w["indexer.wq_b.weight"].T).view(T, INDEX_HEADS, D_I).transpose(0, 1)
    q = torch.cat((rope_half(q[..., :D_R]), q[..., D_R:]), dim=-1)
    head_weights = x @ w["indexer.weights_proj.weight"].T / math.sqrt(INDEX_HEADS)
    scores = torch.zeros(T, T, dtype=torch.float64)
    for t in range(T):
        for u in range(T):
            scores[t, u] = sum(head_weights[t, j] * max(0.0, float(q[j, t] @ k[u]) /
                                                        math.sqrt(D_I))
                               for j in range(INDEX_HEADS)) if u <= t else -math.inf
    return dict(keys=k, queries=q, w=head_weights, scores=scores)


def mha_reference(w: dict[str, torch.Tensor], x: torch.Tensor, kv_heads: int, rope: bool,
                  sink: torch.Tensor | None = None, keys=None, values=None):
    """Causal multi-head attention (grouped when ``kv_heads < H``), with RoPE ("rotate
    half") and a sink per head if asked; ``keys, values (kv_heads, T, d)``: attend with
    these instead of projecting ``x``."""
    d = D_MODEL // H

    def project(name: str) -> torch.Tensor:
        out = x @ w[f"{name}.weight"].T
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    q = project("W_query").view(T, H, d).transpose(0, 1)
    if keys is None:
        keys = project("W_key").view(T, kv_heads, d).transpose(0, 1)
        values = project("W_value").view(T, kv_heads, d).transpose(0, 1)
        if rope:
            keys = rope_half(keys)
    if rope:
        q = rope_half(q)
    group = H // kv_heads
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    weights = causal_softmax(q @ k.transpose(-2, -1) / math.sqrt(d), sink)
    o = (weights @ v).transpose(0, 1).reshape(T, H * d)
    out = o @ w["out_proj.weight"].T + w["out_proj.bias"]
    return dict(keys=keys, values=values, weights=weights, out=out)


def close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(got.to(torch.float64), want, atol=atol, rtol=0)


# ---------------------------------------------------------------------------
# Sections, names and the command line
# ---------------------------------------------------------------------------


def test_sections_in_order_and_each_mechanism_has_its_own(steps):
    assert tuple(steps) == VARIANT_SECTIONS
    assert {s.split(".")[0] for s in VARIANT_SECTIONS} == set(MECHANISMS)
    assert not set(VARIANT_SECTIONS) & set(SECTIONS)
    assert all(not s[0].isdigit() for s in VARIANT_SECTIONS)  # no clash with the book's
    for step in steps.values():
        assert step.explanation and step.tensors and step.modules


def test_only_a_mechanism_prints_its_steps_and_nothing_else(printed):
    for name, output in printed.items():
        headings = [line for line in output.splitlines() if line.startswith("== ")]
        assert [h.split()[1] for h in headings] == [s for s in VARIANT_SECTIONS
                                                    if s.startswith(name + ".")]


def test_steps_lists_book_then_mechanisms(capsys):
    assert main(["walkthrough", "--steps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [*SECTIONS, *VARIANT_SECTIONS]
    assert main(["walkthrough", "--steps", "--only", "3"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(SECTIONS)


def test_help_names_every_mechanism(capsys):
    with pytest.raises(SystemExit):
        main(["walkthrough", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in MECHANISMS:
        assert f"'{name}' shows" in text
    assert "--only mla" in text


def test_unknown_section_lists_the_mechanisms_in_one_line(capsys):
    assert main(["walkthrough", "--only", "mla.9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvshare.2" in err and "3.3.1" in err


def test_every_printed_header_has_the_tensors_shape(steps, printed):
    for section, step in steps.items():
        output = printed[section.split(".")[0]]
        for name, tensor in step.tensors.items():
            assert f"\n{name}  {tuple(tensor.shape)}\n" in output, (section, name)
    shapes = {("mla.1", "c (latent)"): (T, R), ("mla.1", "k_rope"): (T, D_R),
              ("mla.1", "q_nope"): (H, T, D_N), ("mla.2", "cache.kv"): (T, R + D_R),
              ("mla.3", "keys (decompressed)"): (H, T, D_N + D_R),
              ("absorbed.1", "q_latent"): (H, T, R),
              ("absorbed.1", "latent key [c ; k_rope]"): (T, R + D_R),
              ("absorbed.1", "o_latent"): (H, T, R),
              ("dsa.1", "index scores"): (T, T), ("dsa.2", "selected"): (T, TOP_K),
              ("sinks.1", "attn_weights.sum(dim=-1)"): (H, T),
              ("kvshare.1", "handoff.keys"): (1, T, D_MODEL // H)}
    for (section, name), shape in shapes.items():
        assert tuple(steps[section].tensors[name].shape) == shape, (section, name)


def test_variant_steps_leave_global_rng_alone_and_follow_the_seed():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a = variant_steps("the cat sat on the mat", seed=7)
    assert torch.equal(torch.rand(3), expected)
    b = variant_steps("the cat sat on the mat", seed=7)
    c = variant_steps("the cat sat on the mat", seed=8)
    for step_a, step_b in zip(a, b, strict=True):
        for name, tensor in step_a.tensors.items():
            assert torch.equal(tensor, step_b.tensors[name]), (step_a.section, name)
    assert not torch.equal(a[0].tensors["x"], c[0].tensors["x"])
    torch.testing.assert_close(a[0].tensors["x"][0], a[0].tensors["x"][4])  # "the" twice
    one = variant_steps("hello")  # a single token: every section still runs
    assert one[6].tensors["selected"].shape == (1, 1)


@pytest.mark.parametrize(("text", "message"), [("", "empty"), ("w " * 65, "65 tokens")])
def test_bad_text_is_a_one_line_value_error(text, message):
    with pytest.raises(ValueError, match=message) as info:
        variant_steps(text)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------
# Multi-head latent attention, decompressed and absorbed
# ---------------------------------------------------------------------------


def test_mla_latent_queries_and_keys_follow_the_equations(steps):
    step = steps["mla.1"]
    ref = mla_reference(f64(step.modules["mla"]), x64(steps))
    for name, key in (("c_q", "c_q"), ("q_nope", "q_n"), ("q_rope", "q_r"),
                      ("c (latent)", "c"), ("k_rope", "k_r")):
        close(step.tensors[name], ref[key])


def test_mla_cache_holds_the_latent_and_counts_by_hand(steps, printed):
    step = steps["mla.2"]
    ref = mla_reference(f64(step.modules["mla"]), x64(steps))
    close(step.tensors["cache.kv"], torch.cat((ref["c"], ref["k_r"]), dim=-1))
    per_token = [R + D_R, H * (D_N + D_R + D_V)]  # 8 and 20
    assert per_token == [8, 20]
    growth = [[4 * n * p for p in per_token] for n in range(1, T + 1)]  # float32 bytes
    # DeepSeek-V3: the latent (512) and RoPE key (64) against 128 heads' keys (128 + 64)
    # and values (128)
    v3 = [512 + 64, 128 * (128 + 64 + 128)]
    assert v3 == [576, 40_960]
    assert step.tensors["numbers per token"].tolist() == per_token
    assert step.tensors["cache bytes after each token"].tolist() == growth
    assert step.tensors["DeepSeek-V3 numbers per token"].tolist() == v3
    output = printed["mla"]
    assert block(output, "numbers per token  (2,)") == [per_token]
    assert block(output, f"cache bytes after each token  ({T}, 2)") == growth
    assert block(output, "DeepSeek-V3 numbers per token  (2,)") == [v3]
    printed_close(block(output, f"cache.kv  ({T}, {R + D_R})"),
                  torch.cat((ref["c"], ref["k_r"]), dim=-1))


def test_mla_decompressed_keys_weights_and_output(steps, printed):
    step = steps["mla.3"]
    ref = mla_reference(f64(step.modules["mla"]), x64(steps))
    close(step.tensors["keys (decompressed)"], ref["k"])
    close(step.tensors["values (decompressed)"], ref["v"])
    close(step.tensors["attn_weights"], ref["weights"])
    close(step.tensors["out"], ref["out"])
    assert step.tensors["scale"].item() == pytest.approx((D_N + D_R) ** -0.5)
    assert torch.equal(step.weights, step.tensors["attn_weights"])
    printed_close(block(printed["mla"], f"out  ({T}, {D_MODEL})"), ref["out"])


def test_absorbed_scores_in_latent_space_equal_the_decompressed_ones(steps, printed):
    step = steps["absorbed.1"]
    w = f64(step.modules["mla"])
    ref = mla_reference(w, x64(steps))
    w_kvb = w["kv_b_proj.weight"].view(H, D_N + D_V, R)
    # q_n . (c W_UK^T) = (q_n W_UK) . c, per head, for every pair of tokens
    q_latent = torch.stack([ref["q_n"][h] @ w_kvb[h, :D_N] for h in range(H)])
    close(step.tensors["q_latent"], q_latent)
    close(step.tensors["latent key [c ; k_rope]"], torch.cat((ref["c"], ref["k_r"]), -1))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    close(step.tensors["scores (latent space)"], ref["scores"].masked_fill(future, -math.inf))
    close(step.tensors["attn_weights"], ref["weights"])
    close(step.tensors["o_latent"], ref["weights"] @ ref["c"])
    close(step.tensors["out (absorbed)"], ref["out"])
    assert step.tensors["max |absorbed - decompressed|"].item() < 1e-6
    output = printed["absorbed"]
    printed_close(block(output, f"out (absorbed)  ({T}, {D_MODEL})"), ref["out"])
    assert block(output, "max |absorbed - decompressed|  ()") == [[0.0]]


def test_absorbed_decoding_equals_the_full_forward(steps, printed):
    step = steps["absorbed.2"]
    ref = mla_reference(f64(step.modules["mla"]), x64(steps))
    close(step.tensors["out (one token at a time)"], ref["out"])
    assert step.tensors["max |one at a time - full forward|"].item() < 1e-6
    built = [[n * H * (D_N + D_R + D_V), 0] for n in range(1, T + 1)]
    assert step.tensors["keys and values built per step"].tolist() == built
    assert block(printed["absorbed"], f"keys and values built per step  ({T}, 2)") == built


# ---------------------------------------------------------------------------
# DeepSeek sparse attention
# ---------------------------------------------------------------------------


def kept_by_hand(scores: torch.Tensor) -> torch.Tensor:
    """``(T, T)`` 1 where key u is among the ``TOP_K`` best of query t's ``u <= t``."""
    kept = torch.zeros(T, T, dtype=torch.long)
    for t in range(T):
        best = sorted(range(t + 1), key=lambda u: -scores[t, u].item())[:TOP_K]
        kept[t, best] = 1
    return kept


def test_indexer_scores_follow_the_equations(steps):
    step = steps["dsa.1"]
    ref = index_reference(f64(step.modules["dsa"]), x64(steps))
    close(step.tensors["index keys"], ref["keys"])
    close(step.tensors["index queries"], ref["queries"])
    close(step.tensors["w"], ref["w"])
    close(step.tensors["index scores"], ref["scores"])


def test_top_k_keeps_the_best_earlier_keys(steps, printed):
    step = steps["dsa.2"]
    ref = index_reference(f64(step.modules["dsa"]), x64(steps))
    kept = kept_by_hand(ref["scores"])
    assert step.tensors["kept"].tolist() == kept.tolist()
    assert step.tensors["keys kept per query"].tolist() == [min(t + 1, TOP_K) for t in range(T)]
    assert block(printed["dsa"], f"kept  ({T}, {T})") == kept.tolist()


def test_sparse_attention_over_the_kept_keys_and_its_cache(steps, printed):
    step = steps["dsa.3"]
    w = f64(step.modules["dsa"])
    x = x64(steps)
    keep = kept_by_hand(index_reference(w, x)["scores"]).bool()
    ref = mla_reference(w, x, keep)
    close(step.tensors["attn_weights"], ref["weights"])
    close(step.tensors["out"], ref["out"])
    assert (step.tensors["attn_weights"][:, ~keep] == 0).all()
    # top_k >= T: dense latent attention, whose own weights are the same
    dense = mla_reference(f64(step.modules["dense"]), x)
    assert step.tensors["max |top_k = T - dense latent attention|"].item() < 1e-6
    close(mla_reference(w, x)["out"], dense["out"], atol=1e-12)
    assert step.tensors["max |one at a time - full forward|"].item() < 1e-6
    per_token = [R + D_R, D_I]
    growth = [[4 * n * p for p in per_token] for n in range(1, T + 1)]
    assert step.tensors["numbers per token"].tolist() == per_token
    assert step.tensors["cache bytes after each token"].tolist() == growth
    assert block(printed["dsa"], f"cache bytes after each token  ({T}, 2)") == growth
    # DeepSeek-V3.2, per token and layer: latent 512 + RoPE key 64 + index key 128
    assert "576 + 128 = 704" in step.explanation


# ---------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------


def test_sink_weights_sum_below_one_and_the_rest_goes_to_the_sink(steps, printed):
    step = steps["sinks.1"]
    w = f64(step.modules["sinks"])
    sink = torch.tensor(SINKS, dtype=torch.float64)
    ref = mha_reference(w, x64(steps), H, rope=False, sink=sink)
    close(step.tensors["sinks"], sink)
    close(step.tensors["attn_weights"], ref["weights"])
    close(step.tensors["out"], ref["out"])
    sums = ref["weights"].sum(-1)
    assert (sums < 1).all()
    # the rest: e^sink / (sum_u e^s + e^sink), computed from the scores themselves
    scores = step.tensors["scores"].to(torch.float64)
    rest = torch.exp(sink)[:, None] / (torch.exp(scores).sum(-1) + torch.exp(sink)[:, None])
    close(step.tensors["to the sink: 1 - sum"], rest)
    close(step.tensors["attn_weights.sum(dim=-1)"], 1 - rest)
    printed_close(block(printed["sinks"], f"to the sink: 1 - sum  ({H}, {T})"), rest)


def test_sinks_scale_the_rows_of_plain_attention(steps):
    step = steps["sinks.2"]
    w = f64(step.modules["plain"])
    plain = mha_reference(w, x64(steps), H, rope=False)
    sink = torch.tensor(SINKS, dtype=torch.float64)
    with_sink = mha_reference({**w, "sinks": sink}, x64(steps), H, rope=False, sink=sink)
    close(step.tensors["attn_weights (no sinks)"], plain["weights"])
    close(step.tensors["out (no sinks)"], plain["out"])
    close(step.tensors["out (sinks)"], with_sink["out"])
    close(with_sink["weights"], plain["weights"] * with_sink["weights"].sum(-1, keepdim=True),
          atol=1e-12)
    assert step.tensors["max |sink weights - weights without sinks x sum|"].item() < 1e-6


# ---------------------------------------------------------------------------
# KV sharing
# ---------------------------------------------------------------------------


def shared_reference(steps, section: str):
    step = steps[section]
    x = x64(steps)
    source = mha_reference(f64(step.modules["source"]), x, kv_heads=1, rope=True)
    later = mha_reference(f64(step.modules["later"]), x + source["out"], kv_heads=1,
                          rope=True, keys=source["keys"], values=source["values"])
    return source, later


def test_later_layer_attends_with_the_source_layers_keys(steps):
    step = steps["kvshare.1"]
    source, later = shared_reference(steps, "kvshare.1")
    close(step.tensors["handoff.keys"], source["keys"])
    close(step.tensors["handoff.values"], source["values"])
    close(step.tensors["attn_weights (later layer)"], later["weights"])
    close(step.tensors["out (later layer)"], later["out"])
    d, kv = D_MODEL, D_MODEL // H  # one key/value head of 4
    # source: W_query, W_key, W_value (no biases), out_proj (with its bias); later: no keys
    assert step.tensors["parameters"].tolist() == [d * d + 2 * d * kv + d * d + d,
                                                   d * d + d * d + d]


def test_shared_cache_is_held_once(steps, printed):
    step = steps["kvshare.2"]
    _, later = shared_reference(steps, "kvshare.2")
    close(step.tensors["out (one token at a time)"], later["out"])
    assert step.tensors["max |one at a time - full forward|"].item() < 1e-6
    per_token = 4 * 1 * 2 * (D_MODEL // H)  # float32 x 1 head x (key + value) x 4
    growth = [[n * per_token, 2 * n * per_token] for n in range(1, T + 1)]
    assert step.tensors["cache bytes after each token"].tolist() == growth
    assert block(printed["kvshare"], f"cache bytes after each token  ({T}, 2)") == growth


def test_labels_fit_their_columns():
    # format_tensor shortens labels past 10 characters; the sections' stay whole
    for step in variant_steps("a b"):
        for name, tensor in step.tensors.items():
            rows, cols = step.labels.get(name, (None, None))
            text = format_tensor(tensor, rows, name=name, col_labels=cols)
            assert ".." not in text.split("\n", 1)[1], (step.section, name)


# ---------------------------------------------------------------------------
# Linear attention up to the gated delta rule
# ---------------------------------------------------------------------------


def delta_inputs64(steps):
    """The delta sections' q, k, v, decays and write strengths, recomputed in float64 from
    the toy input and the step's own maps: q and k L2-normalised, g = log sigmoid(a x),
    beta = sigmoid(b x)."""
    w = f64(steps["delta.1"].modules["maps"])
    x = x64(steps)

    def unit(t):
        return t / t.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    q, k, v = unit(x @ w["q.weight"].T), unit(x @ w["k.weight"].T), x @ w["v.weight"].T
    a = (x @ w["a.weight"].T + w["a.bias"])[:, 0]
    b = (x @ w["b.weight"].T + w["b.bias"])[:, 0]
    return q, k, v, torch.sigmoid(a), torch.sigmoid(b)


def test_linear_attention_is_a_running_sum(steps, printed):
    q, k, v, _, _ = delta_inputs64(steps)
    step = steps["delta.1"]
    # the state after the last token: sum_u k_u v_u^T
    close(step.tensors["S_T (the state after the last token)"], k.T @ v)
    out = torch.stack([sum(float(q[t] @ k[u]) * v[u] for u in range(t + 1))
                       for t in range(T)])
    close(step.tensors["out"], out)
    printed_close(block(printed["delta"], "out  (6, 3)"), out)


def test_decay_weighs_each_write_by_the_decays_after_it(steps):
    q, k, v, a, _ = delta_inputs64(steps)
    step = steps["delta.2"]
    out = torch.stack([sum(float(q[t] @ k[u]) * float(torch.prod(a[u + 1 : t + 1])) * v[u]
                           for u in range(t + 1)) for t in range(T)])
    close(step.tensors["a = exp(g)"], a)
    close(step.tensors["out"], out)


def test_delta_rule_token_by_token_and_chunked(steps, printed):
    q, k, v, a, beta = delta_inputs64(steps)
    state = torch.zeros(k.shape[1], v.shape[1], dtype=torch.float64)
    outs = []
    for t in range(T):  # S_t = a S + beta k (v - a S^T k)^T, o_t = S_t^T q_t
        state = a[t] * state
        state = state + beta[t] * torch.outer(k[t], v[t] - state.T @ k[t])
        outs.append(state.T @ q[t])
    out = torch.stack(outs)
    step = steps["delta.3"]
    close(step.tensors["out (token by token)"], out)
    close(step.tensors["out (gated_delta_rule, chunked)"], out)
    close(step.tensors["effective weights W"].to(torch.float64) @ v, out)


def test_state_stays_fixed_while_the_cache_grows(steps, printed):
    per_token = 4 * (4 + 3)  # float32 key of 4 and value of 3
    want = torch.tensor([[4 * 4 * 3, per_token * (t + 1)] for t in range(T)])
    assert torch.equal(steps["delta.4"].tensors["cache bytes after each token"], want)
    printed_close(block(printed["delta"], "cache bytes after each token  (6, 2)"), want)
