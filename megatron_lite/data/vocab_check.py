"""Token ids must lie inside the model's vocabulary, checked where data enters.

An id past the vocabulary is no error for the model: at tensor-parallel size 1 it is a bare
IndexError deep inside the embedding, and with the vocabulary split over tensor-parallel ranks every
rank masks it as "another rank's row", so the run trains on zero embeddings and exits 0. So the data
is checked once at start-up (one pass over each .bin by the rank that builds the datasets, a few GB/s),
and the tokenizer is checked against the model's vocabulary when the configuration is read.
"""
from __future__ import annotations

import numpy as np

from megatron_lite.config import ConfigError

_CHUNK_TOKENS = 1 << 24  # tokens per read: bounded memory for .bin files of any size


def first_id_outside(tokens, vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first entry of ``tokens`` (any 1-D array, memory-mapped too) outside
    [0, vocab_size), or None."""
    for start in range(0, len(tokens), _CHUNK_TOKENS):
        chunk = np.asarray(tokens[start:start + _CHUNK_TOKENS])
        bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0))
        if bad.size:
            return start + int(bad[0]), int(chunk[bad[0]])
    return None


def check_token_ids(tokens, vocab_size: int, source: str) -> None:
    """Raise ConfigError naming ``source``, the first bad id and the vocabulary size."""
    found = first_id_outside(tokens, vocab_size)
    if found is not None:
        position, token_id = found
        raise ConfigError(
            f"{source}: token id {token_id} (token {position} of the file) is outside the model's vocabulary of "
            f"{vocab_size} ids: the data was tokenized with another tokenizer. Preprocess it again with this "
            f"run's tokenizer (tools/preprocess_data.py), or train with the tokenizer (or --vocab-size) it was "
            f"made with.")


def check_tokenizer_fits_model(tokenizer_vocab_size: int, model_vocab_size: int, tokenizer_flags: str) -> str | None:
    """A tokenizer larger than the model's vocabulary (a checkpoint's, or --vocab-size) makes ids with no
    embedding row: an error. A smaller one fits but is most likely not the model's: returns a note to print."""
    if tokenizer_vocab_size > model_vocab_size:
        raise ConfigError(
            f"the tokenizer ({tokenizer_flags}) has {tokenizer_vocab_size} tokens, but the model's vocabulary "
            f"(--vocab-size, or the checkpoint's under --use-checkpoint-args) has {model_vocab_size}: ids "
            f"{model_vocab_size}-{tokenizer_vocab_size - 1} would have no embedding. Give the tokenizer the model "
            f"was trained with (a resumed run without tokenizer flags keeps its checkpoint's).")
    if tokenizer_vocab_size < model_vocab_size:
        return (f"the tokenizer ({tokenizer_flags}) has {tokenizer_vocab_size} tokens, fewer than the model's "
                f"vocabulary of {model_vocab_size}: rows {tokenizer_vocab_size}-{model_vocab_size - 1} are never "
                f"used. If the model was trained with another tokenizer, give that one.")
    return None
