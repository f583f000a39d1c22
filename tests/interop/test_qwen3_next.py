"""Qwen3-Next's and Qwen3.5's own cases: the gated delta rule chunked against its recurrence, packed documents
restarting the DeltaNet, recomputation, Qwen3-Next's mixture of experts with its gated shared expert (logits and
greedy generation at 1 process, tp2 x pp2 and ep2 x pp2, a bit-exact round trip, clipped AdamW training against
transformers' at 1 process and ep2 x pp2), and the variants refused by name. The shared family
tests (tests/interop/test_hf_families.py) cover the dense models.
"""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.config import Config, ConfigError, ModelConfig, ParallelConfig, PeftConfig  # noqa: E402
from megatron_lite.interop.hf import checkpoint as hf_checkpoint, weights as hf_weights  # noqa: E402
from megatron_lite.model.delta_rule import (chunk_gated_delta_rule, l2_normalize,  # noqa: E402
                                            recurrent_gated_delta_rule)
from megatron_lite.model.gated_delta_net import GatedDeltaNet  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel  # noqa: E402
from megatron_lite.tensor_parallel import TensorParallelConfig  # noqa: E402
from tests.checkpointing.common import import_hf_model  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.inference.test_generation_vs_transformers import EOS, MAX_NEW_TOKENS, PROMPTS  # noqa: E402
from tests.interop.hf_family_ranks import layouts_rank, load  # noqa: E402
from tests.interop.test_hf_families import (HYBRID_ATOL, HYBRID_TOLERANCES, QWEN3_NEXT, VOCAB,  # noqa: E402
                                            _our_tensors)
from tests.interop.test_hf_moe_families import hf_generate  # noqa: E402
from tests.interop.transformers_training import fair_fight  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

ATOL = HYBRID_ATOL["qwen3_next"]


def test_chunked_delta_rule_equals_its_recurrence():
    """Chunks of 16 over 37 positions (a partial last chunk) from a given state: the outputs and final state of the
    token-by-token recurrence."""
    torch.manual_seed(0)
    shape = (2, 37, 3)
    query, key = (l2_normalize(torch.randn(*shape, 8)) for _ in range(2))
    value, decay, beta = torch.randn(*shape, 6), -2 * torch.rand(shape), torch.rand(shape)
    state = torch.randn(2, 3, 8, 6)
    chunked = chunk_gated_delta_rule(query, key, value, decay, beta, state, chunk_size=16)
    recurrent = recurrent_gated_delta_rule(query, key, value, decay, beta, state)
    for ours, reference in zip(chunked, recurrent):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_packed_documents_restart_the_convolution_and_the_scan():
    """Two documents packed in one row (the block-diagonal mask --sft-pack-sequences gives) compute what each
    computes alone, and a state carried over a document boundary would not."""
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=12, vocab_size=32,
                         experimental_attention_variant="gdn", linear_attention_freq="[1]", linear_key_head_dim=4,
                         linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         normalization="RMSNorm")
    torch.manual_seed(0)
    layer = GatedDeltaNet(config, layer_number=0, tp_config=TensorParallelConfig())
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.5)
    hidden = torch.randn(12, 1, 16)
    document = torch.tensor([0] * 5 + [1] * 7)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    mask = ~(causal & (document[:, None] == document[None, :]))[None, None]
    with torch.no_grad():
        packed, _ = layer(hidden, None, mask)
        alone = torch.cat([layer(hidden[:5])[0], layer(hidden[5:])[0]])
        carried, _ = layer(hidden)
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=1e-6)
    assert (carried[5:] - alone[5:]).abs().max() > 1e-2


# A gated DeltaNet layer with a dense MLP, then a gated attention layer with 4 experts (top 2, renormalised), a
# shared expert 16 wide and its sigmoid gate; the pooled load-balancing loss on.
QWEN3_NEXT_MOE = dict(QWEN3_NEXT, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=16,
                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
                      output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return import_hf_model("qwen3_next", transformers.Qwen3NextConfig(**QWEN3_NEXT_MOE),
                           tmp_path_factory.mktemp("qwen3_next_moe"), vocab=VOCAB, input_seed=1)


def test_moe_logits_and_generation_equal_transformers_at_every_layout(moe):
    config = hf_weights.model_config_from_hf(moe.hf_model.config.to_dict())
    assert config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size == 16
    assert config.moe_layer_freq == "[0,1]" and config.moe_router_load_balancing_type == "pooled_aux_loss"
    assert config.linear_attention_freq == "[1, 0]" and config.attention_output_gate and config.apply_layernorm_1p
    expected = hf_generate(moe.hf_model, PROMPTS)
    model, parallel_state = load(moe.root)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(moe.input_ids), moe.logits, atol=ATOL, rtol=1e-5)
    finally:
        destroy_model_parallel(parallel_state)
    per_rank = run_distributed(layouts_rank, 4, args=([(moe.root, moe.input_ids, [PROMPTS], [(2, 2, 1), (1, 2, 2)])],
                                                      dict(max_new_tokens=MAX_NEW_TOKENS, eod=EOS)))
    last_stage = 0
    for results in per_rank:
        for logits, generations in results:
            assert generations == [expected]
            if logits is not None:
                last_stage += 1
                torch.testing.assert_close(logits, moe.logits, atol=ATOL, rtol=1e-5)
    assert last_stage == 4  # two last-stage ranks at each layout


