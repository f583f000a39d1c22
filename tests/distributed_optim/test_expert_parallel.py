"""Expert parallelism trains like one process: 3 steps through ``pretrain`` at every layout below, losses and
final weights (experts and their routers' expert bias included) within 1e-5 relative of the single-process run,
and the last iteration's routing statistics (the log line's auxiliary losses and tokens per expert) the same.

The model: 4 layers, the first dense and three of 4 experts each (``--moe-layer-freq "([0]+[1]*3)"``), top 2,
SGD with momentum and clipping that bites. Three
routers, each with everything it has switched on (and LoRA on the first):

    A  softmax, load-balancing and z losses, a gated shared expert
    B  sigmoid with the expert bias (aux-loss-free balancing), group-limited top 2 of 2 groups, a scaling
       factor, the per-sequence loss, grouped GEMM experts; DeepSeek-V3's multi-latent attention (query
       latent, YaRN) in every layer, so the layer spec's two choices meet under every parallelism
    C  softmax before the top 2 within the group of the best score (DeepSeek-V2's) and transformers'
       load-balancing loss, pooled over the layers of each micro-batch (the pipeline carries its counts
       between stages)
    D  A's, frozen, with LoRA on every linear: attention, the dense MLP, the shared expert and each expert
       (its own adapters, split over the expert-tensor ranks with the expert)

Layouts (experts over ep ranks, each expert over etp ranks, replicas over the rest of the stage):

    world 4  dp4 ep2 under every sharding strategy (ZeRO 0 to 3, overlap on), tp2 (sequence parallel)
             x dp2 with etp1 (experts whole, replicated over tensor ranks), interleaved pp2 x dp2 (A and C),
             dp4 ep2 with LoRA (D)
    world 8  tp2 x pp2 x dp2 ep2 (etp2 = tp, sequence parallel), no_shard and the distributed optimizer
             (C with the latter), D with no_shard
"""
import pytest

from megatron_lite.config import (Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                  PeftConfig, TrainingConfig)
from tests.distributed import run_distributed
from tests.parity import assert_losses_match, assert_relative_close, full_tensors, rank_tensors

STEPS = 3
VARIANTS = {
    "A": dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
              moe_shared_expert_gate=True),
    "B": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
              moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2, moe_router_num_groups=2,
              moe_router_group_topk=1, moe_router_topk_scaling_factor=2.0, moe_grouped_gemm=True,
              multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
              v_head_dim=8, qk_layernorm=True, rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=8),
    "C": dict(moe_router_load_balancing_type="pooled_aux_loss", moe_aux_loss_coeff=1e-2, moe_router_pre_softmax=True,
              moe_router_num_groups=2, moe_router_group_topk=1, moe_router_group_score="max"),
}
VARIANTS["D"] = VARIANTS["A"]
# D: A's model frozen, LoRA on every linear (attention, the dense layer, the shared expert, each expert's own).
PEFT = {"D": PeftConfig(peft="lora", lora_rank=4, lora_alpha=8.0, peft_without_base_checkpoint=True)}


def _config(variant: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, strategy: str = "no_shard",
            overlap: bool = False, vpp: bool = False) -> Config:
    return Config(
        model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256,
                          ffn_hidden_size=64, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                          add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, num_experts=4,
                          moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq="([0]+[1]*3)",
                          **VARIANTS[variant]),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                num_layers_per_virtual_pipeline_stage=1 if vpp else None,
                                data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap,
                                overlap_param_gather=overlap and strategy != "no_shard", sequence_parallel=tp > 1,
                                ddp_bucket_size=5000),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS, eval_iters=1),
        # SGD's steps are linear in the gradients, so a gradient off by a factor shows in the weights (Adam would
        # divide it out); clipping bites, so the norm over expert and dense gradients must be right too.
        optimizer=OptimizerConfig(optimizer="sgd", lr=0.1, lr_decay_style="constant", clip_grad=0.5),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=STEPS, log_memory=False),
        peft=PEFT.get(variant, PeftConfig()))


def _train(rank, world_size, layouts):
    from megatron_lite.training.loop import pretrain

    from megatron_lite.model.moe.routing_statistics import routing_summary

    results = []
    for layout in layouts:
        config = _config(**layout)
        state, model_chunks, parallel_state = pretrain(config, keep_process_group=True)
        summary = routing_summary(model_chunks, parallel_state, config.model)  # the last iteration's, everywhere
        tensors, shard_ranks = {}, {}
        for chunk in model_chunks:
            chunk.finish_param_sync()
            with chunk.gathered_parameters():  # whole parameters under ZeRO-3
                tensors.update(rank_tensors(chunk.module.named_parameters()))
            tensors.update(rank_tensors((n, b) for n, b in chunk.module.named_buffers() if n.endswith("expert_bias")))
            shard_ranks.update({name: parallel_state.tensor_split(param)[0]
                                for name, param in chunk.module.named_parameters()})
        results.append({"losses": state.losses, "tensors": tensors, "shard_ranks": shard_ranks,
                        "tp_rank": parallel_state.tensor_model_parallel_rank,
                        "routing": (summary.losses, summary.tokens_per_expert.numpy())})
    return results


@pytest.fixture(scope="module")
def single_process():
    """(losses, whole weights) of each variant's reference run."""
    per_variant = run_distributed(_train, 1, args=([{"variant": v} for v in VARIANTS],))[0]
    return {v: (result["losses"], full_tensors([result]), result["routing"])
            for v, result in zip(VARIANTS, per_variant)}


def _check_layouts(single_process, world_size: int, layouts: list) -> None:
    per_rank = run_distributed(_train, world_size, args=(layouts,), timeout=600)
    for index, layout in enumerate(layouts):
        reference_losses, reference_weights, (reference_losses_logged, reference_counts) = single_process[
            layout["variant"]]
        what = f"world {world_size} {layout}"
        results = [r[index] for r in per_rank]
        assert_losses_match([r["losses"] for r in results], reference_losses, STEPS, what)
        for logged, counts in (r["routing"] for r in results):  # the log line's routing, the same on every rank
            assert (counts == reference_counts).all(), what
            for name, value in logged.items():
                assert value == pytest.approx(reference_losses_logged[name], rel=1e-5, abs=1e-7), (what, name)
        weights = full_tensors(results)
        weights.pop("output_layer.weight", None)  # the last stage's copy of the tied embedding
        assert set(weights) == set(reference_weights), what  # every expert of every layer is held somewhere
        for name, value in weights.items():
            assert_relative_close(value, reference_weights[name], what=f"{what} {name}")


def test_expert_parallel_layouts_of_four_ranks_match_one_process(single_process):
    layouts = [{"variant": "A", "ep": 2, "strategy": strategy, "overlap": True}
               for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
    layouts += [{"variant": "B", "ep": 2, "strategy": "optim_grads_params"},
                {"variant": "B", "tp": 2, "ep": 2, "etp": 1, "strategy": "optim"},
                {"variant": "A", "pp": 2, "ep": 2, "vpp": True}, {"variant": "C", "pp": 2, "ep": 2, "vpp": True},
                {"variant": "D", "ep": 2}]
    _check_layouts(single_process, 4, layouts)


def test_ep2_tp2_pp2_dp2_matches_one_process(single_process):
    _check_layouts(single_process, 8, [{"variant": "A", "tp": 2, "pp": 2, "ep": 2, "strategy": "optim"},
                                       {"variant": "B", "tp": 2, "pp": 2, "ep": 2},
                                       {"variant": "C", "tp": 2, "pp": 2, "ep": 2, "strategy": "optim"},
                                       {"variant": "D", "tp": 2, "pp": 2, "ep": 2}])
