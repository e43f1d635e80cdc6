"""``qkv walkthrough``, its library code and the plotting helpers it uses.

Expected numbers are literals copied from the output LLMs-from-scratch prints in
§3.3-3.6, never values recomputed with the library under test.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys

import pytest
import torch

from qkv.book.walkthrough import SECTIONS, Step, format_tensor, walkthrough_steps
from qkv.book.walkthrough_variants import VARIANT_SECTIONS
from qkv.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The book's printed numbers (§3.3.1), rounded to 4 decimals as printed there.
BOOK = {
    ("3.3.1", "attn_scores_2"): [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    ("3.3.1", "attn_weights_2_tmp"): [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656],
    ("3.3.1", "attn_weights_2_naive"): [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    ("3.3.1", "attn_weights_2"): [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    ("3.3.1", "context_vec_2"): [0.4419, 0.6515, 0.5683],
}
BOOK_FIRST_ROWS = {
    ("3.4.2", "sa_v1(inputs)"): [0.2996, 0.8053],
    ("3.5.3", "context_vecs"): [-0.4519, 0.2216],
    ("3.6.2", "context_vecs"): [0.3190, 0.4858],
}
NUMBER = re.compile(r"-?\d+\.\d+|-inf|nan")
# A printed number may differ from the book's by one unit in its last (4th) decimal: a value
# within float rounding of a rounding edge prints either way depending on the CPU's kernels.
PRINTED = 1.5e-4


@pytest.fixture(scope="module")
def book_steps() -> dict[str, Step]:
    return {step.section: step for step in walkthrough_steps()}


@pytest.fixture(scope="module")
def book_output() -> str:
    # One CLI run shared by the tests that read the printed text.
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["walkthrough"]) == 0
    return buffer.getvalue()


def printed_numbers(output: str, header: str) -> list[float]:
    """The numbers printed under a tensor header such as ``attn_scores_2  (6,)``."""
    start = output.index(f"\n{header}\n") + len(header) + 2
    end = output.find("\n\n", start)
    block = output[start : None if end < 0 else end]
    return [float(x) for x in NUMBER.findall(block)]


# ---------------------------------------------------------------------------
# The book's numbers
# ---------------------------------------------------------------------------


def test_sections_in_book_order(book_steps):
    assert tuple(book_steps) == SECTIONS
    assert all(step.explanation and step.tensors for step in book_steps.values())


@pytest.mark.parametrize(("section", "name"), list(BOOK))
def test_parameter_free_numbers_match_the_book(book_steps, section, name):
    got = book_steps[section].tensors[name]
    assert got.tolist() == pytest.approx(BOOK[section, name], abs=1e-4)


@pytest.mark.parametrize(("section", "name"), list(BOOK_FIRST_ROWS))
def test_first_rows_match_the_book(book_steps, section, name):
    got = book_steps[section].tensors[name]
    first_row = got[0] if got.dim() == 2 else got[0, 0]
    assert first_row.tolist() == pytest.approx(BOOK_FIRST_ROWS[section, name], abs=1e-4)


def test_wrapper_first_head_is_the_causal_attention_layer(book_steps):
    # §3.6.1: the wrapper's heads are CausalAttention layers created under the
    # same seed, so its first head reproduces the first row §3.5.3 prints.
    out = book_steps["3.6.1"].tensors["context_vecs"]
    assert out.shape == (2, 6, 4)
    assert out[0, 0, :2].tolist() == pytest.approx([-0.4519, 0.2216], abs=1e-4)


def test_weight_rows_sum_to_one_and_causal_routes_agree(book_steps):
    sums = book_steps["3.3.2"].tensors["attn_weights.sum(dim=-1)"]
    assert sums.tolist() == pytest.approx([1.0] * 6, abs=1e-6)
    causal = book_steps["3.5.1"].tensors
    torch.testing.assert_close(causal["masked_simple_norm"], causal["attn_weights (causal)"])
    assert torch.all(causal["attn_weights (causal)"].triu(diagonal=1) == 0)
    assert torch.isinf(causal["masked"].triu(diagonal=1)[0, 1:]).all()


def test_dropout_scales_survivors_by_two(book_steps):
    tensors = book_steps["3.5.2"].tensors
    ones = tensors["dropout(torch.ones)"]
    assert set(ones.unique().tolist()) == {0.0, 2.0}
    kept = tensors["dropout(attn_weights)"] != 0
    causal = book_steps["3.5.1"].tensors["attn_weights (causal)"]
    torch.testing.assert_close(tensors["dropout(attn_weights)"][kept], 2 * causal[kept])


def test_heatmap_weights_and_per_head_shape(book_steps):
    with_weights = [s for s in book_steps.values() if s.weights is not None]
    assert [s.section for s in with_weights] == ["3.3.2", "3.4.2", "3.5.1", "3.6.2"]
    assert book_steps["3.6.2"].weights.shape == (2, 6, 6)


def test_printed_output_shows_the_books_numbers(book_output):
    assert "== 3.3.1 Attention scores for one query ==" in book_output
    for (_, name), expected in BOOK.items():
        header = f"{name}  ({len(expected)},)"
        assert printed_numbers(book_output, header) == pytest.approx(expected, abs=PRINTED)
    first_rows = [("sa_v1(inputs)  (6, 2)", [0.2996, 0.8053], book_output),
                  ("context_vecs  (2, 6, 2)", [-0.4519, 0.2216], book_output),
                  # The last (2, 6, 2) context_vecs block is MultiHeadAttention's (§3.6.2).
                  ("context_vecs  (2, 6, 2)", [0.3190, 0.4858],
                   book_output[book_output.index("== 3.6.2") :])]
    for header, expected, output in first_rows:
        assert printed_numbers(output, header)[:2] == pytest.approx(expected, abs=PRINTED)


def test_walkthrough_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    walkthrough_steps()
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------------
# Own text
# ---------------------------------------------------------------------------


def test_text_is_deterministic_per_seed():
    text = "the cat sat on the mat"
    a = walkthrough_steps(text, seed=7)
    b = walkthrough_steps(text, seed=7)
    c = walkthrough_steps(text, seed=8)
    for step_a, step_b in zip(a, b, strict=True):
        for name, tensor in step_a.tensors.items():
            # equal_nan: the softmax_naive overflow example is nan by design
            assert torch.equal(tensor, step_b.tensors[name]) or torch.allclose(
                tensor, step_b.tensors[name], rtol=0, atol=0, equal_nan=True
            ), (step_a.section, name)
    inputs_a, inputs_c = a[0].tensors["inputs"], c[0].tensors["inputs"]
    assert inputs_a.shape == (6, 3)
    assert not torch.equal(inputs_a, inputs_c)
    # Repeated words (either case) share their embedding.
    torch.testing.assert_close(inputs_a[0], inputs_a[4])
    again = walkthrough_steps("The cat sat on THE mat", seed=7)[0].tensors["inputs"]
    torch.testing.assert_close(again, inputs_a)
    assert a[-1].tensors["context_vecs"].shape == (2, 6, 2)


@pytest.mark.parametrize(
    ("text", "message"), [("", "empty"), ("  \t\n", "empty"), ("w " * 65, "65 tokens")]
)
def test_bad_text_is_a_one_line_value_error(text, message):
    with pytest.raises(ValueError, match=message) as info:
        walkthrough_steps(text)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------
# format_tensor
# ---------------------------------------------------------------------------


def test_format_tensor_header_and_labels():
    weights = torch.tensor([[1.0, 0.0], [0.25, 0.75]])
    text = format_tensor(weights, ["Your", "journey"], name="attn_weights")
    lines = text.splitlines()
    assert lines[0] == "attn_weights  (2, 2)"
    assert lines[1].split() == ["Your", "journey"]  # columns reuse the row labels
    assert lines[2].split() == ["Your", "1.0000", "0.0000"]
    assert lines[3].split() == ["journey", "0.2500", "0.7500"]
    assert format_tensor(torch.zeros(3), decimals=2).splitlines() == [
        "tensor  (3,)",
        "  0.00  0.00  0.00",
    ]


def test_format_tensor_special_values_and_batches():
    t = torch.tensor([[[0.5, float("-inf")], [-0.00001, 1.0]]])
    text = format_tensor(t, ["a", "b"], name="masked", col_labels=())
    assert text.splitlines()[:2] == ["masked  (1, 2, 2)", "  [0]"]
    assert "-inf" in text and "-0.0000" not in text
    with pytest.raises(ValueError):
        format_tensor(torch.zeros(2, 2), ["only one"])


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def test_cli_only_one_section(capsys):
    assert main(["walkthrough", "--only", "3.5.1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== 3.5.1 Causal attention mask ==")
    assert "== 3.5.2" not in out and "-inf" in out


def test_cli_steps_lists_titles(capsys):
    assert main(["walkthrough", "--steps", "--only", "3.6"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "3.6.1  Stacking single-head attention",
        "3.6.2  Multi-head attention with weight splits",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "9.9"], "3.3.1, 3.3.2"),  # lists the valid sections
        (["--text", ""], "empty"),
        (["--text", "   "], "empty"),
        (["--heatmap", "wt.jpg"], ".png"),
        (["--only", "3.3.1", "--heatmap", "wt.png"], "3.3.2"),
    ],
)
def test_cli_user_errors_are_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["walkthrough", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv walkthrough: error:")
    assert message in lines[0] and "Traceback" not in captured.err
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_heatmap_is_a_readable_png(capsys, tmp_path):
    from matplotlib.image import imread

    path = tmp_path / "figs" / "wt.png"  # the folder does not exist yet
    argv = ["walkthrough", "--text", "the cat sat on the mat", "--heatmap", str(path)]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"heatmap written to {path}")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = imread(path).shape
    assert height > 400 and width > 600
    assert [p.name for p in path.parent.iterdir()] == ["wt.png"]  # no temp file left


def test_python_dash_m_lists_steps():
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "walkthrough", "--steps"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # the book's sections, then the mechanisms' (tests/test_walkthrough_variants.py)
    assert [line.split()[0] for line in lines] == [*SECTIONS, *VARIANT_SECTIONS]
    assert lines[0] == "3.3.1  Attention scores for one query"


# ---------------------------------------------------------------------------
# Plotting helpers
# ---------------------------------------------------------------------------


def test_plot_attention_formats_and_errors(tmp_path):
    from qkv.utils.figures import plot_attention, plot_attention_grid

    weights = torch.softmax(torch.arange(12.0).view(3, 4), dim=-1).requires_grad_()
    labels = dict(row_labels=["je", "suis", "<eos>"], col_labels=["i'm", "home", ".", "<eos>"])
    svg = plot_attention(weights, **labels, title="t", path=tmp_path / "a.svg")
    assert svg.read_text().lstrip().startswith("<?xml")
    pdf = plot_attention(weights.detach().numpy(), path=tmp_path / "a.pdf")
    assert pdf.read_bytes()[:5] == b"%PDF-"
    grid = plot_attention_grid(
        torch.stack([weights.detach()] * 3), titles=["a", "b", "c"], path=tmp_path / "g.png"
    )
    assert grid.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="use one of"):
        plot_attention(weights, path=tmp_path / "a.jpg")
    with pytest.raises(ValueError, match="2-D"):
        plot_attention(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="row_labels"):
        plot_attention(weights, row_labels=["x"])


def test_plot_attention_grid_packs_panels_of_different_widths():
    from qkv.utils.figures import plot_attention_grid

    # Three translations of different source lengths, as `qkv translate run --heatmap`
    # draws them: each row packs its panels from the left, instead of giving every
    # panel the width of the widest, and nothing is cut off at the edges.
    sources = [["3", "mar", "2", "1"], ["july", "4", "th", "1", "9", "7", "6"],
               ["1", "2", "/", "2", "5", "/", "1", "9", "9", "9"]]
    outputs = ["2", "0", "2", "1", "-", "0", "3", "-", "0", "3", "<eos>"]
    shapes = [(len(outputs), len(src) + 1) for src in sources]
    fig = plot_attention_grid(
        [torch.full(shape, 1.0 / shape[1]) for shape in shapes],
        titles=list("abc"),
        row_labels=outputs,
        col_labels=[[*src, "<eos>"] for src in sources],
        suptitle="What the decoder attends to",
        xlabel="source tokens (attended to)",
        ylabel="output tokens",
    )
    fig.canvas.draw()  # runs the constrained layout
    images = [ax for ax in fig.axes if ax.images and ax.get_title() in "abc"]
    boxes = {ax.get_title(): ax.get_window_extent() for ax in images}
    # inches between panels a and b: the colour bar and b's tick labels (2.3 when every
    # panel was as wide as the widest)
    gap = (boxes["b"].x0 - boxes["a"].x1) / fig.dpi
    assert 0 < gap < 1.9, gap  # 1.6 here
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] + [t for ax in images for t in (ax.title, ax.xaxis.label,
                                                             ax.yaxis.label)]
    for text in texts:  # (one sub-figure per row cut the last x label off by 6 pixels)
        box = text.get_window_extent(renderer)
        assert box.x0 >= -1 and box.y0 >= -1, (text.get_text(), box)  # pixels
        assert box.x1 <= fig.bbox.width + 1 and box.y1 <= fig.bbox.height + 1, text
    # panels keep square cells: width / height follows the matrix shape
    for (rows, cols), title in zip(shapes, "abc", strict=True):
        box = boxes[title]
        assert box.width / box.height == pytest.approx(cols / rows, rel=0.05)


def test_heatmaps_draw_any_text(tmp_path):
    import xml.etree.ElementTree as ET

    from matplotlib.image import imread

    from qkv.utils.figures import SUPPORTED_FORMATS, plot_attention, plot_attention_grid

    # What `qkv translate run --text $'\xff\xfe'` or a prompt full of symbols feeds the
    # labels: undecodable bytes (Python's surrogates), mathtext syntax (balanced and not),
    # control characters, an emoji and a very long token.
    labels = ["\udcff", "$x_1^2$", "\x00", "\t", "a\nb", "\U0001f600", "t" * 200, "$x_$"]
    shown = ["\\xff", "$x_1^2$", "\\x00", "\\t", "a\\nb", "\U0001f600", "t" * 19 + "\u2026",
             "$x_$"]
    weights = torch.softmax(torch.arange(64.0).view(8, 8).sin(), dim=-1)
    title = "bytes \udcff\udcfe, $x_$ and a tab\t " + "long " * 100
    for ext in SUPPORTED_FORMATS:
        path = plot_attention(weights, row_labels=labels, col_labels=labels, title=title,
                              path=tmp_path / f"any{ext}")
        assert path.stat().st_size > 1000
    assert imread(tmp_path / "any.png").shape[0] > 400
    ET.parse(tmp_path / "any.svg")  # well-formed XML: no raw NUL or control characters

    fig = plot_attention_grid([weights, weights[:3]], titles=[title, "$_^$"],
                              row_labels=[labels, labels[:3]], col_labels=labels,
                              suptitle=title, xlabel="x_$", ylabel="\udcff")
    fig.canvas.draw()  # mathtext would raise here on "$x_$"
    left = next(ax for ax in fig.axes if ax.get_title() and ax.images)
    assert [t.get_text() for t in left.get_yticklabels()] == shown
    assert [t.get_text() for t in left.get_xticklabels()] == shown
    assert left.get_title().startswith("bytes \\xff\\xfe, $x_$ and a tab\\t long")
    assert left.yaxis.label.get_text() == "\\xff"
    # A title longer than its panel is shortened, not run off the figure.
    renderer = fig.canvas.get_renderer()
    for text in (fig._suptitle, left.title):
        assert text.get_text().endswith("\u2026")
        box = text.get_window_extent(renderer)
        assert box.x0 >= -1 and box.x1 <= fig.bbox.width + 1, text.get_text()
