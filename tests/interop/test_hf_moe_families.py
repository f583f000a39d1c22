"""The mixture-of-experts families against transformers: Mixtral, Qwen3-MoE and OLMoE import, logits, the
router's auxiliary loss and its gradient, greedy generation, export, and every expert accounted for.

Each family is a tiny random model (4 experts, top 2, weights drawn wider than the init so each expert
computes something of its own), imported at tensor x pipeline 2 x 2 and loaded back at one process:

    mixtral    2 MoE layers, sliding window 5
    qwen3_moe  a dense layer (mlp_only_layers [0]) then an MoE layer (so at pp 2 the first stage has no
               router), q/k norms per head, head_dim 16 with hidden 32 / 4 heads, experts 24 wide and the
               dense MLP 48, norm_topk_prob (the top 2 renormalised)
    olmoe      2 MoE layers, q/k norms over the whole projection (split over tensor ranks), the top 2
               of the softmax kept as they are (norm_topk_prob false: --moe-router-pre-softmax)
    deepseek_  multi-latent attention (with a query latent, YaRN), a dense layer then an MoE layer of
    v3         8 experts in 2 groups (the best group by its best two, then the top 2), sigmoid scores
               chosen with a random e_score_correction_bias (our expert bias), renormalised, x 2.5, and a
               shared expert
    deepseek_  V2-Lite's attention (no query latent), the same layers: the softmax's top 2 within the group
    v2         of the best score (group_limited_greedy: --moe-router-group-score max), x 1.5, two shared
               experts
    glm4_moe   Llama's attention with q/k/v biases, q/k norms per head, rotary on half of each head's 16
           XX
               e_score_correction_bias, x 2.5, a shared expert)
    gpt_oss    biases on q/k/v/o, router and experts, a learned sink per head, a sliding layer (window 5) then
               a global one, YaRN (unrounded correction range: truncate false), the experts' gated unit clamped
               at swiglu_limit 1 (low enough to bite), their fused gate_up_proj with interleaved columns
               (tests/interop/test_gpt_oss.py: what is gpt-oss's alone)
    llama4_    a NoPE layer with a dense MLP 48 wide (its queries' temperature tuned from position 3: floor_scale 4,
    text       attn_scale 0.5), then a RoPE layer attending within chunks of 6 (q/k L2 norms, interleaved rotary
               rows, llama3 scaling with Scout's frequency factors 1 and 1) with 4 experts 16 wide, top 1, the
               router's sigmoid on the expert's input, and a shared expert; head_dim 16 (tests/interop/
               test_llama4.py: what is Llama 4's alone). Also at tp2 x pp2, and its packed --sft loss

The load-balancing loss: transformers pools the router statistics of all MoE layers, which the import
selects (``pooled_aux_loss``, ``hf_families``): its value, the training loss and the gradients are
transformers', at one process and under accumulation over pp2 x dp2. DeepSeek's transformers classes
compute none, and neither does its import.
"""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatron_lite.checkpointing import read_config  # noqa: E402
from megatron_lite.interop.hf import peft as hf_peft  # noqa: E402
from megatron_lite.interop.hf import checkpoint as hf_checkpoint, weights as hf_weights  # noqa: E402
from megatron_lite.checkpointing.offline import write_checkpoint  # noqa: E402
from megatron_lite.checkpointing.resharding import CheckpointReader  # noqa: E402
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir  # noqa: E402
from megatron_lite.config import ConfigError, OptimizerConfig, PeftConfig  # noqa: E402
from megatron_lite.inference.text_generation import generate  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel  # noqa: E402
from tests.checkpointing.common import Imported, import_hf_model  # noqa: E402
from megatron_lite.training.loop import pretrain  # noqa: E402
from tests.interop.hf_family_ranks import layouts_rank, load, sgd_step_gradients, training_config  # noqa: E402
from tests.interop.test_hf_families import SFT_PAIRS, sft_first_loss, sft_packings  # noqa: E402
from tests.interop.transformers_training import fair_fight  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.inference.test_generation_vs_transformers import EOS, MAX_NEW_TOKENS, PAD, PROMPTS, _hf_generate  # noqa: E402
from tests.sft.test_sft_training import _transformers_response_loss  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB, EXPERTS, TOPK, COEF = 100, 4, 2, 0.02
ATOL = RTOL = 1e-5
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=TOPK, output_router_logits=True,
             router_aux_loss_coef=COEF, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
             tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}
