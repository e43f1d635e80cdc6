"""Data: translation pairs and vocabularies, the dates corpus, tokenizers and GPT windows."""

from .gpt import (
    GPTDataset,
    GPTDatasetV1,
    GPTEmbedding,
    create_dataloader,
    create_dataloader_v1,
    embed_tokens,
    generated_corpus,
)
from .tokenizers import (
    BPE_DIR_ENV,
    ENDOFTEXT,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    get_tokenizer,
    tokenizer_from_dict,
)

__all__ = [
    "GPTDataset",
    "GPTDatasetV1",
    "GPTEmbedding",
    "create_dataloader",
    "create_dataloader_v1",
    "embed_tokens",
    "generated_corpus",
    "BPE_DIR_ENV",
    "ENDOFTEXT",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "get_tokenizer",
    "tokenizer_from_dict",
]
