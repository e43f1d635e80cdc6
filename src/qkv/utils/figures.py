"""Heatmaps of attention weights.

Three helpers cover every heatmap qkv draws:

- :func:`plot_attention` draws one ``(num_queries, num_keys)`` matrix;
- :func:`plot_attention_grid` draws several side by side (one per head, per
  layer, per decoding step, ...), each with its own colour bar and labels;
- :func:`heatmap_grid` draws a ``(rows, cols, num_queries, num_keys)`` stack on a
  figure it is given, as the books' ``show_heatmaps`` lays it out: panels sharing
  their axes, one colour scale and one colour bar.

The convention is the one both books use: each **row** is a query (y axis,
top to bottom) and each **column** a key it may attend to (x axis), so a row of
attention weights sums to one. Tokens label both axes when given, a colour bar
gives the scale and small matrices get their values written in the cells.

Only matplotlib's object API is used (``Figure`` with an Agg canvas), never
``pyplot``: nothing here touches global plotting state or needs a display, so
the helpers work the same in scripts, tests, notebooks and on headless servers. matplotlib itself
is imported on first use, keeping ``import qkv`` light.
"""

from __future__ import annotations

import io
import math
import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .fileio import check_writable, write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "plot_attention",
    "plot_attention_grid",
    "heatmap_grid",
    "heatmap_stack",
    "check_image_path",
    "new_figure",
    "save_figure",
    "SUPPORTED_FORMATS",
]

SUPPORTED_FORMATS = (".png", ".pdf", ".svg")

# Matrices up to this size (both sides) get their values written in the cells.
ANNOTATE_MAX = 12

# Layout plan, in inches: a cell shrinks from MAX_CELL towards MIN_CELL as the
# matrix grows, so small matrices are not huge and 64 tokens still fit a page.
_MAX_CELL = 0.55
_MIN_CELL = 0.16
_TARGET_SIDE = 4.0  # a matrix side aims at roughly this many inches
_DPI = 150
_MAX_TICK_CHARS = 20

Labels = Sequence[str] | None


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def _as_matrix(x: Any, what: str = "weights") -> np.ndarray:
    """A torch tensor, numpy array or nested list as a float64 2-D numpy array."""
    if hasattr(x, "detach"):  # a torch.Tensor: may need grad, live on a GPU or be bf16
        x = x.detach().to("cpu").float().numpy()
    m = np.asarray(x, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"{what} must be a 2-D (queries, keys) matrix, got shape {m.shape}")
    if m.size == 0:
        raise ValueError(f"{what} is empty (shape {m.shape}); nothing to plot")
    return m


def _as_matrices(matrices: Any) -> list[np.ndarray]:
    """A 3-D stack ``(n, queries, keys)`` or a sequence of 2-D matrices as a list."""
    if hasattr(matrices, "detach") or isinstance(matrices, np.ndarray):
        if matrices.ndim != 3:
            raise ValueError(
                "matrices must be a (n, queries, keys) stack or a list of 2-D matrices, "
                f"got shape {tuple(matrices.shape)}"
            )
        matrices = list(matrices)
    mats = [_as_matrix(m, what=f"matrices[{i}]") for i, m in enumerate(matrices)]
    if not mats:
        raise ValueError("matrices is empty; nothing to plot")
    return mats


def _printable(text: Any) -> str:
    """``str(text)`` as something every renderer draws, with nothing hidden.

    Labels come from users' text: command-line arguments, files, decoded tokens. Python
    turns a byte it cannot decode into a lone surrogate (``'\\udcff'`` for ``0xff``),
    which no font can encode: it is shown as the byte, ``\\xff``; any other lone surrogate
    as U+FFFD, and a surrogate pair as the character it encodes. Control characters
    (tab, newline, NUL, ...) and line separators would be invisible, break the line or
    stop a renderer: they are shown as their escapes, ``\\t``, ``\\n``, ``\\x00``.
    (``$`` is left alone: the text is drawn with mathtext off, see :func:`_draw`.)
    """
    text = str(text)
    out = []
    i = 0
    while i < len(text):
        char, code = text[i], ord(text[i])
        low = ord(text[i + 1]) if i + 1 < len(text) else 0
        if 0xD800 <= code < 0xDC00 and 0xDC00 <= low < 0xE000:  # a pair: one character
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
            i += 2
            continue
        if 0xDC80 <= code < 0xDD00:  # surrogateescape's stand-in for a byte 0x80-0xff
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code < 0xE000:
            out.append("\ufffd")
        elif unicodedata.category(char) in ("Cc", "Zl", "Zp"):
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _tick_label(label: Any) -> str:
    # A very long token would squeeze its matrix out of the figure: shorten it.
    text = _printable(label)
    return text if len(text) <= _MAX_TICK_CHARS else text[: _MAX_TICK_CHARS - 1] + "\u2026"


