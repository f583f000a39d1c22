"""Muon on a mixture-of-experts model: each expert's matrices are orthogonalised on their own (and an expert's
SwiGLU fc1 per gate and up), checked against torch.optim.Muon's Newton-Schulz (run in fp32) on that expert's
gradient alone, through the trainer's own set-up and step."""
import dataclasses
from unittest import mock

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from tests.checkpointing.common import MOE, tiny_config
from tests.distributed import run_distributed

LR = 1e-2


def _step(rank, world_size):
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.training.data_iterators import build_data_iterators
    from megatron_lite.training.loop import setup_model_and_optimizer, train_step
    from megatron_lite.training.run_plan import plan_run

    config = tiny_config(arch=MOE, iters=1)
    # Momentum 0, no decay, no clipping, constant lr: the update is lr x scale x NS(gradient).
    config.optimizer = dataclasses.replace(
        config.optimizer, optimizer="muon", lr=LR, lr_warmup_iters=0, weight_decay=0.0, clip_grad=0.0,
        muon_momentum=0.0, lr_decay_style="constant", muon_coefficient_type="simple",
        muon_scale_mode="shape_scaling", muon_fp32_matmul_prec="high")
    ps = initialize_model_parallel(1, 1)
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, ps)
    before = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    iterator = build_data_iterators(config, ps, plan_run(config, ps), 0)[0]
    train_step(config, ps, chunks, optimizer, scheduler, iterator, config.training.num_microbatches(1))
    grads = {r.name: r.model_grad().view(r.shape).clone() for r in optimizer.param_ranges}
    after = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    return before, grads, after


def _torch_update(grad):
    with mock.patch.object(torch.Tensor, "bfloat16", lambda tensor: tensor.clone()):
        orthogonal = _zeropower_via_newtonschulz(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
    return -LR * max(1.0, grad.shape[0] / grad.shape[1]) ** 0.5 * orthogonal


def test_each_expert_is_orthogonalised_alone():
    ((before, grads, after),) = run_distributed(_step, 1)
    experts = [n for n in grads if ".local_experts." in n]
    assert len(experts) == 4 * 4 * 2  # layers x experts x (fc1, fc2)
    assert all(grads[name].abs().max() > 0 for name in experts)  # every expert got tokens: real updates
    for name in experts:
        update = after[name] - before[name]
        if name.endswith("linear_fc1.weight"):
            expected = torch.cat([_torch_update(half) for half in grads[name].chunk(2)])
        else:
            expected = _torch_update(grads[name])
        torch.testing.assert_close(update, expected, rtol=1e-4, atol=1e-6, msg=name)
