"""The pad token of a Hugging Face import: the id the checkpoint records, and the note when data holds it.

transformers builds the input embedding of every family we import but GPT-2 as
``nn.Embedding(..., padding_idx=pad_token_id)``: that row never gets a gradient. megatron_lite trains
every row, as Megatron-LM does, unless ``--freeze-padding-embedding`` (docs/model_families.md). The two
differ only where the pad token occurs in the training data, which is where it is also a real token:
the eos (many configs set pad = eos, and every document ends in one), the bos, or any id the
tokenizer produces from text. The import says so once.
"""
from __future__ import annotations

import sys

from megatron_lite.tokenizer import build_tokenizer


def pad_token_id_from_hf(hf: dict) -> int | None:
    """config.json's pad_token_id when it is a row of the embedding (GPT-2's configs may name one past it)."""
    pad = hf.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < hf["vocab_size"] else None


def _ids(value) -> set:
    """An id field of config.json: None, one id, or a list of them (Gemma 3's eos_token_id)."""
    return set() if value is None else set(value) if isinstance(value, list) else {value}


def _also_produced_as(pad: int, hf: dict, tokenizer_flags: dict) -> str | None:
    """What else ``pad`` is in the data ("the eos token", ...), or None."""
    for field in ("eos_token_id", "bos_token_id"):
        if pad in _ids(hf.get(field)):
            return f"the {field.split('_')[0]} token"
    if tokenizer_flags:
        tokenizer = build_tokenizer(**tokenizer_flags)
        if tokenizer.tokenize(tokenizer.detokenize([pad])) == [pad]:
            return "a token its tokenizer produces from text"
    return None


def note_trained_pad_token(hf: dict, tokenizer_flags: dict, *, has_padding_idx: bool) -> None:
    """One note when the pad token is also a token of the data, so the default training (every row) differs
    from transformers' (``has_padding_idx``: its class freezes the row)."""
    pad = pad_token_id_from_hf(hf)
    what = None if pad is None or not has_padding_idx else _also_produced_as(pad, hf, tokenizer_flags)
    if what is not None:
        print(f"note: pad_token_id {pad} is also {what}, so the training data holds it: megatron_lite trains its "
              f"embedding row like every other (Megatron-LM's behaviour), where transformers' padding_idx gives it "
              f"no gradient; add --freeze-padding-embedding to train as transformers does "
              f"(docs/model_families.md).", file=sys.stderr)
