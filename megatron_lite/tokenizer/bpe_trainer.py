"""Trains a GPT-2 style byte-level BPE (``vocab.json`` + ``merges.txt``) from text.

Classic BPE training: count pre-tokenised chunks once, then repeatedly merge the most
frequent adjacent symbol pair. Pair counts are updated only for the words that contain
the merged pair, and a heap with lazy deletion finds the next most frequent pair, so a
few MB of text trains a 4k vocabulary in seconds.
"""
from __future__ import annotations

import heapq
import json
import os
from collections import Counter, defaultdict
from typing import Iterable

from megatron_lite.files import atomic_write
from megatron_lite.config import ConfigError
from megatron_lite.tokenizer.gpt2_bpe import (EOD_TOKEN, PRETOKENIZE_PATTERN, bytes_to_unicode, merge_pair,
                                             to_byte_symbols)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
                         special_tokens: tuple[str, ...] = (EOD_TOKEN,)
                         ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learns merges until the vocabulary (256 bytes + merges + special tokens) has ``vocab_size`` entries.

    Returns:
        (vocab, merges): token -> id (bytes 0-255 first, special tokens last) and the merges in rank order.
        Training stops early when no pair occurs ``min_frequency`` times.
    """
    num_merges = vocab_size - 256 - len(special_tokens)
    if num_merges < 0:
        raise ConfigError(f"--vocab-size {vocab_size} is below the 256 byte tokens + {len(special_tokens)} special.")
    byte_encoder = bytes_to_unicode()
    chunk_counts: Counter = Counter()
    for text in texts:
        chunk_counts.update(PRETOKENIZE_PATTERN.findall(text))
    words = [to_byte_symbols(chunk, byte_encoder) for chunk in chunk_counts]
    counts = list(chunk_counts.values())

    pair_counts: dict[tuple[str, str], int] = defaultdict(int)
    words_with_pair: dict[tuple[str, str], set[int]] = defaultdict(set)
    for index, (symbols, count) in enumerate(zip(words, counts)):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += count
            words_with_pair[pair].add(index)
    # Ties go to the lexicographically smallest pair, so training is deterministic.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative_count:
            continue  # stale heap entry: the count changed after it was pushed
        if -negative_count < min_frequency:
            break
        merges.append(pair)
        changed = set()
        for index in words_with_pair.pop(pair):
            old, count = words[index], counts[index]
            new = merge_pair(old, *pair)
            for p in zip(old, old[1:]):
                pair_counts[p] -= count
                changed.add(p)
            for p in zip(new, new[1:]):
                pair_counts[p] += count
                words_with_pair[p].add(index)
                changed.add(p)
            words[index] = new
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]

    vocab = {byte_encoder[b]: b for b in range(256)}
    for first, second in merges:
        vocab[first + second] = len(vocab)
    for token in special_tokens:
        vocab[token] = len(vocab)
    return vocab, merges


def save_gpt2_bpe_files(vocab: dict[str, int], merges: list[tuple[str, str]], output_dir: str) -> tuple[str, str]:
    """Writes ``vocab.json`` and ``merges.txt`` (with the ``#version`` header) atomically; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    vocab_file, merge_file = os.path.join(output_dir, "vocab.json"), os.path.join(output_dir, "merges.txt")
    contents = [(vocab_file, json.dumps(vocab, ensure_ascii=False)),
                (merge_file, "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))]
    for path, text in contents:
        with atomic_write(path) as f:
            f.write(text)
    return vocab_file, merge_file
