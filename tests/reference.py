"""A deliberately naive float64 attention, written with loops, for comparisons.

It shares no code with qkv: scores, masks and the softmax are spelled out per
batch item, head and query.
"""

import math

import torch


def naive_mha(mha, x, key=None, value=None, valid_lens=None, pad=None):
    """Recompute ``qkv.MultiHeadAttention`` in float64 with Python loops.

    ``pad``: optional ``(batch, T_k)`` bool, True = padding.
    Returns ``(output (b, T_q, d_out), weights (b, h, T_q, T_k))``.
    """
    key = x if key is None else key
    value = key if value is None else value

    def lin(layer, t):
        w = layer.weight.detach().double()
        out = t.double() @ w.T
        if layer.bias is not None:
            out = out + layer.bias.detach().double()
        return out

    q, k, v = lin(mha.W_query, x), lin(mha.W_key, key), lin(mha.W_value, value)
    b, tq, _ = q.shape
    tk = k.shape[1]
    h, hd = mha.num_heads, mha.head_dim
    heads = torch.zeros(b, tq, h * hd, dtype=torch.float64)
    weights = torch.zeros(b, h, tq, tk, dtype=torch.float64)
    for n in range(b):
        for head in range(h):
            cols = slice(head * hd, (head + 1) * hd)
            for i in range(tq):
                allowed = []
                for j in range(tk):
                    ok = True
                    if mha.causal and j > i + (tk - tq):
                        ok = False
                    if valid_lens is not None:
                        limit = valid_lens[n] if valid_lens.dim() == 1 else valid_lens[n, i]
                        if j >= int(limit):
                            ok = False
                    if pad is not None and bool(pad[n, j]):
                        ok = False
                    if ok:
                        allowed.append(j)
                if not allowed:
                    continue  # no key to attend to: zero output, zero weights
                scores = [
                    float(q[n, i, cols] @ k[n, j, cols]) / math.sqrt(hd) for j in allowed
                ]
                top = max(scores)
                exps = [math.exp(s - top) for s in scores]
                total = sum(exps)
                for j, e in zip(allowed, exps, strict=True):
                    weights[n, head, i, j] = e / total
                    heads[n, i, cols] += (e / total) * v[n, j, cols]
    return lin(mha.out_proj, heads), weights
