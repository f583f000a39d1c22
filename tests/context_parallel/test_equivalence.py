"""Context parallelism trains like one process: losses, grad norms, validation loss and final weights.

GPT-2-style and Llama-style (grouped-query attention, RoPE, SwiGLU) models of 4 layers train 3 steps through
the trainer's own path (``plan_run``, ``setup_model_and_optimizer``, ``build_data_iterators``, ``train_step``,
then ``evaluate``) at cp2 under each --cp-comm-type, cp2 under ZeRO-3, cp2 with packed fine-tuning data,
cp4, cp2 x tp2 with sequence parallelism, and cp2 x pp2 x dp2 with the 1F1B and the interleaved schedules;
the combined layouts give their layers alternating comm types (``--cp-comm-type`` per layer), so each run
exercises both, and two of them recompute (full, selective); prefix tuning, a mixture of experts (with
its z-loss) and multi-latent attention (values narrower than keys) run at cp2, the last also at cp2 x tp2, and
Llama 4's chunked attention (chunks of 6 that a rank's chunks of 8 start inside; a NoPE layer with temperature
tuning) at cp2 under each comm type and on packed fine-tuning data.
Everything must equal the single-process run within 1e-5 (float32), and the context-parallel replicas of
every weight must agree exactly; two cp2 checkpoints are written once per piece and load into data-parallel replicas.

Pretraining runs mask the loss of every position whose token is a multiple of 3, so the context-parallel
ranks count different numbers of loss tokens per micro-batch (a per-micro-batch mean taken over one rank's
tokens, or a loss scaled by cp twice or not at all, would show); fine-tuning takes the per-token loss path.
"""
import dataclasses
import json

import pytest

from megatron_lite.config import (Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                  PeftConfig, TrainingConfig)
from tests.distributed import run_distributed
from tests.parity import assert_losses_match, assert_relative_close, full_tensors, rank_tensors

STEPS = 3  # 2 of warm-up, 1 of decay; gradients clipped at every one (norms 1.2-2.8 against 0.5)
MIXED = ["p2p", "all_gather", "all_gather", "p2p"]  # one --cp-comm-type per layer: each pipeline stage has both
GPT = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256)
LLAMA = dict(GPT, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=64)
# A mixture of experts (4 experts, top-2, z-loss) with the load-balancing loss over the micro-batch, one with
# DeepSeek's per-sequence loss and one with transformers' loss pooled over the layers: every context-parallel rank
# balances the whole sequences' routing, not its chunks'.
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_z_loss_coeff=0.01,
           moe_aux_loss_coeff=0.1)
MOE_SEQ = dict(MOE, moe_router_load_balancing_type="seq_aux_loss")
MOE_POOLED = dict(MOE, moe_router_load_balancing_type="pooled_aux_loss")
# Multi-latent attention (a query latent, YaRN): keys 8 + 4 rotary channels wide, values 4, so the exchanged keys
# and values differ in width and the ring's blocks take the explicit kernel.
MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=4, qk_layernorm=True, rotary_scaling_factor=4.0,
           yarn_original_max_position_embeddings=8)
# Llama 4: sequences of 32 in chunks of 6 on the layers with rotary embeddings (L2-normed queries and keys), the
# last layer NoPE with temperature tuning that bites every 4 positions. At cp2 a rank's chunks of the sequence
# (8 positions) start at 0, 8, 16 and 24: inside an attention chunk, or at its start; the fine-tuning examples
# (up to 11 positions) span two.
LLAMA4 = dict(LLAMA, seq_length=32, no_rope_freq="4", attention_chunk_size=6, qk_l2_norm=True,
              attn_temperature_tuning=True, attn_temperature_floor_scale=4)
MODELS = {"gpt": GPT, "llama": LLAMA, "moe": MOE, "moe_seq": MOE_SEQ, "moe_pooled": MOE_POOLED, "mla": MLA,
          "llama4": LLAMA4}


