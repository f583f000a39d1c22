"""Preference pairs for --dpo: records read and tokenized, and laid out as pairs of sequences.

Records, in TRL's preference formats (files as for fine-tuning: JSONL, JSON array, Parquet, Arrow):
    strings          ``{"prompt": str, "chosen": str, "rejected": str}``: the prompt is the user's turn;
    conversational   ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``, or without
                     "prompt", ``chosen`` and ``rejected`` whole conversations whose shared first messages
                     are the prompt (TRL's implicit prompt).
Each side is the conversation prompt + answer, rendered with the chat template and tokenized as a
fine-tuning example (``prompt_format``); its loss mask covers the answer's tokens and the closing EOD only,
not earlier assistant turns of the prompt.

Preprocessed (``tools/preprocess_data.py --dpo``): the ids and loss masks of ``examples``' fine-tuning prefix, each
pair one document of two sequences (chosen, rejected), read as the records would be.

A pair is two sequences, chosen then rejected, and a sample is one sequence: sample 2k holds the chosen
side of pair-sample k and sample 2k + 1 its rejected side, so a micro-batch of an even size holds whole
pairs. Padded (the default), a pair-sample is one pair; packed (``--sft-pack-sequences``), pairs in order
fill both sequences while each side fits (the j-th document of one sequence pairs with the j-th of the
other). ``segment_ids`` numbers each position's document within its sequence (padding: ``seq_length``),
which the loss sums log-probabilities over. A side longer than ``seq_length`` + 1 tokens is truncated; a
pair that keeps no answer token on one side is dropped, and counted.
"""
from __future__ import annotations

import functools
import json

import numpy as np

from megatron_lite.config import ConfigError
from megatron_lite.data.sft.examples import (LOSS_MASK_KEY, TOKENS_KEY, check_prompt_format, is_preprocessed_sft,
                                             read_preprocessed, read_records)
from megatron_lite.data.sft.formats import SFTDataError, checked_messages
from megatron_lite.data.sft.prompt_format import format_prompt, tokenize_conversation
from megatron_lite.data.sft.sft_dataset import EpochLayout, build_sample, example_positions


