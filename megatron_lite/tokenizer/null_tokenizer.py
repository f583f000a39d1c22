"""For data that is already token ids: text is space-separated integers."""
from __future__ import annotations

from megatron_lite.config import ConfigError


class NullTokenizer:
    """Ids 0..``vocab_size``-1 are data and ``vocab_size`` itself is EOD, as in Megatron-LM.

    So ``--vocab-size N`` gives a vocabulary of N + 1 entries.
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 1:
            raise ConfigError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}.")
        self._data_vocab_size = int(vocab_size)
        self.eod = self._data_vocab_size
        self.pad = self.eod

    @property
    def vocab_size(self) -> int:
        return self._data_vocab_size + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer expects space-separated integers, got {text[:60]!r}") from None
        for i in ids:
            if not 0 <= i < self._data_vocab_size:
                raise ValueError(f"token id {i} is outside [0, --vocab-size {self._data_vocab_size}).")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)
