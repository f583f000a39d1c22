"""GPT-2 byte-level BPE, written from the algorithm.

Text is split into chunks by GPT-2's pre-tokenisation pattern; each chunk's UTF-8
bytes are mapped to printable characters (so merges never see raw control bytes),
then adjacent symbols are merged greedily by rank from ``merges.txt`` until no
ranked pair is left, and the resulting strings are looked up in ``vocab.json``.

Special tokens are never matched in the text: a literal ``<|endoftext|>`` written inside a
document becomes ordinary BPE pieces (``<``, ``|``, ...), as in Megatron-LM's legacy GPT-2
tokenizer (``megatron/training/tokenizer/gpt2_tokenization.py``, before Megatron-Core 0.17), so
the only EOD ids are those ``--append-eod`` adds. A Hugging Face tokenizer that registers the
token as special (transformers' ``GPT2TokenizerFast``, which Megatron-LM's ``GPT2BPETokenizer``
wraps since 0.17, or a ``tokenizer.json`` used with ``--tokenizer-type HuggingFaceTokenizer``)
turns the literal into the EOD id instead, so a corpus containing it tokenizes differently there.
"""
from __future__ import annotations

import json
import os

from megatron_lite.config import ConfigError

import regex

EOD_TOKEN = "<|endoftext|>"

# Contractions, letters, digits, other symbols (each with an optional leading space),
# then whitespace. `\s+(?!\S)` leaves the last space of a run to start the next word.
PRETOKENIZE_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

_CACHE_LIMIT = 200_000  # chunks; natural text repeats words, so a cache saves most merging


def bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character: printable Latin-1 bytes map to themselves, the rest to chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_merges(merge_file: str) -> list[tuple[str, str]]:
    """Reads ``merges.txt``: an optional ``#version`` header, then one ``left right`` pair per line."""
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if (line_number == 1 and line.startswith("#version")) or not line:
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise ValueError(f"{merge_file}:{line_number}: expected 'left right', got {line!r}; "
                                 "is --merge-file a GPT-2 style merges.txt?")
            merges.append((pair[0], pair[1]))
    return merges


def merge_pair(symbols: list[str], first: str, second: str) -> list[str]:
    """Replaces each non-overlapping occurrence of (first, second), left to right, by first + second."""
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
            merged.append(first + second)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def bpe_merge(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Repeatedly merges every occurrence of the lowest-ranked adjacent pair."""
    while len(symbols) > 1:
        best = min(zip(symbols, symbols[1:]), key=lambda pair: ranks.get(pair, float("inf")))
        if best not in ranks:
            break
        symbols = merge_pair(symbols, *best)
    return symbols


def to_byte_symbols(text: str, byte_encoder: dict[int, str]) -> list[str]:
    """UTF-8 bytes of ``text`` as printable characters (Latin-1 decoding gives one character per byte)."""
    return list(text.encode("utf-8").decode("latin-1").translate(byte_encoder))


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt)."""

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in [("--vocab-file", vocab_file), ("--merge-file", merge_file)]:
            if not path:
                raise ConfigError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file "
                                  "(merges.txt); train them with tools/train_tokenizer.py.")
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file. Give the vocab.json / merges.txt of a GPT-2 BPE, "
                                  "or train them with tools/train_tokenizer.py.")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: dict[str, int] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"--vocab-file {vocab_file} is not a JSON vocabulary (GPT-2's vocab.json); were "
                              f"--vocab-file and --merge-file swapped?") from None
        self.decoder = {i: token for token, i in self.encoder.items()}
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(read_merges(merge_file))}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        if EOD_TOKEN not in self.encoder:
            raise ConfigError(f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} token; GPT2BPETokenizer uses it as "
                              "end of document.")
        self.eod = self.encoder[EOD_TOKEN]
        self.pad = self.eod  # GPT-2 has no pad token; padded positions are masked out anyway
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def _encode_chunk(self, chunk: str) -> list[int]:
        symbols = bpe_merge(to_byte_symbols(chunk, self.byte_encoder), self.bpe_ranks)
        try:
            return [self.encoder[s] for s in symbols]
        except KeyError as error:
            raise ValueError(f"BPE produced {error.args[0]!r}, which is not in the vocabulary: "
                             "--vocab-file and --merge-file do not belong together.") from None

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for chunk in PRETOKENIZE_PATTERN.findall(text):
            chunk_ids = cache.get(chunk)
            if chunk_ids is None:
                chunk_ids = self._encode_chunk(chunk)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[chunk] = chunk_ids
            ids.extend(chunk_ids)
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