# Llama 4 Scout's scaling (a step at the original context: its frequency factors are equal), over a base whose
# slowest channels turn slowly enough for it to act.
LLAMA4_ROPE = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "low_freq_factor": 1.0,
               "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=8,
                num_experts_per_tok=TOPK, moe_intermediate_size=16, tie_word_embeddings=False, bos_token_id=EOS,
                eos_token_id=EOS, pad_token_id=PAD)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=48, num_hidden_layers=2, sliding_window=5, num_local_experts=EXPERTS),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=16,
        num_experts=EXPERTS, mlp_only_layers=[0], norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(
        **SMALL, intermediate_size=48, num_hidden_layers=2, num_experts=EXPERTS, norm_topk_prob=False),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=24, num_nextn_predict_layers=0, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, rope_parameters=dict(YARN, mscale=0.8, mscale_all_dim=0.6)),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **DEEPSEEK, q_lora_rank=None, n_group=2, topk_group=1, topk_method="group_limited_greedy", n_shared_experts=2,
        routed_scaling_factor=1.5, rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=0.7)),
    # transformers writes GLM's partial_rotary_factor into the rope_parameters it is given: a copy of SMALL's.
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **{k: v for k, v in SMALL.items() if k not in ("router_aux_loss_coef", "output_router_logits",
                                                       "rope_parameters")},
        rope_parameters=dict(SMALL["rope_parameters"]),
        intermediate_size=48, num_hidden_layers=2, head_dim=16, first_k_dense_replace=1, n_routed_experts=EXPERTS,
        moe_intermediate_size=16, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**SMALL, "rope_parameters": dict(YARN, truncate=False)}, intermediate_size=24, num_hidden_layers=2,
        head_dim=16, num_local_experts=EXPERTS, sliding_window=5, swiglu_limit=1.0),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **{**SMALL, "num_experts_per_tok": 1, "rope_parameters": LLAMA4_ROPE}, intermediate_size=16,
        intermediate_size_mlp=48, num_hidden_layers=2, head_dim=16, num_local_experts=EXPERTS, no_rope_layers=[0, 1],
        interleave_moe_layer_step=2, attention_chunk_size=6, floor_scale=4, attn_scale=0.5),
}
# Where each family names expert e's gate projection (gpt-oss stacks its experts: test_gpt_oss.py).
EXPERT_NAMES = {"mixtral": "block_sparse_moe.experts.{e}.w1.weight", **{
    name: "mlp.experts.{e}.gate_proj.weight" for name in ("qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2",
                                                          "glm4_moe")}}
# transformers' router weight of each layer, where not mlp.gate.weight.
ROUTER_NAMES = {"gpt_oss": "mlp.router.weight", "llama4_text": "feed_forward.router.weight"}
# transformers' files hold each expert's gate, up and down projection apart, but gpt-oss's four stacked tensors and
# Llama 4's two.
EXPERT_TENSORS = {"gpt_oss": lambda experts: 4, "llama4_text": lambda experts: 2}
# The module of transformers' experts, where not mlp.experts.
EXPERTS_MODULES = {"llama4_text": "feed_forward.experts"}