def _config(model: str, *, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, vpp: bool = False, comm=("p2p",),
            strategy: str = "no_shard", sft: str | None = None, prefix: bool = False,
            recompute: str | None = None) -> Config:
    data = DataConfig(mock_data=True) if sft is None else DataConfig(
        sft=True, train_data_path=[sft], valid_data_path=[sft], tokenizer_type="NullTokenizer",
        sft_pack_sequences=True)
    return Config(
        model=ModelConfig(**MODELS[model], hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                context_parallel_size=cp, cp_comm_type=list(comm), sequence_parallel=tp > 1,
                                expert_model_parallel_size=ep,
                                num_layers_per_virtual_pipeline_stage=1 if vpp else None,
                                data_parallel_sharding_strategy=strategy, overlap_grad_reduce=strategy != "no_shard",
                                overlap_param_gather=strategy != "no_shard", ddp_bucket_size=3000),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS, eval_iters=1,
                                eval_interval=STEPS, recompute_granularity=recompute,
                                recompute_method="uniform" if recompute == "full" else None),
        # adam_eps above the rounding noise of gradients that are zero in exact arithmetic (the key bias's;
        # test_3d_equivalence.py says why).
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, clip_grad=0.5, adam_eps=1e-6),
        data=data, logging=LoggingConfig(log_memory=False),
        # Prefix tuning through its reparametrising MLP: every rank's queries see the whole prefix.
        peft=PeftConfig(peft="prefix" if prefix else None, prefix_length=3, prefix_projection_hidden_size=16))


def _masked_loss(iterator):
    """Pretraining batches with no loss on tokens that are multiples of 3 (cut or not, the same positions)."""
    for batch in iterator:
        yield {**batch, "loss_mask": batch["loss_mask"] * (batch["tokens"] % 3 != 0).float()}


def _train(rank, world_size, runs):
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.training.data_iterators import build_data_iterators
    from megatron_lite.model.moe.routing_statistics import routing_summary
    from megatron_lite.training.loop import evaluate, setup_model_and_optimizer, train_step
    from megatron_lite.training.run_plan import plan_run

    results = []
    for run in runs:
        config = _config(**{k: v for k, v in run.items() if k != "save"})
        parallel = config.parallel
        state = initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                          parallel.virtual_pipeline_model_parallel_size,
                                          context_parallel_size=parallel.context_parallel_size,
                                          expert_model_parallel_size=parallel.expert_model_parallel_size)
        chunks, optimizer, scheduler = setup_model_and_optimizer(config, state)
        train, valid = build_data_iterators(config, state, plan_run(config, state), 0)[:2]
        if not config.data.sft:
            train, valid = ([_masked_loss(i) for i in it] if isinstance(it, list) else _masked_loss(it)
                            for it in (train, valid))
        losses, grad_norms = [], []
        for _ in range(STEPS):
            loss, _, grad_norm = train_step(config, state, chunks, optimizer, scheduler, train,
                                            config.training.num_microbatches(state.data_parallel_world_size))
            losses.append(loss)
            grad_norms.append(grad_norm)
        routing = routing_summary(chunks, state, config.model)  # the last step's, as the log line shows it
        valid_loss = evaluate(config, state, chunks, valid)
        tensors = {}
        for chunk in chunks:
            chunk.finish_param_sync()
            with chunk.gathered_parameters():
                tensors.update(rank_tensors(chunk.module.named_parameters()))
        results.append({"losses": losses if state.is_pipeline_last_stage() else [], "grad_norms": grad_norms,
                        "routing_losses": None if routing is None else routing.losses, "valid_loss": valid_loss,
                        "tensors": tensors, "tp_rank": state.tensor_model_parallel_rank})
        if "save" in run:
            results[-1]["reloaded"] = _save_and_reload(config, state, chunks, optimizer, scheduler, run["save"])
        destroy_model_parallel(state)
    return results


