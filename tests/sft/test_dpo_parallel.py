"""--dpo under tensor x pipeline, ZeRO-3, context and expert parallelism, and with LoRA, trains like one process.

A Llama-style model and a mixture of experts start from a checkpoint of their own (one mock-data step), and
train 3 DPO steps on pairs whose answers differ in length, packed (several pairs per pair of sequences, so
the loss sums over documents) or padded. One process gives the reference losses; one world of 4 processes
runs every layout in turn: tp2 x pp2 (the reference's log-probabilities cross the pipeline to the last stage),
pp2 x dp2 with the interleaved schedule (each chunk reads its own iterator of the micro-batches),
tp2 x dp2 under ZeRO-3 (the reference is a whole copy while the policy is sharded), cp2 x dp2 (each rank
sums its positions' log-probabilities), ep2 over 4 data-parallel ranks (experts split), and LoRA at
tp2 x dp2 (the reference is the base with the adapters off), and pp2 x dp2 interleaved with the reference's
log-probabilities precomputed (scored ahead, then the reference freed); and ORPO at cp2 x dp2 (no reference; its
NLL term's per-token mean over the global batch counted before the pass). Adam's eps sits above float32 noise.
"""
import json
import math
import random

from megatron_lite.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, PeftConfig, TrainingConfig)
from tests.distributed import run_distributed
from tests.parity import assert_losses_match

STEPS = 3
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16, vocab_size=64,
             normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1)
MODELS = {"llama": LLAMA, "llama4": dict(LLAMA, num_layers=4), "moe": MOE}
RUNS = {"tp2 x pp2": dict(model="llama", tp=2, pp=2), "pp2 x dp2, interleaved": dict(model="llama4", pp=2, vpp=1),
        "tp2 x dp2, ZeRO-3": dict(model="llama", tp=2, zero3=True),
        "cp2 x dp2": dict(model="llama", cp=2), "ep2 x dp4": dict(model="moe", ep=2, pack=False),
        "LoRA, tp2 x dp2": dict(model="llama", tp=2, lora=True),
        "pp2 x dp2, interleaved, precomputed": dict(model="llama4", pp=2, vpp=1, precompute=True),
        "ORPO, cp2 x dp2": dict(model="llama", cp=2, loss="orpo")}


def _write_pairs(path) -> str:
    rng = random.Random(0)

    def ids(low, high):
        return " ".join(str(rng.randint(0, 60)) for _ in range(rng.randint(low, high)))
    path.write_text("".join(json.dumps({"prompt": ids(1, 4), "chosen": ids(1, 4), "rejected": ids(1, 4)}) + "\n"
                            for _ in range(24)))
    return str(path)


def _config(data: str, ckpt: str, *, model: str, tp=1, pp=1, cp=1, ep=1, vpp=None, zero3=False, lora=False,
            pack=True, dpo=True, precompute=False, loss="sigmoid") -> Config:
    return Config(
        model=ModelConfig(**MODELS[model]),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                context_parallel_size=cp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                                num_layers_per_virtual_pipeline_stage=vpp,
                                data_parallel_sharding_strategy="optim_grads_params" if zero3 else None),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS if dpo else 1,
                                dpo_precompute_ref_log_probs=precompute, dpo_loss_type=loss),
        optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-6, clip_grad=1.0, lr_decay_style="constant"),
        data=(DataConfig(dpo=True, train_data_path=[data], tokenizer_type="NullTokenizer", sft_pack_sequences=pack)
              if dpo else DataConfig(mock_data=True)),
        peft=PeftConfig(peft="lora", lora_rank=4, lora_alpha=8.0) if lora else PeftConfig(),
        checkpoint=CheckpointConfig(pretrained_checkpoint=ckpt) if dpo else CheckpointConfig(save=ckpt),
        logging=LoggingConfig(log_interval=STEPS, log_memory=False))


def _references(rank, world_size, data, root):
    """Each model's checkpoint (one mock-data step), then every run's single-process losses."""
    from megatron_lite.training.loop import pretrain

    for model in MODELS:
        pretrain(_config(data, f"{root}/{model}", model=model, dpo=False), keep_process_group=True)
    def kind(run):
        return run["model"], run.get("pack", True), run.get("lora", False), run.get("loss", "sigmoid")
    losses = {(model, pack, lora, loss): pretrain(_config(data, f"{root}/{model}", model=model, pack=pack, lora=lora,
                                                          loss=loss), keep_process_group=True)[0].losses
              for model, pack, lora, loss in {kind(run) for run in RUNS.values()}}
    return {name: losses[kind(run)] for name, run in RUNS.items()}


def _layouts(rank, world_size, data, root):
    from megatron_lite.training.loop import pretrain

    return {name: pretrain(_config(data, f"{root}/{run['model']}", **run), keep_process_group=True)[0].losses
            for name, run in RUNS.items()}


def test_dpo_layouts_match_single_process(tmp_path):
    data = _write_pairs(tmp_path / "pairs.jsonl")
    (reference,) = run_distributed(_references, 1, args=(data, str(tmp_path)))
    per_rank = run_distributed(_layouts, 4, args=(data, str(tmp_path)), timeout=600)
    for name in RUNS:
        # the policy starts as the reference (ORPO has none)
        assert abs(reference[name][0] - math.log(2)) < 1e-6 or RUNS[name].get("loss") == "orpo", name
        assert reference[name][-1] < reference[name][0] or RUNS[name]["model"] == "moe", name  # (its router loss)
        assert_losses_match([losses[name] for losses in per_rank], reference[name], STEPS, name)


def test_precomputed_reference_equals_the_per_batch_pass_and_resumes_exactly(tmp_path, capsys):
    """--dpo-precompute-ref-log-probs scores the micro-batches ahead in the schedule calls the per-batch pass makes,
    so training, validation and test losses are bit for bit those of the per-batch run; a run stopped after 2 of 4
    iterations and resumed with --load scores what lies ahead and continues bit for bit."""
    import dataclasses
    import re

    from megatron_lite.inference.loading import read_checkpoint_config
    from megatron_lite.training.loop import pretrain

    data, ckpt = _write_pairs(tmp_path / "pairs.jsonl"), str(tmp_path / "llama")
    pretrain(_config(data, ckpt, model="llama", dpo=False))

    def run(precompute: bool, exit_interval=None, load=None):
        config = _config(data, ckpt, model="llama")
        config = dataclasses.replace(
            config, data=dataclasses.replace(config.data, valid_data_path=[data], test_data_path=[data]),
            training=dataclasses.replace(config.training, train_iters=4, eval_interval=2, eval_iters=1,
                                         dpo_precompute_ref_log_probs=precompute, exit_interval=exit_interval),
            checkpoint=dataclasses.replace(config.checkpoint, save=str(tmp_path / "stopped"), load=load))
        state = pretrain(config)[0]
        return state.losses, re.findall(r"(?:validation|test set).*dpo loss value: \S+", capsys.readouterr().out)

    per_batch, precomputed = run(False), run(True)
    assert precomputed == per_batch and len(per_batch[1]) == 3  # at iterations 2 and 4, and the test set
    run(True, exit_interval=2)
    losses, evaluations = run(True, load=str(tmp_path / "stopped"))
    assert losses == precomputed[0] and evaluations == precomputed[1][1:]
    # generate and evaluate run the trained weights without the run's reference or data
    assert not read_checkpoint_config(str(tmp_path / "stopped"), ParallelConfig()).data.dpo
