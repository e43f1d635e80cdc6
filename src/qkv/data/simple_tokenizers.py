"""The word-level tokenizers LLMs-from-scratch chapter 2 writes before it turns to BPE.

    words = simple_split(raw_text)                     # ['I', 'HAD', 'always', ...]
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    tokenizer = SimpleTokenizerV1(vocab)
    tokenizer.decode(tokenizer.encode(text))

Text is split on whitespace and on the punctuation ``, . : ; ? _ ! " ( ) '`` and ``--``
(kept as tokens of their own), and each piece looks up its id in a given vocabulary.
:class:`SimpleTokenizerV1` knows only its vocabulary's words; :class:`SimpleTokenizerV2`
encodes every other word as ``<|unk|>``, and a vocabulary with ``<|endoftext|>`` lets
it mark where one text ends and the next begins. Decoding joins the words with
spaces and then pulls punctuation back onto the word before it, so a round trip keeps
the words but not all of the spacing (``"It's"`` comes back as ``"It' s"``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ..checks import show

__all__ = ["UNK", "SimpleTokenizerV1", "SimpleTokenizerV2", "simple_split"]

UNK = "<|unk|>"

# The chapter's pattern: the capturing group keeps each separator as a piece of its own.
_SPLIT = re.compile(r'([,.:;?_!"()\']|--|\s)')


def simple_split(text: str) -> list[str]:
    """The chapter's pre-processing: split ``text`` into words and punctuation marks.

    Whitespace only separates (it never becomes a token); empty pieces are dropped.
    ``"Hello, world. Is this-- a test?"`` gives ``['Hello', ',', 'world', '.', 'Is',
    'this', '--', 'a', 'test', '?']``.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    return [piece.strip() for piece in _SPLIT.split(text) if piece.strip()]


class SimpleTokenizerV1:
    """Word-level tokenizer over a fixed vocabulary (the book's ``SimpleTokenizerV1``).

    Args:
        vocab: token -> id, e.g. ``{w: i for i, w in enumerate(sorted(set(words)))}``;
            the ids must be distinct integers.

    Attributes:
        str_to_int: the vocabulary as given; ``int_to_str`` its inverse.

    ``encode(text) -> list[int]`` raises a ``ValueError`` naming the first word that is
    not in the vocabulary (the book's class raises a ``KeyError`` there: this is the
    limitation :class:`SimpleTokenizerV2` removes). ``decode(ids) -> str`` takes a list
    or a 1-D tensor of ids.
    """

    # Punctuation that decoding attaches to the preceding word. The book's V1 leaves
    # ':' and ';' detached, its V2 attaches them too; each class keeps its own.
    _ATTACH = re.compile(r'\s+([,.?!"()\'])')

    def __init__(self, vocab: Mapping[str, int]) -> None:
        if not isinstance(vocab, Mapping):
            raise ValueError(f"vocab must be a dict of token -> id, got {type(vocab).__name__}")
        int_to_str: dict[int, str] = {}
        for token, i in vocab.items():
            if not isinstance(token, str) or isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"vocab must map str tokens to int ids, got {show(token)}: "
                                 f"{show(i)}")
            if i in int_to_str:
                raise ValueError(f"vocab gives id {i} to both {int_to_str[i]!r} and {token!r}; "
                                 "each token needs an id of its own")
            int_to_str[i] = token
        self.str_to_int = vocab
        self.int_to_str = int_to_str

    def _lookup(self, word: str) -> str:
        if word not in self.str_to_int:
            raise ValueError(f"{word!r} is not in the vocabulary ({len(self.str_to_int):,} "
                             f"tokens); SimpleTokenizerV2 encodes unknown words as {UNK}")
        return word

    def encode(self, text: str) -> list[int]:
        """Text -> ids, one per word or punctuation mark."""
        return [self.str_to_int[self._lookup(word)] for word in simple_split(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text: the tokens joined by spaces, punctuation pulled back onto words."""
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        words = []
        for i in ids:
            if i not in self.int_to_str:
                raise ValueError(f"id {show(i)} is not in the vocabulary (ids of "
                                 f"{len(self.int_to_str):,} tokens)")
            words.append(self.int_to_str[i])
        return self._ATTACH.sub(r"\1", " ".join(words))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab of {len(self.str_to_int):,} tokens)"


class SimpleTokenizerV2(SimpleTokenizerV1):
    """:class:`SimpleTokenizerV1` that encodes unknown words as ``<|unk|>`` (the book's V2).

    The vocabulary must hold ``<|unk|>``; the book's also holds ``<|endoftext|>``,
    which the text then uses as a word of its own between documents
    (``" <|endoftext|> ".join((text1, text2))``). Decoding also attaches ``:`` and ``;``.
    """

    _ATTACH = re.compile(r'\s+([,.:;?!"()\'])')

    def __init__(self, vocab: Mapping[str, int]) -> None:
        super().__init__(vocab)
        if UNK not in vocab:
            raise ValueError(f"vocab has no {UNK!r}, the token SimpleTokenizerV2 gives unknown "
                             f"words; add it, e.g. vocab[{UNK!r}] = {len(vocab)}")

    def _lookup(self, word: str) -> str:
        return word if word in self.str_to_int else UNK