def _save_and_reload(config, state, chunks, optimizer, scheduler, directory: str) -> dict:
    """Save, then load into the same world without context parallelism or sharding (data-parallel replicas):
    the weights this rank then holds."""
    from megatron_lite.checkpointing import load_checkpoint, save_checkpoint
    from megatron_lite.checkpointing.training_state import TrainingState
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.training.loop import setup_model_and_optimizer

    config.checkpoint.save = directory
    save_checkpoint(config, state, chunks, optimizer, scheduler, TrainingState(iteration=STEPS))
    plain = dataclasses.replace(config, parallel=ParallelConfig(), checkpoint=dataclasses.replace(
        config.checkpoint, save=None, load=directory))
    plain_state = initialize_model_parallel(1, 1)
    plain_chunks, plain_optimizer, plain_scheduler = setup_model_and_optimizer(plain, plain_state)
    load_checkpoint(plain, plain_state, plain_chunks, plain_optimizer, plain_scheduler)
    reloaded = rank_tensors(plain_chunks[0].module.named_parameters())
    destroy_model_parallel(plain_state)
    return reloaded


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """Prompt/response pairs of 1-6 ids each (NullTokenizer text), so packed samples hold 2-4 examples of
    different lengths and loss counts."""
    import random
    generator = random.Random(0)
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    lines = []
    for _ in range(64):
        prompt, response = ([generator.randrange(1, 200) for _ in range(generator.randint(1, 6))] for _ in range(2))
        lines.append(json.dumps({"prompt": " ".join(map(str, prompt)), "response": " ".join(map(str, response))}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def references(sft_data):
    """The single-process runs: pretraining and packed fine-tuning of each model, prefix tuning of one."""
    runs = [{"model": m} for m in MODELS] + [{"model": m, "sft": sft_data} for m in ("gpt", "llama", "llama4")]
    runs += [{"model": "llama", "prefix": True}]
    (results,) = run_distributed(_train, 1, args=(runs,))
    return {_reference(run): result for run, result in zip(runs, results)}


def _reference(run: dict) -> tuple:
    """Which single-process run a layout is compared with."""
    return run["model"], "sft" in run, run.get("prefix", False)


def _check(references, world_size: int, runs: list) -> None:
    per_rank = run_distributed(_train, world_size, args=(runs,), timeout=900)
    for index, run in enumerate(runs):
        what = f"world {world_size} {run}"
        results = [r[index] for r in per_rank]
        reference = references[_reference(run)]
        assert_losses_match([r["losses"] for r in results], reference["losses"], STEPS, what)
        for result in results:
            assert_relative_close(result["grad_norms"], reference["grad_norms"], what=f"{what} grad norms")
            if reference["routing_losses"] is not None:  # the routers' logged losses
                assert result["routing_losses"] == pytest.approx(reference["routing_losses"], rel=1e-5), what
            if result["valid_loss"] is not None:
                assert_relative_close(result["valid_loss"], reference["valid_loss"], what=f"{what} validation loss")
        expected = full_tensors([reference])
        weights = full_tensors(results)
        assert set(expected) <= set(weights), what
        for name, value in weights.items():
            if name not in expected:  # the last pipeline stage's copy of the tied embedding
                name = "embedding.word_embeddings.weight"
            assert_relative_close(value, expected[name], what=f"{what} {name}")
        if "save" in run:  # the checkpoint reshards: the same weights, exactly, at dp2 without sharding
            _check_written_once(run["save"])
            reloaded = full_tensors([{"tensors": r["reloaded"], "tp_rank": 0} for r in results])
            assert reloaded.keys() == weights.keys(), what
            for name, value in reloaded.items():
                assert_relative_close(value, weights[name], rel=0.0, what=f"{what} reloaded {name}")


def _check_written_once(directory: str) -> None:
    """No piece of a tensor was written by two ranks (context-parallel ranks hold replicas, as data-parallel
    ones do: one of them writes)."""
    from megatron_lite.checkpointing.storage import read_metadata, resolve_checkpoint_dir
    for key, entry in read_metadata(resolve_checkpoint_dir(directory))["tensors"].items():
        pieces = [(shard["tp_rank"], tuple(shard["flat_range"] or ())) for shard in entry["shards"]]
        assert len(pieces) == len(set(pieces)), f"{key} written more than once: {entry['shards']}"


def test_cp2_matches_one_process(references, sft_data, tmp_path):
    """cp2 under each comm type (a checkpoint of which loads into data-parallel replicas), under ZeRO-3
    (sharded over the data x context ranks; its checkpoint too), on packed fine-tuning data (each rank's rows of
    the documents' block-diagonal mask, cut across the chunks, against one process's document rows; the per-token
    loss), and prefix tuning."""
    runs = [{"model": m, "cp": 2, "comm": (comm,)} for m in ("gpt", "llama") for comm in ("p2p", "all_gather")]
    runs[0]["save"] = str(tmp_path / "replicated")
    runs += [{"model": "gpt", "cp": 2, "strategy": "optim_grads_params"},
             {"model": "llama", "cp": 2, "comm": ("all_gather",), "strategy": "optim_grads_params",
              "save": str(tmp_path / "sharded")},
             {"model": "gpt", "cp": 2, "comm": ("all_gather",), "sft": sft_data},
             {"model": "llama", "cp": 2, "sft": sft_data}, {"model": "llama", "cp": 2, "prefix": True},
             {"model": "moe", "cp": 2, "comm": MIXED}, {"model": "moe_pooled", "cp": 2, "comm": MIXED},
             {"model": "mla", "cp": 2, "comm": MIXED}]
    runs += [{"model": "llama4", "cp": 2, "comm": (comm,)} for comm in ("all_gather", "p2p")]
    runs += [{"model": "llama4", "cp": 2, "comm": MIXED, "sft": sft_data}]
    _check(references, 2, runs)


def test_cp4_and_cp2_tp2_match_one_process(references):
    """cp4, and cp2 x tp2 with sequence parallelism (multi-latent attention too: its rotary key's gradient summed
    over the tensor-parallel ranks; the per-sequence balancing loss's counts over tensor and context ranks);
    recomputed (the exchanges run again in the backward); experts split over ep2 across the context and
    data-parallel ranks (cp2 x dp2), with the micro-batch and the pooled balancing losses."""
    runs = [{"model": "gpt", "cp": 4, "comm": MIXED, "recompute": "full"}, {"model": "llama", "cp": 4, "comm": MIXED}]
    runs += [{"model": "gpt", "cp": 2, "tp": 2, "comm": MIXED[::-1]},
             {"model": "llama", "cp": 2, "tp": 2, "comm": MIXED[::-1], "recompute": "selective"},
             {"model": "mla", "cp": 2, "tp": 2, "comm": MIXED}, {"model": "moe_seq", "cp": 2, "tp": 2, "comm": MIXED}]
    runs += [{"model": model, "cp": 2, "ep": 2, "comm": MIXED} for model in ("moe", "moe_pooled")]
    _check(references, 4, runs)


def test_cp2_pp2_dp2_matches_one_process(references):
    runs = [{"model": "gpt", "cp": 2, "pp": 2, "comm": MIXED},
            {"model": "llama", "cp": 2, "pp": 2, "vpp": True, "comm": MIXED, "strategy": "optim"}]
    _check(references, 8, runs)


def test_config_checks_name_the_flags():
    from megatron_lite.config import ConfigError
    with pytest.raises(ConfigError, match=r"--context-parallel-size 4 splits each sequence into 2 x 4 = 8 equal "
                                          r"chunks .* --seq-length \(12\) must be divisible by 8"):
        _config("gpt", cp=4).__class__(model=ModelConfig(**dict(GPT, seq_length=12)),
                                       parallel=ParallelConfig(context_parallel_size=4))
    with pytest.raises(ConfigError, match=r"--cp-comm-type p2p .* no attention dropout: give --attention-dropout 0"):
        Config(model=ModelConfig(**GPT), parallel=ParallelConfig(context_parallel_size=2))
    with pytest.raises(ConfigError, match=r"--cp-comm-type takes one value for every layer or one per layer \(4\)"):
        Config(model=ModelConfig(**GPT), parallel=ParallelConfig(context_parallel_size=2,
                                                                 cp_comm_type=["p2p", "all_gather"]))
    with pytest.raises(ConfigError, match=r"make --seq-length divisible by 2 x 4"):
        Config(model=ModelConfig(**dict(GPT, num_attention_heads=4, seq_length=20), attention_dropout=0.0),
               parallel=ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True))
    config = dataclasses.replace(_config("gpt", cp=2, comm=("allgather",)))
    assert config.parallel.cp_comm_type == ["all_gather"]  # Megatron-LM's spelling
