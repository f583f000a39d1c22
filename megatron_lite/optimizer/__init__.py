"""Optimizers, loss scaling and gradient clipping for mixed-precision, parallel training.

``get_megatron_optimizer`` picks the optimizer for a run; every one offers
``step() -> (update_successful, grad_norm, num_zeros_in_grad)``, ``zero_grad()``,
``scale_loss(loss)``, ``get_loss_scale()``, ``param_groups`` (for the LR scheduler),
``memory_report()``, ``num_skipped_iterations``, ``state_dict()``/``load_state_dict()`` and
``reload_model_params()``.

Optimizer checkpoint format (the same for sharded and unsharded optimizers)::

    {"params": {name: {"shape": full parameter shape,
                       "range": (start, end),        # elements of the flattened parameter held here
                       "main_param": fp32 1-D tensor, # end - start elements
                       "state": {"exp_avg": 1-D, "exp_avg_sq": 1-D, "step": 0-d}}},  # SGD: momentum_buffer
     "param_groups": [hyperparameters of each group, without "params"],  # [decayed, not decayed],
                                                  # then the same two for --decoupled-lr's weights
     "grad_scaler": scaler state or None,
     "num_skipped_iterations": int,
     "data_parallel": {"sharded": bool, "size": dp, "rank": dp rank}}

Names are the model's layout-independent parameter names. A distributed optimizer
saves one such dict per data-parallel rank, each holding only its shard's ranges;
``merge_optimizer_state_dicts`` joins them into whole parameters, which load under
any data-parallel size (``load_state_dict`` slices out the ranges a rank owns).
"""
import torch

from megatron_lite.config import ConfigError, OptimizerConfig, ParallelConfig
from megatron_lite.distributed import DistributedDataParallel
from megatron_lite.optimizer.distributed_optimizer import DistributedOptimizer
from megatron_lite.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_lite.optimizer.optimizer import MegatronOptimizer, merge_optimizer_state_dicts

__all__ = ["get_megatron_optimizer", "MegatronOptimizer", "DistributedOptimizer", "merge_optimizer_state_dicts"]


def get_megatron_optimizer(optimizer_config: OptimizerConfig, model_chunks: list, *, parallel_state,
                           parallel_config: ParallelConfig, params_dtype: torch.dtype) -> MegatronOptimizer:
    """The optimizer for ``model_chunks`` (each a DistributedDataParallel).

    fp16 gets a loss scaler: constant with --loss-scale, else dynamic (--initial-loss-scale,
    --min-loss-scale, --loss-scale-window, --hysteresis). bf16 and fp32 need none.
    """
    for chunk in model_chunks:
        if not isinstance(chunk, DistributedDataParallel):
            raise TypeError("get_megatron_optimizer needs model chunks wrapped in "
                            "megatron_lite.distributed.DistributedDataParallel (it owns the gradient buffers).")
        if chunk.config.data_parallel_sharding_strategy != parallel_config.data_parallel_sharding_strategy:
            raise ConfigError("the model chunks were wrapped with a different --data-parallel-sharding-strategy "
                              f"({chunk.config.data_parallel_sharding_strategy}; --use-distributed-optimizer is "
                              f"optim) than the optimizer's ({parallel_config.data_parallel_sharding_strategy}); "
                              "build both from the same ParallelConfig.")
    grad_scaler = None
    if optimizer_config.loss_scale is not None:
        grad_scaler = ConstantGradScaler(optimizer_config.loss_scale)
    elif params_dtype == torch.float16:
        grad_scaler = DynamicGradScaler(
            initial_scale=optimizer_config.initial_loss_scale, min_scale=optimizer_config.min_loss_scale,
            growth_interval=optimizer_config.loss_scale_window, hysteresis=optimizer_config.hysteresis)
    kind = DistributedOptimizer if parallel_config.use_distributed_optimizer else MegatronOptimizer
    return kind(optimizer_config, model_chunks, parallel_state=parallel_state, grad_scaler=grad_scaler)
