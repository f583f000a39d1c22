"""Multi-token prediction trains like one process: 3 steps through ``pretrain`` at the layouts below, the losses the
log line prints (lm loss and every mtp_k loss) within 1e-5 relative of the single-process run, and the final
weights (the MTP layers', the embedding's copy on the last stage among them) too.

    A  Llama-like, untied, two MTP depths                   tp2 x pp2 with sequence parallelism: the depths
                                                            on the second stage with their copy of the embedding
    B  two layers, the second of 4 experts (sigmoid with    pp2 x dp2, ep2, the distributed optimizer: the MTP
       the expert bias, a shared expert, aux_loss), tied    layer has experts (as the decoder's last layer), the
       embeddings, one MTP depth, a per-token loss          last stage's tied output copy is the embedding MTP reads
    A  again                                                dp4 under ZeRO-3 (optim_grads_params)
    C  A with 4 layers                                      interleaved pp2 x dp2 (2 chunks a stage): the depths
                                                            on the last stage's second chunk

SGD with momentum and clipping that bites, so a gradient off by a factor shows in the weights.
"""
import contextlib
import io

from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.checkpointing.contents import OPTIMIZER_PREFIX
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir
from megatron_lite.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)
from tests.distributed import run_distributed
from tests.parity import assert_losses_match, assert_relative_close, full_tensors, rank_tensors

STEPS = 3
VARIANTS = {
    "A": dict(num_layers=2, untie_embeddings_and_output_weights=True, mtp_num_layers=2, mtp_loss_scaling_factor=0.5),
    "B": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq="[0,1]",
              moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
              moe_router_bias_update_rate=1e-2, moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=1e-2,
              mtp_num_layers=1, mtp_loss_scaling_factor=0.3, num_layers=2),
}
VARIANTS["C"] = dict(VARIANTS["A"], num_layers=4)


def _config(variant: str, tp: int = 1, pp: int = 1, ep: int = 1, strategy: str = "no_shard",
            save: str | None = None, vpp: bool = False) -> Config:
    return Config(
        model=ModelConfig(hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                          make_vocab_size_divisible_by=16, ffn_hidden_size=64, swiglu=True, normalization="RMSNorm",
                          position_embedding_type="rope", add_bias_linear=False, hidden_dropout=0.0,
                          attention_dropout=0.0, init_method_std=0.1, **VARIANTS[variant]),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                expert_model_parallel_size=ep, data_parallel_sharding_strategy=strategy,
                                sequence_parallel=tp > 1, num_layers_per_virtual_pipeline_stage=1 if vpp else None),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS,
                                calculate_per_token_loss=variant == "B"),
        optimizer=OptimizerConfig(optimizer="sgd", lr=0.1, lr_decay_style="constant", clip_grad=0.5),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=1, log_memory=False),
        checkpoint=CheckpointConfig(save=save, save_interval=STEPS if save else None))


def _train(rank, world_size, layouts):
    """Each layout's (losses of every step by name, whole weights) and what the last rank printed."""
    from megatron_lite.training import loop

    recorded, train_step = [], loop.train_step_with_losses

    def recording(*args, **kwargs):  # the step the loop takes, its logged losses kept
        result = train_step(*args, **kwargs)
        recorded.append(result[0])
        return result

    loop.train_step_with_losses = recording
    results = []
    for layout in layouts:
        recorded.clear()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            _, model_chunks, parallel_state = loop.pretrain(_config(**layout), keep_process_group=True)
        tensors, shard_ranks = {}, {}
        for chunk in model_chunks:
            chunk.finish_param_sync()
            with chunk.gathered_parameters():  # whole parameters under ZeRO-3
                tensors.update(rank_tensors(chunk.module.named_parameters()))
            shard_ranks.update({name: parallel_state.tensor_split(param)[0]
                                for name, param in chunk.module.named_parameters()})
        results.append({"losses": list(recorded), "tensors": tensors, "shard_ranks": shard_ranks,
                        "tp_rank": parallel_state.tensor_model_parallel_rank, "printed": printed.getvalue()})
        loop.destroy_model_parallel(parallel_state)
    return results


def test_mtp_layouts_match_one_process(tmp_path):
    """Layout B also saves: the checkpoint holds the embedding once (the first stage's) and the MTP layers."""
    saved = str(tmp_path / "b")
    layouts = [{"variant": "A", "tp": 2, "pp": 2},
               {"variant": "B", "pp": 2, "ep": 2, "strategy": "optim", "save": saved},
               {"variant": "A", "strategy": "optim_grads_params"}, {"variant": "C", "pp": 2, "vpp": True}]
    (single,) = run_distributed(_train, 1, args=([{"variant": v} for v in VARIANTS],))
    reference = {variant: result for variant, result in zip(VARIANTS, single)}
    for variant, result in reference.items():
        names = ["lm loss"] + [f"mtp_{k} loss" for k in range(1, VARIANTS[variant]["mtp_num_layers"] + 1)]
        assert all(list(losses) == names for losses in result["losses"]), result["losses"]
        assert all(f"{name}: " in result["printed"] for name in names), result["printed"]  # the log line's fields
    per_rank = run_distributed(_train, 4, args=(layouts,), timeout=600)
    for index, layout in enumerate(layouts):
        expected, what = reference[layout["variant"]], f"{layout}"
        results = [rank[index] for rank in per_rank]
        for name in expected["losses"][0]:
            assert_losses_match([[step[name] for step in r["losses"]] if r["losses"][0] is not None else []
                                 for r in results],
                                [step[name] for step in expected["losses"]], STEPS, f"{what} {name}")
        weights, reference_weights = full_tensors(results), full_tensors([expected])
        assert set(weights) == set(reference_weights), what
        assert any(name.startswith("mtp.layers.") for name in weights)
        for name, value in weights.items():
            assert_relative_close(value, reference_weights[name], what=f"{what} {name}")
    reader = CheckpointReader(resolve_checkpoint_dir(saved))
    stored = {name for name in reader.tensors if not name.startswith(OPTIMIZER_PREFIX)}
    b_weights = full_tensors([reference["B"]])
    biases = {"decoder.layers.1.mlp.router.expert_bias", "mtp.layers.0.mtp_model_layer.mlp.router.expert_bias"}
    assert stored == set(b_weights) | biases  # the routers' expert bias: buffers, saved too
    for name in b_weights:
        assert_relative_close(reader.read(name)[:b_weights[name].shape[0]], b_weights[name], what=f"saved {name}")
