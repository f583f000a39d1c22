"""Stopping and resuming gives the uninterrupted run's losses bit for bit (float32, CPU).

That needs every piece of state: weights, Adam moments and step, the LR schedule,
the data position (consumed samples) and every RNG stream (dropout is on here).
"""
import pytest
import torch

from megatron_lite.checkpointing import load_checkpoint, storage
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.training.loop import build_optimizer_and_scheduler, get_model, pretrain
from tests.checkpointing.common import GPT2, losses_of, tiny_config, train
from tests.distributed import run_distributed


def _losses(precision: str = "fp32", **kwargs):
    config = tiny_config(**kwargs)
    config.training.bf16, config.training.fp16 = precision == "bf16", precision == "fp16"
    state, _, _ = pretrain(config)
    return state.losses


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_stop_and_resume_is_bitwise_exact(tmp_path, precision):
    """bf16/fp16 add fp32 main parameters to the state; fp16 the dynamic loss scaler (which
    skips and halves on this tiny model's overflows)."""
    root = str(tmp_path)
    uninterrupted = _losses(precision, iters=4, dropout=0.1)
    stopped = _losses(precision, iters=4, dropout=0.1, save=root, exit_interval=2)
    resumed = _losses(precision, iters=4, dropout=0.1, load=root)
    assert stopped == uninterrupted[:2]
    assert resumed == uninterrupted  # exact equality, not approx


def test_rng_state_matters(tmp_path):
    """Control: reseeding instead of restoring the RNG changes the dropout masks, hence the losses."""
    root = str(tmp_path)
    uninterrupted = _losses(iters=3, dropout=0.1, save=root, save_interval=2)
    storage.write_latest_iteration(root, 2)
    resumed = _losses(iters=3, dropout=0.1, load=root, no_load_rng=True)
    assert resumed[:2] == uninterrupted[:2] and resumed[2] != uninterrupted[2]


def test_finetune_loads_weights_only(tmp_path):
    root = str(tmp_path)
    _losses(iters=2, save=root, save_interval=2)
    state, _, _ = pretrain(tiny_config(iters=2, load=root, finetune=True))
    assert state.iteration == 2 and state.consumed_train_samples == 16 and len(state.losses) == 2
    assert state.losses[0] != _losses(iters=1)[0]  # not the fresh model


def test_no_load_optim_restarts_from_the_loaded_weights(tmp_path):
    """bf16: the optimizer's fp32 main parameters are copies, remade from the loaded weights."""
    root = str(tmp_path)
    _losses("bf16", iters=2, save=root, save_interval=2)
    config = tiny_config(load=root, no_load_optim=True)
    config.training.bf16 = True
    parallel_state = initialize_model_parallel(1, 1)
    try:
        model_chunks = get_model(config, parallel_state)
        initial = {n: p.detach().clone() for n, p in model_chunks[0].module.named_parameters()}
        optimizer, scheduler = build_optimizer_and_scheduler(config, parallel_state, model_chunks)
        state = load_checkpoint(config, parallel_state, model_chunks, optimizer, scheduler)
    finally:
        destroy_model_parallel(parallel_state)
    assert state.iteration == 2 and scheduler.num_steps == 2 * 8  # samples: 2 iterations of 8
    weights = dict(model_chunks[0].module.named_parameters())
    for name, entry in optimizer.state_dict()["params"].items():
        assert not torch.equal(weights[name], initial[name]) or "layernorm" in name
        assert torch.equal(entry["main_param"], weights[name].detach().float().reshape(-1))
        assert set(entry["state"]) == {"step", "exp_avg", "exp_avg_sq"}  # fresh Adam: zero moments, step 0
        assert all(not value.any() for value in entry["state"].values())


def test_tensor_pipeline_parallel_resume_is_bitwise_exact(tmp_path):
    """tp=2 x pp=2 with sequence parallelism and two virtual stages per rank: the tensor-parallel
    tracker's stream and the per-stage default streams are restored on each rank."""
    root = str(tmp_path)
    layout = dict(tp=2, pp=2, vpp=2, sequence_parallel=True, dropout=0.1, arch=GPT2, iters=4)
    uninterrupted = losses_of(run_distributed(train, 4, args=(dict(save=root, save_interval=2, **layout),)))
    storage.write_latest_iteration(root, 2)
    resumed = losses_of(run_distributed(train, 4, args=(dict(load=root, **layout),)))
    assert resumed == uninterrupted


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)])
def test_resume_under_another_data_parallel_size_is_bitwise_exact(tmp_path, save_world, load_world):
    """Same global batch (2), one sample per micro-batch: dp=1 accumulates g1/2 + g2/2, dp=2
    reduces g1 x 1/2 + g2 x 1/2 -- the same floating-point sum -- and the sampler hands
    out the same samples, so the runs agree to the bit. (Other data-parallel changes
    agree to rounding: the reduction order differs; see test_resharding.)"""
    root = str(tmp_path)
    common = dict(global_batch=2, iters=4)
    uninterrupted = losses_of(run_distributed(train, save_world, args=(dict(save=root, save_interval=2, **common),)))
    storage.write_latest_iteration(root, 2)
    resumed = losses_of(run_distributed(train, load_world, args=(dict(load=root, **common),)))
    assert resumed == uninterrupted
