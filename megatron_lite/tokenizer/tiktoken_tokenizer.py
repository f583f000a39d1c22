"""Megatron-LM's TikTokenizer: a tiktoken BPE read from a JSON vocabulary; the only place that imports tiktoken.

The ``--tokenizer-model`` file is a JSON list of ``{"rank", "token_bytes" (base64), "token_str"}``
in rank order, the first 256 being the single bytes. Ids 0 .. num_special_tokens - 1 are
special tokens (``<unk> <s> </s> <mask> <pad> <cls> <sep>``, then ``<SPECIAL_7>`` ... fillers);
BPE token of rank r has id ``num_special_tokens + r``. ``</s>`` (id 2) ends a document.
The ids are those Megatron-LM writes for the same file, pattern and sizes.
"""
from __future__ import annotations

import base64
import json
import os

from megatron_lite.config import ConfigError

# Pre-tokenisation patterns, Megatron-LM's --tiktoken-pattern v1 and v2 (v2 splits camelCase words too).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2 ** 17  # Megatron's default when --vocab-size is not given


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise ConfigError("--tokenizer-type TikTokenizer needs the `tiktoken` package: pip install tiktoken") from None
    return tiktoken


def load_mergeable_ranks(path: str, max_entries: int) -> dict[bytes, int]:
    """The first ``max_entries`` BPE tokens of the JSON vocabulary, bytes -> rank."""
    with open(path) as f:
        vocab = json.load(f)
    if not isinstance(vocab, list) or not all(isinstance(e, dict) and "token_bytes" in e for e in vocab):
        raise ConfigError(f"--tokenizer-model {path} is not a TikTokenizer vocabulary (a JSON list of "
                          '{"rank", "token_bytes", "token_str"} entries).')
    ranks = {}
    for rank, entry in enumerate(vocab[:max_entries]):
        token = base64.b64decode(entry["token_bytes"])
        if entry.get("rank", rank) != rank or (rank < 256 and token != bytes([rank])):
            raise ConfigError(f"--tokenizer-model {path}: entry {rank} is out of order (ranks must count from 0, "
                              "and the first 256 must be the single bytes).")
        ranks[token] = rank
    return ranks


class TikTokenizer:
    """``--vocab-size`` counts the special tokens too (Megatron's convention); the file must hold the rest."""

    def __init__(self, tokenizer_model: str, *, pattern: str | None = None, vocab_size: int | None = None,
                 num_special_tokens: int = 1000):
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-type TikTokenizer needs --tokenizer-model pointing at its JSON "
                              f"vocabulary; {tokenizer_model!r} is not a file.")
        pattern = pattern or "v2"
        vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        if not len(SPECIAL_TOKENS) <= num_special_tokens <= vocab_size - 256:
            # Fewer than the 256 single bytes would leave text that cannot be encoded (tiktoken aborts on it).
            raise ConfigError(f"--tiktoken-num-special-tokens ({num_special_tokens}) must be at least "
                              f"{len(SPECIAL_TOKENS)}, and --vocab-size ({vocab_size}) must leave room for it and "
                              f"the 256 single bytes.")
        ranks = load_mergeable_ranks(tokenizer_model, vocab_size - num_special_tokens)
        if len(ranks) != vocab_size - num_special_tokens:
            raise ConfigError(f"--tokenizer-model {tokenizer_model} holds {len(ranks)} tokens, but --vocab-size "
                              f"{vocab_size} with {num_special_tokens} special tokens needs "
                              f"{vocab_size - num_special_tokens}; pass --vocab-size "
                              f"{len(ranks) + num_special_tokens}.")
        specials = list(SPECIAL_TOKENS) + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)]
        self._vocab_size = vocab_size
        self._encoding = _import_tiktoken().Encoding(
            name=os.path.basename(tokenizer_model), pat_str=PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens={token: i for i, token in enumerate(specials)})
        self.eod = SPECIAL_TOKENS.index("</s>")
        self.pad = SPECIAL_TOKENS.index("<pad>")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        # As Megatron-LM: special-token text in a document ("</s>") becomes the special token.
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids], errors="replace")
