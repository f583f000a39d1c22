"""Tokenizers behind one interface: ``vocab_size`` (unpadded), ``tokenize``, ``detokenize``, ``eod``, ``pad``.

The model pads the vocabulary for tensor parallelism (``ModelConfig.padded_vocab_size``);
tokenizers report the true size.
"""
from __future__ import annotations

import os
from typing import Optional

from megatron_lite.config import TOKENIZER_TYPES, ConfigError
from megatron_lite.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron_lite.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron_lite.tokenizer.null_tokenizer import NullTokenizer
from megatron_lite.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron_lite.tokenizer.tiktoken_tokenizer import TikTokenizer

# The flags that name a run's tokenizer and its files, as a checkpoint's config records them.
TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def build_tokenizer(tokenizer_type: str, *, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    tiktoken_pattern: Optional[str] = None, tiktoken_num_special_tokens: int = 1000):
    """Builds the tokenizer named by ``--tokenizer-type`` from the files its flags point at."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                            num_special_tokens=tiktoken_num_special_tokens)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}; got {tokenizer_type!r}.")


def checkpoint_tokenizer_flags(recorded: dict, given: dict) -> dict:
    """The ``--tokenizer-*`` flags given on the command line if they name a tokenizer type, else the ones a
    checkpoint recorded (its config's data section), so a tool needs no tokenizer flags of its own."""
    flags = given if given.get("tokenizer_type") else recorded
    missing = [f"--{field.replace('_', '-')} {flags[field]}" for field in ("vocab_file", "merge_file",
                                                                            "tokenizer_model")
               if flags.get(field) and not os.path.exists(flags[field])]
    if missing:
        raise ConfigError(f"the checkpoint's tokenizer files are gone ({', '.join(missing)}); pass "
                          "--tokenizer-type and its files (--vocab-file and --merge-file, or --tokenizer-model) "
                          "where they are now.")
    return flags


def build_model_tokenizer(flags: dict, model_vocab_size: int):
    """The tokenizer of a model with ``model_vocab_size`` ids (unpadded), from the ``--tokenizer-*`` and
    ``--tiktoken-*`` values in ``flags`` (a DataConfig's fields, or the flags a checkpoint recorded).

    The one rule for a model's EOD: a NullTokenizer's ids are data below its EOD, which is the model
    vocabulary's last id (data preprocessed with ``--vocab-size N`` trains a model of ``--vocab-size N+1``);
    a TikTokenizer fills the model's vocabulary with its special and BPE tokens."""
    null = flags["tokenizer_type"] == "NullTokenizer"
    return build_tokenizer(flags["tokenizer_type"], vocab_file=flags.get("vocab_file"),
                           merge_file=flags.get("merge_file"), tokenizer_model=flags.get("tokenizer_model"),
                           vocab_size=model_vocab_size - 1 if null else model_vocab_size,
                           tiktoken_pattern=flags.get("tiktoken_pattern"),
                           tiktoken_num_special_tokens=flags.get("tiktoken_num_special_tokens", 1000))


__all__ = ["build_tokenizer", "build_model_tokenizer", "checkpoint_tokenizer_flags",
           "GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"]
