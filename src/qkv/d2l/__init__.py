"""Dive into Deep Learning's API under its own names: ``from qkv import d2l``.

A script written against ``from d2l import torch as d2l`` for the attention chapter and
the Bahdanau seq2seq translator runs with that one line replaced. Each name has d2l's
signature, return shapes and conventions, and is a thin front on qkv's own code where
qkv has it (vocabulary, padding, BLEU, the GRU encoder, the attention modules, the
sinusoidal positional encoding); the d2l-zh Transformer section trains and translates
with its ``train_seq2seq`` and ``predict_seq2seq``.

Where qkv departs from d2l on purpose, the names here follow d2l:

- ``masked_softmax``, the two scoring modules and ``MultiHeadAttention`` give a query
  whose valid length is 0 *uniform* weights over all keys (qkv's kernels give zeros);
- ``MaskedSoftmaxCELoss`` averages each sequence's masked loss over all ``num_steps``
  positions (qkv's averages over the valid tokens);
- ``tokenize_nmt(text, num_examples)`` reads lines ``0 .. num_examples`` inclusive,
  i.e. one pair more than asked, as d2l's loop does; ``build_array_nmt``'s valid
  lengths count the non-``<pad>`` ids;
- ``EncoderDecoder.forward`` returns the decoder's output only (d2l 1.0.3); callers that
  unpack ``Y_hat, state`` get both from ``decoder(...)`` directly.

d2l 1.0's object-oriented framework, which the English edition is written in, is here
too: ``HyperParameters``, ``add_to_class``, ``ProgressBoard``, ``Module``,
``DataModule``, ``Trainer``, ``Classifier``, ``RNN``, ``GRU``, ``init_seq2seq`` (all
from :mod:`qkv.d2l.v2`, which says where it departs from 1.0.3), and on it
``EncoderDecoder`` (a ``Classifier``, with ``predict_step``), ``Seq2Seq`` and
``MTFraEng``. The Chinese edition's ``EncoderDecoder`` + ``train_seq2seq`` and the
English ``Seq2Seq`` + ``Trainer`` run on the same classes, so there is no separate
import for either, with one exception: ``Seq2SeqEncoder``. Both editions build it with
the same arguments, but d2l 1.0.3 draws its Xavier weights when it is built and d2l-zh
when ``train_seq2seq`` starts, and every random number after that depends on which. Here
it is d2l-zh's; ``qkv.d2l.v2.Seq2SeqEncoder`` is 1.0.3's (a run of the English chapter
follows the book's random stream with ``d2l.Seq2SeqEncoder = d2l.v2.Seq2SeqEncoder``,
and trains to the same kind of result without it). ``Seq2Seq``'s loss averages over
every label token, the padding too, as the 1.0.3 package does; the book's seq2seq
section replaces it with a masked one by ``add_to_class``, which works here as there.

Same seeds, same numbers: where the books draw random numbers (weights, shuffling,
dropout), the classes here draw the same ones in the same order, and
``MultiHeadAttention`` computes in d2l's order of operations (its ``backend``), so the
chapters' training cells print the books' losses and translations.

Where it departs from d2l:

- ``read_data_nmt`` (and so ``MTFraEng``) reads the file named by ``$QKV_FRA_ENG`` when
  that is set; otherwise, while ``download`` and ``download_extract`` are this module's
  own, it takes the corpus from qkv's SHA-1-verified cache (``$QKV_CACHE`` or
  ``~/.cache/qkv``) instead of d2l's ``../data``. Once a script replaces either
  (``d2l.download = my_download``), it goes through them as d2l does:
  ``download_extract('fra-eng')`` calling ``download``, both looked up at call time;
- ``download_extract`` refuses archive members whose path would leave the extraction
  folder, and ``download`` never leaves a partial or unverified file behind;
- ``MultiHeadAttention`` also keeps its weights in ``attention_weights`` as ``(batch,
  num_heads, n_q, n_k)``, next to d2l's folded ``attention.attention_weights``, and
  takes keyword-only ``query_size``, ``key_size``, ``value_size`` that size d2l 1.0.3's
  lazy projections when built.

Versions: the attention and Transformer classes (:mod:`qkv.d2l.attention`,
:mod:`qkv.d2l.transformer`) take both books' forms and tell them apart by signature:
d2l 1.0.3's (``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)``,
``AdditiveAttention(num_hiddens, dropout)``, ``PositionWiseFFN(ffn_num_hiddens,
ffn_num_outputs)``, ``TransformerEncoder(vocab_size, num_hiddens, ...)``), whose layers
are ``nn.LazyLinear`` sized by the first call as in 1.0.3, and d2l-zh 2.0's (d2l 0.17's)
``MultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads, dropout,
bias=False)``, ``AdditiveAttention(key_size, query_size, num_hiddens, dropout)``,
``EncoderBlock``, ``DecoderBlock`` and the encoder and decoder with ``key_size, ...,
norm_shape, ffn_num_input`` widths. Elsewhere, 1.0.3's forms where the versions differ
and 1.0.3 has the name (``download(url, folder, sha1_hash)``, ``EncoderDecoder``); the
d2l 0.17/2.0 functions the translator chapters use (``load_data_nmt``,
``train_seq2seq``, ``predict_seq2seq``) otherwise. As in d2l, ``train_seq2seq``
Xavier-initialises exact ``nn.Linear``/``nn.GRU`` modules only, so lazy layers not yet
sized keep PyTorch's init.

``Vocab`` numbers its tokens as d2l 1.0.3 does: ``idx_to_token`` is the sorted set of
``<unk>``, the reserved tokens and the tokens kept by ``min_freq``, so ``<unk>`` is not
always id 0; ``vocab.unk`` is its id, and the functions here look ``<pad>``, ``<bos>``,
``<eos>`` up by name. ``Vocab.by_frequency`` numbers them as d2l-zh does (``<unk>`` at
0, then the reserved tokens, then by frequency), and ``load_data_nmt``, d2l-zh's
function, builds its vocabularies so. Unlike ``qkv.data.translate.Vocab``, a reserved
``<unk>`` or a token reserved twice is accepted and gets one id, as in 1.0.3.

Tensors: d2l's framework-neutral names (``d2l.reshape``, ``ones``, ``concat``,
``normal``, ``check_shape``, ...) are in :mod:`qkv.d2l.tensors`, re-exported here.

Plots: ``plt`` is matplotlib's pyplot. ``plot``, ``set_axes``, ``set_figsize`` and
``show_heatmaps`` (:mod:`qkv.d2l.plotting`) draw on pyplot figures as d2l's do;
``train_seq2seq`` draws its loss curve on a figure without showing it, so a later
``plt.show()`` displays it on a desktop; with a non-interactive backend (Agg, which
matplotlib picks when there is no display) it saves the curve to ``seq2seq_loss.png``
in the working directory instead, and the plotting helpers save theirs by the same rule
(see :mod:`qkv.d2l.plotting`). ``Trainer.fit`` draws on its model's ``ProgressBoard``,
which shows each redraw in a Jupyter cell and elsewhere writes it to ``progress.png`` in
the working directory. Nothing here blocks.
"""

