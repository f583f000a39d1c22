"""OLMo 2 and 3: config.json read as transformers reads it (layer kinds, RoPE per kind, defaults), written back
the same, and the variants we do not compute refused by name. The models themselves (logits, generation,
training, LoRA, SFT against transformers) are in test_hf_families.py's tables."""
import pytest

transformers = pytest.importorskip("transformers")

from megatron_lite.config import ConfigError  # noqa: E402
from megatron_lite.interop.hf import weights as hf_weights  # noqa: E402
from megatron_lite.model.sliding_window import is_local_layer  # noqa: E402

SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4)


def _ours(hf_config) -> tuple:
    """(our ModelConfig, the config.json it exports) of a transformers config."""
    ours = hf_weights.model_config_from_hf(hf_config.to_dict())
    return ours, hf_weights.hf_config_from_model_config(ours)


def test_olmo3_defaults_read_as_transformers_reads_them():
    """Every fourth layer global, one rope_theta 5e5 for both kinds (no local base of their own), window 4096;
    the export reads back the same."""
    theirs = transformers.Olmo3Config(**SMALL)
    ours, exported = _ours(theirs)
    assert [not is_local_layer(ours, i) for i in range(8)] == [kind == "full_attention" for kind in theirs.layer_types]
    assert (ours.window_size, ours.window_attn_skip_freq, ours.rotary_base, ours.rotary_base_local) == (
        [4095, 0], 4, 5e5, None)
    assert ours.no_pre_sublayer_norm and ours.qk_layernorm_whole_projection and ours.norm_epsilon == 1e-5
    assert exported["layer_types"] == theirs.layer_types and exported["rope_parameters"] == theirs.rope_parameters
    assert hf_weights.model_config_from_hf(exported) == ours


def test_olmo3_older_rope_fields():
    """transformers < 5's rope_scaling is the global layers' only: the local layers then rotate unscaled
    (--rotary-base-local), as transformers' conversion makes them. A rope_theta of its own is refused: transformers
    5 gives it to the global layers alone (the local ones keep 5e5), transformers 4 to every layer."""
    legacy = {k: v for k, v in transformers.Olmo3Config(**SMALL).to_dict().items() if k != "rope_parameters"}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ours = hf_weights.model_config_from_hf({**legacy, "rope_theta": 5e5, "rope_scaling": yarn})
    theirs = transformers.Olmo3Config(**SMALL, rope_scaling=yarn).rope_parameters
    assert theirs["sliding_attention"] == {"rope_type": "default", "rope_theta": 5e5}
    assert (ours.position_embedding_type, ours.rotary_scaling_factor, ours.rotary_base, ours.rotary_base_local) == (
        "yarn", 4.0, 5e5, 5e5)
    assert transformers.Olmo3Config(**SMALL, rope_theta=300.0).rope_parameters["sliding_attention"]["rope_theta"] == 5e5
    with pytest.raises(ConfigError, match="rope_theta 300.0 without rope_parameters.sliding_attention"):
        hf_weights.model_config_from_hf({**legacy, "rope_theta": 300.0})


def test_olmo_variants_are_refused_by_name():
    olmo2 = transformers.Olmo2Config(**SMALL).to_dict()
    olmo3 = transformers.Olmo3Config(**SMALL).to_dict()
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    for config, field, value, message in [
            (olmo2, "attention_bias", True, "attention_bias"),
            (olmo2, "sliding_window", 4, "config.json field\\(s\\) sliding_window \\(not read by the olmo2 import\\)"),
            (olmo3, "layer_types", ["full_attention"] + ["sliding_attention"] * 7, "global layers \\[0\\]"),
            (olmo3, "layer_types", ["full_attention"] * 8, "no sliding_attention"),
            (olmo3, "rope_parameters", {"sliding_attention": linear}, "rope_parameters.sliding_attention"),
            (olmo3, "rope_parameters", {"rope_type": "default"}, "per layer kind")]:
        with pytest.raises(ConfigError, match=message):
            hf_weights.model_config_from_hf({**config, field: value})


def test_olmo_norms_need_post_sublayer_norm():
    from megatron_lite.cli.arguments import parse_args
    with pytest.raises(ConfigError, match="--no-pre-sublayer-norm .* add --post-sublayer-norm"):
        parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                    "--vocab-size", "64", "--mock-data", "--no-pre-sublayer-norm"])