def parse_preference_record(record) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen answer messages, rejected answer messages); raises SFTDataError."""
    if not isinstance(record, dict):
        raise SFTDataError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("chosen", "rejected") if key not in record]
    if missing:
        raise SFTDataError(f'a preference record needs "chosen" and "rejected" (and "prompt", unless they are '
                           f'whole conversations); this one lacks {" and ".join(repr(k) for k in missing)} (it has '
                           f'keys {sorted(record)})')
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise SFTDataError('string "chosen" and "rejected" need a string "prompt"')
        prompt = [{"role": "user", "content": prompt}]
        chosen, rejected = [_answer(chosen, "chosen")], [_answer(rejected, "rejected")]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = checked_messages(chosen, '"chosen"'), checked_messages(rejected, '"rejected"')
        if prompt is None:  # the shared first messages are the prompt
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        elif isinstance(prompt, list):
            prompt = checked_messages(prompt, '"prompt"', ends_with_answer=False)
        else:
            raise SFTDataError('message-list "chosen" and "rejected" need "prompt" as a message list too (or none)')
    else:
        raise SFTDataError('"chosen" and "rejected" must both be strings or both message lists')
    return prompt, chosen, rejected


def _answer(text: str, key: str) -> dict:
    if not text.strip():
        raise SFTDataError(f'empty "{key}" answer')
    return {"role": "assistant", "content": text}


def tokenize_side(prompt: list[dict], answer: list[dict], tokenizer, prompt_format: str):
    """(ids ending with EOD, loss mask over the answer's tokens and the EOD) of prompt + answer."""
    ids, mask = tokenize_conversation(prompt + answer, tokenizer, prompt_format)
    prompt_ids = format_prompt(prompt, tokenizer, prompt_format)
    if list(ids[:len(prompt_ids)]) != prompt_ids:
        raise ConfigError("the chat template renders the prompt differently from the start of the whole "
                          "conversation, so the answer's tokens cannot be located; use "
                          "--sft-tokenizer-prompt-format chatml or plain.")
    mask[:len(prompt_ids)] = 0
    return ids, mask


def encode_preference_line(line: str, tokenizer, prompt_format: str):
    """One record's JSON text -> ({TOKENS_KEY: [chosen ids, rejected ids], LOSS_MASK_KEY: [their masks]}, None), or
    (None, problem) for a bad one: what tools/preprocess_data.py --dpo writes, a pair per document."""
    try:
        sides = [tokenize_side(*side, tokenizer, prompt_format)
                 for side in _side_messages(parse_preference_record(json.loads(line)))]
    except json.JSONDecodeError as error:
        return None, f"malformed JSON ({error.msg} at column {error.colno})"
    except ConfigError:
        raise  # the template or tokenizer is wrong for every record, not this one
    except ValueError as error:  # SFTDataError, or text the tokenizer rejects
        return None, str(error)
    return {TOKENS_KEY: [ids for ids, _ in sides], LOSS_MASK_KEY: [mask for _, mask in sides]}, None


def _side_messages(record: tuple) -> tuple:
    """((prompt, chosen answer), (prompt, rejected answer)) of ``parse_preference_record``'s triple."""
    prompt, chosen, rejected = record
    return (prompt, chosen), (prompt, rejected)


class PreferencePairs:
    """Tokenized pairs: ``get(i) -> ((chosen ids, mask), (rejected ids, mask))`` and each side's ``lengths`` [n, 2],
    from sources in order: lists of tokenized pairs, or preprocessed (ids, masks) with sequences 2i, 2i + 1 pair i."""

    def __init__(self, sources: list, descriptions: tuple[str, ...] = ()):
        self.sources = sources
        self.descriptions = descriptions
        self.lengths = np.concatenate([_side_lengths(source) for source in sources]).astype(np.int64)
        self._starts = np.cumsum([0] + [len(_side_lengths(source)) for source in sources])

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, index: int):
        number = int(np.searchsorted(self._starts, index, side="right")) - 1
        source, local = self.sources[number], index - int(self._starts[number])
        if isinstance(source, list):
            return source[local]
        ids, masks = source
        return tuple((np.asarray(ids[2 * local + side], dtype=np.int64),
                      np.asarray(masks[2 * local + side], dtype=np.uint8)) for side in (0, 1))


def _side_lengths(source) -> np.ndarray:
    if isinstance(source, list):
        return np.asarray([[len(c[0]), len(r[0])] for c, r in source], dtype=np.int64).reshape(-1, 2)
    return np.asarray(source[0].sequence_lengths).reshape(-1, 2)


def load_preference_pairs(paths: list[str], tokenizer, prompt_format: str) -> PreferencePairs:
    """Pairs from data files (tokenized now) and preprocessed prefixes, in order; every bad record is named
    ``file:line`` (``file:row`` in a table)."""
    sources, descriptions = [], []
    for path in paths:
        if is_preprocessed_sft(path):
            check_prompt_format(path, prompt_format)
            sources.append(read_preprocessed(path, sequences_per_document=2))
            descriptions.append(f"{path}: {len(sources[-1][0]) // 2} preprocessed preference pairs")
            continue
        sources.append(_read_pairs(path, tokenize=lambda *record: tuple(
            tokenize_side(*side, tokenizer, prompt_format) for side in _side_messages(record))))
        descriptions.append(f"{path}: {len(sources[-1])} preference pairs")
    return PreferencePairs(sources, tuple(descriptions))


def count_preference_pairs(paths: list[str]) -> int:
    """The pairs of data files and preprocessed prefixes, each record checked as training reads it (everything but
    the tokenizing): a misnamed field fails at start-up, before any model is built."""
    return sum(len(read_preprocessed(path, sequences_per_document=2)[0]) // 2 if is_preprocessed_sft(path)
               else len(_read_pairs(path)) for path in paths)


