"""Tokenizers behind one interface: ``vocab_size`` (unpadded), ``tokenize``, ``detokenize``, ``eod``, ``pad``.

The model pads the vocabulary for tensor parallelism (``ModelConfig.padded_vocab_size``);
tokenizers report the true size.
"""
from __future__ import annotations

from typing import Optional

from megatron_lite.config import ConfigError
from megatron_lite.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron_lite.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron_lite.tokenizer.null_tokenizer import NullTokenizer
from megatron_lite.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type: str, *, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None):
    """Builds the tokenizer named by ``--tokenizer-type`` from the files its flags point at."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}; got {tokenizer_type!r}.")


def build_model_tokenizer(flags, model_vocab_size: int):
    """The tokenizer of a model with ``model_vocab_size`` ids, from the --tokenizer-type, --vocab-file,
    --merge-file and --tokenizer-model values on ``flags`` (a DataConfig or a parsed namespace).

    A NullTokenizer's ids are data below its EOD, which is the model vocabulary's last id."""
    vocab_size = model_vocab_size - 1 if flags.tokenizer_type == "NullTokenizer" else None
    return build_tokenizer(flags.tokenizer_type, vocab_file=flags.vocab_file, merge_file=flags.merge_file,
                           tokenizer_model=flags.tokenizer_model, vocab_size=vocab_size)


__all__ = ["build_tokenizer", "build_model_tokenizer", "TOKENIZER_TYPES", "GPT2BPETokenizer", "SentencePieceTokenizer",
           "HuggingFaceTokenizer", "NullTokenizer"]
