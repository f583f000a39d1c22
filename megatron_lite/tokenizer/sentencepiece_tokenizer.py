"""SentencePiece models (``--tokenizer-model``), and training one from text."""
from __future__ import annotations

import os
from typing import Iterable

from megatron_lite.config import ConfigError

import sentencepiece


class SentencePieceTokenizer:
    """A ``.model`` file; end of document is the model's ``</s>`` (eos) piece."""

    def __init__(self, tokenizer_model: str):
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-type SentencePieceTokenizer needs --tokenizer-model, a .model file; "
                              f"{tokenizer_model!r} is not a file. Train one with tools/train_tokenizer.py "
                              "--tokenizer-type SentencePieceTokenizer.")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        except (RuntimeError, OSError) as error:  # its message is a C++ check, no hint at the flag
            raise ConfigError(f"--tokenizer-model {tokenizer_model} is not a SentencePiece model ({error}); give "
                              f"the tokenizer.model file, or use the --tokenizer-type that matches it.") from None
        if self._processor.eos_id() < 0:
            raise ConfigError(f"{tokenizer_model} has no eos piece; SentencePieceTokenizer uses it as end of document.")
        self.eod = self._processor.eos_id()
        self.pad = self._processor.pad_id() if self._processor.pad_id() >= 0 else self.eod
        self.bos = self._processor.bos_id() if self._processor.bos_id() >= 0 else None

    @property
    def special_tokens(self) -> dict:
        """The model's own special pieces by Hugging Face's names (``bos_token``, ...): those it has."""
        ids = {"bos_token": self._processor.bos_id(), "eos_token": self.eod, "unk_token": self._processor.unk_id(),
               "pad_token": self._processor.pad_id()}
        return {name: self._processor.id_to_piece(i) for name, i in ids.items() if i >= 0}

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def detokenize(self, ids) -> str:
        return self._processor.decode([int(i) for i in ids])


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int, *, model_type: str = "bpe") -> str:
    """Trains a lossless model (identity normalisation, byte fallback, whitespace kept); returns its path.

    SentencePiece learns from lines, so each text is fed line by line; newlines and any
    character outside the learned pieces come back through the byte-fallback pieces.
    """
    def lines():
        for text in texts:
            yield from (line for line in text.split("\n") if line)

    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    except RuntimeError as error:  # its checks (a vocabulary larger than the text allows) name the limit
        raise ConfigError(f"SentencePiece could not train a --vocab-size {vocab_size} model: {error}") from None
    return f"{model_prefix}.model"
