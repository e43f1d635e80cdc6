"""Dive into Deep Learning 1.0's object-oriented framework (the English edition's d2l).

d2l-en, whose ``d2l`` package is 1.0.3, writes every model as a :class:`Module`, every
data set as a :class:`DataModule`, and trains them with
``Trainer(max_epochs, num_gpus, gradient_clip_val).fit(model, data)``, which plots the
losses on a :class:`ProgressBoard`. This module holds the framework's pieces that stand
on their own: :class:`HyperParameters`, :func:`add_to_class`, :class:`ProgressBoard`,
:class:`Module`, :class:`DataModule`, :class:`Trainer`, :class:`Classifier`, :class:`RNN`,
:class:`GRU`, and the functions both editions share (:func:`init_seq2seq`,
:func:`grad_clipping`, :func:`bleu`). ``qkv.d2l`` re-exports every one of them and builds
1.0's translation pieces on them (``EncoderDecoder`` is a :class:`Classifier`; ``Seq2Seq``,
``MTFraEng``), so ``from qkv import d2l`` runs the English chapters.

The two editions clash in one name: both build ``Seq2SeqEncoder`` with the same
signature, but 1.0.3 draws its weights when it is built and d2l-zh when it is trained, so
this module's :class:`Seq2SeqEncoder` is 1.0.3's and ``qkv.d2l.Seq2SeqEncoder`` is
d2l-zh's. Everything else here is one object with ``qkv.d2l``'s (d2l-zh 2.0 has none of
these classes, and ``Encoder``, ``Decoder``, ``AttentionDecoder``, ``EncoderDecoder``
and ``bleu`` serve both editions; see its docstring).

As in d2l 1.0.3, except:

- nothing blocks or needs a display: a :class:`ProgressBoard` draws on a figure of
  :func:`qkv.utils.figures.new_figure`; in a Jupyter kernel each redraw is shown in the
  cell's output (as d2l does), elsewhere it is written to ``path`` (``progress.png`` in
  the working directory; ``None``: kept in ``board.fig`` only);
- :meth:`Module.plot` averages at least one point per drawn point (d2l's ``every_n``
  rounds to 0, and then never draws, when an epoch has fewer batches than plotted points);
- gradient clipping skips parameters that got no gradient (d2l's fails on them).
"""

from __future__ import annotations

import collections
import inspect
import io
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ..checks import check_positive_int
from ..data.loading import batch_loader
from ..models import bahdanau
from ..utils import figures

__all__ = [
    "HyperParameters",
    "add_to_class",
    "ProgressBoard",
    "Module",
    "DataModule",
    "Trainer",
    "Classifier",
    "RNN",
    "GRU",
    "init_seq2seq",
    "Seq2SeqEncoder",
    "grad_clipping",
    "bleu",
]


def add_to_class(Class: type) -> Callable[[Callable[..., Any]], None]:
    """Decorator: ``@add_to_class(C)`` over ``def f(self, ...)`` sets ``C.f``.

    As in d2l, the decorated name is bound to ``None`` where it is defined (the decorator
    returns nothing); the function lives on as the class's method.
    """

    def wrapper(obj: Callable[..., Any]) -> None:
        setattr(Class, obj.__name__, obj)

    return wrapper


class HyperParameters:
    """Base of every class that keeps its constructor's arguments as attributes."""

    def save_hyperparameters(self, ignore: Sequence[str] = ()) -> None:
        """Copy the calling function's local variables into ``self.hparams`` and onto
        ``self``, as d2l does: every local at the time of the call (normally just the
        arguments of ``__init__``), except ``self``, the names in ``ignore`` and names
        starting with ``_``."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:  # only on Pythons without frame introspection
            raise RuntimeError("save_hyperparameters needs the caller's frame")
        skip = {"self", *ignore}
        self.hparams = {k: v for k, v in dict(caller.f_locals).items()
                        if k not in skip and not k.startswith("_")}
        for k, v in self.hparams.items():
            setattr(self, k, v)


def _notebook_shell() -> Any:
    """The IPython shell when running in a Jupyter kernel (one that shows figures), else
    None. IPython is only looked at when already imported: a kernel always has it."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if getattr(shell, "kernel", None) is not None else None