from __future__ import annotations

import collections
import hashlib
import os
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib import pyplot as plt
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from ..checks import check_positive_int
from ..data import translate
from ..data.loading import batch_loader
from ..functional import masked_softmax
from ..models import seq2seq
from ..positional import PositionalEncoding
from ..training.losses import valid_mask
from . import encoder_decoder, tensors, transformer, v2
from .attention import (
    AdditiveAttention,
    DotProductAttention,
    MultiHeadAttention,
    transpose_output,
    transpose_qkv,
)

# Whole modules of d2l's names, re-exported: their __all__ is part of this one's.
from .encoder_decoder import *  # noqa: F403
from .plotting import plot, save_if_headless, set_axes, set_figsize, show_heatmaps, use_svg_display
from .transformer import *  # noqa: F403
from .v2 import *  # noqa: F403

__all__ = [
    # attention
    "masked_softmax",
    "DotProductAttention",
    "AdditiveAttention",
    "MultiHeadAttention",
    "transpose_qkv",
    "transpose_output",
    "PositionalEncoding",
    # encoder-decoder (with the bases of qkv.d2l.encoder_decoder; Seq2SeqEncoder: below)
    "Seq2Seq",
    # data
    "DATA_HUB",
    "DATA_URL",
    "download",
    "download_extract",
    "read_data_nmt",
    "preprocess_nmt",
    "tokenize_nmt",
    "Vocab",
    "truncate_pad",
    "build_array_nmt",
    "load_data_nmt",
    "load_array",
    "MTFraEng",
    # training and inference
    "sequence_mask",
    "MaskedSoftmaxCELoss",
    "train_seq2seq",
    "predict_seq2seq",
    # utilities
    "cpu",
    "gpu",
    "num_gpus",
    "try_gpu",
    "Timer",
    "Accumulator",
    "Animator",
    "plt",
    "use_svg_display",
    # plotting
    "plot",
    "set_axes",
    "set_figsize",
    "show_heatmaps",
    # tensors: d2l's names for torch's functions and tensor methods
    *tensors.__all__,
    *encoder_decoder.__all__,
    *transformer.__all__,
    *v2.__all__,
]

FRA_ENG_ENV = "QKV_FRA_ENG"


def __getattr__(name: str) -> Any:
    # d2l's tensor names (abs, size, to, numpy, tensor, ...) are looked up in .tensors
    # only when asked for as `d2l.<name>`: as globals here they would shadow builtins
    # and everyday words in this module's own code.
    if name in tensors.__all__:
        return getattr(tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *tensors.__all__})


# ----------------------------------------------------------------------------
# The 1.0 sequence-to-sequence model


