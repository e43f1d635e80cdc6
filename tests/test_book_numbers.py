"""The numbers LLMs-from-scratch chapter 3 prints, reproduced to 4 decimals.

Every expected value below is copied from the book's printed output; none is
computed by qkv.
"""

import pytest
import torch

import qkv


def close(actual, expected):
    torch.testing.assert_close(actual.detach(), torch.tensor(expected), atol=1e-4, rtol=0)


SCORES_2 = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]


def test_scores_for_one_query_loop_and_matrix(inputs):
    close(qkv.attention_scores_loop(inputs[1], inputs), SCORES_2)
    close(qkv.attention_scores(inputs[1], inputs), SCORES_2)


def test_three_normalisations(inputs):
    scores = qkv.attention_scores(inputs[1], inputs)
    close(qkv.normalize_by_sum(scores), [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])
    softmax = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
    close(qkv.softmax_naive(scores), softmax)
    close(torch.softmax(scores, dim=0), softmax)
    for w in (qkv.normalize_by_sum(scores), qkv.softmax_naive(scores)):
        assert w.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_context_vector_z2(inputs):
    weights = torch.softmax(qkv.attention_scores(inputs[1], inputs), dim=0)
    close(qkv.context_vector(weights, inputs), [0.4419, 0.6515, 0.5683])
    close(qkv.context_vector_loop(weights, inputs), [0.4419, 0.6515, 0.5683])


ALL_SCORES = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
    [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
    [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
    [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450],
]
ALL_WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
ALL_CONTEXT = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]


def test_all_queries_loop_and_matrix(inputs):
    close(qkv.all_attention_scores_loop(inputs), ALL_SCORES)
    close(qkv.all_attention_scores(inputs), ALL_SCORES)
    context, weights = qkv.simple_self_attention(inputs)
    close(weights, ALL_WEIGHTS)
    close(weights.sum(dim=-1), [1.0] * 6)
    close(context, ALL_CONTEXT)


def test_trainable_weights_for_one_query(inputs):
    torch.manual_seed(123)
    W_query, W_key, W_value = (torch.rand(3, 2) for _ in range(3))
    query_2 = inputs[1] @ W_query
    keys, values = inputs @ W_key, inputs @ W_value
    close(query_2, [0.4306, 1.4551])
    close(query_2 @ keys[1], 1.8524)
    scores = qkv.attention_scores(query_2, keys)
    close(scores, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440])
    weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
    close(weights, [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820])
    close(qkv.context_vector(weights, values), [0.3061, 0.8210])


def test_self_attention_v1(inputs):
    torch.manual_seed(123)
    close(
        qkv.SelfAttention_v1(3, 2)(inputs),
        [
            [0.2996, 0.8053],
            [0.3061, 0.8210],
            [0.3058, 0.8203],
            [0.2948, 0.7939],
            [0.2927, 0.7891],
            [0.2990, 0.8040],
        ],
    )


V2_OUT = [
    [-0.0739, 0.0713],
    [-0.0748, 0.0703],
    [-0.0749, 0.0702],
    [-0.0760, 0.0685],
    [-0.0763, 0.0679],
    [-0.0754, 0.0693],
]
CAUSAL_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]


def test_self_attention_v2(inputs):
    torch.manual_seed(789)
    close(qkv.SelfAttention_v2(3, 2)(inputs), V2_OUT)


def test_causal_weights_two_routes(inputs):
    torch.manual_seed(789)
    sa = qkv.SelfAttention_v2(3, 2)
    scores = sa.W_query(inputs) @ sa.W_key(inputs).T
    weights = torch.softmax(scores / 2**0.5, dim=-1)
    # (a) mask after softmax, then renormalise the rows
    simple = weights * torch.tril(torch.ones(6, 6))
    route_a = simple / simple.sum(dim=-1, keepdim=True)
    # (b) -inf above the diagonal before softmax
    route_b = torch.softmax(
        scores.masked_fill(~qkv.causal_mask(6), float("-inf")) / 2**0.5, dim=-1
    )
    close(route_a, CAUSAL_WEIGHTS)
    close(route_b, CAUSAL_WEIGHTS)


