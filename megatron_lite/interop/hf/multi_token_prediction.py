"""Multi-token prediction layers in Hugging Face files (DeepSeek-V3, GLM-4.5) <-> ours (--mtp-num-layers).

config.json's num_nextn_predict_layers D is our mtp_num_layers (model/multi_token_prediction.py). The files
hold depth d as one more decoder layer after the L of the model, model.layers.{L + d}:

    theirs (model.layers.{L + d}.)          ours (mtp.layers.{d}.)
    enorm, hnorm, eh_proj                   enorm, hnorm, eh_proj      (eh_proj's input: [embedding; hidden])
    shared_head.norm                        final_layernorm
    the decoder layer's own tensors         mtp_model_layer.           (named as the family names a layer)
    embed_tokens, shared_head.head          the model's embedding and output layer

The last two are copies of the model's embedding and output layer in DeepSeek-V3's files, which Megatron-LM's
MTP shares: read only to check they are those copies, and written back as them. transformers builds no module
for these layers (they do not change its logits) and its save_pretrained drops them: such a directory says D
in config.json but holds none, and is imported without multi-token prediction (``without_absent_mtp_layers``).
"""
from __future__ import annotations

import dataclasses

from megatron_lite.config import ConfigError, ModelConfig

MTP_FIELDS = frozenset({"num_nextn_predict_layers"})
_RENAMED = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
            ("shared_head.norm.weight", "final_layernorm.weight"))


def mtp_fields_to_ours(hf: dict) -> dict:
    return {"mtp_num_layers": hf.get("num_nextn_predict_layers") or None}


def mtp_fields_to_hf(config: ModelConfig) -> dict:
    return {"num_nextn_predict_layers": config.mtp_num_layers or 0}


def without_absent_mtp_layers(config: ModelConfig, tensors: dict) -> ModelConfig:
    """``config`` without multi-token prediction when the files hold none of its layers (a directory
    transformers saved); a file with some of them is read as it is (and refused by name if incomplete)."""
    first = f"layers.{config.num_layers}.eh_proj.weight"
    if config.mtp_num_layers is None or any(name.endswith(first) for name in tensors):
        return config
    print(f" note: config.json has num_nextn_predict_layers {config.mtp_num_layers} but the weights hold no "
          f"multi-token prediction layer (no model.{first}; transformers' save_pretrained drops them): imported "
          f"without them.", flush=True)
    return dataclasses.replace(config, mtp_num_layers=None)


def _prefixes(config: ModelConfig, depth: int, theirs_prefix: str) -> tuple[str, str, int]:
    number = config.num_layers + depth  # the layer's kind is the decoder's last (ModelConfig.pattern_layer)
    return f"{theirs_prefix}layers.{number}.", f"mtp.layers.{depth}.", number


def _copies(config: ModelConfig, theirs: str) -> tuple:
    """(their copy, the tensor of ours it copies) for depth ``theirs``'s embedding and output layer."""
    output = "output_layer.weight" if config.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    return ((theirs + "embed_tokens.weight", "embedding.word_embeddings.weight"),
            (theirs + "shared_head.head.weight", output))


def mtp_from_hf(take, tensors: dict, ours: dict, config: ModelConfig, layer_from_hf) -> dict:
    """Every depth's weights from the Hugging Face tensors (``take`` removes one, naming the file's model prefix
    away; ``tensors`` is what is left), ``ours`` the model's weights read so far, ``layer_from_hf(theirs, mine,
    number=)`` the family's reading of a decoder layer."""
    weights = {}
    for depth in range(config.mtp_num_layers):
        theirs, mine, number = _prefixes(config, depth, "")
        weights.update({mine + name: take(theirs + hf_name) for hf_name, name in _RENAMED})
        weights.update(layer_from_hf(theirs, mine + "mtp_model_layer.", number=number))
        for copy, original in _copies(config, theirs):
            if copy in tensors and not tensors[copy].equal(ours[original][:tensors[copy].shape[0]]):
                raise ConfigError(f"the Hugging Face weights' {copy} differs from the model's {original}: "
                                  f"megatron_lite's multi-token prediction shares the embedding and output layer "
                                  f"(as Megatron-LM's), so a layer with its own cannot be imported.")
            tensors.pop(copy, None)
    return weights


def mtp_to_hf(read, config: ModelConfig, layer_to_hf) -> dict:
    """Inverse of ``mtp_from_hf``, with DeepSeek-V3's copies of the embedding and output layer in every depth."""
    hf = {}
    for depth in range(config.mtp_num_layers):
        theirs, mine, number = _prefixes(config, depth, "model.")
        hf.update({theirs + hf_name: read(mine + name) for hf_name, name in _RENAMED})
        hf.update(layer_to_hf(theirs, mine + "mtp_model_layer.", number=number))
        hf.update({copy: read(original)[:config.vocab_size] for copy, original in _copies(config, theirs)})
    return hf
