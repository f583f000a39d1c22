"""The optimizer step: plain AdamW semantics, mixed precision, overflow skipping,
memory accounting, CPU offload and the checkpoint format."""
import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import OptimizerConfig
from megatron_lite.distributed import finalize_model_grads
from megatron_lite.optimizer import merge_optimizer_state_dicts
from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.training import loop
from tests.distributed import run_distributed
from tests.distributed_optim import toy
from tests.parity import assert_relative_close
from tests.nccl_stand_in import NcclDeviceError, StandInNcclGroup, nccl_stand_in


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_single_process_matches_torch_optimizer_with_clipping(kind):
    config = OptimizerConfig(optimizer=kind, lr=0.05, weight_decay=0.1, clip_grad=0.5)
    losses, norms, weights = toy.train(toy.single_process_state(), 10, optimizer_config=config)
    model = toy.MLP()
    # Biases and norm weights (1-D) are not decayed.
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": config.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]
    if kind == "adam":
        reference = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_eps)
    else:
        reference = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    for step in range(10):
        reference.zero_grad()
        x, y = toy.global_batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
        reference.step()
        assert abs(loss.item() - losses[step]) <= 1e-5 * loss.item()
        assert abs(norm.item() - norms[step]) <= 1e-5 * norm.item()
    for name, param in model.named_parameters():
        assert_relative_close(weights[name], param.detach(), what=name)


def _bf16_run(rank, world_size):
    parallel_state = initialize_model_parallel(1, 1)
    run = toy.build(parallel_state, dtype=torch.bfloat16, use_distributed_optimizer=True)
    assert all(p.dtype == torch.bfloat16 for p in run.ddp.parameters())
    assert all(m.dtype == torch.float32 for m in run.optimizer.main_params)
    return [toy.train_step(run, parallel_state, step)[0] for step in range(20)]


def test_bf16_tracks_fp32():
    reference = toy.train(toy.single_process_state(), 20)[0]
    for losses in run_distributed(_bf16_run, 2):
        relative = [abs(a - b) / b for a, b in zip(losses, reference)]
        # bf16 keeps 8 mantissa bits (~0.4% per rounding); fp32 main weights keep the
        # rounding errors from compounding, so the curves stay within 1% (measured: 0.14%).
        assert max(relative) < 1e-2, relative
        assert max(relative) > 0  # it really ran in bf16


def _inject_inf(rank, world_size, strategy):
    parallel_state = initialize_model_parallel(1, 1)
    config = OptimizerConfig(lr=0.05, clip_grad=0.5, initial_loss_scale=1024.0, hysteresis=1)
    run = toy.build(parallel_state, dtype=torch.float16, optimizer_config=config,
         data_parallel_sharding_strategy=strategy)

    def poisoned_finalize(model_chunks, num_tokens=None, *, parallel_state):
        """The trainer's finalize_model_grads after one element of one rank's gradient (its shard
        only, under ZeRO-2/3) became inf: between the last backward and the reduction's end."""
        if rank == 0:
            model_chunks[0].param_slices()[0].grad[3] = float("inf")
        finalize_model_grads(model_chunks, num_tokens, parallel_state=parallel_state)

    log = []
    for step in range(4):
        before = {k: v.clone() for k, v in run.ddp.state_dict().items()}
        poison = mock.patch.object(loop, "finalize_model_grads", poisoned_finalize)
        with poison if step == 2 else contextlib.nullcontext():
            _, ok, norm = toy.train_step(run, parallel_state, step)
        unchanged = all(torch.equal(before[k], v) for k, v in run.ddp.state_dict().items())
        log.append((ok, norm is None, unchanged, run.optimizer.get_loss_scale()))
    return log, run.optimizer.num_skipped_iterations


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(strategy):
    for log, skipped in run_distributed(_inject_inf, 2, args=(strategy,)):
        assert [entry[0] for entry in log] == [True, True, False, True]
        assert log[2][1:] == (True, True, 512.0)  # no norm, weights untouched, scale halved
        assert not log[1][2] and not log[3][2]  # the other steps did update
        assert [entry[3] for entry in log] == [1024.0, 1024.0, 512.0, 512.0]
        assert skipped == 1


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _memory(rank, world_size):
    parallel_state = initialize_model_parallel(1, 1)
    reports = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        config = OptimizerConfig(lr=0.01, initial_loss_scale=1024.0)
        for strategy in STRATEGIES:
            run = toy.build(parallel_state, dtype=dtype, optimizer_config=config,
                            data_parallel_sharding_strategy=strategy)
            at_start = run.optimizer.memory_report()
            toy.train_step(run, parallel_state, 0)
            (buffer,) = run.ddp.grad_buffers
            reports[(str(dtype), strategy)] = {
                "start": at_start, "after a step": run.optimizer.memory_report(), "padding": buffer.padding,
                "elements": sum(r.end - r.start for r in run.optimizer.param_ranges),
                "ranges": len(run.optimizer.param_ranges),
                "staging": 0 if buffer.staging_pool is None else buffer.staging_pool.numel}
    return reports