CAUSAL_OUT = [
    [-0.4519, 0.2216],
    [-0.5874, 0.0058],
    [-0.6300, -0.0632],
    [-0.5675, -0.0843],
    [-0.5526, -0.0981],
    [-0.5299, -0.1081],
]


def test_causal_attention(batch):
    torch.manual_seed(123)
    ca = qkv.CausalAttention(3, 2, 6, 0.0)
    out = ca(batch)
    assert out.shape == (2, 6, 2)
    close(out[0], CAUSAL_OUT)
    close(out[1], CAUSAL_OUT)


def test_multi_head_attention_wrapper(batch):
    torch.manual_seed(123)
    out = qkv.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(batch)
    assert out.shape == (2, 6, 4)
    close(
        out[0],
        [
            [-0.4519, 0.2216, 0.4772, 0.1063],
            [-0.5874, 0.0058, 0.5891, 0.3257],
            [-0.6300, -0.0632, 0.6202, 0.3860],
            [-0.5675, -0.0843, 0.5478, 0.3589],
            [-0.5526, -0.0981, 0.5321, 0.3428],
            [-0.5299, -0.1081, 0.5077, 0.3493],
        ],
    )


MHA_OUT = [
    [0.3190, 0.4858],
    [0.2943, 0.3897],
    [0.2856, 0.3593],
    [0.2693, 0.3873],
    [0.2639, 0.3928],
    [0.2575, 0.4028],
]


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_multi_head_attention(batch, backend):
    torch.manual_seed(123)
    mha = qkv.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2, backend=backend)
    out = mha(batch)
    assert out.shape == (2, 6, 2)
    close(out[0], MHA_OUT)


def test_gpt2_sized_parameter_count():
    mha = qkv.MultiHeadAttention(768, 768, 1024, 0.0, 12)
    assert sum(p.numel() for p in mha.parameters()) == 2_360_064


def test_per_head_scores_batched_equals_loop():
    # The book's (1, 2, 3, 4) example tensor: heads x tokens x head_dim.
    a = torch.tensor(
        [
            [
                [[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388],
                 [0.7179, 0.7058, 0.9156, 0.4340]],
                [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737],
                 [0.4606, 0.5159, 0.4220, 0.5786]],
            ]
        ]
    )
    batched = a @ a.transpose(2, 3)
    close(
        batched,
        [
            [
                [[1.3208, 1.1631, 1.2879], [1.1631, 2.2150, 1.8424], [1.2879, 1.8424, 2.0402]],
                [[0.4391, 0.7003, 0.5903], [0.7003, 1.3737, 1.0620], [0.5903, 1.0620, 0.9912]],
            ]
        ],
    )
    for h in range(2):
        torch.testing.assert_close(batched[0, h], a[0, h] @ a[0, h].T)


def test_dropout_on_causal_weights_uses_the_books_random_stream(inputs):
    """Book §3.5.2: seed 123, p = 0.5 on the causal weights of sa_v2 (seed 789)."""
    torch.manual_seed(789)
    sa = qkv.SelfAttention_v2(3, 2)
    q, k, v = sa.W_query(inputs), sa.W_key(inputs), sa.W_value(inputs)
    torch.manual_seed(123)
    out, weights = qkv.attention(
        q, k, v, mask=qkv.causal_mask(6), dropout_p=0.5, need_weights=True
    )
    close(weights, CAUSAL_WEIGHTS)
    book_dropped = torch.tensor(
        [
            [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.7599, 0.6194, 0.6206, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.4921, 0.4925, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.3966, 0.0000, 0.3775, 0.0000, 0.0000],
            [0.0000, 0.3327, 0.3331, 0.3084, 0.3331, 0.0000],
        ]
    )
    torch.testing.assert_close(out, book_dropped @ v, atol=1e-3, rtol=0)