def _check_labels(labels: Labels, n: int, name: str, axis: str) -> list[str] | None:
    if labels is None:
        return None
    labels = [_tick_label(label) for label in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but the matrix has {n} {axis}")
    return labels


def _per_panel(labels: Any, n: int, name: str) -> list[Any]:
    """One label list shared by all panels, or one per panel (each may be None)."""
    if labels is None:
        return [None] * n
    labels = list(labels)
    per_panel = bool(labels) and all(
        item is None or (isinstance(item, Sequence) and not isinstance(item, str))
        for item in labels
    )
    if not per_panel:
        return [labels] * n
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} label lists for {n} matrices")
    return labels


def check_image_path(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path if an image can be written there, else raise one line.

    Checks the extension and that the location is writable (creating missing parent
    folders, as saving will). Call it before a long computation so that a typo or a
    read-only folder fails fast.
    """
    path = Path(path)
    if path.suffix.lower() not in SUPPORTED_FORMATS:
        ext = path.suffix or "no extension"
        raise ValueError(
            f"cannot write an image to {str(path)!r} ({ext}); "
            f"use one of {', '.join(SUPPORTED_FORMATS)}"
        )
    return check_writable(path)


# ---------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------


def _cell_size(mats: list[np.ndarray]) -> float:
    """Inches per cell, so the largest matrix side is about ``_TARGET_SIDE``."""
    longest = max(max(m.shape) for m in mats)
    return min(_MAX_CELL, max(_MIN_CELL, _TARGET_SIDE / longest))


def _tick_fontsize(cell: float) -> float:
    # A label is about as tall as its font size; keep it under the cell height.
    return min(10.0, max(4.0, cell * 72 * 0.6))


def _label_inches(labels: list[str] | None, fontsize: float) -> float:
    """Rough width of the longest tick label (characters are ~0.6 em wide)."""
    if not labels:
        return 0.3
    return max(len(label) for label in labels) * fontsize * 0.6 / 72


def _panel_size(
    shape: tuple[int, ...], cell: float, rows: list[str] | None, cols: list[str] | None
) -> tuple[float, float]:
    """Inches (width, height) one panel needs: matrix, tick labels, colour bar, title."""
    fs = _tick_fontsize(cell)
    width = shape[1] * cell + _label_inches(rows, fs) + 0.4 + 0.9  # y label, colour bar
    # Rotated column labels hang below the matrix at 45 degrees: ~0.7 of their length.
    height = shape[0] * cell + 0.7 * _label_inches(cols, fs) + 0.4 + 0.5  # x label, title
    return max(width, 2.5), max(height, 2.2)


def _draw(
    fig: Figure,
    ax: Axes,
    m: np.ndarray,
    *,
    rows: list[str] | None,
    cols: list[str] | None,
    title: str | None,
    cmap: Any,
    annotate: bool | None,
    cell: float,
    xlabel: str | None,
    ylabel: str | None,
    width: float,
    centred: bool = False,
) -> None:
    """One heatmap with its colour bar on ``ax``, in a panel ``width`` inches wide."""
    from matplotlib.ticker import MaxNLocator

    # -inf (masked scores) and nan cannot be coloured: shown as grey cells.
    data = np.ma.masked_invalid(m)
    vmin, vmax = _color_scale(m, centred)
    num_rows, num_cols = m.shape
    # Square cells unless the matrix is very elongated (e.g. 1 x 60).
    aspect = "equal" if max(num_rows, num_cols) <= 8 * min(num_rows, num_cols) else "auto"
    image = ax.imshow(
        data, cmap=_colormap(cmap), vmin=vmin, vmax=vmax, aspect=aspect,
        interpolation="nearest"
    )
    fig.colorbar(image, ax=ax, shrink=0.8 if num_rows >= num_cols else 0.5)

    fs = _tick_fontsize(cell)
    ax.tick_params(labelsize=fs, length=2)
    # Unlabelled axes show positions: whole numbers only.
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    # parse_math=False everywhere: a token or title with "$", "_" or "^" is text, not a
    # mathtext formula (an unbalanced one would raise while drawing).
    if cols is not None:
        ax.set_xticks(range(num_cols), cols, parse_math=False)
        # Rotate when the widest label would not fit across its cell.
        if _label_inches(cols, fs) > 0.9 * cell:
            for label in ax.get_xticklabels():
                label.set(rotation=45, ha="right", rotation_mode="anchor")
    if rows is not None:
        ax.set_yticks(range(num_rows), rows, parse_math=False)
    if xlabel:
        ax.set_xlabel(_printable(xlabel), fontsize=9, parse_math=False)
    if ylabel:
        ax.set_ylabel(_printable(ylabel), fontsize=9, parse_math=False)
    if title:
        ax.set_title(_fit(fig, _printable(title), width, 10), fontsize=10, parse_math=False)

    if annotate is None:
        annotate = num_rows <= ANNOTATE_MAX and num_cols <= ANNOTATE_MAX
    if annotate:
        _annotate(ax, m, image, cell)


def _color_scale(m: np.ndarray, centred: bool = False) -> tuple[float, float]:
    """``(vmin, vmax)`` of the finite values of ``m`` (non-finite ones stay off the scale);
    ``centred``: symmetric about 0, so that 0 is the middle of the colour map (the white
    of a diverging one such as "RdBu_r", for weights of either sign)."""
    finite = m[np.isfinite(m)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if centred:
        vmax = max(-vmin, vmax)
        return (-vmax, vmax) if vmax > 0 else (-1.0, 1.0)
    # Anchor non-negative data (attention weights) at 0 so "no attention" is white.
    if vmin > 0:
        vmin = 0.0
    if vmax <= vmin:
        vmax = vmin + 1.0
    return vmin, vmax


def _colormap(cmap: Any) -> Any:
    """The colour map named (or given) by ``cmap``, drawing non-finite cells grey."""
    import matplotlib

    colormap = matplotlib.colormaps[cmap] if isinstance(cmap, str) else cmap
    return colormap.with_extremes(bad="0.85")


def _annotate(ax: Axes, m: np.ndarray, image: Any, cell: float) -> None:
    """Write each value in its cell, in black or white, whichever contrasts more."""
    # "0.25" is four characters; make them fit about 85% of the cell width.
    fontsize = min(9.0, max(3.5, 0.85 * cell * 72 / (4 * 0.6)))
    rgba = image.cmap(image.norm(np.ma.masked_invalid(m)))  # (rows, cols, 4) cell colours
    # Relative luminance of each cell decides the text colour, whatever the colour map.
    luminance = rgba[..., :3] @ np.array([0.2126, 0.7152, 0.0722])
    for i, j in np.ndindex(*m.shape):
        v = m[i, j]
        if not np.isfinite(v):
            text = ("-inf" if v < 0 else "inf") if np.isinf(v) else "nan"
        else:
            # Exact zeros (masked positions) read best as a quiet "0".
            text = "0" if v == 0 else f"{v:.2f}"
        colour = "black" if luminance[i, j] > 0.45 else "white"
        if v == 0 and colour == "black":
            colour = "0.45"
        ax.text(j, i, text, ha="center", va="center", fontsize=fontsize, color=colour)


def _fit(fig: Figure, text: str, inches: float, fontsize: float) -> str:
    """``text`` shortened with an ellipsis to at most ``inches`` wide at ``fontsize``.

    A title wider than its panel would run into the next panel or off the figure, cut
    at both ends; measured with the figure's renderer, so a title that fits is kept."""
    from matplotlib.font_manager import FontProperties

    renderer = fig.canvas.get_renderer()
    font = FontProperties(size=fontsize)

    def fits(candidate: str) -> bool:
        width, _, _ = renderer.get_text_width_height_descent(candidate, font, ismath=False)
        return width <= inches * renderer.dpi

    if fits(text):
        return text
    short, long = 0, len(text)  # the longest prefix that fits with the ellipsis
    while long - short > 1:
        middle = (short + long) // 2
        short, long = (middle, long) if fits(text[:middle] + "\u2026") else (short, middle)
    return text[:short] + "\u2026"


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches, for :func:`save_figure`.

    Every figure qkv draws (heatmaps, loss curves, benchmark plots) starts here: the
    object API on an Agg canvas, so no pyplot state, no GUI backend, no display needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to fig
    return fig


def save_figure(
    fig: Figure, path: str | os.PathLike[str], dpi: int = _DPI, tight: bool = False
) -> Path:
    """Write ``fig`` to ``path`` (PNG, PDF or SVG by its extension) atomically: a reader
    never sees half a file. Returns ``path`` as a Path.

    ``tight`` crops the image to what is drawn, as notebooks show figures, so that the
    labels of a figure without a layout engine are not cut at its edges."""
    path = check_image_path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:].lower(), dpi=dpi,
                bbox_inches="tight" if tight else None)
    return write_atomic(path, buffer.getvalue())