def _fc1_of_expert(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """One expert's transformers gate_up_proj (or its gradient) as our fc1, [gate; up]: gpt-oss's is [in, out] with
    gate and up interleaved columns, Llama 4's [in, out] with [gate | up] columns, the others' already ours."""
    if name == "llama4_text":
        return gate_up.t()
    if name != "gpt_oss":
        return gate_up
    return torch.cat([gate_up[:, 0::2].t(), gate_up[:, 1::2].t()])
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v2")
# DeepSeek's routing and Llama 4's, for which transformers computes no load-balancing loss.
UNBALANCED_FAMILIES = (*DEEPSEEK_FAMILIES, "glm4_moe", "llama4_text")
# transformers' Llama 4 scales the NoPE layers' queries by the batch row's column (a left-padded prompt's padding
# included; ours by the position in the prompt: model/attention_temperature.py): its greedy tokens of a batch are
# those of each prompt alone.
TEMPERATURE_BY_COLUMN = ("llama4_text",)
# Layouts beside the expert-parallel ones, where a family has none of its own test (tp2 x pp2).
EXTRA_LAYOUTS = {"llama4_text": [(2, 2, 1)]}
# Dense MLPs (a dense layer, shared experts) in a model whose gate/up/down_proj peft remaps: no PEFT export of them.
PEFT_REFUSED = ("qwen3_moe", *DEEPSEEK_FAMILIES, "glm4_moe")


def _moe_layers(imported: Imported) -> list[int]:
    config = read_config(imported.root).model
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def _random_expert_bias(hf_model) -> None:
    """DeepSeek-V3's e_score_correction_bias: a buffer, which widen_and_save leaves at 0."""
    for module in hf_model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_(0.0, 0.5)


def _import(name: str, directory) -> Imported:
    return import_hf_model(name, FAMILIES[name](), directory, vocab=VOCAB, input_seed=1, prepare=_random_expert_bias)


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Every family's import, built once for the module (the expert-parallel test runs them all)."""
    return {name: _import(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.fixture(params=sorted(FAMILIES))
def family(request, imports) -> Imported:
    return imports[request.param]


def test_config_maps_every_feature(imports):
    mixtral, qwen3_moe, olmoe = (read_config(imports[n].root).model for n in ("mixtral", "qwen3_moe", "olmoe"))
    v3, v2 = (read_config(imports[n].root).model for n in DEEPSEEK_FAMILIES)
    for config in (v3, v2):
        assert (config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, TOPK, 16)
        assert config.multi_latent_attention and config.moe_layer_freq == "[0, 1]" and config.moe_aux_loss_coeff == 0
        assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert v3.moe_router_score_function == "sigmoid" and v3.moe_router_enable_expert_bias
    assert (v3.moe_router_group_score, v3.moe_router_topk_scaling_factor) == ("topk_sum", 2.5)
    assert v3.moe_shared_expert_intermediate_size == 16
    assert v2.moe_router_pre_softmax and (v2.moe_router_group_score, v2.moe_router_topk_scaling_factor) == ("max", 1.5)
    assert v2.moe_shared_expert_intermediate_size == 32 and not v2.moe_router_enable_expert_bias
    for config in (mixtral, qwen3_moe, olmoe):
        assert (config.num_experts, config.moe_router_topk) == (EXPERTS, TOPK)
        assert config.moe_router_score_function == "softmax"
        assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("pooled_aux_loss", COEF)
    assert mixtral.window_size == [4, 0] and mixtral.moe_layer_freq == "1" and not mixtral.moe_router_pre_softmax
    assert mixtral.moe_ffn_hidden_size == 48
    assert qwen3_moe.moe_layer_freq == "[0, 1]"
    assert (qwen3_moe.ffn_hidden_size, qwen3_moe.moe_ffn_hidden_size) == (48, 24)
    assert qwen3_moe.qk_layernorm and not qwen3_moe.qk_layernorm_whole_projection and qwen3_moe.kv_channels == 16
    assert not qwen3_moe.moe_router_pre_softmax
    assert olmoe.qk_layernorm and olmoe.qk_layernorm_whole_projection and olmoe.moe_router_pre_softmax
    assert olmoe.moe_layer_freq == "1" and olmoe.moe_ffn_hidden_size == 48


def hf_generate(hf_model, prompts):
    """transformers' greedy tokens; its generate computes no router loss (transformers 5.24's Mixtral fails to, on
    a left-padded batch: the attention mask is not cut to the new token)."""
    kept, hf_model.config.output_router_logits = hf_model.config.output_router_logits, False
    try:
        if hf_model.config.model_type in TEMPERATURE_BY_COLUMN:
            return [_hf_generate(hf_model, [prompt], EOS)[0] for prompt in prompts]
        return _hf_generate(hf_model, prompts, EOS)
    finally:
        hf_model.config.output_router_logits = kept


def test_logits_and_greedy_generation_equal_transformers(family):
    model, parallel_state = load(family.root)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(family.input_ids), family.logits, atol=ATOL, rtol=RTOL)
        batched = hf_generate(family.hf_model, PROMPTS)
        assert len({tuple(row) for row in batched}) == len(PROMPTS) and max(map(len, batched)) == MAX_NEW_TOKENS
        assert generate(model, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eod=EOS, greedy=True) == batched
        assert generate(model, PROMPTS[1:2], max_new_tokens=MAX_NEW_TOKENS, eod=EOS, greedy=True) == hf_generate(
            family.hf_model, PROMPTS[1:2])
    finally:
        destroy_model_parallel(parallel_state)


def test_expert_parallel_logits_and_generation_equal_transformers(imports):
    """ep2 (with dp), ep2 x tp2 and ep2 x pp2 of every family, in one world of 4 ranks (one start-up for all).
    Generation (of every family: Qwen3-MoE's first stage at pp2 has no router, DeepSeek's cache holds the latent)
    takes three prompts, then (Mixtral, Qwen3-MoE, DeepSeek-V3) one: tensor-parallel ranks without sequence
    parallelism split a step's tokens unevenly, and one of them gets none."""
    names = sorted(FAMILIES)
    layouts = {name: [(1, 1, 2), (2, 1, 2), (1, 2, 2), *EXTRA_LAYOUTS.get(name, [])] for name in names}
    generation = dict(max_new_tokens=MAX_NEW_TOKENS, eod=EOS)
    batches = {name: [PROMPTS[:3], PROMPTS[3:]] if name in ("mixtral", "qwen3_moe", "deepseek_v3") else [PROMPTS[:3]]
               for name in names}
    runs = [(imports[name].root, imports[name].input_ids, batches[name], layouts[name]) for name in names]
    per_rank = run_distributed(layouts_rank, 4, args=(runs, generation))
    expected = {name: [hf_generate(imports[name].hf_model, prompts) for prompts in batches[name]] for name in names}
    for index, (name, layout) in enumerate((name, layout) for name in names for layout in layouts[name]):
        expected_tokens = expected[name]
        results = [rank_results[index] for rank_results in per_rank]
        assert sum(logits is not None for logits, _ in results) == (2 if layout[1] > 1 else 4), (name, layout)
        for logits, tokens in results:
            if logits is not None:
                torch.testing.assert_close(logits, imports[name].logits, atol=ATOL, rtol=RTOL, msg=f"{name} {layout}")
            assert tokens == expected_tokens, (name, layout)


def _labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Ours predicts every position's next token; transformers' labels are the inputs (shifted inside)."""
    return torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # the last position's label is unused


def _routers(model) -> list:
    return [layer.mlp.router for layer in model.decoder.layers.values() if hasattr(layer.mlp, "router")]


def test_training_loss_and_gradients_are_transformers(family):
    """transformers' loss = cross entropy + router_aux_loss_coef x aux_loss, with its load-balancing statistics
    pooled over the MoE layers (``pooled_aux_loss``): our language-model loss with the routers' gradient attached
    must have the same value and the same gradient in every weight."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(family.hf_dir).train()
    output = hf_model(family.input_ids, labels=family.input_ids, output_router_logits=True)
    output.loss.backward()
    model, parallel_state = load(family.root)
    try:
        model.train()
        lm_loss = model(family.input_ids, labels=_labels(family.input_ids))[:, :-1].mean()
        lm_loss.backward()
        routers = _routers(model)
        pooled = sum(r.loss_sums["pooled_load_balancing_loss"] for r in routers)  # the layers' shares
        if family.name in UNBALANCED_FAMILIES:  # no load-balancing loss in transformers', nor in the import
            assert getattr(output, "aux_loss", None) is None and pooled == 0
        else:
            assert pooled.item() == pytest.approx(output.aux_loss.item(), rel=1e-6)
        torch.testing.assert_close(lm_loss + routers[0].aux_loss_coeff * pooled, output.loss.detach(), atol=1e-6,
                                   rtol=1e-6)
        ours = {name: p.grad for name, p in model.named_parameters()}
        theirs = {name: p.grad for name, p in hf_model.named_parameters()}
        first = _moe_layers(family)[0]
        router = ROUTER_NAMES.get(family.name, "mlp.gate.weight")
        pairs = {f"decoder.layers.{i}.mlp.router.weight": theirs[f"model.layers.{i}.{router}"]
                 for i in _moe_layers(family)}
        experts = EXPERTS_MODULES.get(family.name, "mlp.experts")
        pairs.update({f"decoder.layers.{first}.mlp.experts.local_experts.{e}.linear_fc1.weight":
                      _fc1_of_expert(family.name, theirs[f"model.layers.{first}.{experts}.gate_up_proj"][e])
                      for e in range(EXPERTS)})
        for name, gradient in pairs.items():
            torch.testing.assert_close(ours[name], gradient, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(ours["embedding.word_embeddings.weight"][:VOCAB],
                                   theirs["model.embed_tokens.weight"], atol=1e-6, rtol=1e-5)
    finally:
        destroy_model_parallel(parallel_state)


def test_router_loss_gradient_under_accumulation_data_and_pipeline_parallelism_is_transformers(imports):
    """Four micro-batches, accumulated at one process and over pp2 x dp2 (each data-parallel rank two, the
    pooled statistics of each micro-batch travelling between the stages with its activation and its gradient):
    the step's gradient is transformers' gradient of the mean of the micro-batches' losses (cross entropy +
    coefficient x aux_loss), as its Trainer accumulates them."""
    family = imports["mixtral"]  # an MoE layer on each stage
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(family.hf_dir).train()
    ids = torch.randint(2, VOCAB, (4, 2, 16), generator=torch.Generator().manual_seed(3))
    for micro_batch in ids:
        (hf_model(micro_batch, labels=micro_batch, output_router_logits=True).loss / len(ids)).backward()
    theirs = {name: p.grad for name, p in hf_model.named_parameters()}
    # The last position, whose next token transformers does not have, is masked out of our loss (the router
    # still sees all 16 tokens, as transformers').
    loss_mask = torch.ones(2, 16)
    loss_mask[:, -1] = 0
    microbatches = [{"tokens": m, "labels": _labels(m), "loss_mask": loss_mask,
                     "position_ids": torch.arange(16).expand(2, 16)} for m in ids]
    expected = {f"decoder.layers.{i}.mlp.router.weight": theirs[f"model.layers.{i}.mlp.gate.weight"] for i in (0, 1)}
    expected.update({"decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight":
                     theirs["model.layers.0.mlp.experts.down_proj"][3],
                     "decoder.layers.0.self_attention.linear_proj.weight":
                     theirs["model.layers.0.self_attn.o_proj.weight"]})
    single = sgd_step_gradients(0, 1, family.root, microbatches)
    pipelined = {}
    for rank_gradients in run_distributed(sgd_step_gradients, 4, args=(family.root, microbatches, 2)):
        pipelined.update(rank_gradients)
    for ours, what in ((single, "one process"), (pipelined, "pp2 x dp2")):
        for name, gradient in expected.items():
            torch.testing.assert_close(torch.from_numpy(ours[name]), gradient, atol=1e-6, rtol=1e-5,
                                       msg=f"{name} at {what}")


def _our_tensors(root: str) -> dict:
    reader = CheckpointReader(resolve_checkpoint_dir(root))
    return {name: reader.read(name) for name in reader.tensors}


def test_round_trip_is_bit_exact(family, tmp_path):
    exported, again = str(tmp_path / "hf"), str(tmp_path / "again")
    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", family.root,
                    "--save-dir", exported]) == 0
    hf_config, original = hf_checkpoint.read_hf_directory(family.hf_dir)
    exported_config, round_trip = hf_checkpoint.read_hf_directory(exported)
    assert exported_config["model_type"] == family.name
    if family.name not in UNBALANCED_FAMILIES:
        assert exported_config["router_aux_loss_coef"] == pytest.approx(COEF)
        assert exported_config["output_router_logits"]
    assert hf_weights.model_config_from_hf(exported_config) == hf_weights.model_config_from_hf(hf_config)
    assert original.keys() == round_trip.keys()
    experts = read_config(family.root).model.num_experts
    per_layer = EXPERT_TENSORS.get(family.name, lambda experts: experts * 3)(experts)
    assert sum(".experts." in key for key in original) == len(_moe_layers(family)) * per_layer
    for key in original:
        assert torch.equal(original[key], round_trip[key]), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(family.input_ids).logits, family.logits)
    hf_checkpoint.import_hf_checkpoint(exported, again, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    first, second = _our_tensors(family.root), _our_tensors(again)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


@pytest.mark.parametrize("name", sorted(EXPERT_NAMES))  # gpt-oss stacks its experts: test_gpt_oss.py counts them
def test_an_expert_missing_or_extra_in_the_files_is_refused(imports, name):
    family = imports[name]
    hf_config, tensors = hf_checkpoint.read_hf_directory(family.hf_dir)
    config = hf_weights.model_config_from_hf(hf_config)
    naming = hf_checkpoint.FAMILIES[family.name].naming
    layer, last = _moe_layers(family)[0], config.num_experts - 1
    missing = {k: v for k, v in tensors.items() if f".experts.{last}." not in k}
    expert = f"layers.{layer}.{EXPERT_NAMES[family.name].format(e=last)}"
    with pytest.raises(ConfigError, match=f"have no '{expert}'"):
        hf_weights.weights_from_hf(missing, config, naming)
    extra = dict(tensors, **{k.replace(f".experts.{last}.", f".experts.{last + 1}."): v for k, v in tensors.items()
                             if f".experts.{last}." in k})
    with pytest.raises(ConfigError, match=rf"not understood .*experts\.{last + 1}\."):
        hf_weights.weights_from_hf(extra, config, naming)


def test_a_duplicated_expert_changes_the_logits(family, tmp_path):
    """What makes the logits test catch a converter that writes one expert's weights for another: here
    expert 2 of the first MoE layer is replaced by expert 1, as such a converter would, and the logits move."""
    tensors = _our_tensors(family.root)
    for projection in ("linear_fc1", "linear_fc2"):
        name = f"decoder.layers.{_moe_layers(family)[0]}.mlp.experts.local_experts.{{}}.{projection}.weight"
        tensors[name.format(2)] = tensors[name.format(1)]
    write_checkpoint(str(tmp_path / "dup"), read_config(family.root), tensors.__getitem__, iteration=0)
    model, parallel_state = load(str(tmp_path / "dup"))
    try:
        with torch.no_grad():
            assert (model(family.input_ids) - family.logits).abs().max() > 100 * ATOL
    finally:
        destroy_model_parallel(parallel_state)


# ---------------------------------------------------------------------------------------------
# Fine-tuning


def test_lora_on_attention_and_experts_exports_to_peft_and_merges(family, tmp_path):
    """LoRA on every linear (attention, each expert's fc1 and fc2, the dense MLPs), 2 steps: the merged export
    loads in transformers and gives our logits, and so does the PEFT export (experts as PEFT's
    target_parameters) loaded in peft, where peft can load it: not with dense MLPs adapted (a dense layer,
    shared experts) in the families whose gate/up/down_proj it takes for the experts'."""
    adapters, peft_dir, merged = (str(tmp_path / name) for name in ("lora", "peft", "merged"))
    config = training_config(family.root, adapters, 1, 1, optimizer=OptimizerConfig(lr=3e-2),
                             peft_config=PeftConfig(peft="lora", lora_rank=4, lora_alpha=8.0))
    pretrain(dataclasses.replace(config, training=dataclasses.replace(config.training, train_iters=2),
                                 checkpoint=dataclasses.replace(config.checkpoint, save_interval=2)))
    model, parallel_state = load(adapters)
    try:
        with torch.no_grad():
            ours = model(family.input_ids)
    finally:
        destroy_model_parallel(parallel_state)
    assert (ours - family.logits).abs().max() > 1e-2  # LoRA moved the model
    assert convert(["--merge-lora", "--target-format", "hf", "--load-dir", adapters, "--save-dir", merged]) == 0
    with torch.no_grad():
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(family.input_ids).logits
    torch.testing.assert_close(merged_logits, ours, atol=ATOL, rtol=RTOL)
    if family.name in PEFT_REFUSED:  # its dense layer 0: peft would read gate_proj etc. as the experts'
        with pytest.raises(ConfigError, match=rf"of a {family.name} model's dense MLPs \(layers \[0\]"):
            hf_peft.export_peft_adapters(adapters, peft_dir, base_model_name_or_path=family.hf_dir,
                                         hf_model_type=family.name)
        return
    assert convert(["--target-format", "peft", "--load-dir", adapters, "--save-dir", peft_dir,
                    "--base-model-name-or-path", family.hf_dir]) == 0
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(family.hf_dir),
                                             peft_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(family.input_ids).logits, ours, atol=ATOL, rtol=RTOL)
    with pytest.raises(ConfigError, match="target_parameters"):  # expert adapters are exported, not imported
        hf_peft.import_peft_adapters(peft_dir, str(tmp_path / "back"), base_checkpoint=family.root)