def test_moe_round_trip_is_bit_exact(moe, tmp_path):
    exported, again = str(tmp_path / "hf"), str(tmp_path / "again")
    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", moe.root,
                    "--save-dir", exported]) == 0
    hf_config, original = hf_checkpoint.read_hf_directory(moe.hf_dir)
    exported_config, round_trip = hf_checkpoint.read_hf_directory(exported)
    assert exported_config["model_type"] == "qwen3_next"
    assert hf_weights.model_config_from_hf(exported_config) == hf_weights.model_config_from_hf(hf_config)
    assert original.keys() == round_trip.keys() and "model.layers.1.mlp.shared_expert_gate.weight" in original
    for key in original:
        assert torch.equal(original[key], round_trip[key]), key
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(exported)(moe.input_ids).logits,
                           moe.logits)
    hf_checkpoint.import_hf_checkpoint(exported, again, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    first, second = _our_tensors(moe.root), _our_tensors(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_variants_are_refused_by_name(moe):
    hf = moe.hf_model.config.to_dict()
    for field, value, message in [
            ("layer_types", ["linear_attention", "sliding_attention"], "layer_types \\['sliding_attention'\\]"),
            ("layer_types", ["linear_attention"], "layer_types of 1 entries for 2 layers"),
            ("attention_bias", True, "attention_bias"),
            ("hidden_act", "gelu", "hidden_act 'gelu'"),
            ("rope_parameters", {"rope_type": "longrope", "factor": 2.0}, "rope scaling 'longrope'"),
            ("linear_conv_bias", True, "config.json field\\(s\\) linear_conv_bias ")]:
        with pytest.raises(ConfigError, match=message):
            hf_weights.model_config_from_hf({**hf, field: value})
    model = hf_weights.model_config_from_hf(hf)
    with pytest.raises(ConfigError, match="--context-parallel-size 2 with --experimental-attention-variant gdn"):
        Config(model=dataclasses.replace(model, seq_length=16), parallel=ParallelConfig(context_parallel_size=2))
    with pytest.raises(ConfigError, match="--linear-num-key-heads \\(2\\) must be divisible by "
                                          "--tensor-model-parallel-size \\(4\\)"):
        Config(model=dataclasses.replace(model, num_attention_heads=4, num_query_groups=4),
               parallel=ParallelConfig(tensor_model_parallel_size=4))
    with pytest.raises(ConfigError, match="--peft prefix prepends keys and values"):
        Config(model=model, peft=PeftConfig(peft="prefix"))
    with pytest.raises(ConfigError, match="--linear-attention-freq places gated DeltaNet layers"):
        dataclasses.replace(model, experimental_attention_variant=None)
    with pytest.raises(ConfigError, match="one 0 or 1 per layer"):
        dataclasses.replace(model, linear_attention_freq="[1]")
    # Without a shared expert the model has no Qwen3-Next form (its MoE layers always have one).
    with pytest.raises(ConfigError, match="moe_shared_expert"):
        hf_weights.hf_config_from_model_config(dataclasses.replace(
            model, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False))


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(granularity):
    """--recompute-granularity selective recomputes the DeltaNet's convolution and scan, full whole layers: the
    gradients of a hybrid model are those without recomputation."""
    from megatron_lite.model.gpt_model import GPTModel

    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                         normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                         experimental_attention_variant="gdn", linear_attention_freq="2", linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, hidden_dropout=0.0,
                         attention_dropout=0.0)
    input_ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    gradients = []
    for recompute in (None, granularity):
        torch.manual_seed(0)
        model = GPTModel(config, TensorParallelConfig(), recompute_granularity=recompute,
                         recompute_num_layers=1 if recompute == "full" else None)
        for param in model.parameters():
            torch.nn.init.normal_(param, 0.0, 0.1)
        model.train()
        model(input_ids, labels=input_ids).mean().backward()
        gradients.append(torch.cat([param.grad.flatten() for param in model.parameters()]))
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-7, rtol=1e-6)


def test_moe_fine_tuning_equals_transformers_with_clipping(moe, tmp_path):
    """AdamW with every step clipped, against transformers' training (its pooled load-balancing loss included), at
    1 process and at ep2 x pp2 (the experts split, the DeltaNet layer on the first stage)."""
    fair_fight({"qwen3_next": moe}, {"qwen3_next": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2)},
               tmp_path, {}, vocab=VOCAB, pad=EOS, tolerances=HYBRID_TOLERANCES)
