"""What is gpt-oss's alone (the family harness, tests/interop/test_hf_moe_families.py, checks the rest): its
config.json read as Megatron-LM's flags, logits and greedy generation at tp2 x pp2, features that bite in the
harness's tiny model (the sinks, the clamp), the stacked experts counted, the variants refused by name, the
sinks' softmax against vanilla attention over one more key, and the flags' own checks.
"""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.checkpointing import read_config  # noqa: E402
from megatron_lite.cli.arguments import parse_args  # noqa: E402
from megatron_lite.config import ConfigError, ModelConfig  # noqa: E402
from megatron_lite.interop.hf import checkpoint as hf_checkpoint, weights as hf_weights  # noqa: E402
from megatron_lite.interop.megatron.args_mapping import (megatron_args_from_config,  # noqa: E402
                                                          model_config_from_megatron_args)
from megatron_lite.model.dot_product_attention import DotProductAttention  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.inference.test_generation_vs_transformers import EOS, MAX_NEW_TOKENS, PROMPTS  # noqa: E402
from tests.interop.hf_family_ranks import tp2_pp2_rank  # noqa: E402
from tests.interop.test_hf_moe_families import ATOL, RTOL, _import, hf_generate  # noqa: E402


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _import("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def test_config_maps_every_feature(gpt_oss):
    config = read_config(gpt_oss.root).model
    assert config.add_bias_linear and config.softmax_type == "learnable"
    assert (config.quick_geglu, config.glu_linear_offset, config.activation_func_clamp_value) == (True, 1.0, 1.0)
    assert config.window_size == [4, 0] and config.window_attn_skip_freq == 2  # layer 0 slides, layer 1 global
    assert config.position_embedding_type == "yarn" and not config.yarn_correction_range_round_to_int
    assert (config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 24)
    assert not config.moe_router_pre_softmax and config.moe_router_load_balancing_type == "pooled_aux_loss"
    assert config.kv_channels == 16 and config.num_query_groups == 2


def test_tp2_pp2_logits_and_generation_equal_transformers(gpt_oss):
    """The sinks split with the heads, the experts with their biases (fc2's added on one rank), the sliding layer
    on the first stage and the global one on the second."""
    generation = dict(max_new_tokens=MAX_NEW_TOKENS, eod=EOS)
    per_rank = run_distributed(tp2_pp2_rank, 4, args=([(gpt_oss.root, gpt_oss.input_ids)], PROMPTS, generation))
    expected_tokens = hf_generate(gpt_oss.hf_model, PROMPTS)
    results = [rank_results[0] for rank_results in per_rank]
    assert sum(logits is not None for logits, _ in results) == 2  # the last stage's two tensor-parallel ranks
    for logits, tokens in results:
        if logits is not None:
            torch.testing.assert_close(logits, gpt_oss.logits, atol=ATOL, rtol=RTOL)
        assert tokens == expected_tokens


def test_the_sinks_and_the_clamp_bite(gpt_oss):
    """Without sinks (a sink of -inf gets no attention) or without the clamp (a limit no value reaches) transformers'
    logits move far past the tolerance the harness holds ours to: a converter that dropped either would fail it."""
    original = {name: p.clone() for name, p in gpt_oss.hf_model.named_parameters() if name.endswith("sinks")}
    model = gpt_oss.hf_model
    try:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("sinks"):
                    parameter.fill_(-1e4)
            without_sinks = model(gpt_oss.input_ids).logits
            for name, parameter in model.named_parameters():
                if name in original:
                    parameter.copy_(original[name])
            for layer in model.model.layers:
                layer.mlp.experts.limit = 1e9
            without_clamp = model(gpt_oss.input_ids).logits
    finally:
        for layer in model.model.layers:
            layer.mlp.experts.limit = model.config.swiglu_limit
    for other in (without_sinks, without_clamp):
        assert (other - gpt_oss.logits).abs().max() > 1000 * ATOL
    with torch.no_grad():
        assert torch.equal(model(gpt_oss.input_ids).logits, gpt_oss.logits)  # the model is back as it was


def test_stacked_experts_must_be_as_many_as_the_config_says(gpt_oss):
    hf_config, tensors = hf_checkpoint.read_hf_directory(gpt_oss.hf_dir)
    config = hf_weights.model_config_from_hf(hf_config)
    fewer = {k: v[:-1] if ".mlp.experts." in k else v for k, v in tensors.items()}
    with pytest.raises(ConfigError, match=r"hold 3 experts in layers.0.mlp.experts.gate_up_proj, but its "
                                          r"config.json says num_local_experts 4"):
        hf_weights.weights_from_hf(fewer, config, "gpt_oss")


@pytest.mark.parametrize("field, value, message", [
    ("swiglu_alpha", 1.5, r"swiglu_alpha 1.5 \(quick GELU's sigmoid gain is 1.702\)"),
    ("attention_bias", False, "attention_bias false"),
    ("layer_types", ["full_attention", "sliding_attention"], r"global layers \[0\]"),
    ("quantization_config", {"quant_method": "mxfp4"}, r"field\(s\) quantization_config"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "attention_factor": 2.0},
     "attention_factor"),
])
def test_variants_we_do_not_implement_are_refused_by_name(gpt_oss, field, value, message):
    with pytest.raises(ConfigError, match=message):
        hf_weights.model_config_from_hf({**gpt_oss.hf_model.config.to_dict(), field: value})


