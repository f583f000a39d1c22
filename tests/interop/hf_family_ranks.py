"""What the ranks of tests/interop/test_hf_families.py run: loading an imported checkpoint at a
layout, a forward pass through the pipeline, training runs. Kept apart from the test module so
that the spawned ranks do not import transformers and peft (seconds each, on every rank).
"""
import contextlib
import dataclasses
import io
import re

import torch

from megatron_lite.checkpointing import load_checkpoint, read_config
from megatron_lite.config import (CheckpointConfig, DataConfig, LoggingConfig, OptimizerConfig, ParallelConfig,
                                  PeftConfig, TrainingConfig)
from megatron_lite.inference.loading import load_model, read_checkpoint_config
from megatron_lite.inference.text_generation import generate
from megatron_lite.pipeline_parallel import p2p
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.training.loop import pretrain, setup_model_and_optimizer, train_step

STEPS = 3


def load(root: str, tp: int = 1, pp: int = 1, ep: int = 1):
    config = read_checkpoint_config(root, ParallelConfig(tensor_model_parallel_size=tp,
                                                         pipeline_model_parallel_size=pp,
                                                         expert_model_parallel_size=ep))
    parallel_state = initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    return load_model(config, parallel_state), parallel_state


def _pipelined_logits(model, parallel_state, input_ids):
    """One forward pass through both pipeline stages: the last stage's logits, None on the first."""
    exchange = dict(shape=(input_ids.shape[1], input_ids.shape[0], model.config.hidden_size), dtype=torch.float32,
                    device=torch.device("cpu"), group=parallel_state.pipeline_model_parallel_group)
    with torch.no_grad():
        if parallel_state.is_pipeline_first_stage():
            p2p.exchange(sends=[(model(input_ids), parallel_state.pipeline_next_rank)], receives=[], **exchange)
            return None
        (received,) = p2p.exchange(sends=[], receives=[parallel_state.pipeline_prev_rank], **exchange)
        model.set_input_tensor(received)
        return model(input_ids)


def tp2_pp2_rank(rank, world_size, runs, prompts, generation):
    """For each (checkpoint, input ids) of ``runs``: (logits of the input ids, greedy tokens after ``prompts``
    with ``generation``'s settings)."""
    results = []
    for root, input_ids in runs:
        model, parallel_state = load(root, tp=2, pp=2)
        results.append((_pipelined_logits(model, parallel_state, input_ids),
                        generate(model, prompts, greedy=True, parallel_state=parallel_state, **generation)))
        destroy_model_parallel(parallel_state)
    return results


def layouts_rank(rank, world_size, runs, generation):
    """For each (checkpoint, input ids, prompt batches, layouts) of ``runs`` and each (tp, pp, ep) of its layouts:
    (logits of the input ids on the last stage, else None; for each batch of prompts, the greedy tokens after its
    prompts with ``generation``'s settings)."""
    results = []
    for root, input_ids, prompt_batches, layouts in runs:
        for tp, pp, ep in layouts:
            model, parallel_state = load(root, tp=tp, pp=pp, ep=ep)
            with torch.no_grad():
                logits = _pipelined_logits(model, parallel_state, input_ids) if pp > 1 else model(input_ids)
            results.append((logits, [generate(model, prompts, greedy=True, parallel_state=parallel_state,
                                              **generation) for prompts in prompt_batches]))
            destroy_model_parallel(parallel_state)
    return results


# SGD with momentum, whose steps are linear in the gradients, so the weights of two layouts differ by their
# gradients' rounding. Adam divides each gradient by its own size: a gradient that is zero in exact
# arithmetic (a key bias's: softmax ignores a shift of a query's scores) or a near-cancelling sum is rounding
# noise that it turns into lr-sized, layout-dependent steps (measured: 3e-5 relative after 5 steps).
PARITY_OPTIMIZER = OptimizerConfig(optimizer="sgd", lr=0.1, lr_decay_style="constant")


def training_config(root: str, save: str, tp: int, pp: int, *, optimizer: OptimizerConfig = PARITY_OPTIMIZER,
                    peft_config: PeftConfig | None = None, sequence_parallel: bool = False):
    config = read_config(root)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                sequence_parallel=sequence_parallel),
        checkpoint=CheckpointConfig(pretrained_checkpoint=root, save=save, save_interval=STEPS),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS, eval_iters=1),
        optimizer=optimizer, data=DataConfig(mock_data=True),
        logging=LoggingConfig(log_interval=STEPS, log_memory=False), peft=peft_config or PeftConfig())


