"""A two-layer MLP trained by the trainer's own ``train_step``: enough to exercise DDP and the
optimizers without the GPT model, fast enough for 4 gloo ranks on 2 cores."""
from __future__ import annotations

import dataclasses
import typing

import torch
import torch.nn.functional as F

from megatron_lite.config import Config, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_lite.distributed import DistributedDataParallel
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.training import loop

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

    def set_input_tensor(self, input_tensor):
        """The schedule hands each pipeline stage its input here; the MLP is one whole stage, so none comes."""
        assert input_tensor is None

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


def forward_step(data_iterator, model):
    """``loop.forward_step``'s contract for the MLP: the micro-batch mean squared error, reported as
    Megatron's ``[sum, count]`` (one "token" per micro-batch) so the trainer averages it like a loss."""
    x, y = next(data_iterator)

    def loss_func(output):
        loss = F.mse_loss(output.float(), y)
        return loss, {"lm loss": torch.stack([loss.detach(), torch.ones(())])}

    return model(x.to(next(model.parameters()).dtype)), loss_func


class Toy(typing.NamedTuple):
    """What the trainer holds for a model: its config, the wrapped chunk, optimizer and LR schedule."""
    config: Config
    ddp: DistributedDataParallel
    optimizer: object
    scheduler: object


def build(parallel_state, *, dtype=torch.float32, optimizer_config=OPTIMIZER, **parallel) -> Toy:
    """The MLP wrapped and given an optimizer as the trainer does; ``parallel`` are ParallelConfig fields.
    The learning rate stays at ``optimizer_config.lr`` (constant style), as torch.optim's references run."""
    parallel.setdefault("ddp_bucket_size", BUCKET_SIZE)
    config = Config(
        # The trainer reads the model's shape only to size pipeline messages, which one stage never sends.
        model=ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, seq_length=1, vocab_size=OUT),
        parallel=ParallelConfig(**parallel),
        training=TrainingConfig(micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, train_iters=1,
                                bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16),
        optimizer=dataclasses.replace(optimizer_config, lr_decay_style="constant"))
    ddp = DistributedDataParallel(MLP(dtype), config=config.parallel,
                                  data_parallel_group=parallel_state.data_parallel_group)
    optimizer, scheduler = loop.build_optimizer_and_scheduler(config, parallel_state, [ddp])
    return Toy(config, ddp, optimizer, scheduler)


def train_step(toy: Toy, parallel_state, step: int):
    """The trainer's ``train_step`` on this rank's micro-batches of global batch ``step``.

    Returns (global-batch loss, update_successful, grad_norm)."""
    batches = micro_batches(step, parallel_state.data_parallel_rank, parallel_state.data_parallel_world_size)
    return loop.train_step(toy.config, parallel_state, [toy.ddp], toy.optimizer, toy.scheduler, iter(batches),
                           len(batches), forward_step_func=forward_step)


def train(parallel_state, steps: int, **build_kwargs):
    """Losses, grad norms and final weights (float32 numpy arrays by name: tensors would be
    sent between processes through shared memory that dies with the rank) after ``steps`` steps."""
    toy = build(parallel_state, **build_kwargs)
    losses, norms = [], []
    for step in range(steps):
        loss, ok, norm = train_step(toy, parallel_state, step)
        assert ok
        losses.append(loss)
        norms.append(norm)
    toy.ddp.finish_param_sync()
    weights = {k: v.detach().float().numpy().copy() for k, v in toy.ddp.state_dict().items()}
    return losses, norms, weights


def single_process_state():
    """A ParallelState with every group of size one (None)."""
    return initialize_model_parallel(1, 1, rank=0, world_size=1)
