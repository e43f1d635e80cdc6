"""``qkv.viz.explore``: a model's attention on some texts, as a page for a browser or a
notebook."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..tasks.lm import TASK as LM_TASK
from ..tasks.lm import LanguageModel
from ..tasks.translate import TASK as TRANSLATE_TASK
from ..tasks.translate import Translator
from ..training import CheckpointError, load_config
from ..utils.fileio import write_atomic
from .data import Target, page_data
from .page import render_page

__all__ = ["Exploration", "explore", "load_target"]


def load_target(run_dir: str | Path, *, device: str = "cpu",
                bpe_dir: str | None = None) -> Target:
    """The model of any qkv run directory: a :class:`LanguageModel` or a
    :class:`Translator`, by the task its checkpoint says it is."""
    task = load_config(run_dir).get("task")
    if task == LM_TASK:
        return LanguageModel.load(run_dir, device=device, bpe_dir=bpe_dir)
    if task == TRANSLATE_TASK:
        return Translator.load(run_dir, device=device)
    raise CheckpointError(f"{run_dir}: a {task!r} checkpoint; qkv view shows "
                          f"{LM_TASK!r} and {TRANSLATE_TASK!r} runs")


class Exploration:
    """A page of attention maps (see :mod:`qkv.viz.data`): :meth:`save` writes it as one
    self-contained HTML file; in Jupyter it shows itself (``_repr_html_``).

    Attributes:
        data: the page's data, :func:`qkv.viz.data.page_data`'s dict.
        title: the page's title.
    """

    def __init__(self, data: dict[str, Any], title: str) -> None:
        self.data = data
        self.title = title

    def html(self) -> str:
        """The whole page as a string."""
        return render_page(self.data, title=self.title)

    def save(self, path: str | Path) -> Path:
        """Write the page to ``path`` (atomically: a reader never sees half a page)."""
        return write_atomic(Path(path), self.html().encode("utf-8"))

    def _repr_html_(self) -> str:
        # The page runs in an iframe of its own: notebook front ends differ in whether
        # they run a <script> in an output cell, and an iframe keeps the page's styles
        # and ids from clashing with the notebook's.
        return (f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" '
                'style="width: 100%; height: 640px; border: 1px solid #ddd" '
                'sandbox="allow-scripts allow-downloads"></iframe>')

    def __repr__(self) -> str:
        sections = sum(len(e["sections"]) for e in self.data["examples"])
        return (f"Exploration({self.data['model']['name']!r}, "
                f"{len(self.data['examples'])} text(s), {sections} attention map(s))")


def explore(model_or_run_dir: Target | str | Path, text: str | Sequence[str], *,
            device: str = "cpu", beam: int = 1, bpe_dir: str | None = None,
            generate: int = 0) -> Exploration:
    """What a model attends to on ``text`` (one string or several): an
    :class:`Exploration` to show in a notebook or :meth:`~Exploration.save` as HTML.

    ``model_or_run_dir``: a :class:`~qkv.tasks.lm.LanguageModel`, a
    :class:`~qkv.tasks.translate.Translator`, or the run directory of either (loaded on
    ``device``; ``bpe_dir`` for a GPT-2 tokenizer's files). A translator translates each
    text (greedy, or beam search with ``beam``) and shows its attention while doing so.
    A language model with ``generate=N`` first continues each text greedily by ``N``
    tokens (prompt and continuation must fit its context) and shows the attention of the
    whole sequence, the generated tokens marked.
    """
    run_dir = None
    if isinstance(model_or_run_dir, (str, Path)):
        run_dir = Path(model_or_run_dir)
        target = load_target(run_dir, device=device, bpe_dir=bpe_dir)
    elif isinstance(model_or_run_dir, (LanguageModel, Translator)):
        target = model_or_run_dir
    else:
        raise TypeError(f"explore needs a LanguageModel, a Translator or a run directory, "
                        f"got {type(model_or_run_dir).__name__}")
    texts = [text] if isinstance(text, str) else list(text)
    data = page_data(target, texts, run_dir=run_dir, beam=beam, generate=generate)
    title = f"qkv attention: {run_dir.name if run_dir else data['model']['name']}"
    return Exploration(data, title)