# ---------------------------------------------------------------------------
# Public helpers
# ---------------------------------------------------------------------------


def plot_attention(
    weights: Any,
    *,
    row_labels: Labels = None,
    col_labels: Labels = None,
    title: str | None = None,
    path: str | os.PathLike[str] | None = None,
    cmap: Any = "Reds",
    annotate: bool | None = None,
    xlabel: str | None = "keys (attended to)",
    ylabel: str | None = "queries",
) -> Path | Figure:
    """Draw one attention matrix as a heatmap.

    Args:
        weights: ``(num_queries, num_keys)`` torch tensor, numpy array or nested
            list; row ``i`` holds how much query ``i`` attends to each key.
        row_labels: ``num_queries`` tokens for the y axis (queries).
        col_labels: ``num_keys`` tokens for the x axis (keys attended to).
        title: drawn above the matrix.
        path: where to write the image (``.png``, ``.pdf`` or ``.svg``);
            missing parent directories are created and the file is replaced
            atomically. None returns the matplotlib ``Figure`` instead.
        cmap: matplotlib colour map name or object.
        annotate: write the values in the cells; None (default) does so when
            the matrix is at most 12 x 12.
        xlabel, ylabel: axis titles; None leaves an axis untitled.

    Returns:
        ``path`` as a :class:`pathlib.Path`, or the ``Figure`` when ``path`` is None.

    Non-finite values (e.g. ``-inf`` masked scores) are drawn as grey cells.
    """
    target = None if path is None else check_image_path(path)
    m = _as_matrix(weights)
    rows = _check_labels(row_labels, m.shape[0], "row_labels", "rows")
    cols = _check_labels(col_labels, m.shape[1], "col_labels", "columns")
    cell = _cell_size([m])
    width, height = _panel_size(m.shape, cell, rows, cols)
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    _draw(
        fig,
        ax,
        m,
        rows=rows,
        cols=cols,
        title=title,
        cmap=cmap,
        annotate=annotate,
        cell=cell,
        xlabel=xlabel,
        ylabel=ylabel,
        width=width,
    )
    return fig if target is None else save_figure(fig, target)