class ProgressBoard(HyperParameters):
    """Lines of points added one at a time: ``draw(x, y, label, every_n=1)``.

    Every ``every_n`` points given for a ``label`` are averaged into one point of that
    label's line (``board.data[label]``, a list of ``Point(x, y)``). Each new point
    redraws the figure ``board.fig`` (one line per label, styled by ``ls`` and
    ``colors``) and, when ``display``, shows it: in a Jupyter kernel in the cell's output,
    replacing the previous picture; elsewhere by writing it to ``path`` (PNG, PDF or SVG
    by extension; ``None`` writes nothing). Nothing blocks.

    ``fig`` / ``axes``: draw on these instead of a new :func:`qkv.utils.figures.new_figure`
    of ``figsize`` inches.
    """

    Point = collections.namedtuple("Point", ["x", "y"])

    def __init__(
        self, xlabel: str | None = None, ylabel: str | None = None,
        xlim: Sequence[float] | None = None, ylim: Sequence[float] | None = None,
        xscale: str = "linear", yscale: str = "linear",
        ls: Sequence[str] = ("-", "--", "-.", ":"),
        colors: Sequence[str] = ("C0", "C1", "C2", "C3"),
        fig: Any = None, axes: Any = None, figsize: tuple[float, float] = (3.5, 2.5),
        display: bool = True, path: str | os.PathLike[str] | None = "progress.png",
    ) -> None:
        # The extension now (a typo fails before training); the folder when first saved.
        if path is not None and os.path.splitext(path)[1].lower() not in figures.SUPPORTED_FORMATS:
            raise ValueError(f"ProgressBoard path must end in one of "
                             f"{', '.join(figures.SUPPORTED_FORMATS)}, got {str(path)!r}")
        self.save_hyperparameters()
        self.raw_points: dict[str, list[ProgressBoard.Point]] = collections.OrderedDict()
        self.data: dict[str, list[ProgressBoard.Point]] = collections.OrderedDict()

    def draw(self, x: float, y: float, label: str, every_n: int = 1) -> None:
        check_positive_int("every_n", every_n)
        points = self.raw_points.setdefault(label, [])
        line = self.data.setdefault(label, [])
        points.append(self.Point(float(x), float(y)))
        if len(points) != every_n:
            return
        line.append(self.Point(sum(p.x for p in points) / every_n,
                               sum(p.y for p in points) / every_n))
        points.clear()
        if self.display:
            self._redraw()
            self._show()

    def _redraw(self) -> None:
        if self.fig is None:
            self.fig = (self.axes.figure if self.axes is not None
                        else figures.new_figure(*self.figsize))
        axes = self.axes if self.axes is not None else (
            self.fig.axes[0] if self.fig.axes else self.fig.add_subplot())
        axes.cla()
        for (label, line), ls, color in zip(self.data.items(), self.ls, self.colors,
                                            strict=False):
            axes.plot([p.x for p in line], [p.y for p in line], linestyle=ls, color=color,
                      label=label)
        if self.xlim:
            axes.set_xlim(self.xlim)
        if self.ylim:
            axes.set_ylim(self.ylim)
        axes.set_xlabel(self.xlabel or "")
        axes.set_ylabel(self.ylabel or "")
        axes.set_xscale(self.xscale)
        axes.set_yscale(self.yscale)
        axes.legend()

    def _show(self) -> None:
        if _notebook_shell() is not None:
            from IPython import display  # present: the kernel runs on it

            buffer = io.BytesIO()
            self.fig.savefig(buffer, format="png")
            display.display(display.Image(data=buffer.getvalue()))
            display.clear_output(wait=True)  # the next picture replaces this one
        elif self.path is not None:
            figures.save_figure(self.fig, self.path)


