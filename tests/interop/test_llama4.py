"""Llama 4 (``Llama4ForCausalLM``) beyond the MoE family harness (``test_hf_moe_families``, where it is one entry:
logits and greedy generation at 1 process, tp2 x pp2 and the expert-parallel layouts, the bit-exact round trip,
the fair fight with transformers' training, LoRA on every linear through peft, the --sft loss packed and not): its
config as transformers reads it (its defaults, a config.json that leaves them out), the variants refused by name,
the family an export picks, attention adapters back from PEFT (their q/k rows reordered), and the flags' checks."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatron_lite.checkpointing import read_config  # noqa: E402
from megatron_lite.checkpointing.resharding import CheckpointReader  # noqa: E402
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir  # noqa: E402
from megatron_lite.cli.arguments import parse_args  # noqa: E402
from megatron_lite.config import ConfigError, ModelConfig, OptimizerConfig, PeftConfig  # noqa: E402
from megatron_lite.interop.hf import checkpoint as hf_checkpoint, peft as hf_peft, weights as hf_weights  # noqa: E402
from megatron_lite.training.loop import pretrain  # noqa: E402
from tests.interop.hf_family_ranks import training_config  # noqa: E402
from tests.interop.test_hf_moe_families import EXPERTS, _import  # noqa: E402


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return _import("llama4_text", tmp_path_factory.mktemp("llama4_text"))


def test_config_maps_every_feature(llama4):
    config = read_config(llama4.root).model
    assert config.hf_model_type == "llama4_text" and config.kv_channels == 16
    assert [config.is_nope_layer(i) for i in range(2)] == [True, False] and config.qk_l2_norm
    assert config.attention_chunk_size == 6
    assert (config.attn_temperature_tuning, config.attn_temperature_floor_scale, config.attn_temperature_scale) == (
        True, 4, 0.5)
    assert config.use_rope_scaling and config.rotary_base == 1e6
    assert (config.rope_scaling_factor, config.rope_scaling_low_freq_factor, config.rope_scaling_high_freq_factor) == (
        16.0, 1.0, 1.0)
    assert (config.num_experts, config.moe_router_topk, config.moe_router_score_function) == (EXPERTS, 1, "sigmoid")
    assert config.moe_apply_probs_on_input and config.moe_layer_freq == "[0, 1]" and config.moe_aux_loss_coeff == 0
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size) == (
        48, 16, 16)


def _layers(config: ModelConfig) -> tuple:
    """(NoPE, chunked, MoE) of each layer."""
    return tuple([test(i) for i in range(config.num_layers)] for test in (
        config.is_nope_layer, lambda i: config.attention_chunk_size is not None and not config.is_nope_layer(i),
        config.is_moe_layer))


def test_a_config_without_the_defaults_reads_as_transformers_reads_it():
    """No layer_types, no_rope_layers, moe_layers, head_dim or chunk size: transformers' defaults (every 4th layer
    NoPE, the others chunked by 8192, experts on every interleave_moe_layer_step-th, head_dim 128); the fields that
    change nothing it computes (router_jitter_noise, cache_implementation) pass; attention_chunk_size null chunks
    nothing."""
    written = dict(model_type="llama4_text", vocab_size=100, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=8, interleave_moe_layer_step=2, router_jitter_noise=0.0,
                   cache_implementation="hybrid", for_llm_compressor=False)
    ours = hf_weights.model_config_from_hf(written)
    theirs = transformers.Llama4TextConfig(**{k: v for k, v in written.items() if k != "model_type"})
    assert _layers(ours) == ([not rotates for rotates in theirs.no_rope_layers],
                             [kind == "chunked_attention" for kind in theirs.layer_types],
                             [i in theirs.moe_layers for i in range(8)])
    assert (ours.kv_channels, ours.attention_chunk_size, ours.rotary_base) == (128, 8192, 500000.0)
    assert ours.qk_l2_norm and ours.attn_temperature_tuning and ours.attn_temperature_floor_scale == 8192
    unchunked = hf_weights.model_config_from_hf({**written, "attention_chunk_size": None})
    assert unchunked.attention_chunk_size is None and not any(_layers(unchunked)[1])
    # Released configs spell the tuning 4 (transformers 5's strict config refuses the int; its truth is meant).
    assert hf_weights.model_config_from_hf({**written, "attn_temperature_tuning": 4}).attn_temperature_tuning


def test_variants_are_refused_by_name(llama4):
    written = llama4.hf_model.config.to_dict()
    kinds = written["layer_types"]
    for field, value, message in [
            ("attention_bias", True, "attention_bias"), ("hidden_act", "gelu", "hidden_act 'gelu'"),
            ("num_experts_per_tok", 2, "num_experts_per_tok 2"), ("moe_layers", [], "no mixture-of-experts layer"),
            ("layer_types", kinds[::-1], "layer_types .* \\(chunked_attention on exactly the layers with rotary"),
            ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_type yarn"),
            ("rope_parameters", dict(written["rope_parameters"], original_max_position_embeddings=4096),
             "original_max_position_embeddings 4096"),
            ("for_llm_compressor", True, "for_llm_compressor"), ("sliding_window", 4, "field\\(s\\) sliding_window"),
            ("model_type", "llama4", "model_type llama4_text \\(Llama4ForCausalLM\\)")]:
        with pytest.raises(ConfigError, match=message):
            hf_weights.model_config_from_hf({**written, field: value})
    hf_config, tensors = hf_checkpoint.read_hf_directory(llama4.hf_dir)
    config = hf_weights.model_config_from_hf(hf_config)
    name = "model.layers.1.feed_forward.experts.gate_up_proj"
    with pytest.raises(ConfigError, match=f"hold {EXPERTS - 1} experts in layers.1.feed_forward.experts"):
        hf_weights.weights_from_hf(dict(tensors, **{name: tensors[name][1:]}), config, "llama4")


def test_export_picks_llama4_and_refuses_what_it_cannot_describe(llama4):
    """A model routing as Llama 4 does exports as Llama 4 without --hf-model-type; its shared expert must be as wide
    as the experts (intermediate_size is both), and no other family has its routing."""
    config = dataclasses.replace(read_config(llama4.root).model, hf_model_type=None)
    assert hf_weights.hf_config_from_model_config(config)["model_type"] == "llama4_text"
    with pytest.raises(ConfigError, match="moe_shared_expert_intermediate_size"):
        hf_weights.hf_config_from_model_config(dataclasses.replace(config, moe_shared_expert_intermediate_size=32))
    with pytest.raises(ConfigError, match="moe_apply_probs_on_input"):
        hf_weights.hf_config_from_model_config(config, "mixtral")


def _our_tensors(root: str) -> dict:
    reader = CheckpointReader(resolve_checkpoint_dir(root))
    return {name: reader.read(name) for name in reader.tensors if ".lora." in name and not name.startswith("optim")}


def test_attention_adapters_come_back_from_peft(llama4, tmp_path):
    """LoRA on q/k/v and o_proj exported to PEFT (q_proj's and k_proj's B rows interleaved as their weights) and
    imported back: the same factors (the harness checks peft's logits of the export)."""
    adapters, peft_dir, back = (str(tmp_path / name) for name in ("lora", "peft", "back"))
    config = training_config(llama4.root, adapters, 1, 1, optimizer=OptimizerConfig(lr=3e-2), peft_config=PeftConfig(
        peft="lora", lora_rank=4, lora_alpha=8.0, lora_target_modules=["linear_qkv", "linear_proj"]))
    pretrain(dataclasses.replace(config, training=dataclasses.replace(config.training, train_iters=1),
                                 checkpoint=dataclasses.replace(config.checkpoint, save_interval=1)))
    hf_peft.export_peft_adapters(adapters, peft_dir, base_model_name_or_path=llama4.hf_dir)
    hf_peft.import_peft_adapters(peft_dir, back, base_checkpoint=llama4.root)
    trained, returned = _our_tensors(adapters), _our_tensors(back)
    assert trained.keys() == returned.keys() and any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    for name, factor in trained.items():
        assert torch.equal(returned[name], factor), name


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--mock-data", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("flags,message", [
    (["--attention-chunk-size", "4", "--window-size", "3", "0"], "neither --multi-latent-attention nor --window"),
    (["--qk-l2-norm", "--qk-layernorm"], "drop --qk-layernorm"),
    (["--attn-temperature-tuning"], "add --no-rope-freq"),
    (["--rope-scaling-high-freq-factor", "1"], "add it"),
    (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "2", "--rope-scaling-high-freq-factor", "1"],
     "at most --rope-scaling-high-freq-factor"),
    (["--num-experts", "4", "--swiglu", "--moe-apply-probs-on-input"], "--moe-router-topk 1 only, got 2"),
    (["--moe-apply-probs-on-input"], "add --num-experts")])
def test_llama4_flags_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*BASE, *flags])


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_chunked_attention_takes_context_parallelism(comm):
    """Chunks under either --cp-comm-type (tests/context_parallel/test_equivalence.py trains them against one
    process): the configuration keeps both."""
    config = parse_args([*BASE, "--attention-chunk-size", "4", "--context-parallel-size", "2", "--cp-comm-type", comm,
                         "--attention-dropout", "0"])
    assert (config.model.attention_chunk_size, config.parallel.context_parallel_size) == (4, 2)
    assert config.parallel.cp_comm_type == [comm]
