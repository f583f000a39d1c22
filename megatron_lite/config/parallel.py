"""ParallelConfig: how the world is cut (tensor x context x data x pipeline, and the expert view), and
its checks."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.fields import check_choices, require

# --cp-comm-type values: keys and values all-gathered, or passed around a ring (Megatron-LM's p2p). Megatron-LM
# spells the first "allgather"; both spellings are taken.
CP_COMM_TYPES = ("p2p", "all_gather", "allgather")

# Megatron-LM's names for ZeRO stages 0 to 3: nothing, optimizer state, + gradients, + parameters sharded.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is cut: tensor x context x data x pipeline (tensor-parallel ranks adjacent)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1  # every sequence split over this many ranks (megatron_lite/context_parallel/)
    # How context-parallel attention exchanges keys and values: one value for every layer, or one per layer.
    cp_comm_type: list = field(default_factory=lambda: ["p2p"], metadata={"choices": CP_COMM_TYPES})
    # Mixture-of-experts layers: experts split over expert-model-parallel ranks, each expert's weights over
    # expert-tensor-parallel ranks (None: the tensor-parallel size, as Megatron-LM).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False  # the same as data_parallel_sharding_strategy "optim"
    # What data-parallel ranks shard (ZeRO stages 0-3); None = "optim" with --use-distributed-optimizer,
    # else "no_shard". See megatron_lite/distributed/distributed_data_parallel.py.
    data_parallel_sharding_strategy: Optional[str] = field(default=None, metadata={"choices": SHARDING_STRATEGIES})
    grad_cpu_offload: bool = False  # ZeRO-2/3: the fp32 gradient shards live in host memory
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None  # elements; None = Megatron's default (max(40M, 1M * dp))
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False  # with --bf16: bf16 gradient buffers and reductions (main grads stay fp32)
    distributed_backend: Optional[str] = field(default=None, metadata={"choices": ("nccl", "gloo")})  # None: by device
    distributed_timeout_minutes: float = 10  # every process group's collective timeout (fractions allowed)

    def __post_init__(self) -> None:
        check_choices(self)
        strategy = self.data_parallel_sharding_strategy
        require(not (strategy == "no_shard" and self.use_distributed_optimizer),
                 "--use-distributed-optimizer shards the optimizer state, but --data-parallel-sharding-strategy is "
                 "no_shard: drop one of them (--use-distributed-optimizer is the same as the strategy optim).")
        if strategy is None:
            self.data_parallel_sharding_strategy = "optim" if self.use_distributed_optimizer else "no_shard"
        # Every strategy but no_shard shards the optimizer state: it is the distributed optimizer.
        self.use_distributed_optimizer = self.data_parallel_sharding_strategy != "no_shard"
        require(not self.grad_cpu_offload or self.shards_gradients,
                 "--grad-cpu-offload keeps gradient shards in host memory, which needs sharded gradients: add "
                 "--data-parallel-sharding-strategy optim_grads (or optim_grads_params).")
        require(self.tensor_model_parallel_size >= 1,
                 f"--tensor-model-parallel-size must be >= 1, got {self.tensor_model_parallel_size}.")
        require(self.pipeline_model_parallel_size >= 1,
                 f"--pipeline-model-parallel-size must be >= 1, got {self.pipeline_model_parallel_size}.")
        require(self.context_parallel_size >= 1,
                 f"--context-parallel-size must be >= 1, got {self.context_parallel_size}.")
        self.cp_comm_type = ["all_gather" if kind == "allgather" else kind for kind in self.cp_comm_type]
        require(self.expert_model_parallel_size >= 1,
                 f"--expert-model-parallel-size must be >= 1, got {self.expert_model_parallel_size}.")
        require(self.expert_tensor_parallel_size is None or self.expert_tensor_parallel_size >= 1,
                 f"--expert-tensor-parallel-size must be >= 1, got {self.expert_tensor_parallel_size}.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # As Megatron-LM: with one tensor-parallel rank there is no sequence to split.
            warnings.warn("--sequence-parallel has no effect at --tensor-model-parallel-size 1; turning it off.")
            self.sequence_parallel = False
        require(not self.overlap_param_gather or self.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer (only sharded parameters are gathered).")
        vpp = self.virtual_pipeline_model_parallel_size
        require(vpp is None or vpp >= 1, f"--virtual-pipeline-model-parallel-size must be >= 1, got {vpp}.")
        require(vpp is None or vpp == 1 or self.pipeline_model_parallel_size > 1,
                 "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1.")
        require(not (self.grad_reduce_in_bf16 and self.accumulate_allreduce_grads_in_fp32),
                 "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other; pick one.")
        require(self.distributed_timeout_minutes > 0,
                 f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}.")

    @property
    def shards_gradients(self) -> bool:
        """ZeRO-2 and 3: each rank keeps only its shard of the averaged gradients."""
        return self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3: each rank keeps only its shard of the parameters between uses."""
        return self.data_parallel_sharding_strategy == "optim_grads_params"

    def check_interleaved_microbatches(self, num_microbatches: int) -> None:
        """With virtual pipeline stages, Megatron's interleaved schedule walks micro-batches in groups of p."""
        pp = self.pipeline_model_parallel_size
        require((self.virtual_pipeline_model_parallel_size or 1) == 1 or num_microbatches % pp == 0,
                 f"the interleaved pipeline schedule needs the number of micro-batches (--global-batch-size / "
                 f"(--micro-batch-size x data-parallel size) = {num_microbatches}) to be a multiple of "
                 f"--pipeline-model-parallel-size ({pp}); change --global-batch-size or --micro-batch-size, or drop "
                 f"--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage.")

    @property
    def expert_tensor_size(self) -> int:
        """The expert-tensor-parallel size: --expert-tensor-parallel-size, else the tensor-parallel size."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = (self.tensor_model_parallel_size * self.context_parallel_size
                          * self.pipeline_model_parallel_size)
        context = (f" x --context-parallel-size ({self.context_parallel_size})"
                   if self.context_parallel_size > 1 else "")
        require(world_size % model_parallel == 0,
                 f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                 f"({self.tensor_model_parallel_size}){context} x --pipeline-model-parallel-size "
                 f"({self.pipeline_model_parallel_size}) = {model_parallel}; launch a multiple of "
                 f"{model_parallel} processes or change the parallel sizes.")
        stage, experts = world_size // self.pipeline_model_parallel_size, (
            self.expert_tensor_size * self.expert_model_parallel_size)
        require(stage % experts == 0,
                 f"the {stage} processes of each pipeline stage do not split into --expert-tensor-parallel-size "
                 f"({self.expert_tensor_size}) x --expert-model-parallel-size ({self.expert_model_parallel_size}) "
                 f"= {experts} expert shards; launch a multiple of {experts * self.pipeline_model_parallel_size} "
                 f"processes or change the expert sizes.")
        return world_size // model_parallel
