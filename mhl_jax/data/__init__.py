"""Data: tokenizers, `.bin` shards, Hugging Face text, the built-in corpus, the Grain pipeline, prepare and its named
datasets."""

from mhl_jax.data.errors import DataError
from mhl_jax.data.pipeline import load_val_sequences, make_train_loader, source_windows
from mhl_jax.data.tokenizers import BYTE_EOT, BYTE_VOCAB, ByteTokenizer, get_tokenizer

__all__ = ["BYTE_EOT", "BYTE_VOCAB", "ByteTokenizer", "DataError", "get_tokenizer", "load_val_sequences",
           "make_train_loader", "source_windows"]