def train(rank, world_size, runs):
    """For each (checkpoint, save directory, tp, pp, sequence parallel?): the training losses."""
    results = []
    for root, save, tp, pp, sequence_parallel in runs:
        state, _, parallel_state = pretrain(training_config(root, save, tp, pp, sequence_parallel=sequence_parallel),
                                            keep_process_group=True)
        results.append(state.losses)
        destroy_model_parallel(parallel_state)
    return results


def sgd_step_gradients(rank, world_size, root, microbatches, pp: int = 1):
    """The gradient one training step of the checkpoint ``root`` applies (SGD at learning rate 1: the weights'
    change) to this rank's pipeline stage, each data-parallel rank taking its share of ``microbatches`` (dicts of
    tokens, labels, loss_mask, position_ids), through setup_model_and_optimizer and train_step."""
    config = read_config(root)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, seq_length=microbatches[0]["tokens"].shape[1]),
        parallel=ParallelConfig(pipeline_model_parallel_size=pp),
        training=TrainingConfig(micro_batch_size=microbatches[0]["tokens"].shape[0],
                                global_batch_size=len(microbatches) * microbatches[0]["tokens"].shape[0],
                                train_iters=1),
        optimizer=OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                                  lr_decay_style="constant"),
        checkpoint=CheckpointConfig(pretrained_checkpoint=root), data=DataConfig(mock_data=True),
        logging=LoggingConfig(log_memory=False))
    parallel_state = initialize_model_parallel(1, pp)
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, parallel_state)
    load_checkpoint(config, parallel_state, chunks, optimizer, scheduler)
    before = {name: p.detach().clone() for name, p in chunks[0].module.named_parameters()}
    dp_size = parallel_state.data_parallel_world_size
    mine = microbatches[parallel_state.data_parallel_rank::dp_size]
    train_step(config, parallel_state, chunks, optimizer, scheduler, iter(mine), len(mine))
    gradients = {name: (before[name] - p.detach()).numpy() for name, p in chunks[0].module.named_parameters()}
    destroy_model_parallel(parallel_state)
    return gradients


# The fair fight against transformers (tests/interop/transformers_training.py): AdamW at a constant LR with
# weight decay (matrices only, as Megatron and the reference's groups), every step clipped to norm 1.
FAIR_STEPS, FAIR_BATCH = 3, 4
FAIR_OPTIMIZER = OptimizerConfig(lr=1e-3, lr_decay_style="constant", weight_decay=0.01, clip_grad=1.0)
_GRAD_NORM = re.compile(r" lm loss: ([0-9.E+-]+) \|.* grad norm: ([0-9.]+) \|")


def fair_config(root: str, save: str, *, pad_token_id: int | None, **parallel):
    """The imported checkpoint ``root`` fine-tuned FAIR_STEPS iterations on --mock-data (FAIR_BATCH sequences of
    16, micro-batches of 1 under every layout), saved to ``save``, with the embedding row of ``pad_token_id``
    frozen (--freeze-padding-embedding) unless None; ``parallel``: ParallelConfig's fields, and ``bf16``. The
    expert bias is not stepped: transformers' training does not update it."""
    config = read_config(root)
    bf16 = parallel.pop("bf16", False)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                                          freeze_padding_embedding=pad_token_id is not None,
                                          pad_token_id=pad_token_id,
                                          moe_router_bias_update_rate=0.0),
        parallel=ParallelConfig(**parallel),
        checkpoint=CheckpointConfig(pretrained_checkpoint=root, save=save, save_interval=FAIR_STEPS),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=FAIR_BATCH, train_iters=FAIR_STEPS, bf16=bf16),
        optimizer=FAIR_OPTIMIZER, data=DataConfig(mock_data=True),
        logging=LoggingConfig(log_interval=1, log_memory=False))


def train_logged(rank, world_size, runs):
    """For each (checkpoint, save directory, frozen pad token or None, parallel fields): the (lm loss, grad norm) of
    each iteration as the log line prints them, on the rank that prints it; else None."""
    results = []
    for root, save, pad, parallel in runs:
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            _, _, parallel_state = pretrain(fair_config(root, save, pad_token_id=pad, **parallel),
                                            keep_process_group=True)
        destroy_model_parallel(parallel_state)
        logged = [(float(loss), float(norm)) for loss, norm in _GRAD_NORM.findall(log.getvalue())]
        results.append(logged or None)
    return results
