"""A two-layer MLP and a plain training step: enough to exercise DDP and the optimizers
without the GPT model, fast enough for 4 gloo ranks on 2 cores."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron_lite.config import OptimizerConfig, ParallelConfig
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.process_groups.parallel_state import initialize_model_parallel

IN, HIDDEN, OUT = 16, 32, 8
GLOBAL_BATCH, MICRO_BATCH = 8, 2
# Reverse parameter order: norm.bias, norm.weight, fc2.bias, fc2.weight (280 elements),
# then fc1.bias closes bucket 0 at 312 >= 300; fc1.weight (512) fills bucket 1.
BUCKET_SIZE = 300


class MLP(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(IN, HIDDEN, dtype=dtype)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT, dtype=dtype)
        self.norm = torch.nn.LayerNorm(OUT, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.fc1(x))))


def global_batch(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=generator), torch.randn(GLOBAL_BATCH, OUT, generator=generator)


def micro_batches(step: int, dp_rank: int, dp_size: int):
    """This rank's contiguous slice of the global batch, cut into micro-batches."""
    x, y = global_batch(step)
    per_rank = GLOBAL_BATCH // dp_size
    x, y = x[dp_rank * per_rank:(dp_rank + 1) * per_rank], y[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [(x[i:i + MICRO_BATCH], y[i:i + MICRO_BATCH]) for i in range(0, per_rank, MICRO_BATCH)]


OPTIMIZER = OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.5)


def build(parallel_state, *, dtype=torch.float32, optimizer_config=OPTIMIZER, **parallel):
    """(ddp, optimizer) for the MLP; ``parallel`` are ParallelConfig fields."""
    parallel.setdefault("ddp_bucket_size", BUCKET_SIZE)
    config = ParallelConfig(**parallel)
    ddp = DistributedDataParallel(MLP(dtype), config=config, data_parallel_group=parallel_state.data_parallel_group)
    optimizer = get_megatron_optimizer(optimizer_config, [ddp], parallel_state=parallel_state,
                                       parallel_config=config, params_dtype=dtype)
    return ddp, optimizer


def train_step(ddp, optimizer, parallel_state, step: int, *, before_finalize=None):
    """Gradient accumulation over this rank's micro-batches, then one step.

    Returns (global-batch loss, update_successful, grad_norm)."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    batches = micro_batches(step, parallel_state.data_parallel_rank, parallel_state.data_parallel_world_size)
    total = 0.0
    for i, (x, y) in enumerate(batches):
        context = ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
        with context:
            loss = F.mse_loss(ddp(x.to(next(ddp.parameters()).dtype)).float(), y) / len(batches)
            optimizer.scale_loss(loss).backward()
        total += loss.item()
    if before_finalize is not None:
        before_finalize(ddp)
    finalize_model_grads([ddp], parallel_state=parallel_state)
    update_successful, grad_norm, _ = optimizer.step()
    loss = torch.tensor([total / parallel_state.data_parallel_world_size])
    if parallel_state.data_parallel_group is not None:
        torch.distributed.all_reduce(loss, group=parallel_state.data_parallel_group)
    return loss.item(), update_successful, grad_norm


def train(parallel_state, steps: int, **build_kwargs):
    """Losses, grad norms and final weights (float32 numpy arrays by name: tensors would be
    sent between processes through shared memory that dies with the rank) after ``steps`` steps."""
    ddp, optimizer = build(parallel_state, **build_kwargs)
    losses, norms = [], []
    for step in range(steps):
        loss, ok, norm = train_step(ddp, optimizer, parallel_state, step)
        assert ok
        losses.append(loss)
        norms.append(norm)
    ddp.finish_param_sync()
    weights = {k: v.detach().float().numpy().copy() for k, v in ddp.state_dict().items()}
    return losses, norms, weights


def single_process_state():
    """A ParallelState with every group of size one (None)."""
    return initialize_model_parallel(1, 1, rank=0, world_size=1)
