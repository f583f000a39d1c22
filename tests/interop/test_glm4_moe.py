"""GLM-4.5 (``Glm4MoeForCausalLM``) beyond the MoE family harness (``test_hf_moe_families``, where it is one entry):
logits and greedy generation at tensor 2 x pipeline 2, attention adapters exported to PEFT, the defaults
transformers fills in, the variants refused by name."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatron_lite.config import ConfigError, OptimizerConfig, PeftConfig  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel  # noqa: E402
from megatron_lite.training.loop import pretrain  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402
from megatron_lite.interop.hf import weights as hf_weights  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.inference.test_generation_vs_transformers import MAX_NEW_TOKENS, PROMPTS  # noqa: E402
from tests.interop.hf_family_ranks import layouts_rank, load, training_config  # noqa: E402
from tests.interop.test_hf_moe_families import ATOL, EOS, FAMILIES, RTOL, _import, hf_generate  # noqa: E402


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return _import("glm4_moe", tmp_path_factory.mktemp("glm4_moe"))


def test_logits_and_greedy_generation_at_tensor_and_pipeline_parallel_equal_transformers(glm):
    """tp2 x pp2: the q/k/v biases and q/k norms split by heads over the tensor ranks, the dense layer on the first
    stage and the experts on the second."""
    runs = [(glm.root, glm.input_ids, [PROMPTS[:3]], [(2, 2, 1)])]
    per_rank = run_distributed(layouts_rank, 4, args=(runs, dict(max_new_tokens=MAX_NEW_TOKENS, eod=EOS)))
    expected = hf_generate(glm.hf_model, PROMPTS[:3])
    logits = [rank[0][0] for rank in per_rank if rank[0][0] is not None]
    assert len(logits) == 2
    for result in logits:
        torch.testing.assert_close(result, glm.logits, atol=ATOL, rtol=RTOL)
    assert all(rank[0][1] == [expected] for rank in per_rank)


def test_attention_lora_exports_to_peft(glm, tmp_path):
    """LoRA on q/k/v (with their biases in the base) and o_proj, 2 steps: peft loads the export onto the original
    model and gives our logits (the harness covers the merged export of adapters on every linear)."""
    adapters, peft_dir = str(tmp_path / "lora"), str(tmp_path / "peft")
    config = training_config(glm.root, adapters, 1, 1, optimizer=OptimizerConfig(lr=3e-2), peft_config=PeftConfig(
        peft="lora", lora_rank=4, lora_alpha=8.0, lora_target_modules=["linear_qkv", "linear_proj"]))
    pretrain(dataclasses.replace(config, training=dataclasses.replace(config.training, train_iters=2),
                                 checkpoint=dataclasses.replace(config.checkpoint, save_interval=2)))
    model, parallel_state = load(adapters)
    try:
        with torch.no_grad():
            ours = model(glm.input_ids)
    finally:
        destroy_model_parallel(parallel_state)
    assert (ours - glm.logits).abs().max() > 1e-2  # LoRA moved the model
    assert convert(["--target-format", "peft", "--load-dir", adapters, "--save-dir", peft_dir,
                    "--base-model-name-or-path", glm.hf_dir]) == 0
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(glm.hf_dir),
                                             peft_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(glm.input_ids).logits, ours, atol=ATOL, rtol=RTOL)


def test_config_maps_glm_fields():
    hf = FAMILIES["glm4_moe"]().to_dict()
    config = hf_weights.model_config_from_hf(hf)
    assert (config.add_qkv_bias, config.qk_layernorm, config.rotary_percent, config.kv_channels) == (True, True, 0.5,
                                                                                                      16)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (config.moe_layer_freq, config.moe_router_num_groups, config.moe_router_group_topk) == ("[0,1]", 2, 1)
    assert (config.moe_router_topk_scaling_factor, config.moe_shared_expert_intermediate_size) == (2.5, 16)
    assert config.moe_aux_loss_coeff == 0.0 and config.ffn_hidden_size == 48
    # transformers' own default where config.json names no partial_rotary_factor: half of each head rotates.
    rope = {k: v for k, v in hf["rope_parameters"].items() if k != "partial_rotary_factor"}
    assert hf_weights.model_config_from_hf({**hf, "rope_parameters": rope}).rotary_percent == 0.5
    assert hf_weights.model_config_from_hf({**hf, "partial_rotary_factor": 1.0, "rope_parameters": rope}
                                           ).rotary_percent == 1.0
    dense = hf_weights.model_config_from_hf({**hf, "first_k_dense_replace": 2})
    assert dense.num_experts is None


@pytest.mark.parametrize("field, value, message", [
    ("norm_topk_prob", False, "norm_topk_prob false with sigmoid scores"),
    ("num_experts_per_tok", 4, "num_experts_per_tok 4 other than twice topk_group 1"),
    ("topk_method", "greedy", r"field\(s\) topk_method \(not read by the glm4_moe import\)"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 500.0}, "rope scaling 'longrope'"),
])
def test_variants_are_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        hf_weights.model_config_from_hf({**FAMILIES["glm4_moe"]().to_dict(), field: value})