def test_no_sliding_layer_is_full_attention_throughout(gpt_oss):
    hf = {**gpt_oss.hf_model.config.to_dict(), "layer_types": ["full_attention"] * 2}
    config = hf_weights.model_config_from_hf(hf)
    assert config.window_size is None and config.window_attn_skip_freq is None
    assert hf_weights.hf_config_from_model_config(config)["layer_types"] == ["full_attention"] * 2


def test_off_by_one_softmax_is_attention_over_one_more_key_whose_score_and_value_are_zero():
    """--softmax-type off-by-one, against SDPA given a first key of zeros (score 0) with a zero value, which every
    query sees: Megatron-LM's definition, computed another way."""
    heads, dim, length = 2, 8, 6
    config = ModelConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, seq_length=length,
                         vocab_size=16, softmax_type="off-by-one", attention_dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(length, 1, heads, dim, generator=generator) for _ in range(3))
    core = DotProductAttention(config, layer_number=0, softmax_scale=1 / math.sqrt(dim))
    ours = core(query, key, value, softmax_offset=torch.zeros(heads))
    zero = torch.zeros(1, 1, heads, dim)
    blocks = [t.permute(1, 2, 0, 3) for t in (query, torch.cat([zero, key]), torch.cat([zero, value]))]
    visible = torch.ones(length, length + 1, dtype=torch.bool).tril(1)  # the zero key, then causal
    reference = torch.nn.functional.scaled_dot_product_attention(*blocks, attn_mask=visible)
    torch.testing.assert_close(ours, reference.permute(2, 0, 1, 3).reshape(length, 1, -1), atol=1e-6, rtol=1e-5)


GPT_OSS_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                 "--vocab-size", "256", "--mock-data", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--num-experts", "4", "--softmax-type", "learnable",
                 "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
                 "--window-size", "127", "0", "--window-attn-skip-freq", "2"]


def test_megatron_flags_build_gpt_oss_and_their_checks_name_the_flag():
    model = parse_args(GPT_OSS_FLAGS).model
    assert (model.softmax_type, model.quick_geglu, model.glu_linear_offset, model.activation_func_clamp_value) == (
        "learnable", True, 1.0, 7.0)
    for drop, extra, message in [
            ("--swiglu", [], r"--quick-geglu, --glu-linear-offset, --activation-func-clamp-value change\(s\) the "
                             r"gated MLP of --swiglu"),
            (None, ["--geglu"], "--geglu and --quick-geglu each pick the gate"),
            (None, ["--activation-func-clamp-value", "-1"], "--activation-func-clamp-value must be finite and "
                                                            "positive"),
            (None, ["--softmax-type", "sinks"], "--softmax-type"),
            (None, ["--multi-latent-attention"], "--multi-latent-attention has none")]:
        with pytest.raises(ConfigError, match=message):
            parse_args([f for f in GPT_OSS_FLAGS if f != drop] + extra)


def test_megatron_lms_args_for_gpt_oss_map_both_ways():
    """Megatron-LM's args for gpt-oss's model (its --quick-geglu a gated unit without --swiglu, the SwiGLU fusion
    off for the clamp and offset, biased experts whole on each rank) and back to ours; its checkpoints' weights
    and logits: tests/interop/test_megatron_import.py's gpt-oss fixture, written by Megatron-LM itself."""
    config = parse_args(GPT_OSS_FLAGS)
    args = megatron_args_from_config(config, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                     iteration=1, source="ckpt")
    assert (args.swiglu, args.quick_geglu, args.bias_swiglu_fusion, args.softmax_type, args.window_size,
            args.expert_tensor_parallel_size) == (False, True, False, "learnable", (127, 0), 1)
    assert model_config_from_megatron_args(args, "ckpt") == config.model