def test_expert_adapters_with_dropout_export_merged_only(imports, tmp_path):
    family = imports["olmoe"]
    adapters = str(tmp_path / "lora")
    config = training_config(family.root, adapters, 1, 1, peft_config=PeftConfig(
        peft="lora", lora_rank=2, lora_dropout=0.1, lora_target_modules=["linear_fc2"]))
    pretrain(dataclasses.replace(config, training=dataclasses.replace(config.training, train_iters=1),
                                 checkpoint=dataclasses.replace(config.checkpoint, save_interval=1)))
    with pytest.raises(ConfigError, match="export with --merge-lora"):
        hf_peft.export_peft_adapters(adapters, str(tmp_path / "peft"), base_model_name_or_path=family.hf_dir)


def test_sft_first_loss_equals_transformers(family, tmp_path):
    """--sft through the trainer: the first loss is transformers' cross-entropy over the response tokens of the
    same examples, each run alone (the router's loss is not part of it, in either). With Llama 4's chunks and
    temperature, packed too: both count each example's positions from its first token (and the block-diagonal mask
    of --sft-pack-sequences must act besides the chunks')."""
    with torch.no_grad():
        expected = _transformers_response_loss(family.hf_model, SFT_PAIRS).item()
    for pack in sft_packings(family.root):
        assert sft_first_loss(family.root, tmp_path, pack=pack) == pytest.approx(expected, rel=1e-5), (
            f"{family.name} packed={pack}")


