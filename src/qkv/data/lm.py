"""Data for GPT-style next-token training (LLMs-from-scratch chapter 2).

From text to batches:

    ids = get_tokenizer("gpt2").encode(text)          # [40, 367, 2885, 1464, ...]
    loader = create_dataloader(ids, batch_size=8, max_length=4, stride=4)
    loader = create_dataloader(text, batch_size=8, max_length=4, stride=4)   # the same
    x, y = next(iter(loader))                         # (8, 4) int64 each, y is x shifted by 1
    emb = GPTEmbedding(50257, 256, context_length=4)
    emb(x).shape                                      # (8, 4, 256)

A sliding window of ``max_length`` tokens moves over the ids in steps of ``stride``; each
window is an input, and the same window one token further on is its target, so the model
learns to predict every next token at once. :class:`GPTDataset` keeps the ids once and cuts
windows as views on demand: with ``stride=1`` the book's version stores ``max_length`` copies
of the text, this one stores the text.

:func:`generated_corpus` writes a small English-like text from a fixed grammar, so a model
can be trained with no download at all.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from .tokenizers import ENDOFTEXT, Tokenizer, get_tokenizer

__all__ = [
    "GPTDataset",
    "GPTDatasetV1",
    "create_dataloader",
    "create_dataloader_v1",
    "generated_corpus",
]


# ----------------------------------------------------------------------------
# Sliding-window dataset


class GPTDataset(Dataset):
    """Input/target windows over one sequence of token ids.

    Args:
        token_ids: the ids, a list or a 1-D integer tensor; or a 1-D integer NumPy array,
            such as the ``np.memmap`` of a text tokenized once into a file
            (:func:`qkv.data.tokenfile.prepare_token_file`), which is kept as it is and
            read a window at a time, so a corpus larger than memory trains in bounded
            memory.
        max_length: tokens per window (the model's input length).
        stride: step between the starts of consecutive windows; ``stride == max_length``
            gives disjoint inputs, ``stride < max_length`` overlapping ones.

    Window ``n`` starts at ``i = n * stride`` for ``i in range(0, len(ids) - max_length,
    stride)`` (the book's loop, so the last target token always exists): the input is
    ``ids[i : i + max_length]``, the target ``ids[i + 1 : i + max_length + 1]``; both are
    ``(max_length,)`` int64 views of :attr:`token_ids` (of one int64 copy of the window,
    for a NumPy array), so memory does not grow with the number of windows.

    Raises:
        ValueError: a sequence too short for one window, or a non-positive size.
    """

    def __init__(
        self, token_ids: Tensor | Sequence[int] | np.ndarray, max_length: int, stride: int
    ) -> None:
        if max_length < 1 or stride < 1:
            raise ValueError(
                f"max_length and stride must be positive, got max_length={max_length}, "
                f"stride={stride}"
            )
        self.token_ids: Tensor | np.ndarray
        if isinstance(token_ids, np.ndarray):
            if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
                raise ValueError(
                    f"token_ids must be a 1-D array of integers, got {token_ids.dtype} of "
                    f"shape {token_ids.shape}"
                )
            self.token_ids = token_ids  # not copied: it may be a file larger than memory
        else:
            ids = torch.as_tensor(token_ids)
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                raise ValueError(
                    f"token_ids must be a 1-D sequence of integers, got {ids.dtype} of "
                    f"shape {tuple(ids.shape)}"
                )
            # int64 is what nn.Embedding and cross_entropy take; contiguous so that every
            # window is a plain slice of one storage.
            self.token_ids = ids.to(torch.long).contiguous()
        self.max_length = max_length
        self.stride = stride
        self.starts = range(0, len(self.token_ids) - max_length, stride)
        if len(self.starts) == 0:
            raise ValueError(
                f"text too short: {len(self.token_ids)} tokens, but one window of "
                f"max_length={max_length} needs at least {max_length + 1} "
                "(inputs plus the next-token target)"
            )

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: int) -> tuple[Tensor, Tensor]:
        i = self.starts[idx]  # range indexing: negative indices work, out of range raises
        if isinstance(self.token_ids, np.ndarray):
            window = torch.from_numpy(self.token_ids[i : i + self.max_length + 1]
                                      .astype(np.int64))
            return window[:-1], window[1:]
        return (
            self.token_ids[i : i + self.max_length],
            self.token_ids[i + 1 : i + self.max_length + 1],
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tokens={len(self.token_ids)}, max_length={self.max_length}, "
            f"stride={self.stride}, windows={len(self)})"
        )


def _encode(tokenizer: Any, txt: str) -> list[int]:
    """Tokenize with a qkv :class:`Tokenizer`, or with a raw ``tiktoken.Encoding`` the book way."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(txt)
    return tokenizer.encode(txt, allowed_special={ENDOFTEXT})


class GPTDatasetV1(GPTDataset):
    """The book's ``GPTDatasetV1(txt, tokenizer, max_length, stride)``: tokenize, then window.

    ``tokenizer`` is a qkv :class:`~qkv.data.tokenizers.Tokenizer` or, as in the book, a
    ``tiktoken`` encoding (called with ``allowed_special={"<|endoftext|>"}``). Indexing cuts
    the windows as views on demand; the book's lists ``input_ids`` and ``target_ids`` (one
    ``(max_length,)`` tensor per window) are there too, built on first use, as views of
    the same ids.
    """

    def __init__(self, txt: str, tokenizer: Any, max_length: int, stride: int) -> None:
        super().__init__(_encode(tokenizer, txt), max_length, stride)

    @cached_property
    def input_ids(self) -> list[Tensor]:
        """The input windows, ``input_ids[n] == self[n][0]``."""
        return [self[n][0] for n in range(len(self))]

    @cached_property
    def target_ids(self) -> list[Tensor]:
        """The target windows, ``target_ids[n] == self[n][1]``."""
        return [self[n][1] for n in range(len(self))]


# ----------------------------------------------------------------------------
# Loaders


def create_dataloader(
    token_ids: str | Tensor | Sequence[int] | GPTDataset,
    batch_size: int = 4,
    max_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    *,
    sampler: Sampler | None = None,
    generator: torch.Generator | None = None,
    pin_memory: bool = False,
    tokenizer: Any = None,
) -> DataLoader:
    """A ``DataLoader`` of ``(inputs, targets)``, each ``(batch_size, max_length)`` int64.

    Args:
        token_ids: the ids; or a text (a ``str``), tokenized first into a
            :class:`GPTDatasetV1` as the book's ``create_dataloader(txt, ...)`` does; or a
            ready :class:`GPTDataset` (then ``max_length`` and ``stride`` are the
            dataset's own and these arguments are ignored).
        tokenizer: for a text: a qkv tokenizer or a tiktoken encoding; default
            ``get_tokenizer("gpt2")``, which reads ``$QKV_BPE_DIR`` to work offline.
        shuffle: reshuffle windows every epoch. Ignored when a ``sampler`` is given: the
            sampler decides the order (a ``DistributedSampler`` shuffles by itself).
        sampler: e.g. ``DistributedSampler(loader_dataset)`` for multi-process training.
        generator: seeds the shuffling, for reproducible epochs.

    Raises:
        ValueError: ``drop_last`` would leave no batch at all (fewer windows than
            ``batch_size``), which would silently train on nothing.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if tokenizer is not None and not isinstance(token_ids, str):
        raise ValueError(f"tokenizer is for a text, but the data is a {type(token_ids).__name__}"
                         "; pass the text, or the ids without a tokenizer")
    if isinstance(token_ids, GPTDataset):
        dataset = token_ids
    elif isinstance(token_ids, str):
        tokenizer = get_tokenizer("gpt2") if tokenizer is None else tokenizer
        dataset = GPTDatasetV1(token_ids, tokenizer, max_length, stride)
    else:
        dataset = GPTDataset(token_ids, max_length, stride)
    per_loader = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else None
    windows = len(dataset) if per_loader is None else per_loader
    if drop_last and windows < batch_size:
        raise ValueError(
            f"only {windows} windows for batch_size={batch_size} with drop_last=True, so the "
            "loader would be empty; use more text, a smaller batch_size/max_length/stride, "
            "or drop_last=False"
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and sampler is None,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=generator,
        pin_memory=pin_memory,
    )


def create_dataloader_v1(
    txt: str,
    batch_size: int = 4,
    max_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    *,
    tokenizer: Any = None,
) -> DataLoader:
    """The book's loader: tokenize ``txt`` (GPT-2 BPE unless ``tokenizer`` is given), window it.

    Same signature and defaults as the book; :func:`create_dataloader` given a text.
    ``tokenizer`` is a qkv tokenizer or a tiktoken encoding; the default is
    ``get_tokenizer("gpt2")``, which honours ``$QKV_BPE_DIR`` for offline use.
    """
    if not isinstance(txt, str):
        raise ValueError(f"txt must be the text to tokenize (a str), got {type(txt).__name__}; "
                         "create_dataloader takes token ids")
    return create_dataloader(txt, batch_size, max_length, stride, shuffle, drop_last,
                             num_workers, tokenizer=tokenizer)


# ----------------------------------------------------------------------------
# A corpus the package writes itself

_NAMES = (
    "Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Henry", "Iris", "Jack",
    "Kate", "Leo", "Maria", "Nora", "Oscar", "Paul", "Rosa", "Sam", "Tom", "Vera",
)  # fmt: skip
# (singular, plural); living things first, they are the ones that act
_NOUNS = (
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("horse", "horses"),
    ("fox", "foxes"), ("child", "children"), ("teacher", "teachers"), ("farmer", "farmers"),
    ("sailor", "sailors"), ("baker", "bakers"), ("doctor", "doctors"), ("king", "kings"),
    ("queen", "queens"), ("boy", "boys"), ("girl", "girls"), ("man", "men"),
    ("woman", "women"), ("friend", "friends"), ("stranger", "strangers"), ("owl", "owls"),
    ("apple", "apples"), ("book", "books"), ("letter", "letters"), ("key", "keys"),
    ("lamp", "lamps"), ("boat", "boats"), ("basket", "baskets"), ("coin", "coins"),
    ("map", "maps"), ("song", "songs"), ("story", "stories"), ("stone", "stones"),
    ("flower", "flowers"), ("hat", "hats"), ("box", "boxes"), ("cake", "cakes"),
    ("ship", "ships"), ("picture", "pictures"), ("window", "windows"), ("door", "doors"),
    ("umbrella", "umbrellas"), ("egg", "eggs"), ("island", "islands"), ("idea", "ideas"),
)  # fmt: skip
_ANIMATE, _THINGS = _NOUNS[:20], _NOUNS[20:]
_PLACES = (
    "garden", "river", "forest", "market", "village", "kitchen", "library", "harbour",
    "mountain", "bridge", "school", "castle", "station", "meadow", "tower", "beach",
    "hill", "lake", "farm", "city",
)  # fmt: skip
_ADJECTIVES = (
    "old", "young", "small", "big", "quiet", "loud", "happy", "sad", "clever", "brave",
    "tired", "hungry", "kind", "strange", "bright", "dark", "warm", "cold", "green", "red",
    "blue", "golden", "heavy", "gentle", "curious", "busy", "lazy", "proud", "wise", "shy",
    "angry", "lucky", "early", "honest", "empty", "ancient", "elegant", "icy", "orange",
)  # fmt: skip
# (present third-person singular, present plural, past) of transitive verbs
_VERBS = (
    ("finds", "find", "found"), ("sees", "see", "saw"), ("carries", "carry", "carried"),
    ("likes", "like", "liked"), ("paints", "paint", "painted"), ("opens", "open", "opened"),
    ("follows", "follow", "followed"), ("takes", "take", "took"), ("loses", "lose", "lost"),
    ("brings", "bring", "brought"), ("watches", "watch", "watched"),
    ("reads", "read", "read"), ("wants", "want", "wanted"), ("helps", "help", "helped"),
    ("builds", "build", "built"), ("hides", "hide", "hid"), ("sells", "sell", "sold"),
    ("remembers", "remember", "remembered"), ("drops", "drop", "dropped"),
    ("keeps", "keep", "kept"),
)  # fmt: skip
# (present third-person singular, present plural, past) of intransitive verbs
_INTRANSITIVE = (
    ("sleeps", "sleep", "slept"), ("sings", "sing", "sang"), ("runs", "run", "ran"),
    ("laughs", "laugh", "laughed"), ("waits", "wait", "waited"), ("walks", "walk", "walked"),
    ("dances", "dance", "danced"), ("smiles", "smile", "smiled"), ("works", "work", "worked"),
    ("rests", "rest", "rested"), ("listens", "listen", "listened"),
)  # fmt: skip
_ADVERBS = (
    "slowly", "quickly", "quietly", "happily", "carefully", "suddenly", "sadly", "loudly",
    "softly", "gladly", "bravely", "patiently",
)  # fmt: skip
_PREPOSITIONS = ("in", "near", "behind", "beside", "under", "across", "by")
_TIMES = (
    "In the morning", "At night", "Every day", "After dinner", "On Sunday", "Last winter",
    "One evening", "Before sunrise", "In the spring", "Later",
)  # fmt: skip
_THINK = ("saw", "knew", "noticed", "heard", "thought", "felt")
_SAY = ("said", "asked", "whispered", "answered", "shouted", "replied")
_GREETINGS = ("Good morning", "Hello", "Thank you", "Come with me", "Look at this", "Wait")
_WEATHER = ("rain", "snow", "sun", "wind", "fog")


def _article(word: str) -> str:
    # "an" before a vowel sound: a rule a small model can visibly learn
    return "an" if word[0] in "aeiou" else "a"


class _SentenceMaker:
    """Draws sentences from a small grammar with agreement (a/an, singular/plural verbs)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, options: Sequence[Any]) -> Any:
        return self.rng.choice(options)

    def noun_phrase(
        self,
        plural: bool = False,
        definite: bool | None = None,
        nouns: Sequence[tuple[str, str]] = _THINGS,
    ) -> str:
        noun = self.pick(nouns)[1 if plural else 0]
        words = [self.pick(_ADJECTIVES), noun] if self.rng.random() < 0.5 else [noun]
        if definite is None:
            definite = self.rng.random() < 0.6
        if definite:
            return "the " + " ".join(words)
        if plural:
            return ("some " if self.rng.random() < 0.5 else "two ") + " ".join(words)
        return _article(words[0]) + " " + " ".join(words)

    def subject(self) -> tuple[str, bool]:
        """A subject and whether it is plural."""
        roll = self.rng.random()
        if roll < 0.3:
            return self.pick(_NAMES), False
        if roll < 0.4:
            first, second = self.rng.sample(_NAMES, 2)
            return f"{first} and {second}", True
        plural = roll < 0.6
        return self.noun_phrase(plural=plural, definite=True, nouns=_ANIMATE), plural

    def place(self) -> str:
        return f"{self.pick(_PREPOSITIONS)} the {self.pick(_PLACES)}"

    def sentence(self) -> str:
        kind = self.rng.randrange(8)
        subj, plural = self.subject()
        past = self.rng.random() < 0.6
        verb = self.pick(_VERBS)
        verb_form = verb[2] if past else verb[1 if plural else 0]
        if kind == 0:
            text = f"{subj} {verb_form} {self.noun_phrase(self.rng.random() < 0.3)} {self.place()}."
        elif kind == 1:
            walk = self.pick(_INTRANSITIVE)
            text = f"{subj} {walk[2] if past else walk[1 if plural else 0]} {self.pick(_ADVERBS)}."
        elif kind == 2:
            walk = self.pick(_INTRANSITIVE)
            time = self.pick(_TIMES)
            text = f"{time}, {subj} {walk[2]} {self.place()}."
        elif kind == 3:
            be = ("were" if plural else "was") if past else ("are" if plural else "is")
            a, b = self.rng.sample(_ADJECTIVES, 2)
            text = f"{subj} {be} {a} and {b}."
        elif kind == 4:
            speaker, listener = self.rng.sample(_NAMES, 2)
            text = f'"{self.pick(_GREETINGS)}, {listener}," {self.pick(_SAY)} {speaker}.'
        elif kind == 5:
            seen = self.noun_phrase(plural=False, definite=True, nouns=_NOUNS)
            text = f"{subj} {self.pick(_THINK)} that {seen} was {self.pick(_ADJECTIVES)}."
        elif kind == 6:
            thing = self.pick(_THINGS)
            plural_q = self.rng.random() < 0.4
            be = "are" if plural_q else "is"
            text = f"Where {be} the {thing[1 if plural_q else 0]}?"
        else:
            weather = self.pick(_WEATHER)
            text = f"The {weather} came, so {subj} stayed {self.place()}."
        return text[0].upper() + text[1:]


def generated_corpus(num_chars: int = 50_000, seed: int = 0) -> str:
    """A small English-like corpus written from a fixed grammar: no files, no network.

    Short stories of simple sentences (names, a few hundred words, past and present tense,
    singular/plural agreement, ``a``/``an``, dialogue, questions), in paragraphs of three to
    six sentences separated by blank lines. A small model trained on it for a few minutes
    on a CPU visibly learns spelling, agreement and punctuation.

    Args:
        num_chars: length of the returned text, exactly (the last sentence may be cut).
        seed: the same seed always gives the same text.
    """
    if num_chars < 1:
        raise ValueError(f"num_chars must be positive, got {num_chars}")
    rng = random.Random(seed)
    maker = _SentenceMaker(rng)
    paragraphs: list[str] = []
    total = 0
    while total < num_chars:
        paragraph = " ".join(maker.sentence() for _ in range(rng.randint(3, 6)))
        paragraphs.append(paragraph)
        total += len(paragraph) + 2  # "\n\n" between paragraphs
    return "\n\n".join(paragraphs)[:num_chars]
