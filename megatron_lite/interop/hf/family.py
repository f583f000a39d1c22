"""What every Hugging Face family module declares: its ``Family`` (``config.json``'s fields and the
ModelConfig fields they give), and the refusals they share."""
from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_lite.config import ConfigError, ModelConfig


# PretrainedConfig's own fields and the token ids: bookkeeping, no effect on the logits.
GENERIC_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "tie_word_embeddings"})


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class
    naming: str  # "gpt2" or "llama": how the weights are named (weights)
    fields: frozenset  # config.json fields it reads
    to_ours: Callable[[dict], dict]  # config.json -> ModelConfig fields
    to_hf: Callable[[ModelConfig], dict]  # ModelConfig -> the family's own config.json fields
    features: dict = dataclasses.field(default_factory=dict)  # ModelConfig fields that select it on export
    also: frozenset = frozenset()  # optional features it may have besides (Mixtral's sliding window)
    padding_idx: bool = True  # transformers' input embedding gives the pad row no gradient (all but GPT-2, GPT-NeoX)


def refuse(condition: bool, what: str) -> None:
    if condition:
        raise ConfigError(f"this Hugging Face model uses {what}, which megatron_lite's GPT does not implement.")


def without_biases(to_ours: Callable[[dict], dict]) -> Callable[[dict], dict]:
    def read(hf: dict) -> dict:
        refuse(hf.get("attention_bias", False), "attention_bias (biases on q, k, v and o_proj)")
        refuse(hf.get("mlp_bias", False), "mlp_bias")
        return to_ours(hf)
    return read


def set_fields(hf: dict) -> dict:
    return {name: value for name, value in hf.items() if value is not None}