def test_unknown_fields_and_variants_are_refused_by_name(imports):
    qwen3_moe = imports["qwen3_moe"].hf_model.config.to_dict()
    with pytest.raises(ConfigError, match="use_sliding_window"):
        hf_weights.model_config_from_hf({**qwen3_moe, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        hf_weights.model_config_from_hf({**qwen3_moe, "mlp_only_layers": [0, 1]})
    with pytest.raises(ConfigError, match=r"field\(s\) shared_expert_intermediate_size"):
        hf_weights.model_config_from_hf({**qwen3_moe, "shared_expert_intermediate_size": 16})
    olmoe = imports["olmoe"].hf_model.config.to_dict()
    with pytest.raises(ConfigError, match="clip_qkv"):
        hf_weights.model_config_from_hf({**olmoe, "clip_qkv": 8.0})
    with pytest.raises(ConfigError, match="head_dim x num_attention_heads"):
        hf_weights.model_config_from_hf({**olmoe, "head_dim": 16})
    mixtral = imports["mixtral"].hf_model.config.to_dict()
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        hf_weights.model_config_from_hf({**mixtral, "router_jitter_noise": 0.1})
    v3, v2 = (imports[name].hf_model.config.to_dict() for name in DEEPSEEK_FAMILIES)
    for config, field, value, message in [
            (v3, "norm_topk_prob", False, "norm_topk_prob false with sigmoid scores"),
            (v3, "num_experts_per_tok", 4, "num_experts_per_tok 4 other than twice topk_group 1"),
            (v3, "topk_method", "greedy", "topk_method 'greedy' \\(DeepSeek-V3's router is noaux_tc\\)"),
            (v2, "norm_topk_prob", True, "norm_topk_prob true"), (v2, "topk_method", "noaux_tc", "topk_method")]:
        with pytest.raises(ConfigError, match=message):
            hf_weights.model_config_from_hf({**config, field: value})
    assert hf_weights.model_config_from_hf({**v3, "n_group": 1}).moe_router_num_groups is None  # one group: no limit


# One layout of 4 ranks per family, expert-parallel each, beside its 1-process run (fair_fight).
FAIR_LAYOUTS = {
    "mixtral": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    "qwen3_moe": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
    "olmoe": dict(expert_model_parallel_size=2, use_distributed_optimizer=True),
    "deepseek_v3": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    "deepseek_v2": dict(expert_model_parallel_size=4, data_parallel_sharding_strategy="optim_grads"),
    "glm4_moe": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
    # Experts split over the tensor ranks with their biases (fc2's on rank 0), the sinks split with the heads.
    "gpt_oss": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2),
    # The chunk masks and the temperature on the gathered sequence, the shared expert split over the tensor ranks.
    "llama4_text": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
}


# Llama 4's embedding of token 95 (seen once, in the first step) takes a gradient of 6.7e-7 in one coordinate (the
# row's largest is 0.33), which our float32 rounding gets within 4e-7 (every other coordinate of the embedding within
# 1e-6 relative); Adam turns that near-zero gradient into an lr-sized step of its own sign, so the row ends 7.8e-5
# from transformers' at tp2 x ep2 (2.3e-4 of the distance the weights move; 1.9e-5 at one process), every other
# tensor within 2.1e-6.
FAIR_TOLERANCES = {"llama4_text": dict(weight_rtol=3e-4)}


def test_fine_tuning_equals_transformers_with_clipping(imports, tmp_path):
    """transformers' loss with the load-balancing loss (pooled_aux_loss) for Mixtral, Qwen3-MoE, OLMoE and gpt-oss;
    DeepSeek's expert bias held still (transformers' training does not step it)."""
    fair_fight(imports, FAIR_LAYOUTS, tmp_path, {"deepseek_v2": "deepseek_v2"}, vocab=VOCAB, pad=EOS,
               tolerances=FAIR_TOLERANCES)