class Seq2Seq(encoder_decoder.EncoderDecoder):
    """d2l 1.0's sequence-to-sequence model: ``Seq2Seq(encoder, decoder, tgt_pad, lr)``.

    Trained by a :class:`Trainer` on batches ``(src, dec_input, src_valid_len, label)``
    with Adam at ``lr``. The loss is :class:`Classifier`'s cross-entropy averaged over
    every label token, padding included, as in d2l 1.0.3's package, whose numbers the
    English chapter prints. The book's seq2seq section adds a loss that leaves ``tgt_pad``
    out (``@d2l.add_to_class(d2l.Seq2Seq) def loss``); run that cell and it replaces this
    one here as it does in d2l.
    """

    def __init__(self, encoder: nn.Module, decoder: nn.Module, tgt_pad: int, lr: float) -> None:
        super().__init__(encoder, decoder)
        self.save_hyperparameters()

    def validation_step(self, batch: Sequence[Tensor]) -> None:
        Y_hat = self(*batch[:-1])
        self.plot("loss", self.loss(Y_hat, batch[-1]), train=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Seq2SeqEncoder(v2.Seq2SeqEncoder, encoder_decoder.Encoder):
    """d2l-zh's GRU encoder: an embedding, then ``num_layers`` GRU layers.

    ``X (batch, num_steps)`` int ``-> (outputs (num_steps, batch, num_hiddens),
    state (num_layers, batch, num_hiddens))``, time-major as d2l returns them; extra
    arguments (the valid lengths) are accepted and ignored.

    The two editions build this class with the same signature but draw its first
    weights at different moments: d2l-zh leaves PyTorch's initialisation in place and
    :func:`train_seq2seq` draws Xavier weights for the whole model, while d2l 1.0.3 draws
    them when the encoder is built. Which one runs decides every random number after it,
    so this one is d2l-zh's, as the rest of ``qkv.d2l``'s ``train_seq2seq`` API is, and
    :class:`qkv.d2l.v2.Seq2SeqEncoder` is 1.0.3's.
    """

    init_when_built = False


# ----------------------------------------------------------------------------
# Data: download, the English-French corpus, vocabulary, batches

DATA_URL = "http://d2l-data.s3-accelerate.amazonaws.com/"
# name -> (url, sha1 of the file); download(name) looks names up here.
DATA_HUB: dict[str, tuple[str, str]] = {
    "fra-eng": (translate.FRA_ENG_URL, translate.FRA_ENG_SHA1),
}


def _sha1_matches(path: str, sha1_hash: str) -> bool:
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == sha1_hash.lower()


def download(url: str, folder: str = "../data", sha1_hash: str | None = None) -> str:
    """Download ``url`` into ``folder`` and return the local path.

    ``url`` may also be a ``DATA_HUB`` name, which gives both the URL and its SHA-1. A file
    already in ``folder`` whose SHA-1 matches is reused without touching the network. A
    downloaded file is checked against ``sha1_hash`` before it replaces anything, so a
    wrong or truncated answer never lands in the cache.

    Raises:
        KeyError: ``url`` is neither a URL nor a ``DATA_HUB`` name.
        qkv.data.translate.DownloadError: the SHA-1 of what arrived is not ``sha1_hash``.
        urllib.error.URLError: the network or the server failed.
    """
    if not url.startswith(("http://", "https://")):
        url, sha1_hash = DATA_HUB[url]
    os.makedirs(folder, exist_ok=True)
    fname = os.path.join(folder, url.split("/")[-1])
    if sha1_hash and os.path.isfile(fname) and _sha1_matches(fname, sha1_hash):
        return fname
    print(f"Downloading {fname} from {url}...")
    # Into a temporary file next to the target, renamed only once complete and verified.
    fd, tmp = tempfile.mkstemp(prefix=".download.", dir=folder)
    try:
        digest = hashlib.sha1()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
            while chunk := resp.read(1 << 16):
                digest.update(chunk)
                out.write(chunk)
        if sha1_hash and digest.hexdigest() != sha1_hash.lower():
            raise translate.DownloadError(
                f"SHA-1 mismatch for {url}: expected {sha1_hash.lower()}, "
                f"got {digest.hexdigest()}"
            )
        os.replace(tmp, fname)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return fname


def download_extract(name: str, folder: str | None = None) -> str:
    """Download the ``DATA_HUB`` archive ``name`` (``.zip``, ``.tar`` or ``.gz``) with
    :func:`download` (looked up at call time, so a replaced ``d2l.download`` is used) and
    extract it next to itself.

    Returns ``base_dir/folder`` when ``folder`` is given, else the archive's path without
    its extension (``../data/fra-eng`` for ``fra-eng.zip``). Members whose path would
    leave the extraction folder are refused.
    """
    fname = download(name)
    base_dir = os.path.dirname(fname)
    data_dir, ext = os.path.splitext(fname)
    if ext == ".zip":
        with zipfile.ZipFile(fname) as zf:
            _check_members(zf.namelist(), fname)
            zf.extractall(base_dir)
    elif ext in (".tar", ".gz"):
        with tarfile.open(fname) as tf:
            _check_members(tf.getnames(), fname)
            tf.extractall(base_dir)
    else:
        raise ValueError(f"only zip and tar archives can be extracted, got {fname}")
    return os.path.join(base_dir, folder) if folder else data_dir


# The module's own functions, kept so read_data_nmt can tell when a user replaced them.
_DOWNLOAD = download
_DOWNLOAD_EXTRACT = download_extract


def _check_members(names: Iterable[str], archive: str) -> None:
    for name in names:
        parts = Path(name.replace("\\", "/")).parts
        if name.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
            raise translate.DownloadError(f"refusing to extract {name!r} from {archive}")


def read_data_nmt() -> str:
    """The raw English-French text: ``"Go.\\tVa !\\n..."``, one tab-separated pair a line.

    Where it comes from, first match wins:

    1. the file named by the environment variable ``QKV_FRA_ENG`` (nothing downloaded);
    2. when ``d2l.download`` or ``d2l.download_extract`` has been replaced (a script
       redirecting d2l's data folder does this), d2l's own path:
       ``download_extract('fra-eng')``, which calls ``download('fra-eng')``, both looked
       up at call time, then ``fra.txt`` in the folder it returns;
    3. otherwise the Tatoeba fra-eng corpus through
       :func:`qkv.data.translate.download_fra_eng` (fetched once, SHA-1 verified, cached
       under ``$QKV_CACHE`` or ``~/.cache/qkv`` rather than d2l's ``../data``).

    :func:`load_data_nmt` calls this name at run time, so assigning
    ``d2l.read_data_nmt = my_reader`` also replaces the corpus.
    """
    local = os.environ.get(FRA_ENG_ENV)
    if local:
        return translate.load_corpus(Path(local).expanduser())
    if download is not _DOWNLOAD or download_extract is not _DOWNLOAD_EXTRACT:
        return translate.load_corpus(Path(download_extract("fra-eng")) / "fra.txt")
    return translate.load_corpus(translate.download_fra_eng())


def preprocess_nmt(text: str) -> str:
    """Lower-case, turn no-break spaces into spaces and put a space before ``, . ! ?``."""
    return translate.preprocess(text)


def tokenize_nmt(
    text: str, num_examples: int | None = None
) -> tuple[list[list[str]], list[list[str]]]:
    """Split ``source<TAB>target`` lines into token lists (split on single spaces).

    Lines with exactly two columns count; with ``num_examples``, lines ``0`` to
    ``num_examples`` inclusive are read, as in d2l, so at most ``num_examples + 1``
    pairs come back.
    """
    source: list[list[str]] = []
    target: list[list[str]] = []
    for i, line in enumerate(text.split("\n")):
        if num_examples and i > num_examples:
            break
        parts = line.split("\t")
        if len(parts) == 2:
            source.append(parts[0].split(" "))
            target.append(parts[1].split(" "))
    return source, target


class Vocab(translate.Vocab):
    """d2l's vocabulary: ``Vocab(tokens=None, min_freq=0, reserved_tokens=None)``.

    ``tokens`` is a list of string tokens, or a list of token *lists* (flattened when its
    first item is a list, as d2l checks it). As in d2l 1.0.3, ``idx_to_token`` is the
    sorted (code-point order) set of ``<unk>``, ``reserved_tokens`` and every token seen
    at least ``min_freq`` times, so ``<unk>`` need not be id 0 and special tokens are
    looked up by name (``vocab["<pad>"]``). ``vocab[token]`` gives an id (unknown:
    ``vocab.unk``, the id of ``<unk>``), and a list or tuple gives a list of ids;
    ``vocab.to_tokens(ids)`` goes back; ``token_freqs`` lists every token with its count,
    most frequent first, ties in first-seen order.

    Raises:
        TypeError: a token that cannot be sorted with strings (d2l 1.0.3's ``sorted``
            fails there too).
    """

    def __init__(
        self,
        tokens: Sequence[Any] | None = None,
        min_freq: int = 0,
        reserved_tokens: Sequence[str] | None = None,
    ) -> None:
        tokens = [] if tokens is None else tokens
        if len(tokens) and isinstance(tokens[0], list):
            tokens = [token for line in tokens for token in line]
        # Counter keeps first-seen order and sorted() is stable: ties stay in that order.
        token_freqs = sorted(collections.Counter(tokens).items(), key=lambda kv: kv[1],
                             reverse=True)
        # d2l 1.0.3: a set, so a reserved "<unk>" or a token given twice gets one id.
        kept = {"<unk>", *(reserved_tokens or []),
                *(token for token, freq in token_freqs if freq >= min_freq)}
        try:
            idx_to_token = sorted(kept)
        except TypeError as e:
            raise TypeError("d2l.Vocab sorts its tokens (d2l 1.0.3's order), so they must "
                            f"be strings: {e}") from None
        # The parent's __init__ (which puts <unk> at 0) is not called: _set is all it needs.
        self._set(idx_to_token, token_freqs)

    @classmethod
    def by_frequency(
        cls,
        tokens: Sequence[Any] | None = None,
        min_freq: int = 0,
        reserved_tokens: Sequence[str] | None = None,
    ) -> Vocab:
        """d2l-zh 2.0's order instead of 1.0.3's: ``<unk>`` (id 0), ``reserved_tokens``,
        then the tokens seen at least ``min_freq`` times, most frequent first (ties in
        first-seen order). ``load_data_nmt`` builds its vocabularies so, as d2l-zh does.

        Raises:
            ValueError: ``reserved_tokens`` holding ``<unk>`` or a token twice.
        """
        tokens = [] if tokens is None else tokens
        by_count = translate.Vocab(tokens, min_freq, list(reserved_tokens or []))
        return cls.from_dict(by_count.to_dict())

    @property
    def unk(self) -> int:
        """Id of ``<unk>`` (where sorting put it; not always 0)."""
        return self.token_to_idx["<unk>"]

    @classmethod
    def from_dict(cls, d: Any) -> Vocab:
        """Rebuild from :meth:`to_dict` output, ids as they were (``<unk>`` anywhere).

        Raises:
            ValueError: as ``qkv.data.translate.Vocab.from_dict``, except that ``<unk>``
                may be at any index (but must be there, once).
        """
        idx_to_token = d.get("idx_to_token") if isinstance(d, Mapping) else d
        if not isinstance(idx_to_token, list) or idx_to_token.count("<unk>") != 1:
            raise ValueError("vocabulary 'idx_to_token' must be a list holding '<unk>' once")
        # The parent checks everything else with <unk> moved to the front.
        moved = ["<unk>", *(tok for tok in idx_to_token if tok != "<unk>")]
        parent = translate.Vocab.from_dict(
            {**d, "idx_to_token": moved} if isinstance(d, Mapping) else moved)
        vocab = cls()
        vocab._set(list(idx_to_token), parent.token_freqs)
        return vocab

    def __getitem__(self, tokens: Any) -> Any:
        """The id of one token, or a list of ids for a list or tuple of tokens."""
        if not isinstance(tokens, (list, tuple)):
            return self.token_to_idx.get(tokens, self.unk)
        return [self[token] for token in tokens]

    def to_tokens(self, indices: Any) -> Any:
        """The token at one id (Python indexing: ``-1`` is the last), or a list of tokens
        for a list, tuple, tensor or array of ids."""
        if hasattr(indices, "tolist"):  # tensors and numpy arrays (and their scalars)
            indices = indices.tolist()
        if isinstance(indices, (list, tuple)):
            return [self.to_tokens(i) for i in indices]
        return self.idx_to_token[indices]


def truncate_pad(line: list[int], num_steps: int, padding_token: int) -> list[int]:
    """Cut ``line`` to ``num_steps`` items or pad it on the right with ``padding_token``."""
    return translate.truncate_pad(line, num_steps, padding_token)


def build_array_nmt(
    lines: list[list[str]], vocab: Vocab, num_steps: int
) -> tuple[Tensor, Tensor]:
    """Token lists -> ``(array (n, num_steps), valid_len (n,))``, both int64.

    Each line gets ``<eos>``, is mapped to ids and is truncated or padded with ``<pad>``;
    ``valid_len`` counts the ids that are not ``<pad>``, as d2l counts them.
    """
    array, _ = translate.build_array(lines, vocab, num_steps)
    valid_len = (array != vocab["<pad>"]).sum(1)
    return array, valid_len


def load_array(
    data_arrays: Sequence[Tensor], batch_size: int, is_train: bool = True
) -> DataLoader:
    """Batches of the tensors in ``data_arrays`` (same first dimension), shuffled when
    ``is_train``."""
    return batch_loader(TensorDataset(*data_arrays), batch_size, shuffle=is_train)


def load_data_nmt(
    batch_size: int, num_steps: int, num_examples: int = 600
) -> tuple[DataLoader, Vocab, Vocab]:
    """``(train_iter, src_vocab, tgt_vocab)`` for the first pairs of :func:`read_data_nmt`.

    Vocabularies keep tokens seen at least twice, with ``<pad>``, ``<bos>``, ``<eos>``
    reserved, in d2l-zh's order (:meth:`Vocab.by_frequency`: ``<unk>`` is 0, ``<pad>``
    1). Batches are ``(X, X_valid_len, Y, Y_valid_len)``: ``X, Y (batch_size,
    num_steps)`` int64 ids, valid lengths ``(batch_size,)`` int64, shuffled.
    """
    text = preprocess_nmt(read_data_nmt())
    source, target = tokenize_nmt(text, num_examples)
    reserved = ["<pad>", "<bos>", "<eos>"]
    src_vocab = Vocab.by_frequency(source, min_freq=2, reserved_tokens=reserved)
    tgt_vocab = Vocab.by_frequency(target, min_freq=2, reserved_tokens=reserved)
    src_array, src_valid_len = build_array_nmt(source, src_vocab, num_steps)
    tgt_array, tgt_valid_len = build_array_nmt(target, tgt_vocab, num_steps)
    data_iter = load_array((src_array, src_valid_len, tgt_array, tgt_valid_len), batch_size)
    return data_iter, src_vocab, tgt_vocab


class MTFraEng(v2.DataModule):
    """d2l 1.0's English-French data: ``MTFraEng(batch_size, num_steps=9, num_train=512,
    num_val=128)``.

    The first ``num_train + num_val + 1`` lines of :func:`read_data_nmt`'s text (so
    ``$QKV_FRA_ENG``, a replaced ``download``, or qkv's cache, as there; not d2l's
    ``root``), each side tokenized with ``<eos>``, cut or padded with ``<pad>`` to
    ``num_steps`` tokens, the target prefixed with ``<bos>``. ``src_vocab`` and
    ``tgt_vocab`` keep the tokens seen at least twice (the special ones among them).

    ``arrays`` is ``(src (n, num_steps), dec_input (n, num_steps), src_valid_len (n,),
    label (n, num_steps))``, int64: ``dec_input`` is the target without its last
    token, ``label`` without its ``<bos>``, ``src_valid_len`` counts the non-``<pad>``
    source tokens. Rows ``:num_train`` are for training (shuffled batches), the rest for
    validation; ``build(src_sentences, tgt_sentences)`` makes the same arrays for new
    sentences with these vocabularies.
    """

    def __init__(self, batch_size: int, num_steps: int = 9, num_train: int = 512,
                 num_val: int = 128) -> None:
        for name, value in (("batch_size", batch_size), ("num_steps", num_steps),
                            ("num_train", num_train)):
            check_positive_int(name, value)
        if isinstance(num_val, bool) or not isinstance(num_val, int) or num_val < 0:
            raise ValueError(f"num_val must be an integer >= 0, got {num_val!r}")
        super().__init__()
        self.save_hyperparameters()
        self.arrays, self.src_vocab, self.tgt_vocab = self._build_arrays(self._download())

    def _download(self) -> str:
        return read_data_nmt()

    def _preprocess(self, text: str) -> str:
        return preprocess_nmt(text)

    def _tokenize(
        self, text: str, max_examples: int | None = None
    ) -> tuple[list[list[str]], list[list[str]]]:
        """``(src, tgt)`` token lists, each ending in ``<eos>``, of the tab-separated
        pairs among lines ``0 .. max_examples`` (inclusive, as d2l counts; all lines when
        ``max_examples`` is None or 0). Lines that are not one pair are skipped."""
        src, tgt = [], []
        for i, line in enumerate(text.split("\n")):
            if max_examples and i > max_examples:
                break
            parts = line.split("\t")
            if len(parts) == 2:
                src.append([t for t in f"{parts[0]} <eos>".split(" ") if t])
                tgt.append([t for t in f"{parts[1]} <eos>".split(" ") if t])
        return src, tgt

    def _build_arrays(
        self, raw_text: str, src_vocab: Vocab | None = None, tgt_vocab: Vocab | None = None
    ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Vocab, Vocab]:
        """``(arrays, src_vocab, tgt_vocab)`` of ``raw_text`` (see the class); new
        vocabularies unless given."""

        def build(sentences: list[list[str]], vocab: Vocab | None, is_tgt: bool = False,
                  ) -> tuple[Tensor, Vocab, Tensor]:
            t = self.num_steps
            sentences = [s[:t] + ["<pad>"] * (t - len(s)) for s in sentences]
            if is_tgt:
                sentences = [["<bos>", *s] for s in sentences]
            if vocab is None:
                vocab = Vocab(sentences, min_freq=2)
            array = torch.tensor([vocab[s] for s in sentences], dtype=torch.long)
            array = array.reshape(len(sentences), t + is_tgt)  # (0, t) when no pairs
            return array, vocab, (array != vocab["<pad>"]).sum(dim=1)

        src, tgt = self._tokenize(self._preprocess(raw_text), self.num_train + self.num_val)
        src_array, src_vocab, src_valid_len = build(src, src_vocab)
        tgt_array, tgt_vocab, _ = build(tgt, tgt_vocab, is_tgt=True)
        arrays = (src_array, tgt_array[:, :-1], src_valid_len, tgt_array[:, 1:])
        return arrays, src_vocab, tgt_vocab

    def get_dataloader(self, train: bool) -> DataLoader:
        idx = slice(0, self.num_train) if train else slice(self.num_train, None)
        return self.get_tensorloader(self.arrays, train, idx)

    def build(
        self, src_sentences: Sequence[str], tgt_sentences: Sequence[str]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The ``arrays`` of these sentence pairs (preprocessed and tokenized as the
        corpus), with this data set's vocabularies; unknown tokens become ``<unk>``."""
        if len(src_sentences) != len(tgt_sentences):
            raise ValueError(f"build needs one target per source sentence, got "
                             f"{len(src_sentences)} and {len(tgt_sentences)}")
        pairs = zip(src_sentences, tgt_sentences, strict=True)
        raw_text = "\n".join(f"{src}\t{tgt}" for src, tgt in pairs)
        arrays, _, _ = self._build_arrays(raw_text, self.src_vocab, self.tgt_vocab)
        return arrays


# ----------------------------------------------------------------------------
# Training and inference


def sequence_mask(X: Tensor, valid_len: Tensor, value: float = 0) -> Tensor:
    """Set ``X[b, t:]`` to ``value`` for every ``t >= valid_len[b]``, *in place*; return X.

    ``X (batch, num_steps, ...)``, ``valid_len (batch,)``.
    """
    X[~valid_mask(valid_len.to(X.device), X.shape[1])] = value
    return X


class MaskedSoftmaxCELoss(nn.CrossEntropyLoss):
    """``loss(pred, label, valid_len) -> (batch,)``, d2l's masked cross-entropy.

    ``pred (batch, num_steps, vocab)``, ``label (batch, num_steps)``, ``valid_len
    (batch,)``. Each sequence's loss is the sum over its valid positions divided by
    ``num_steps`` (padding counts in the denominator, as in d2l).
    """

    def __init__(self) -> None:
        super().__init__(reduction="none")

    def forward(self, pred: Tensor, label: Tensor, valid_len: Tensor) -> Tensor:  # type: ignore[override]
        weights = sequence_mask(torch.ones_like(label, dtype=pred.dtype), valid_len)
        # nn.CrossEntropyLoss wants the class axis second: (batch, vocab, num_steps).
        unweighted = super().forward(pred.permute(0, 2, 1), label)
        return (unweighted * weights).mean(dim=1)


def train_seq2seq(
    net: nn.Module, data_iter: Iterable[Sequence[Tensor]], lr: float, num_epochs: int,
    tgt_vocab: Vocab, device: torch.device | str,
) -> None:
    """Train a seq2seq model with teacher forcing, d2l's recipe.

    Xavier-uniform init of every ``nn.Linear`` and ``nn.GRU`` weight (exact types, as
    d2l tests them: a lazy layer not yet sized, such as the 2-argument
    :class:`AdditiveAttention`'s, keeps PyTorch's init when the first batch sizes it),
    Adam at ``lr``,
    :class:`MaskedSoftmaxCELoss` summed over the batch, gradients clipped to norm 1.
    ``net(X, dec_input, X_valid_len)`` may return ``Y_hat`` or ``(Y_hat, state)`` with
    ``Y_hat (batch, num_steps, vocab)``. Every 10 epochs the loss per token goes on the
    loss curve (see the module docstring for where it ends up); at the end one line,
    ``loss X, Y tokens/sec on DEVICE``, is printed for the last epoch.
    """
    net.apply(v2.init_seq2seq)
    net.to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    loss = MaskedSoftmaxCELoss()
    net.train()
    animator = Animator(xlabel="epoch", ylabel="loss", xlim=[10, num_epochs])
    bos_id = tgt_vocab["<bos>"]
    metric, timer = Accumulator(2), Timer()  # loss sum, tokens
    for epoch in range(num_epochs):
        timer = Timer()
        metric = Accumulator(2)
        for batch in data_iter:
            optimizer.zero_grad()
            X, X_valid_len, Y, Y_valid_len = (x.to(device) for x in batch)
            # Teacher forcing: the decoder reads <bos> y1 .. y(T-1) and predicts y1 .. yT.
            dec_input = seq2seq.teacher_forcing_input(Y, bos_id)
            out = net(X, dec_input, X_valid_len)
            Y_hat = out[0] if isinstance(out, tuple) else out
            losses = loss(Y_hat, Y, Y_valid_len)
            losses.sum().backward()
            v2.grad_clipping(net, 1)
            optimizer.step()
            with torch.no_grad():
                metric.add(losses.sum(), Y_valid_len.sum())
        if (epoch + 1) % 10 == 0:
            animator.add(epoch + 1, (metric[0] / metric[1],))
    print(f"loss {metric[0] / metric[1]:.3f}, {metric[1] / timer.stop():.1f} "
          f"tokens/sec on {device}")
    save_if_headless(animator.fig, "seq2seq_loss.png")


def predict_seq2seq(
    net: nn.Module, src_sentence: str, src_vocab: Vocab, tgt_vocab: Vocab, num_steps: int,
    device: torch.device | str, save_attention_weights: bool = False,
) -> tuple[str, list[Any]]:
    """Greedy translation of one sentence: ``(translation, attention_weight_seq)``.

    The sentence is lower-cased, split on spaces, given ``<eos>`` and padded to
    ``num_steps``; its valid length is its token count with ``<eos>``. Decoding starts
    from ``<bos>``, feeds each argmax back and stops at ``<eos>`` or after ``num_steps``
    tokens. With ``save_attention_weights``, ``net.decoder.attention_weights`` is
    recorded after every step.
    """
    net.eval()
    src_tokens = src_vocab[src_sentence.lower().split(" ")] + [src_vocab["<eos>"]]
    enc_valid_len = torch.tensor([len(src_tokens)], device=device)
    src_tokens = truncate_pad(src_tokens, num_steps, src_vocab["<pad>"])
    enc_X = torch.tensor([src_tokens], dtype=torch.long, device=device)  # (1, num_steps)
    output_seq: list[int] = []
    attention_weight_seq: list[Any] = []
    with torch.no_grad():
        enc_outputs = net.encoder(enc_X, enc_valid_len)
        dec_state = net.decoder.init_state(enc_outputs, enc_valid_len)
        dec_X = torch.tensor([[tgt_vocab["<bos>"]]], dtype=torch.long, device=device)
        for _ in range(num_steps):
            Y, dec_state = net.decoder(dec_X, dec_state)  # Y (1, 1, vocab)
            dec_X = Y.argmax(dim=2)
            pred = int(dec_X.squeeze(dim=0).item())
            if save_attention_weights:
                attention_weight_seq.append(net.decoder.attention_weights)
            if pred == tgt_vocab["<eos>"]:
                break
            output_seq.append(pred)
    return " ".join(tgt_vocab.to_tokens(output_seq)), attention_weight_seq


# ----------------------------------------------------------------------------
# Utilities


def cpu() -> torch.device:
    """The CPU device."""
    return torch.device("cpu")


def gpu(i: int = 0) -> torch.device:
    """The ``i``-th CUDA device."""
    return torch.device(f"cuda:{i}")


def num_gpus() -> int:
    """How many CUDA devices there are."""
    return torch.cuda.device_count()


def try_gpu(i: int = 0) -> torch.device:
    """``cuda:i`` when it exists, else the CPU."""
    return gpu(i) if num_gpus() >= i + 1 else cpu()


class Timer:
    """Wall-clock timer that keeps every interval; it starts when created."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.start()

    def start(self) -> None:
        self.tik = time.time()

    def stop(self) -> float:
        """End the current interval, record it and return its length in seconds."""
        self.times.append(time.time() - self.tik)
        return self.times[-1]

    def avg(self) -> float:
        return sum(self.times) / len(self.times)

    def sum(self) -> float:
        return sum(self.times)

    def cumsum(self) -> list[float]:
        out, total = [], 0.0
        for t in self.times:
            total += t
            out.append(total)
        return out


class Accumulator:
    """``n`` running sums: ``add(a1, ..., an)`` adds to each, ``acc[i]`` reads one."""

    def __init__(self, n: int) -> None:
        self.data = [0.0] * n

    def add(self, *args: Any) -> None:
        self.data = [a + float(b) for a, b in zip(self.data, args, strict=True)]

    def reset(self) -> None:
        self.data = [0.0] * len(self.data)

    def __getitem__(self, idx: int) -> float:
        return self.data[idx]


class Animator:
    """Points added during training, drawn as lines on one figure (never shown here).

    d2l's signature: the labels, limits, scales and legend as in :func:`set_axes`, one
    format per line, and ``nrows x ncols`` panels of which the lines go on the first,
    ``axes[0]``. ``add(x, y)`` appends a point to each of ``len(y)`` lines (``y`` a
    number, a list or a 1-D tensor; one ``x`` serves them all); the figure is ``fig``
    and ``plt.show()`` displays it.
    """

    def __init__(
        self, xlabel: str | None = None, ylabel: str | None = None,
        legend: Sequence[str] | None = None, xlim: Sequence[float] | None = None,
        ylim: Sequence[float] | None = None, xscale: str = "linear", yscale: str = "linear",
        fmts: Sequence[str] = ("-", "m--", "g-.", "r:"), nrows: int = 1, ncols: int = 1,
        figsize: tuple[float, float] = (3.5, 2.5),
    ) -> None:
        use_svg_display()
        self.fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False)
        self.axes = list(axes.ravel())
        self.labels = (xlabel, ylabel, xlim, ylim, xscale, yscale, legend or [])
        self.fmts = fmts
        self.X: list[list[float]] = []
        self.Y: list[list[float]] = []

    def add(self, x: Any, y: Any) -> None:
        ys = list(y) if _is_series(y) else [y]
        xs = list(x) if _is_series(x) else [x] * len(ys)
        if not self.X:
            self.X = [[] for _ in ys]
            self.Y = [[] for _ in ys]
        for i, (a, b) in enumerate(zip(xs, ys, strict=True)):
            if a is not None and b is not None:
                self.X[i].append(float(a))
                self.Y[i].append(float(b))
        ax = self.axes[0]
        ax.cla()
        for xs_i, ys_i, fmt in zip(self.X, self.Y, self.fmts, strict=False):
            ax.plot(xs_i, ys_i, fmt)
        set_axes(ax, *self.labels)


def _is_series(v: Any) -> bool:
    """A list, tuple, array or tensor of values rather than one value (a 0-d tensor)."""
    return hasattr(v, "__len__") and getattr(v, "ndim", 1) > 0
