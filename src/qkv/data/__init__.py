"""Data: translation pairs and vocabularies, the dates corpus, tokenizers (GPT-2's, bytes,
open models' from tokenizer.json or a GGUF file, the book's ch. 2 word-level ones), chat
templates and GPT windows."""

# The book's ch. 2 ends with the input embeddings; they are a model's first layer and
# live in qkv.models.gpt, re-exported here beside the data pipeline that feeds them.
from ..models.gpt import GPTEmbedding, embed_tokens
from .chat import chat_messages, render_chat_template
from .gguf_tokenizer import tokenizer_from_gguf
from .lm import (
    GPTDataset,
    GPTDatasetV1,
    create_dataloader,
    create_dataloader_v1,
    generated_corpus,
)
from .simple_tokenizers import SimpleTokenizerV1, SimpleTokenizerV2, simple_split
from .tokenizers import (
    BPE_DIR_ENV,
    ENDOFTEXT,
    ByteTokenizer,
    GPT2Tokenizer,
    HFTokenizer,
    Tokenizer,
    get_tokenizer,
    load_hf_tokenizer,
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
    "HFTokenizer",
    "SimpleTokenizerV1",
    "SimpleTokenizerV2",
    "Tokenizer",
    "chat_messages",
    "get_tokenizer",
    "load_hf_tokenizer",
    "render_chat_template",
    "simple_split",
    "tokenizer_from_dict",
    "tokenizer_from_gguf",
]