def test_memory_report_is_measured_and_matches_the_per_parameter_table():
    """Measured from the live tensors, per rank at dp 3 (the second bucket needs padding): the bytes per
    parameter of docs/reference.md section 6, sharded as each strategy says."""
    psi = sum(p.numel() for p in toy.MLP().parameters())
    dp = 3
    results = run_distributed(_memory, dp)
    # Bytes per element: (weights, gradients, optimizer state: fp32 main copy + Adam's two moments + main grad copy).
    table = {"torch.float32": (4, 4, 8), "torch.bfloat16": (2, 4, 12), "torch.float16": (2, 2, 16)}
    for dtype, (weight, grad, state) in table.items():
        unsharded = results[0][(dtype, "no_shard")]["start"]
        # 16, 18 and 20 bytes per parameter (Adam's 0-d step counters are not counted: docs/reference.md section 6).
        assert unsharded["parameter_bytes"] + unsharded["gradient_bytes"] + unsharded["optimizer_state_bytes"] \
            == (weight + grad + state) * psi
        for strategy in STRATEGIES[1:]:
            shards = []
            for reports in results:
                entry = reports[(dtype, strategy)]
                report = entry["start"]
                total = psi + entry["padding"]
                per_rank = total // dp
                step = entry["after a step"]
                for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
                    assert step[key] == report[key], (dtype, strategy, key)  # nothing appears later
                # ZeRO-3 gathers the toy's one unit (the whole model) for its forward and backward.
                whole = weight * total if strategy == "optim_grads_params" else 0
                assert step["peak_parameter_bytes"] == report["parameter_bytes"] + whole
                assert report["parameter_bytes"] == weight * (per_rank if strategy == "optim_grads_params" else total)
                # ZeRO-2/3: the gradient shard plus one bucket-sized staging buffer.
                expected_grads = grad * (per_rank + entry["staging"]) if strategy != "optim" else grad * total
                assert report["gradient_bytes"] == expected_grads, (dtype, strategy)
                assert report["optimizer_state_bytes"] == state * entry["elements"]
                shards.append(entry["elements"])
            assert sum(shards) == psi  # the shards partition the state exactly


def _placement(ddp, optimizer) -> dict:
    """Where the optimizer keeps each tensor, and whether the model holds its own copy of the update."""
    ranges = list(zip(optimizer.param_ranges, optimizer.main_params))
    state = [t for s in optimizer.optimizer.state.values() for k, t in s.items() if k != "step"]
    return {
        "main params": {(m.device.type, m.dtype) for _, m in ranges},
        "main grads": {None if m.grad_copy is None else (m.grad_copy.device.type, m.grad_copy.dtype)
                       for _, m in ranges},
        "adam state": {(t.device.type, t.dtype) for t in state},
        "adam state tensors": len(state),
        # A main parameter sharing the model's storage is the model's own tensor, not a copy in host memory.
        "aliased main params": sum(m.untyped_storage().data_ptr() == r.param.untyped_storage().data_ptr()
                                   for r, m in ranges),
        "model params": {(p.device.type, p.dtype) for p in ddp.parameters()},
        # The step's result reached the model's parameters (a copy of the main parameters, on the model's device).
        "model holds the update": all(torch.equal(r.model_data(), m.detach().to(r.param.dtype)) for r, m in ranges),
        "on host": optimizer.memory_report()["optimizer_state_on_host"],
    }


def _offload(rank, world_size):
    parallel_state = initialize_model_parallel(1, 1)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for offload in (False, True):
            config = OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.5, optimizer_cpu_offload=offload)
            run = toy.build(parallel_state, dtype=dtype, optimizer_config=config,
                            use_distributed_optimizer=True)
            losses = [toy.train_step(run, parallel_state, step)[0] for step in range(5)]
            run.ddp.finish_param_sync()
            results[(str(dtype), offload)] = (losses, _placement(run.ddp, run.optimizer),
                                              len(run.optimizer.main_params))
    return results


def test_cpu_offload_gives_the_same_losses_with_state_in_host_memory():
    for results in run_distributed(_offload, 2):
        for dtype, model_dtype in (("torch.float32", torch.float32), ("torch.bfloat16", torch.bfloat16)):
            losses, resident, _ = results[(dtype, False)]
            offloaded_losses, placement, n_main = results[(dtype, True)]
            assert offloaded_losses == losses, dtype
            # fp32 main parameters, their gradients and Adam's two moments all live on the host, as copies.
            assert placement["main params"] == {("cpu", torch.float32)}, dtype
            assert placement["main grads"] == {("cpu", torch.float32)}, dtype
            assert placement["adam state"] == {("cpu", torch.float32)}, dtype
            assert placement["adam state tensors"] == 2 * n_main, dtype
            assert placement["aliased main params"] == 0, dtype
            assert placement["on host"] is True
            # The model keeps its parameters on its own device and dtype, updated from the host copies.
            assert placement["model params"] == {("cpu", model_dtype)}, dtype
            assert placement["model holds the update"], dtype
            assert resident["on host"] is False
            assert resident["model holds the update"], dtype
        # Without offload an fp32 model's parameters are themselves the main parameters (no copy).
        assert results[("torch.float32", False)][1]["aliased main params"] == results[("torch.float32", False)][2]
        assert results[("torch.float32", False)][1]["main grads"] == {None}