def plot_attention_grid(
    matrices: Any,
    *,
    titles: Sequence[str | None] | None = None,
    row_labels: Any = None,
    col_labels: Any = None,
    path: str | os.PathLike[str] | None = None,
    suptitle: str | None = None,
    ncols: int | None = None,
    cmap: Any = "Reds",
    annotate: bool | None = None,
    xlabel: str | None = "keys (attended to)",
    ylabel: str | None = "queries",
    centred: bool | Sequence[bool] = False,
) -> Path | Figure:
    """Draw several attention matrices in a grid, each with its own colour bar.

    Args:
        matrices: a ``(n, num_queries, num_keys)`` tensor or array (e.g. the
            heads of one layer), or a sequence of ``n`` 2-D matrices, which may
            differ in shape (e.g. different layers or models). In a sequence of
            matrices of one shape, None leaves a slot of the grid empty (a layer with
            fewer heads than the next ends its row early); it is not one of the ``n``.
        titles: ``n`` panel titles (None entries allowed).
        row_labels, col_labels: one label list shared by every panel, or a
            list of ``n`` label lists (None entries allowed), one per panel.
        path: output file (``.png``, ``.pdf``, ``.svg``), written atomically;
            None returns the ``Figure``.
        suptitle: title over the whole figure.
        ncols: panels per row; default ``ceil(sqrt(n))``, at most 4.
        cmap: as in :func:`plot_attention`, or a list of ``n``, one per panel.
        annotate, xlabel, ylabel: as in :func:`plot_attention`.
        centred: each panel's colour scale symmetric about 0 (weights of either sign,
            with a diverging ``cmap``), or a list of ``n`` such flags; default: from 0
            (or the smallest value) to the largest.

    Returns:
        ``path`` as a :class:`pathlib.Path`, or the ``Figure`` when ``path`` is None.
    """
    target = None if path is None else check_image_path(path)
    places = None  # the grid slot of each matrix, when some slots are left empty
    if isinstance(matrices, (list, tuple)) and any(m is None for m in matrices):
        places = [k for k, m in enumerate(matrices) if m is not None]
        slots = len(matrices)
        matrices = [matrices[k] for k in places]
    mats = _as_matrices(matrices)
    n = len(mats)
    if places is None:
        slots = n
    if titles is None:
        titles = [None] * n
    elif len(titles) != n:
        raise ValueError(f"titles has {len(titles)} entries for {n} matrices")
    cmaps = list(cmap) if isinstance(cmap, (list, tuple)) else [cmap] * n
    if len(cmaps) != n:
        raise ValueError(f"cmap lists {len(cmaps)} colour maps for {n} matrices")
    centres = list(centred) if isinstance(centred, (list, tuple)) else [centred] * n
    if len(centres) != n:
        raise ValueError(f"centred lists {len(centres)} flags for {n} matrices")
    rows = [
        _check_labels(labels, m.shape[0], "row_labels", "rows")
        for labels, m in zip(_per_panel(row_labels, n, "row_labels"), mats, strict=True)
    ]
    cols = [
        _check_labels(labels, m.shape[1], "col_labels", "columns")
        for labels, m in zip(_per_panel(col_labels, n, "col_labels"), mats, strict=True)
    ]
    if ncols is None:
        ncols = min(n, 4, math.ceil(math.sqrt(n)))
    if ncols <= 0:
        raise ValueError(f"ncols must be a positive integer, got {ncols}")
    ncols = min(ncols, slots)
    nrows = math.ceil(slots / ncols)

    cell = _cell_size(mats)
    sizes = [_panel_size(m.shape, cell, r, c) for m, r, c in zip(mats, rows, cols, strict=True)]
    extra = 0.4 if suptitle else 0.0
    panels: list[Axes] = []  # where matrix k is drawn
    unused: list[Axes] = []
    if len(set(sizes)) == 1:
        # Equal panels (the heads of a layer): one grid, columns aligned across rows.
        w, h = sizes[0]
        fig = new_figure(ncols * w, nrows * h + extra)
        grid = fig.subplots(nrows, ncols, squeeze=False).ravel()
        where = list(range(n)) if places is None else places
        panels = [grid[k] for k in where]
        unused = [ax for k, ax in enumerate(grid) if k not in set(where)]  # and the last row
    elif places is not None:
        raise ValueError("empty slots (None) in matrices need matrices of one shape")
    else:
        # Panels of different shapes (sentences of different lengths): a grid of its own
        # for each row, each panel at its own width, so that a narrow panel leaves no gap.
        rows_of = [range(i * ncols, min((i + 1) * ncols, n)) for i in range(nrows)]
        widths = [[sizes[k][0] for k in ks] for ks in rows_of]
        width = max(sum(ws) for ws in widths)
        heights = [max(sizes[k][1] for k in ks) for ks in rows_of]
        fig = new_figure(width, sum(heights) + extra)
        grid = fig.add_gridspec(nrows, 1, height_ratios=heights)
        for row, ks, ws in zip(grid, rows_of, widths, strict=True):
            spare = width - sum(ws)
            ratios = ws + ([spare] if spare > 0.1 else [])  # an empty slot keeps widths true
            cells = row.subgridspec(1, len(ratios), width_ratios=ratios)
            axes = [fig.add_subplot(cells[0, j]) for j in range(len(ratios))]
            panels += axes[: len(ks)]
            unused += axes[len(ks) :]
    for ax in unused:
        ax.set_visible(False)
    for ax, m, r, c, title, size, colours, centre in zip(panels, mats, rows, cols, titles, sizes,
                                                         cmaps, centres, strict=True):
        _draw(
            fig,
            ax,
            m,
            rows=r,
            cols=c,
            title=title,
            cmap=colours,
            annotate=annotate,
            cell=cell,
            xlabel=xlabel,
            ylabel=ylabel,
            width=size[0],
            centred=centre,
        )
    if suptitle:
        suptitle = _fit(fig, _printable(suptitle), fig.get_figwidth(), 12)
        fig.suptitle(suptitle, fontsize=12, parse_math=False)
    return fig if target is None else save_figure(fig, target)