class Module(nn.Module, HyperParameters):
    """Base of d2l 1.0's models: an ``nn.Module`` that knows its loss, its optimiser and
    how to plot its progress on ``self.board`` while a :class:`Trainer` fits it.

    Subclasses define ``forward`` (or ``self.net``), ``loss`` and
    ``configure_optimizers`` (default: SGD at ``self.lr``). ``plot_train_per_epoch`` and
    ``plot_valid_per_epoch`` set how many points per epoch the training and validation
    losses get.
    """

    def __init__(self, plot_train_per_epoch: int = 2, plot_valid_per_epoch: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.board = ProgressBoard()

    def loss(self, y_hat: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, X: Tensor) -> Any:
        if not hasattr(self, "net"):
            raise NotImplementedError(
                f"{type(self).__name__} has no self.net: set one or override forward")
        return self.net(X)

    def plot(self, key: str, value: Any, train: bool) -> None:
        """Add ``value`` to the line ``train_<key>`` or ``val_<key>`` of the board, at
        x = epochs done so far (fractional for training batches)."""
        if not hasattr(self, "trainer"):
            raise RuntimeError(
                f"{type(self).__name__}.plot needs a Trainer: call trainer.fit(model, data)")
        trainer = self.trainer
        self.board.xlabel = "epoch"
        if train:
            x = trainer.train_batch_idx / trainer.num_train_batches
            n = trainer.num_train_batches / self.plot_train_per_epoch
        else:
            x = trainer.epoch + 1
            n = trainer.num_val_batches / self.plot_valid_per_epoch
        value = value.detach().to("cpu") if isinstance(value, Tensor) else value
        self.board.draw(x, float(value), ("train_" if train else "val_") + key,
                        every_n=max(1, int(n)))

    def training_step(self, batch: Sequence[Tensor]) -> Tensor:
        """``loss(self(*batch[:-1]), batch[-1])``, plotted, returned for backward."""
        loss = self.loss(self(*batch[:-1]), batch[-1])
        self.plot("loss", loss, train=True)
        return loss

    def validation_step(self, batch: Sequence[Tensor]) -> None:
        loss = self.loss(self(*batch[:-1]), batch[-1])
        self.plot("loss", loss, train=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def apply_init(self, inputs: Sequence[Any], init: Callable[[nn.Module], None] | None = None,
                   ) -> None:
        """Run ``forward(*inputs)`` once (sizing lazy layers), then ``self.net.apply(init)``."""
        self.forward(*inputs)
        if init is not None:
            self.net.apply(init)


class DataModule(HyperParameters):
    """Base of d2l 1.0's data sets: ``train_dataloader()`` and ``val_dataloader()`` are
    ``get_dataloader(train=True / False)``, which subclasses define."""

    def __init__(self, root: str = "../data", num_workers: int = 4) -> None:
        self.save_hyperparameters()

    def get_dataloader(self, train: bool) -> DataLoader:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return self.get_dataloader(train=True)

    def val_dataloader(self) -> DataLoader:
        return self.get_dataloader(train=False)

    def get_tensorloader(self, tensors: Sequence[Tensor], train: bool,
                         indices: slice | Tensor = slice(0, None)) -> DataLoader:
        """Batches of ``self.batch_size`` rows ``indices`` of every tensor (same first
        dimension), shuffled when ``train``: the batches of ``DataLoader(..., shuffle=train)``."""
        check_positive_int("batch_size", self.batch_size)
        dataset = TensorDataset(*(t[indices] for t in tensors))
        return batch_loader(dataset, self.batch_size, shuffle=train)


class Trainer(HyperParameters):
    """Fits a :class:`Module` to a :class:`DataModule`: ``Trainer(max_epochs, num_gpus=0,
    gradient_clip_val=0).fit(model, data)``.

    Each epoch runs ``model.training_step`` on every training batch (then backward, the
    gradients clipped to global norm ``gradient_clip_val`` when it is > 0, an optimiser
    step) and ``model.validation_step`` on every validation batch in eval mode, without
    gradients. The model and batches go to the first of ``min(num_gpus, available)`` CUDA
    devices, or stay where they are when that is none.
    """

    def __init__(self, max_epochs: int, num_gpus: int = 0, gradient_clip_val: float = 0) -> None:
        check_positive_int("max_epochs", max_epochs)
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 0:
            raise ValueError(f"num_gpus must be an integer >= 0, got {num_gpus!r}")
        self.save_hyperparameters()
        self.gpus = [torch.device(f"cuda:{i}")
                     for i in range(min(num_gpus, torch.cuda.device_count()))]

    def prepare_data(self, data: DataModule) -> None:
        self.train_dataloader = data.train_dataloader()
        self.val_dataloader = data.val_dataloader()
        self.num_train_batches = len(self.train_dataloader)
        self.num_val_batches = (len(self.val_dataloader)
                                if self.val_dataloader is not None else 0)

    def prepare_model(self, model: Module) -> None:
        model.trainer = self
        model.board.xlim = [0, self.max_epochs]
        if self.gpus:
            model.to(self.gpus[0])
        self.model = model

    def prepare_batch(self, batch: Sequence[Tensor]) -> Sequence[Tensor]:
        if self.gpus:
            batch = [a.to(self.gpus[0]) for a in batch]
        return batch

    def fit(self, model: Module, data: DataModule) -> None:
        self.prepare_data(data)
        self.prepare_model(model)
        self.optim = model.configure_optimizers()
        self.epoch = 0
        self.train_batch_idx = 0
        self.val_batch_idx = 0
        for epoch in range(self.max_epochs):
            self.epoch = epoch
            self.fit_epoch()

    def fit_epoch(self) -> None:
        self.model.train()
        for batch in self.train_dataloader:
            loss = self.model.training_step(self.prepare_batch(batch))
            self.optim.zero_grad()
            loss.backward()
            if self.gradient_clip_val > 0:
                self.clip_gradients(self.gradient_clip_val, self.model)
            self.optim.step()
            self.train_batch_idx += 1
        if self.val_dataloader is None:
            return
        self.model.eval()
        for batch in self.val_dataloader:
            with torch.no_grad():
                self.model.validation_step(self.prepare_batch(batch))
            self.val_batch_idx += 1

    def clip_gradients(self, grad_clip_val: float, model: nn.Module) -> None:
        """Scale ``model``'s gradients to global L2 norm ``grad_clip_val`` if above it."""
        grad_clipping(model, grad_clip_val)


class Classifier(Module):
    """A :class:`Module` whose loss is the cross-entropy over the last axis of
    ``Y_hat (..., num_classes)`` against ``Y (...)`` and whose validation also plots
    the accuracy."""

    def validation_step(self, batch: Sequence[Tensor]) -> None:
        Y_hat = self(*batch[:-1])
        self.plot("loss", self.loss(Y_hat, batch[-1]), train=False)
        self.plot("acc", self.accuracy(Y_hat, batch[-1]), train=False)

    def accuracy(self, Y_hat: Tensor, Y: Tensor, averaged: bool = True) -> Tensor:
        """Fraction of argmax predictions equal to ``Y`` (or the 0/1 per item)."""
        preds = Y_hat.reshape(-1, Y_hat.shape[-1]).argmax(dim=1).type(Y.dtype)
        compare = (preds == Y.reshape(-1)).type(torch.float32)
        return compare.mean() if averaged else compare

    def loss(self, Y_hat: Tensor, Y: Tensor, averaged: bool = True) -> Tensor:
        """Cross-entropy, the mean over all items or one per item (flattened)."""
        return F.cross_entropy(Y_hat.reshape(-1, Y_hat.shape[-1]), Y.reshape(-1),
                               reduction="mean" if averaged else "none")

    def layer_summary(self, X_shape: Sequence[int]) -> None:
        """Print each layer of ``self.net`` with its output shape for a random input."""
        X = torch.randn(*X_shape)
        for layer in self.net:
            X = layer(X)
            print(layer.__class__.__name__, "output shape:\t", X.shape)


class RNN(Module):
    """One-layer ``nn.RNN(num_inputs, num_hiddens)``: ``forward(inputs (steps, batch,
    num_inputs), H=None) -> (outputs (steps, batch, num_hiddens), H (1, batch, num_hiddens))``."""

    def __init__(self, num_inputs: int, num_hiddens: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.rnn = nn.RNN(num_inputs, num_hiddens)

    def forward(self, inputs: Tensor, H: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.rnn(inputs, H)


class GRU(RNN):
    """``nn.GRU(num_inputs, num_hiddens, num_layers, dropout=dropout)`` as a
    :class:`Module`: ``forward(inputs (steps, batch, num_inputs), H=None) -> (outputs
    (steps, batch, num_hiddens), H (num_layers, batch, num_hiddens))``."""

    def __init__(self, num_inputs: int, num_hiddens: int, num_layers: int,
                 dropout: float = 0) -> None:
        Module.__init__(self)  # not RNN's: no nn.RNN to build
        self.save_hyperparameters()
        self.rnn = nn.GRU(num_inputs, num_hiddens, num_layers, dropout=dropout)


def init_seq2seq(module: nn.Module) -> None:
    """Xavier-uniform init of ``module``'s own weights when it is exactly an
    ``nn.Linear`` (its weight) or an ``nn.GRU`` (every weight matrix); anything else,
    lazy layers included, is left alone. Not recursive: use ``model.apply(init_seq2seq)``.
    """
    if type(module) is nn.Linear:
        nn.init.xavier_uniform_(module.weight)
    elif type(module) is nn.GRU:
        for name, param in module.named_parameters(recurse=False):
            if "weight" in name:
                nn.init.xavier_uniform_(param)


class Seq2SeqEncoder(bahdanau.Seq2SeqEncoder):
    """d2l 1.0.3's GRU encoder: ``Seq2SeqEncoder(vocab_size, embed_size, num_hiddens,
    num_layers, dropout=0)``, its weights drawn by :func:`init_seq2seq` when it is built.

    ``X (batch, num_steps)`` int ``-> (outputs (num_steps, batch, num_hiddens),
    state (num_layers, batch, num_hiddens))``, time-major; extra arguments (the valid
    lengths) are accepted and ignored. The GRU runs through ``nn.GRU``'s own forward
    (``backend="eager"``), so dropout between layers draws the random numbers d2l's does.
    ``qkv.d2l.Seq2SeqEncoder`` is d2l-zh's, which leaves the drawing to ``train_seq2seq``.
    """

    # Whether __init__ draws Xavier weights (1.0.3) or leaves PyTorch's (d2l-zh).
    init_when_built = True

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        num_hiddens: int,
        num_layers: int,
        dropout: float = 0,
    ) -> None:
        super().__init__(vocab_size, embed_size, num_hiddens, num_layers, dropout,
                         backend="eager")
        if self.init_when_built:
            self.apply(init_seq2seq)

    def forward(self, X: Tensor, *args: Any) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        # Embedded, then made time-major, as d2l does it: the parent transposes the ids
        # instead, which sums the embedding's gradient in another order, and the books'
        # printed numbers drift from there in the last bits.
        return self.rnn(self.embedding(X.long()).permute(1, 0, 2))


def grad_clipping(net: nn.Module | Any, theta: float) -> None:
    """Scale all gradients by ``theta / norm`` when their global L2 norm exceeds ``theta``.

    ``net`` is a module (its trainable parameters) or an object with a ``params`` list.
    """
    params = (
        [p for p in net.parameters() if p.requires_grad]
        if isinstance(net, nn.Module)
        else list(net.params)
    )
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    norm = torch.sqrt(sum(torch.sum(g**2) for g in grads))
    if norm > theta:
        for g in grads:
            g.mul_(theta / norm)


def bleu(pred_seq: str, label_seq: str, k: int) -> float:
    """d2l's sentence BLEU of ``pred_seq`` against ``label_seq``, tokens split on ``" "``.

    ``exp(min(0, 1 - len_label / len_pred)) * prod_{n=1..min(k, len_pred)} p_n ** (1/2**n)``
    with ``p_n`` the clipped n-gram precision: each label n-gram matches at most as often
    as it occurs. Unlike :func:`qkv.training.metrics.bleu`, a prediction shorter than
    ``k`` tokens is scored on the n-grams it has, as d2l scores it.
    """
    check_positive_int("k", k)
    pred_tokens, label_tokens = pred_seq.split(" "), label_seq.split(" ")
    len_pred, len_label = len(pred_tokens), len(label_tokens)
    score = math.exp(min(0.0, 1 - len_label / len_pred))
    for n in range(1, min(k, len_pred) + 1):
        label_grams = collections.Counter(
            tuple(label_tokens[i:i + n]) for i in range(len_label - n + 1))
        pred_grams = collections.Counter(
            tuple(pred_tokens[i:i + n]) for i in range(len_pred - n + 1))
        matches = sum(min(count, label_grams[gram]) for gram, count in pred_grams.items())
        score *= math.pow(matches / (len_pred - n + 1), math.pow(0.5, n))
    return score
