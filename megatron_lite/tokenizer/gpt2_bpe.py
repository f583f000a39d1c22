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
import re
import sys

from megatron_lite.config import ConfigError

import regex

EOD_TOKEN = "<|endoftext|>"


def _pretokenize_pattern(letters: str, digits: str, spaces: str) -> str:
    r"""GPT-2's pattern over the given character classes: contractions, letters, digits, other symbols (each
    with an optional leading space), then whitespace; ``\s+(?!\S)`` leaves the last space of a run to start
    the next word."""
    return (rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{digits}]+| ?[^{spaces}{letters}{digits}]+"
            rf"|[{spaces}]+(?![^{spaces}])|[{spaces}]+")


def _ascii_members(character_class: str) -> str:
    """The ASCII characters that ``regex`` puts in ``character_class``, escaped for a class of ``re``."""
    return "".join(re.escape(chr(c)) for c in range(128) if regex.fullmatch(character_class, chr(c)))


PRETOKENIZE_PATTERN = regex.compile(_pretokenize_pattern(r"\p{L}", r"\p{N}", r"\s"))
# The same pattern for text that is all ASCII, in the standard library's `re`, which finds the chunks in half
# the time: its classes are the ASCII members of the Unicode ones, read from `regex` itself.
ASCII_PRETOKENIZE_PATTERN = re.compile(_pretokenize_pattern(*map(_ascii_members, (r"\p{L}", r"\p{N}", r"\s"))))


def pretokenize(text: str) -> list[str]:
    """The chunks of ``text`` that BPE merges within: PRETOKENIZE_PATTERN's matches."""
    return (ASCII_PRETOKENIZE_PATTERN if text.isascii() else PRETOKENIZE_PATTERN).findall(text)


_UNRANKED = sys.maxsize  # the rank of a pair that merges.txt does not list
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
    """Repeatedly merges every occurrence (left to right, without overlap) of the lowest-ranked adjacent pair.

    The ranks of the adjacent pairs are kept in a list beside the symbols: a merge changes only the ranks of
    its two neighbours, so a step is one ``min`` over that list rather than a dict lookup for every pair."""
    symbols = list(symbols)
    rank_of = ranks.get
    pair_ranks = [rank_of(pair, _UNRANKED) for pair in zip(symbols, symbols[1:])]
    while pair_ranks:
        best = min(pair_ranks)
        if best == _UNRANKED:
            break
        i = pair_ranks.index(best)
        first, second = symbols[i], symbols[i + 1]
        while True:
            symbols[i:i + 2] = [first + second]
            del pair_ranks[i]
            if i > 0:
                pair_ranks[i - 1] = rank_of((symbols[i - 1], symbols[i]), _UNRANKED)
            if i < len(pair_ranks):
                pair_ranks[i] = rank_of((symbols[i], symbols[i + 1]), _UNRANKED)
            i = _next_occurrence(symbols, pair_ranks, best, first, second, i + 1)
            if i < 0:
                break
    return symbols


def _next_occurrence(symbols: list[str], pair_ranks: list[int], rank: int, first: str, second: str,
                     start: int) -> int:
    """The position of the next pair (first, second) from ``start`` on, or -1 (ranks given as a plain dict
    may repeat, so a pair of the same rank is the same pair only where its symbols say so)."""
    while rank in pair_ranks[start:]:
        i = pair_ranks.index(rank, start)
        if symbols[i] == first and symbols[i + 1] == second:
            return i
        start = i + 1
    return -1


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
        for chunk in pretokenize(text):
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