def heatmap_stack(matrices: Any) -> np.ndarray:
    """``matrices`` as a float64 ``(rows, cols, num_queries, num_keys)`` numpy array.

    Takes a 4-D torch tensor (detached, moved to the CPU), numpy array or nested list;
    raises a one-line ``ValueError`` for any other shape or an empty one.
    """
    if hasattr(matrices, "detach"):  # a torch.Tensor: may need grad, live on a GPU, be bf16
        matrices = matrices.detach().to("cpu").float().numpy()
    stack = np.asarray(matrices, dtype=np.float64)
    if stack.ndim != 4:
        raise ValueError(
            "matrices must be a 4-D (rows, cols, num_queries, num_keys) stack, "
            f"got shape {stack.shape}"
        )
    if stack.size == 0:
        raise ValueError(f"matrices is empty (shape {stack.shape}); nothing to plot")
    return stack


def heatmap_grid(
    fig: Figure,
    matrices: Any,
    *,
    xlabel: str | None = None,
    ylabel: str | None = None,
    titles: Sequence[str] | None = None,
    cmap: Any = "Reds",
    shrink: float = 0.6,
) -> np.ndarray:
    """Draw a stack of matrices on ``fig`` as a grid of heatmaps with one colour bar.

    The books' layout (d2l's ``show_heatmaps``): matrix ``[i, j]`` in row ``i``, column
    ``j``; the panels share their axes; ``xlabel`` under the bottom row, ``ylabel`` left
    of the first column, ``titles[j]`` over every panel of column ``j``; one colour bar,
    ``shrink`` times the grid's height, beside the grid. All panels share one colour
    scale, so that one bar reads right for each of them (non-negative data starts at 0).

    Args:
        fig: an empty figure, from :func:`new_figure` or pyplot.
        matrices: ``(rows, cols, num_queries, num_keys)`` tensor, array or nested list.
        xlabel, ylabel: axis titles; None leaves an axis untitled.
        titles: at least ``cols`` column titles (extra ones are unused), or None.
        cmap: matplotlib colour map name or object; non-finite cells are grey.
        shrink: colour bar length as a fraction of the grid's height.

    Returns:
        the ``(rows, cols)`` numpy array of the panels' ``Axes``.
    """
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    stack = heatmap_stack(matrices)
    num_rows, num_cols = stack.shape[:2]
    titles = list(titles) if titles else None  # d2l's test: an empty list means none
    if titles is not None and len(titles) < num_cols:
        raise ValueError(f"titles has {len(titles)} entries for {num_cols} columns of matrices")
    norm = Normalize(*_color_scale(stack))
    colormap = _colormap(cmap)
    axes = fig.subplots(num_rows, num_cols, sharex=True, sharey=True, squeeze=False)
    for (i, j), ax in np.ndenumerate(axes):
        image = ax.imshow(np.ma.masked_invalid(stack[i, j]), cmap=colormap, norm=norm,
                          interpolation="nearest")
        # Positions are whole numbers; parse_math=False: "$" or "_" in a label is text.
        ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(nbins="auto", integer=True))
        if i == num_rows - 1 and xlabel:
            ax.set_xlabel(_printable(xlabel), parse_math=False)
        if j == 0 and ylabel:
            ax.set_ylabel(_printable(ylabel), parse_math=False)
        if titles is not None:
            ax.set_title(_printable(titles[j]), parse_math=False)
    fig.colorbar(image, ax=axes, shrink=shrink)
    return axes