def _resume(rank, world_size):
    """Train 3 steps sharded over 2 ranks, save, then resume (a) sharded on the same layout,
    (b) on one process from the merged shards; both must continue like the original."""
    parallel_state = initialize_model_parallel(1, 1)
    run = toy.build(parallel_state, use_distributed_optimizer=True)
    for step in range(3):
        toy.train_step(run, parallel_state, step)
    weights = {k: v.clone() for k, v in run.ddp.state_dict().items()}
    state = run.optimizer.state_dict()
    shards = [None] * world_size
    torch.distributed.all_gather_object(shards, state)
    continued = [toy.train_step(run, parallel_state, step)[0] for step in (3, 4)]

    run = toy.build(parallel_state, use_distributed_optimizer=True)
    run.ddp.load_state_dict(weights)
    run.optimizer.load_state_dict(state)
    same_layout = [toy.train_step(run, parallel_state, step)[0] for step in (3, 4)]

    single = toy.single_process_state()
    run = toy.build(single)
    run.ddp.load_state_dict(weights)
    with pytest.raises(ValueError, match="merge_optimizer_state_dicts"):
        run.optimizer.load_state_dict(state)
    run.optimizer.load_state_dict(merge_optimizer_state_dicts(shards))
    merged = [toy.train_step(run, single, step)[0] for step in (3, 4)]
    return continued, same_layout, merged, state["data_parallel"], sorted(state["params"])


def test_optimizer_state_resumes_on_same_and_merged_layouts():
    results = run_distributed(_resume, 2)
    for rank, (continued, same_layout, merged, data_parallel, _) in enumerate(results):
        assert same_layout == continued
        assert_relative_close(merged, continued, what="resumed from merged shards")
        assert data_parallel == {"sharded": True, "size": 2, "rank": rank}
    # Each rank saves only the parameters its shard touches; together, all of them.
    assert "fc1.bias" not in results[0][4]
    assert sorted(set(results[0][4]) | set(results[1][4])) == [
        "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "norm.bias", "norm.weight"]


@pytest.mark.parametrize("strategy, grad_offload", [("no_shard", False), ("optim", False), ("optim_grads", False),
                                                    ("optim_grads", True), ("optim_grads_params", True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_offloaded_step_hands_nccl_only_gpu_tensors(dtype, strategy, grad_offload):
    """Under --optimizer-cpu-offload the main gradients are on the host (under --grad-cpu-offload the
    gradient shards themselves), but every collective of the step (the gradient norm, and fp16's
    overflow check) goes over NCCL groups, which take only GPU tensors."""
    parallel_state = toy.single_process_state()
    sharded = strategy != "no_shard"
    config = OptimizerConfig(lr=0.05, clip_grad=0.5, optimizer_cpu_offload=True, initial_loss_scale=1024.0)
    run = toy.build(parallel_state, dtype=dtype, optimizer_config=config,
                    data_parallel_sharding_strategy=strategy, grad_cpu_offload=grad_offload)
    x, y = toy.global_batch(0)
    run.optimizer.scale_loss(F.mse_loss(run.ddp(x.to(dtype)).float(), y)).backward()
    finalize_model_grads([run.ddp], parallel_state=parallel_state)
    groups = {name: StandInNcclGroup(name) for name in ("model", "data")}
    parallel_state.groups.update(groups)
    before = {k: v.clone() for k, v in run.ddp.state_dict().items()}
    with nccl_stand_in():
        update_successful, grad_norm, _ = run.optimizer.step()
    assert update_successful and grad_norm == 0.0  # a meta norm reads 0: no clipping, the step ran
    assert all(not torch.equal(before[k], v) for k, v in run.ddp.state_dict().items())
    collectives_per_group = 2 if dtype == torch.float16 else 1  # fp16: the overflow flag, then the norm
    assert groups["model"].calls == [("all_reduce", "meta")] * collectives_per_group
    # Sharded, each data-parallel rank holds different gradients: both also reduce over data parallelism.
    assert groups["data"].calls == ([("all_reduce", "meta")] * collectives_per_group if sharded else [])


def test_nccl_stand_in_refuses_host_tensors():
    group = StandInNcclGroup("model")
    with nccl_stand_in(), pytest.raises(NcclDeviceError, match="'model' was handed a tensor on cpu"):
        collectives.all_reduce(torch.ones(1), group)
    assert group.calls == [("all_reduce", "cpu")]
