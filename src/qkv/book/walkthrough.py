"""Chapter 3 of *Build a Large Language Model (From Scratch)*, one step at a time.

:func:`walkthrough_steps` replays sections 3.3 to 3.6 with the qkv library:
each :class:`Step` holds the tensors the book prints at that point, in the
order it prints them, plus a short explanation and, for the main steps, the
attention-weight matrix to draw as a heatmap. With the default example the
numbers are the book's; ``qkv walkthrough`` prints them.

Seeds follow the book: ``torch.manual_seed(123)`` before every random
initialisation except ``SelfAttention_v2``, which the book seeds with 789.
A different ``seed`` replaces 123 and keeps the book's offset for v2
(``seed + 666``), so every step changes with it and the default reproduces
the book. The seeding happens on a forked generator: calling the walkthrough
leaves the caller's random state untouched.

Own text
--------
``walkthrough_steps("the cat sat on the mat")`` splits on whitespace and gives
each token a toy 3-dimensional embedding (the book's width, so every seed and
shape stays the same): the distinct lower-cased tokens, in order of first
appearance, get the rows of ``torch.rand(num_distinct, 3)`` drawn from
``torch.Generator().manual_seed(seed)``. Repeated words ("the") therefore share
a vector, and the same text and seed always give the same numbers.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..functional import (
    all_attention_scores,
    attention,
    attention_scores,
    attention_scores_loop,
    causal_mask,
    context_vector,
    context_vector_loop,
    normalize_by_sum,
    softmax_naive,
    softmax_stable,
    softmax_with_mask,
)
from ..multihead import MultiHeadAttention
from ..options import BOOK_TEXT
from ..options import MAX_WALKTHROUGH_TOKENS as MAX_TOKENS
from .self_attention import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

__all__ = [
    "Step",
    "walkthrough_steps",
    "select_steps",
    "heatmap_panels",
    "toy_embedding",
    "format_tensor",
    "BOOK_TEXT",
    "BOOK_INPUTS",
    "SECTIONS",
    "MAX_TOKENS",
]

# The book's hand-picked 3-d embeddings of BOOK_TEXT, one row per token (§3.3).
BOOK_INPUTS = (
    (0.43, 0.15, 0.89),  # Your
    (0.55, 0.87, 0.66),  # journey
    (0.57, 0.85, 0.64),  # starts
    (0.22, 0.58, 0.33),  # with
    (0.77, 0.25, 0.10),  # one
    (0.05, 0.80, 0.55),  # step
)
EMBED_DIM = 3
SECTIONS = ("3.3.1", "3.3.2", "3.4.1", "3.4.2", "3.5.1", "3.5.2", "3.5.3", "3.6.1", "3.6.2")
# Added to one query's scores in §3.3.1 to show softmax_naive overflowing (exp(x) is
# inf in float32 above about 88.7) where softmax_stable does not.
LARGE_SHIFT = 1000.0
# The book seeds SelfAttention_v2 with 789 where everything else uses 123.
V2_SEED_OFFSET = 789 - 123

# (row labels, column labels) of a tensor's last two dimensions; for a 1-D
# tensor the first entry labels its elements. An empty tuple means "no labels".
LabelPair = tuple[Sequence[str] | None, Sequence[str] | None]


@dataclass
class Step:
    """One stop of the walkthrough.

    Attributes:
        section: the book's section number, e.g. ``"3.3.1"``, or a mechanism's
            step, e.g. ``"mla.1"``.
        title: a short heading.
        explanation: what the step computes and why, in one to three sentences.
        tensors: name -> tensor, in the order to show them (detached, on CPU).
        labels: name -> ``(row_labels, col_labels)`` for the tensors whose
            axes are tokens; see :func:`format_tensor`.
        weights: attention weights to draw: ``(T, T)``, or ``(heads, T, T)``
            for one matrix per head; None for steps without one.
        weights_title: caption for the heatmap of ``weights``.
        tokens: the ``T`` tokens, labelling both axes of ``weights``.
        modules: the layers the step ran, by name, so that their weights can be read
            back (the mechanisms' sections, :mod:`qkv.book.walkthrough_variants`).
    """

    section: str
    title: str
    explanation: str
    tensors: dict[str, Tensor]
    labels: dict[str, LabelPair] = field(default_factory=dict)
    weights: Tensor | None = None
    weights_title: str = "attention weights"
    tokens: tuple[str, ...] = ()
    modules: dict[str, nn.Module] = field(default_factory=dict)

    @property
    def heading(self) -> str:
        return f"== {self.section} {self.title} =="

    def render(self, decimals: int = 4, width: int = 88) -> str:
        """The step as text: heading, wrapped explanation, then every tensor."""
        parts = [self.heading, textwrap.fill(self.explanation, width=width)]
        for name, tensor in self.tensors.items():
            rows, cols = self.labels.get(name, (None, None))
            parts.append(format_tensor(tensor, rows, decimals, name=name, col_labels=cols))
        return "\n\n".join(parts)


# ---------------------------------------------------------------------------
# Printing tensors
# ---------------------------------------------------------------------------

_MAX_LABEL = 10  # longer tokens are shortened so columns stay narrow


def _short(label: str) -> str:
    return label if len(label) <= _MAX_LABEL else label[: _MAX_LABEL - 2] + ".."


def _number(v: float, decimals: int, integer: bool) -> str:
    if integer:
        return str(int(v))
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    text = f"{v:.{decimals}f}"
    # Rounding can leave "-0.0000", which reads like a sign that matters.
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def _check_count(labels: Sequence[str], n: int, what: str) -> list[str]:
    labels = [_short(str(label)) for label in labels]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} {what} labels for a tensor with {n} {what}s")
    return labels


def _matrix_lines(
    rows: list[list[str]], row_labels: list[str] | None, col_labels: list[str] | None
) -> list[str]:
    """Right-aligned columns, row labels on the left, column labels on top."""
    width = max(len(cell) for row in rows for cell in row)
    if col_labels:
        width = max(width, *(len(label) for label in col_labels))
    left = max(len(label) for label in row_labels) + 2 if row_labels else 0
    lines = []
    if col_labels:
        lines.append(" " * left + "  ".join(label.rjust(width) for label in col_labels))
    for i, row in enumerate(rows):
        prefix = row_labels[i].ljust(left) if row_labels else ""
        lines.append(prefix + "  ".join(cell.rjust(width) for cell in row))
    return lines


def format_tensor(
    t: Tensor,
    labels: Sequence[str] | None = None,
    decimals: int = 4,
    *,
    name: str | None = None,
    col_labels: Sequence[str] | None = None,
) -> str:
    """Render a tensor as aligned text under a header such as ``attn_weights  (6, 6)``.

    The output does not depend on ``torch.set_printoptions``.

    Args:
        t: a tensor of any shape (numbers are shown with ``decimals`` places;
            bool and integer tensors as integers, ``-inf`` as ``-inf``).
        labels: for 1-D ``(n,)`` tensors, the ``n`` names printed above the
            values; otherwise the names of the rows (dimension -2), printed on
            the left. Tokens longer than 10 characters are shortened.
        decimals: digits after the decimal point.
        name: shown in the header (default ``tensor``).
        col_labels: names of the columns (dimension -1), printed on top. When
            omitted and the matrix is square with as many ``labels`` as rows
            (an attention matrix over the same tokens), ``labels`` is reused;
            pass ``()`` for no column labels.

    Tensors with more than two dimensions print one matrix per leading index,
    each under ``[i]`` (or ``[i, j]``, ...).
    """
    t = torch.as_tensor(t).detach().to("cpu")
    integer = t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex())
    header = f"{name or 'tensor'}  {tuple(t.shape)}"
    if t.numel() == 0:
        return f"{header}\n  (empty)"
    values = t.to(torch.float64)
    if t.dim() == 0:
        return f"{header}\n  {_number(values.item(), decimals, integer)}"

    if t.dim() == 1:
        cells = [[_number(v, decimals, integer) for v in values.tolist()]]
        top = _check_count(labels, t.shape[0], "element") if labels else None
        return "\n".join([header, *("  " + line for line in _matrix_lines(cells, None, top))])

    num_rows, num_cols = t.shape[-2:]
    rows = _check_count(labels, num_rows, "row") if labels else None
    if col_labels is None and rows is not None and num_rows == num_cols:
        cols = rows
    else:
        cols = _check_count(col_labels, num_cols, "column") if col_labels else None
    lines = [header]
    leading = t.shape[:-2]
    for index in itertools.product(*(range(n) for n in leading)):
        indent = "  "
        if leading:
            lines.append(f"  [{', '.join(str(i) for i in index)}]")
            indent = "    "
        matrix = values[index].tolist()
        cells = [[_number(v, decimals, integer) for v in row] for row in matrix]
        lines.extend(indent + line for line in _matrix_lines(cells, rows, cols))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def toy_embedding(
    text: str, seed: int = 123, width: int = EMBED_DIM
) -> tuple[list[str], Tensor]:
    """Split ``text`` on whitespace and embed each token as a seeded random row.

    Returns ``(tokens, inputs (T, width))``, ``width`` 3 by default (the book's).
    Distinct lower-cased tokens, in order of first appearance, take the rows of
    ``torch.rand(num_distinct, width)`` from a private generator seeded with
    ``seed``; repeated words share a row.
    """
    tokens = text.split()
    if not tokens:
        raise ValueError("text is empty: give at least one whitespace-separated word")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(
            f"text has {len(tokens)} tokens; the walkthrough prints T x T matrices, "
            f"so at most {MAX_TOKENS} are allowed"
        )
    vocab = {word: i for i, word in enumerate(dict.fromkeys(t.lower() for t in tokens))}
    generator = torch.Generator().manual_seed(seed)
    table = torch.rand(len(vocab), width, generator=generator)
    return tokens, table[[vocab[t.lower()] for t in tokens]]


def _seed(seed: int) -> None:
    # What torch.manual_seed does for the CPU generator, which initialises
    # every module here; GPU generators are left alone.
    torch.random.default_generator.manual_seed(seed)


def _check_args(seed: int, d_out: int, num_heads: int) -> None:
    if not 0 <= seed < 2**62:
        raise ValueError(f"seed must be a non-negative integer below 2**62, got {seed}")
    if d_out <= 0:
        raise ValueError(f"d_out must be a positive integer, got {d_out}")
    if num_heads <= 0:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads}")
    if d_out % num_heads != 0:
        raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")


# ---------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------


@dataclass
class _Context:
    """What every step needs, and what later steps reuse from earlier ones."""

    tokens: tuple[str, ...]
    inputs: Tensor  # (T, 3)
    seed: int
    d_out: int
    num_heads: int
    sa_v2: SelfAttention_v2 | None = None
    causal_weights: Tensor | None = None

    @property
    def query(self) -> int:
        # The book's query is x2, "journey"; a one-token text can only use x1.
        return 1 if len(self.tokens) > 1 else 0

    @property
    def attn(self) -> LabelPair:
        """Labels of a (queries, keys) matrix over the tokens."""
        return self.tokens, self.tokens

    @property
    def by_token(self) -> LabelPair:
        """Labels of a (tokens, features) matrix, or of a (tokens,) vector."""
        return self.tokens, ()


def _step_3_3_1(c: _Context) -> Step:
    q, n = c.query, c.query + 1  # the book counts tokens from 1
    query = c.inputs[q]
    scores = attention_scores_loop(query, c.inputs)
    weights = torch.softmax(scores, dim=0)
    # Softmax ignores a constant added to every score, so these large scores have the same
    # weights; exp(1000) overflows float32, which is where the two hand-written forms part.
    large = scores + LARGE_SHIFT
    large_name = f"attn_scores_{n} + {LARGE_SHIFT:g}"
    return Step(
        "3.3.1",
        "Attention scores for one query",
        f"With x{n} ('{c.tokens[q]}') as the query, its score with every token is a dot "
        "product: tokens whose embeddings point the same way score high. Dividing by the "
        "sum makes the scores add up to one, but softmax (by hand or torch's) is what "
        f"attention uses; the context vector z{n} is the inputs averaged with those weights. "
        f"The book's softmax_naive, exp(x) / exp(x).sum(), overflows once scores are large: "
        f"adding {LARGE_SHIFT:g} to every score leaves softmax unchanged, yet exp gives inf "
        "and inf / inf is nan. softmax_stable subtracts the largest score first and gives "
        "the same weights as before.",
        {
            "inputs": c.inputs,
            f"attn_scores_{n}": scores,
            f"attn_weights_{n}_tmp": normalize_by_sum(scores),
            f"attn_weights_{n}_naive": softmax_naive(scores, dim=0),
            f"attn_weights_{n}": weights,
            f"context_vec_{n}": context_vector_loop(weights, c.inputs),
            large_name: large,
            f"softmax_naive({large_name})": softmax_naive(large, dim=0),
            f"softmax_stable({large_name})": softmax_stable(large, dim=0),
        },
        labels={
            "inputs": c.by_token,
            f"attn_scores_{n}": c.by_token,
            f"attn_weights_{n}_tmp": c.by_token,
            f"attn_weights_{n}_naive": c.by_token,
            f"attn_weights_{n}": c.by_token,
            large_name: c.by_token,
            f"softmax_naive({large_name})": c.by_token,
            f"softmax_stable({large_name})": c.by_token,
        },
    )


def _step_3_3_2(c: _Context) -> Step:
    scores = all_attention_scores(c.inputs)
    weights = torch.softmax(scores, dim=-1)
    return Step(
        "3.3.2",
        "Attention weights for all inputs",
        "Every query at once: inputs @ inputs.T holds all pairwise scores (row = query, "
        "column = key), a row-wise softmax turns each row into weights that sum to one, and "
        "weights @ inputs gives one context vector per token.",
        {
            "attn_scores": scores,
            "attn_weights": weights,
            "attn_weights.sum(dim=-1)": weights.sum(dim=-1),
            "all_context_vecs": context_vector(weights, c.inputs),
        },
        labels={
            "attn_scores": c.attn,
            "attn_weights": c.attn,
            "attn_weights.sum(dim=-1)": c.by_token,
            "all_context_vecs": c.by_token,
        },
        weights=weights,
        weights_title="softmax(inputs @ inputs.T)",
        tokens=c.tokens,
    )


def _step_3_4_1(c: _Context) -> Step:
    q, n = c.query, c.query + 1
    d_in = c.inputs.shape[1]
    _seed(c.seed)
    # Created in the book's order so the seed gives the book's matrices.
    W_query = torch.rand(d_in, c.d_out)
    W_key = torch.rand(d_in, c.d_out)
    W_value = torch.rand(d_in, c.d_out)
    query = c.inputs[q] @ W_query
    keys = c.inputs @ W_key
    values = c.inputs @ W_value
    scores = attention_scores(query, keys)
    d_k = keys.shape[-1]
    weights = torch.softmax(scores / d_k**0.5, dim=-1)
    return Step(
        "3.4.1",
        "Trainable weights, one query",
        f"Three matrices drawn after torch.manual_seed({c.seed}) project each token to a "
        f"query, a key and a value of width {c.d_out}; the scores of query_{n} against "
        f"the keys are divided by sqrt(d_k) = sqrt({d_k}) before the softmax so wider "
        "projections do not saturate it, and the weights average the values.",
        {
            "W_query": W_query,
            "W_key": W_key,
            "W_value": W_value,
            f"query_{n}": query,
            "keys": keys,
            "values": values,
            f"attn_scores_{n}": scores,
            f"attn_weights_{n}": weights,
            f"context_vec_{n}": context_vector(weights, values),
        },
        labels={
            "keys": c.by_token,
            "values": c.by_token,
            f"attn_scores_{n}": c.by_token,
            f"attn_weights_{n}": c.by_token,
        },
    )


def _step_3_4_2(c: _Context) -> Step:
    d_in = c.inputs.shape[1]
    _seed(c.seed)
    sa_v1 = SelfAttention_v1(d_in, c.d_out)
    v2_seed = c.seed + V2_SEED_OFFSET
    _seed(v2_seed)
    c.sa_v2 = SelfAttention_v2(d_in, c.d_out)
    x = c.inputs
    _, weights = attention(
        c.sa_v2.W_query(x), c.sa_v2.W_key(x), c.sa_v2.W_value(x), need_weights=True
    )
    return Step(
        "3.4.2",
        "Self-attention classes",
        f"SelfAttention_v1 (seed {c.seed}) packs the previous step into a module and "
        f"reproduces context_vec as its row {c.query + 1}. SelfAttention_v2 (seed {v2_seed}) "
        "uses nn.Linear layers, whose better initialisation gives different numbers; copying "
        "its weights, transposed, into v1 would make the two agree.",
        {"sa_v1(inputs)": sa_v1(x), "sa_v2(inputs)": c.sa_v2(x), "sa_v2 weights": weights},
        labels={
            "sa_v1(inputs)": c.by_token,
            "sa_v2(inputs)": c.by_token,
            "sa_v2 weights": c.attn,
        },
        weights=weights,
        weights_title="SelfAttention_v2",
        tokens=c.tokens,
    )


def _step_3_5_1(c: _Context) -> Step:
    assert c.sa_v2 is not None, "3.5.1 reuses the SelfAttention_v2 of 3.4.2"
    queries = c.sa_v2.W_query(c.inputs)
    keys = c.sa_v2.W_key(c.inputs)
    scores = queries @ keys.T
    d_k = keys.shape[-1]
    weights = torch.softmax(scores / d_k**0.5, dim=-1)
    keep = causal_mask(len(c.tokens))  # True on and below the diagonal
    # Route (a): zero the future after the softmax, then renormalise the rows.
    mask_simple = keep.float()
    masked_simple_norm = normalize_by_sum(weights * mask_simple)
    # Route (b): -inf scores for the future, so softmax gives them exactly 0.
    masked = scores.masked_fill(~keep, float("-inf"))
    c.causal_weights = softmax_with_mask(scores / d_k**0.5, keep)
    return Step(
        "3.5.1",
        "Causal attention mask",
        "A language model must not look ahead, so query i may only attend to keys 0..i. "
        "Multiplying the v2 weights by a lower-triangular mask and renormalising each row "
        "gives the same weights as filling the future scores with -inf before the softmax, "
        "which does it in one pass.",
        {
            "attn_weights": weights,
            "mask_simple": mask_simple,
            "masked_simple_norm": masked_simple_norm,
            "masked": masked,
            "attn_weights (causal)": c.causal_weights,
        },
        labels={
            "attn_weights": c.attn,
            "mask_simple": c.attn,
            "masked_simple_norm": c.attn,
            "masked": c.attn,
            "attn_weights (causal)": c.attn,
        },
        weights=c.causal_weights,
        weights_title="SelfAttention_v2, causal mask",
        tokens=c.tokens,
    )


def _step_3_5_2(c: _Context) -> Step:
    assert c.causal_weights is not None, "3.5.2 reuses the causal weights of 3.5.1"
    p = 0.5
    num_tokens = len(c.tokens)
    _seed(c.seed)
    dropout = nn.Dropout(p)  # a fresh module is in training mode: dropout is active
    example = dropout(torch.ones(num_tokens, num_tokens))
    _seed(c.seed)
    dropped = dropout(c.causal_weights)
    return Step(
        "3.5.2",
        "Dropout on the attention weights",
        f"During training, dropout with p = {p} zeroes each weight with probability {p} "
        f"and scales the survivors by 1/(1 - p) = {1 / (1 - p):g}, so a row keeps its sum "
        "on average: a matrix of ones becomes zeros and twos. In eval mode it does nothing.",
        {"dropout(torch.ones)": example, "dropout(attn_weights)": dropped},
        labels={"dropout(torch.ones)": c.attn, "dropout(attn_weights)": c.attn},
    )


def _step_3_5_3(c: _Context, batch: Tensor) -> Step:
    d_in, num_tokens = c.inputs.shape[1], len(c.tokens)
    _seed(c.seed)
    ca = CausalAttention(d_in, c.d_out, num_tokens, 0.0)
    context_vecs = ca(batch)
    assert ca.attention_weights is not None
    return Step(
        "3.5.3",
        "Causal attention class",
        f"CausalAttention (seed {c.seed}) bundles the projections, the causal mask (a "
        f"buffer) and dropout, and takes a batch: here the inputs stacked twice, shape "
        f"{tuple(batch.shape)}, so both batch entries give the same context vectors.",
        {"context_vecs": context_vecs, "ca.attention_weights[0]": ca.attention_weights[0]},
        labels={"context_vecs": c.by_token, "ca.attention_weights[0]": c.attn},
    )


def _step_3_6_1(c: _Context, batch: Tensor) -> Step:
    d_in, num_tokens = c.inputs.shape[1], len(c.tokens)
    _seed(c.seed)
    wrapper = MultiHeadAttentionWrapper(d_in, c.d_out, num_tokens, 0.0, num_heads=c.num_heads)
    return Step(
        "3.6.1",
        "Stacking single-head attention",
        f"MultiHeadAttentionWrapper (seed {c.seed}) runs {c.num_heads} independent "
        f"CausalAttention heads of width {c.d_out} and concatenates their outputs, giving "
        f"{c.num_heads * c.d_out} features per token; the first head is the layer of 3.5.3.",
        {"context_vecs": wrapper(batch)},
        labels={"context_vecs": c.by_token},
    )


def _step_3_6_2(c: _Context, batch: Tensor) -> Step:
    d_in, num_tokens = c.inputs.shape[1], len(c.tokens)
    _seed(c.seed)
    mha = MultiHeadAttention(d_in, c.d_out, num_tokens, 0.0, num_heads=c.num_heads)
    context_vecs, weights = mha(batch, need_weights=True)
    return Step(
        "3.6.2",
        "Multi-head attention with weight splits",
        f"MultiHeadAttention (seed {c.seed}) projects once to width {c.d_out} and splits "
        f"it into {c.num_heads} heads of head_dim {mha.head_dim}, each with its own causal "
        "weights; the heads' outputs are merged and mixed by out_proj, so the output keeps "
        f"width {c.d_out} however many heads there are.",
        {"context_vecs": context_vecs, "attn_weights[0]": weights[0]},
        labels={"context_vecs": c.by_token, "attn_weights[0]": c.attn},
        weights=weights[0],
        weights_title="MultiHeadAttention",
        tokens=c.tokens,
    )


def walkthrough_steps(
    text: str | None = None, *, seed: int = 123, d_out: int = 2, num_heads: int = 2
) -> list[Step]:
    """Replay LLMs-from-scratch §3.3-3.6 and return one :class:`Step` per section.

    Args:
        text: None for the book's "Your journey starts with one step" and its
            embeddings; otherwise whitespace-separated words (1 to 64) embedded
            with :func:`toy_embedding`.
        seed: replaces the book's ``torch.manual_seed(123)``; v2 uses
            ``seed + 666`` (the book's 789). Also seeds the toy embedding.
        d_out: projection width of the trainable steps (the book: 2).
        num_heads: heads in §3.6 (the book: 2); must divide ``d_out``.

    Returns:
        Steps in the order of :data:`SECTIONS`. Tensors are detached CPU float32.
    """
    _check_args(seed, d_out, num_heads)
    if text is None:
        tokens, inputs = BOOK_TEXT.split(), torch.tensor(BOOK_INPUTS)
    else:
        tokens, inputs = toy_embedding(text, seed)
    c = _Context(tuple(tokens), inputs, seed, d_out, num_heads)
    batch = torch.stack((inputs, inputs))  # (2, T, 3), as in §3.5.3
    # Fork the CPU generator: the book reseeds the global one before each
    # module, and a library function should not leave that behind.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        steps = [
            _step_3_3_1(c),
            _step_3_3_2(c),
            _step_3_4_1(c),
            _step_3_4_2(c),
            _step_3_5_1(c),
            _step_3_5_2(c),
            _step_3_5_3(c, batch),
            _step_3_6_1(c, batch),
            _step_3_6_2(c, batch),
        ]
    for step in steps:
        step.tensors = {name: t.detach().cpu() for name, t in step.tensors.items()}
    return steps


def select_steps(steps: Sequence[Step], section: str) -> list[Step]:
    """The steps of ``section``: an exact number ("3.5.1") or a prefix ("3.5")."""
    chosen = [s for s in steps if s.section == section or s.section.startswith(section + ".")]
    if not chosen:
        raise ValueError(
            f"unknown section {section!r}; choose one of {', '.join(s.section for s in steps)}"
            " (or a prefix such as 3.5 or mla)"
        )
    return chosen


def heatmap_panels(steps: Sequence[Step]) -> tuple[list[Tensor], list[str], list[tuple[str, ...]]]:
    """Flatten the steps' attention weights into heatmap panels.

    Returns ``(matrices, titles, tokens)``: one ``(T, T)`` matrix per step with
    2-D weights and one per head for stacked ``(heads, T, T)`` weights.
    """
    matrices, titles, tokens = [], [], []
    for step in steps:
        if step.weights is None:
            continue
        if step.weights.dim() == 2:
            matrices.append(step.weights)
            titles.append(f"{step.section} {step.weights_title}")
            tokens.append(step.tokens)
            continue
        for h, matrix in enumerate(step.weights):
            matrices.append(matrix)
            titles.append(f"{step.section} {step.weights_title}, head {h + 1}")
            tokens.append(step.tokens)
    return matrices, titles, tokens