def _read_pairs(path: str, tokenize=None) -> list:
    """(prompt, chosen, rejected) messages of every record of ``path``, each passed through ``tokenize`` (which
    may reject text); one SFTDataError names every bad record."""
    def parse(record):
        sides = parse_preference_record(record)
        return tokenize(*sides) if tokenize is not None else sides
    return read_records(path, parse)


class PreferenceDataset:
    """``dataset[i]``: sequence i (chosen side of pair-sample i // 2 when i is even, its rejected side when
    odd): the fields of an SFT sample plus ``segment_ids`` (int64 [seq_length], see the module docstring)."""

    def __init__(self, pairs: PreferencePairs, *, seq_length: int, num_samples: int, seed: int, pad_token: int,
                 pack_sequences: bool = False):
        self.pairs, self.seq_length, self.num_samples = pairs, seq_length, num_samples
        self.pad_token, self.pack_sequences = pad_token, pack_sequences
        self.num_truncated = int((pairs.lengths > seq_length + 1).any(axis=1).sum())
        kept = np.asarray([all(mask[1:seq_length + 1].any() for _, mask in pairs.get(i))
                           for i in range(len(pairs))], dtype=bool)
        self.kept = np.flatnonzero(kept)
        if not len(self.kept):
            raise SFTDataError(f"every one of the {len(pairs)} preference pairs has a side longer than --seq-length "
                               f"+ 1 = {seq_length + 1} tokens whose prompt fills the sequence: none has an answer "
                               f"token to compare. Raise --seq-length or shorten the prompts.")
        positions = example_positions(pairs.lengths[self.kept], seq_length)
        self.layout = EpochLayout(positions, num_samples=(num_samples + 1) // 2, seed=seed,
                                  bins=functools.partial(pair_bins, capacity=seq_length) if pack_sequences else None)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for a PreferenceDataset of {self.num_samples} samples")
        pair_sample, side = divmod(index, 2)
        sides = [self.pairs.get(int(self.kept[i]))[side] for i in self.layout.members(pair_sample)]
        sample = build_sample(sides, seq_length=self.seq_length, pad_token=self.pad_token,
                              pack_sequences=self.pack_sequences)
        sample["segment_ids"] = segment_ids(sides, self.seq_length)
        return sample

    def describe(self) -> str:
        """For the start-up summary: pairs, sequences, truncations and dropped pairs (never silent)."""
        layout = "packed" if self.pack_sequences else "one pair each, padded"
        dropped = len(self.pairs) - len(self.kept)
        return (f"{len(self.pairs)} preference pairs ({self.num_samples} sequences of {self.seq_length} positions, "
                f"two per pair-sample, {layout}, {len(self.layout.orders)} epochs; {self.num_truncated} pairs with a "
                f"side longer than --seq-length + 1 = {self.seq_length + 1} tokens truncated, {dropped} dropped for "
                f"keeping no answer token)" + "".join(f"; {d}" for d in self.pairs.descriptions))


def pair_bins(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Next-fit bins of pairs ``sizes`` [n, 2] (chosen, rejected positions): a pair joins the current bin while
    both of its sides fit their sequences, else opens the next; boundaries ``[0, s1, ..., n]``."""
    starts, used = [0], np.zeros(2, dtype=np.int64)
    for index, size in enumerate(sizes):
        if (used + size > capacity).any():
            starts.append(index)
            used[:] = 0
        used += size
    starts.append(len(sizes))
    return np.asarray(starts, dtype=np.int64)


def segment_ids(sides: list, seq_length: int) -> np.ndarray:
    """Each position's document number in a sequence laid out by ``build_sample``; padding gets ``seq_length``."""
    segments = np.full(seq_length, seq_length, dtype=np.int64)
    offset = 0
    for number, (ids, _) in enumerate(sides):
        end = offset + min(len(ids), seq_length + 1) - 1
        segments[offset:end] = number
        offset = end
    return segments
