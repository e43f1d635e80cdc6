"""d2l's plotting helpers: ``plot``, ``set_axes``, ``set_figsize``, ``show_heatmaps``.

They draw as d2l's do, on pyplot figures, so a notebook shows them under the cell and a
script's ``d2l.plt.show()`` opens them: ``plot`` on the current axes (``plt.gca()``,
which later ``plt.plot`` calls add to), ``show_heatmaps`` on a new figure. The
heatmaps are drawn by :func:`qkv.utils.figures.heatmap_grid`, in the books' layout: a
grid of panels sharing their axes, the ``Reds`` colour map, one colour bar.

One departure: the panels of ``show_heatmaps`` share one colour scale, so that its one
colour bar reads right for every panel (d2l scales each panel on its own and labels
the bar with the last panel's scale).

Where nothing can be shown (a non-interactive backend such as Agg, which matplotlib
picks when there is no display), each picture is also saved in the working directory,
as ``plot_1.png``, ``plot_2.png``, ... and ``heatmaps_1.png``, ...; ``train_seq2seq``
saves its loss curve, ``seq2seq_loss.png``, by the same rule. A file is written when
the call returns and written again when the next ``plot`` or ``show_heatmaps`` begins,
so what the caller draws on the figure in between (the chapters'
``d2l.plt.plot(x_train, y_train, 'o')`` after ``d2l.plot``) is in it; after a script's
last picture, ``d2l.plt.savefig`` keeps such additions. Nothing here blocks or opens a
window.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib import pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..utils.figures import heatmap_grid, heatmap_stack, save_figure
from .tensors import numpy

__all__ = [
    "plot",
    "set_axes",
    "set_figsize",
    "show_heatmaps",
    "use_svg_display",
    "interactive_backend",
    "save_if_headless",
]

# Backends that draw to files only: pyplot can show nothing with them.
_FILE_BACKENDS = {"agg", "cairo", "pdf", "pgf", "ps", "svg", "template"}
# How many pictures of each kind this process has saved, for their file names.
_saved: collections.Counter[str] = collections.Counter()
# The figures saved since the last picture began, each with its file.
_last_saved: dict[Figure, Path] = {}


def interactive_backend() -> bool:
    """Whether pyplot can show figures (False for Agg and the other file-only backends)."""
    return plt.get_backend().lower() not in _FILE_BACKENDS


def save_if_headless(fig: Figure, name: str, numbered: bool = False) -> Path | None:
    """Save ``fig`` as ``name`` (PNG, PDF or SVG by its extension) in the working
    directory when pyplot cannot show it; return the path, or None when it can.

    With ``numbered``, ``name`` is a stem and the file is ``{name}_{k}.png``, ``k``
    counting this process's saved pictures of that stem from 1.
    """
    if interactive_backend():
        return None
    if numbered:
        _saved[name] += 1
        name = f"{name}_{_saved[name]}.png"
    path = save_figure(fig, name, tight=True).resolve()  # cropped as a notebook shows it
    _last_saved[fig] = path
    return path


def _save_again() -> None:
    """Write the figures saved since the last picture began once more, with whatever
    their callers drew on them since; a new picture may clear their axes next."""
    for fig, path in _last_saved.items():
        save_figure(fig, path, tight=True)
    _last_saved.clear()


def use_svg_display() -> None:
    """Draw inline notebook figures as SVG; a no-op outside a notebook."""
    try:
        from matplotlib_inline import backend_inline
    except ImportError:
        return
    backend_inline.set_matplotlib_formats("svg")


def set_figsize(figsize: tuple[float, float] = (3.5, 2.5)) -> None:
    """Make ``figsize`` (inches) the size of the figures pyplot creates from now on."""
    use_svg_display()
    plt.rcParams["figure.figsize"] = figsize


def set_axes(
    axes: Axes,
    xlabel: str | None,
    ylabel: str | None,
    xlim: Sequence[float] | None,
    ylim: Sequence[float] | None,
    xscale: str,
    yscale: str,
    legend: Sequence[str] | None,
) -> None:
    """Label, scale and limit ``axes``, add a legend when one is given, and a grid.

    None leaves a label empty and a limit to matplotlib's autoscaling.
    """
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_xscale(xscale)
    axes.set_yscale(yscale)
    axes.set_xlim(xlim)
    axes.set_ylim(ylim)
    if legend:
        axes.legend(legend)
    axes.grid()


def _has_one_axis(X: Any) -> bool:
    """True for one series of numbers: a 1-D tensor or array, or a list of scalars."""
    if hasattr(X, "ndim"):
        return X.ndim == 1
    return isinstance(X, list) and bool(X) and not hasattr(X[0], "__len__")


def _values(v: Any) -> Any:
    # Tensors may need grad or live on a GPU; matplotlib takes everything else as is.
    return numpy(v) if hasattr(v, "detach") else v


def plot(
    X: Any,
    Y: Any = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    legend: Sequence[str] | None = None,
    xlim: Sequence[float] | None = None,
    ylim: Sequence[float] | None = None,
    xscale: str = "linear",
    yscale: str = "linear",
    fmts: Sequence[str] = ("-", "m--", "g-.", "r:"),
    figsize: tuple[float, float] = (3.5, 2.5),
    axes: Axes | None = None,
) -> None:
    """Draw lines on ``axes`` (default: pyplot's current axes), replacing what was there.

    ``X`` and ``Y`` are each one series (a 1-D tensor or array, a list of numbers) or
    several (a 2-D tensor or array: one series per row; a list of series). Line ``i``
    is ``Y[i]`` against ``X[i]`` (one ``X`` serves every ``Y``), drawn in ``fmts[i]``;
    lines beyond ``len(fmts)`` are not drawn. Without ``Y``, ``X`` holds the y values,
    drawn against their indices. ``figsize`` applies to a figure this call creates.
    """
    _save_again()
    set_figsize(figsize)
    axes = axes if axes is not None else plt.gca()
    if _has_one_axis(X):
        X = [X]
    if Y is None:
        X, Y = [[]] * len(X), X
    elif _has_one_axis(Y):
        Y = [Y]
    if len(X) != len(Y):
        X = list(X) * len(Y)
    axes.cla()
    for x, y, fmt in zip(X, Y, fmts, strict=False):  # as d2l: len(fmts) lines at most
        if len(x):
            axes.plot(_values(x), _values(y), fmt)
        else:
            axes.plot(_values(y), fmt)
    set_axes(axes, xlabel, ylabel, xlim, ylim, xscale, yscale, legend)
    save_if_headless(axes.figure, "plot", numbered=True)


def show_heatmaps(
    matrices: Any,
    xlabel: str | None,
    ylabel: str | None,
    titles: Sequence[str] | None = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: Any = "Reds",
) -> None:
    """Draw ``matrices (rows, cols, num_queries, num_keys)`` as a rows x cols grid of
    heatmaps on a new pyplot figure of ``figsize`` inches.

    ``xlabel`` goes under the bottom row, ``ylabel`` left of the first column,
    ``titles[j]`` over column ``j``; one colour bar on the right. ``matrices`` is a tensor
    (with grad or on a GPU is fine), an array or a nested list.
    """
    heatmap_stack(matrices)  # a wrong shape fails before a figure exists
    _save_again()
    use_svg_display()
    fig = plt.figure(figsize=figsize, layout="constrained")
    try:
        heatmap_grid(fig, matrices, xlabel=xlabel, ylabel=ylabel, titles=titles, cmap=cmap)
    except Exception:
        plt.close(fig)
        raise
    save_if_headless(fig, "heatmaps", numbered=True)
