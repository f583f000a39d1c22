"""The ``--step-batch-size-schedule`` format (Megatron-Core 0.20's step batch-size schedule).

    --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"

Entries ``THRESHOLD:BATCH``, separated by spaces or commas, in any order. A threshold counts
TOKENS (Megatron's trainer passes --seq-length, and divides: samples = tokens // seq_length) and may
end in K, M, B or T (10^3 .. 10^12, decimals allowed: 2.4B). From THRESHOLD tokens consumed on, the
global batch is BATCH; the last entry's batch is the run's global batch.

One deliberate difference: Megatron reads a threshold through a float and truncates (``2.01K`` is 2009
tokens there), we read the decimal exactly (2010), so a threshold may sit one sample later than Megatron's.
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation

from megatron_lite.config.errors import ConfigError

FLAG = "--step-batch-size-schedule"
FORMAT = '"THRESHOLD:BATCH THRESHOLD:BATCH ..." (thresholds in tokens, suffixes K M B T, the first 0)'
SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_batch_size_schedule(text: str) -> list[tuple[int, int]]:
    """(threshold in tokens, global batch) pairs, sorted by threshold; a ConfigError names a bad entry."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ConfigError(f"{FLAG} is empty; expected {FORMAT}.")
    schedule = sorted(_parse_entry(entry) for entry in entries)
    if schedule[0][0] != 0:
        raise ConfigError(f"{FLAG}: the first threshold must be 0 (the batch the run starts with), got "
                          f"{schedule[0][0]} tokens; add an entry 0:BATCH.")
    for (threshold, batch), (next_threshold, next_batch) in zip(schedule, schedule[1:]):
        if next_threshold == threshold:
            raise ConfigError(f"{FLAG}: two entries at {threshold} tokens; thresholds must differ.")
        # Megatron-LM's training loop stops with an assertion when the micro-batch count drops; say it now.
        if next_batch < batch:
            raise ConfigError(f"{FLAG}: the batch drops from {batch} to {next_batch} at {next_threshold} tokens; "
                              "a schedule may only keep or grow the batch.")
    return schedule


def schedule_in_samples(schedule: list[tuple[int, int]], seq_length: int) -> list[tuple[int, int]]:
    """The thresholds in samples (tokens // seq_length, as Megatron), which must still increase strictly."""
    in_samples = [(threshold // seq_length, batch) for threshold, batch in schedule]
    for (tokens, _), (next_tokens, _), (samples, _), (next_samples, _) in zip(schedule, schedule[1:], in_samples,
                                                                              in_samples[1:]):
        if next_samples == samples:
            raise ConfigError(f"{FLAG}: the thresholds {tokens} and {next_tokens} tokens are the same sample "
                              f"({samples}) at --seq-length {seq_length}; move them at least one sequence apart.")
    return in_samples


def _parse_entry(entry: str) -> tuple[int, int]:
    threshold, colon, batch = entry.partition(":")
    parsed = (_parse_count(threshold), _parse_count(batch)) if colon else None
    if parsed is None or None in parsed:
        raise ConfigError(f"{FLAG}: cannot read the entry {entry!r}; expected {FORMAT}.")
    if parsed[1] <= 0:
        raise ConfigError(f"{FLAG}: the entry {entry!r} has batch {parsed[1]}; batch sizes must be positive.")
    return parsed


def _parse_count(text: str) -> int | None:
    """``2.4B`` -> 2400000000, exactly (Megatron goes through a float); None if it is not a count."""
    text = text.strip().upper()
    multiplier = SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SUFFIXES else text
    try:
        value = Decimal(digits) * multiplier
    except InvalidOperation:
        return None
    return int(value) if value.is_finite() and value >= 0 else None
