"""A layout to estimate, and every valid layout of a model on a cluster.

A layout is a full training ``Config`` (so every check pretraining makes applies to it
too, and the planner reads its sharding strategy, bucket size and overlap flags as
training does) on a number of GPUs. Enumeration varies the sizes of tensor, context,
pipeline and virtual pipeline parallelism, expert parallelism (a mixture of experts': the
experts over a divisor of the data-parallel size, each expert split like the dense layers,
Megatron-LM's default), the micro-batch size, recomputation and the sharding strategy;
everything else (precision, global batch, overlap flags, --cp-comm-type) stays as the user
gave it. Sequence parallelism is on whenever tensor parallelism is: it only saves memory, for
the same communication volume. Context parallelism is tried for long sequences only: while
each of the 2 x cp chunks keeps ``MIN_CONTEXT_PARALLEL_CHUNK`` positions, below which
exchanging keys and values costs more than the activations it saves are worth.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

from megatron_lite.config import SHARDING_STRATEGIES, Config, ConfigError
from megatron_lite.pipeline_parallel.layer_split import get_layer_numbers
from megatron_lite.planner.cluster import Cluster
from megatron_lite.process_groups.parallel_state import RankLayout

RECOMPUTE_CHOICES = ((None, None), ("selective", None), ("full", "uniform"))
MAX_MICRO_BATCH_SIZE = 16  # larger ones gain little matmul efficiency and cost activation memory
MIN_CONTEXT_PARALLEL_CHUNK = 1024  # positions per chunk (a rank holds two) for context parallelism to be tried


@dataclass(frozen=True)
class Layout:
    config: Config
    world_size: int

    @property
    def sharding_strategy(self) -> str:
        """--data-parallel-sharding-strategy: ``config`` says, as it says everything pretraining reads."""
        return self.config.parallel.data_parallel_sharding_strategy

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.config.parallel.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.config.parallel.pipeline_model_parallel_size

    @property
    def virtual_pipeline_model_parallel_size(self) -> int:
        return self.config.parallel.virtual_pipeline_model_parallel_size or 1

    @property
    def context_parallel_size(self) -> int:
        return self.config.parallel.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return RankLayout(self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                          context_parallel_size=self.context_parallel_size).data_parallel_size

    @property
    def data_parallel_size_with_context(self) -> int:
        """The ranks that reduce (and, sharded, split) gradients together: data x context."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def cp_comm_types(self) -> list[str]:
        """--cp-comm-type of every layer."""
        types = self.config.parallel.cp_comm_type
        return types if len(types) > 1 else types * self.config.model.num_layers

    @property
    def expert_model_parallel_size(self) -> int:
        return self.config.parallel.expert_model_parallel_size

    @property
    def micro_batch_size(self) -> int:
        return self.config.training.micro_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.config.training.num_microbatches(self.data_parallel_size)

    @property
    def global_batch_size(self) -> int:
        return self.config.training.global_batch(self.data_parallel_size)

    @property
    def recompute(self) -> str:
        training = self.config.training
        if training.recompute_granularity == "full":
            return f"full/{training.recompute_method or 'uniform'}/{training.recompute_num_layers or 1}"
        return training.recompute_granularity or "none"

    def as_dict(self) -> dict:
        return {"tensor_model_parallel_size": self.tensor_model_parallel_size,
                "context_parallel_size": self.context_parallel_size,
                "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
                "data_parallel_size": self.data_parallel_size, "micro_batch_size": self.micro_batch_size,
                "num_microbatches": self.num_microbatches, "global_batch_size": self.global_batch_size,
                "sequence_parallel": self.config.parallel.sequence_parallel, "recompute": self.recompute,
                "data_parallel_sharding_strategy": self.sharding_strategy,
                **({"expert_model_parallel_size": self.expert_model_parallel_size,
                    "expert_tensor_parallel_size": self.config.parallel.expert_tensor_size}
                   if self.config.model.num_experts is not None else {})}

    def flags(self) -> str:
        """The pretraining flags that select this layout."""
        parts = [f"--tensor-model-parallel-size {self.tensor_model_parallel_size}",
                 f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size}"]
        if self.context_parallel_size > 1:
            parts.append(f"--context-parallel-size {self.context_parallel_size} "
                         f"--cp-comm-type {' '.join(self.config.parallel.cp_comm_type)}")
        if self.virtual_pipeline_model_parallel_size > 1:
            parts.append(f"--virtual-pipeline-model-parallel-size {self.virtual_pipeline_model_parallel_size}")
        if self.expert_model_parallel_size > 1:
            parts.append(f"--expert-model-parallel-size {self.expert_model_parallel_size}")
        parts.append(f"--micro-batch-size {self.micro_batch_size}")
        if self.config.parallel.sequence_parallel:
            parts.append("--sequence-parallel")
        training = self.config.training
        if training.recompute_granularity:
            parts.append(f"--recompute-granularity {training.recompute_granularity}")
        if training.recompute_method:
            parts.append(f"--recompute-method {training.recompute_method}")
        parts.append(f"--data-parallel-sharding-strategy {self.sharding_strategy}")
        return " ".join(parts)


def check_layout(layout: Layout, cluster: Cluster, *, tensor_parallel_across_nodes: bool = False) -> None:
    """Raise ConfigError unless pretraining would accept ``layout`` on ``cluster``."""
    config, t, p = layout.config, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    if layout.world_size != cluster.num_gpus:
        raise ConfigError(f"the layout is for {layout.world_size} GPUs but the cluster has {cluster.num_gpus}.")
    dp = layout.data_parallel_size  # raises when tp x pp does not divide the world
    RankLayout(layout.world_size, t, p, context_parallel_size=layout.context_parallel_size,
               expert_model_parallel_size=layout.expert_model_parallel_size,
               expert_tensor_parallel_size=config.parallel.expert_tensor_parallel_size)  # experts fit in a stage
    config.training.num_microbatches(dp)
    config.parallel.check_interleaved_microbatches(layout.num_microbatches)
    for rank in range(p):
        for virtual_rank in range(layout.virtual_pipeline_model_parallel_size):
            get_layer_numbers(config.model.num_layers, pipeline_model_parallel_size=p, pipeline_rank=rank,
                              virtual_pipeline_model_parallel_size=config.parallel.virtual_pipeline_model_parallel_size,
                              virtual_pipeline_rank=virtual_rank,
                              decoder_first_pipeline_num_layers=config.parallel.decoder_first_pipeline_num_layers,
                              decoder_last_pipeline_num_layers=config.parallel.decoder_last_pipeline_num_layers)
    if not tensor_parallel_across_nodes and cluster.spans_nodes(1, t):
        raise ConfigError(f"--tensor-model-parallel-size {t} does not fit in a node of {cluster.gpus_per_node} GPUs: "
                          f"its all-reduces would cross the network. Lower it, or pass "
                          f"--tensor-parallel-across-nodes to plan it anyway.")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _micro_batch_sizes(global_batch: int, data_parallel_size: int) -> list[int]:
    if global_batch % data_parallel_size:
        return []
    return [b for b in _divisors(global_batch // data_parallel_size) if b <= MAX_MICRO_BATCH_SIZE]


def _context_parallel_sizes(seq_length: int, ranks: int) -> list[int]:
    """1, and every cp dividing ``ranks`` whose chunks keep ``MIN_CONTEXT_PARALLEL_CHUNK`` positions."""
    return [cp for cp in _divisors(ranks)
            if cp == 1 or (seq_length % (2 * cp) == 0 and seq_length // (2 * cp) >= MIN_CONTEXT_PARALLEL_CHUNK)]


def _candidate(base: Config, *, tp: int, cp: int, pp: int, vpp: int, ep: int, micro_batch_size: int,
               recompute: tuple) -> Config:
    parallel = dataclasses.replace(base.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   context_parallel_size=cp,
                                   expert_model_parallel_size=ep, expert_tensor_parallel_size=None,
                                   virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                   num_layers_per_virtual_pipeline_stage=None, sequence_parallel=tp > 1,
                                   use_distributed_optimizer=False, overlap_param_gather=False)
    training = dataclasses.replace(base.training, micro_batch_size=micro_batch_size,
                                   recompute_granularity=recompute[0], recompute_method=recompute[1],
                                   recompute_num_layers=None)
    return Config(model=base.model, parallel=parallel, training=training, optimizer=base.optimizer, data=base.data,
                  checkpoint=base.checkpoint, logging=base.logging)


def with_strategy(config: Config, strategy: str) -> Config:
    """``config`` with the flags pretraining reads for ``strategy``."""
    sharded = strategy != "no_shard"
    overlap_param = config.parallel.overlap_grad_reduce and sharded
    parallel = dataclasses.replace(config.parallel, use_distributed_optimizer=sharded,
                                   data_parallel_sharding_strategy=strategy, overlap_param_gather=overlap_param)
    return dataclasses.replace(config, parallel=parallel)


def enumerate_layouts(base: Config, cluster: Cluster, *,
                      tensor_parallel_across_nodes: bool = False) -> Iterator[Layout]:
    """Every layout of ``base``'s model and global batch on ``cluster`` that pretraining accepts.

    ``--overlap-grad-reduce`` in ``base`` also turns on ``--overlap-param-gather`` for the
    sharded strategies (Megatron's recommended pair).
    """
    n, layers = cluster.num_gpus, base.model.num_layers
    global_batch = base.training.global_batch_size
    if global_batch is None:
        raise ConfigError("enumerating layouts needs --global-batch-size (the micro-batch count depends on it).")
    for tp in _divisors(n):
        if not tensor_parallel_across_nodes and cluster.spans_nodes(1, tp):
            continue
        for cp, pp in _context_and_pipeline_sizes(base.model.seq_length, layers, n // tp):
            dp = n // (tp * cp * pp)
            for vpp, ep in [(v, e) for v in _divisors(layers // pp) if v == 1 or pp > 1
                            for e in _expert_parallel_sizes(base, dp * cp)]:
                for micro_batch_size in _micro_batch_sizes(global_batch, dp):
                    for recompute in RECOMPUTE_CHOICES:
                        try:
                            config = _candidate(base, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep,
                                                micro_batch_size=micro_batch_size, recompute=recompute)
                        except ConfigError:
                            continue  # e.g. heads not divisible by tp
                        for strategy in SHARDING_STRATEGIES:
                            try:
                                # A strategy can clash with other flags (--grad-cpu-offload needs sharded gradients).
                                layout = Layout(with_strategy(config, strategy), n)
                                check_layout(layout, cluster, tensor_parallel_across_nodes=tensor_parallel_across_nodes)
                            except ConfigError:
                                continue
                            yield layout


def _context_and_pipeline_sizes(seq_length: int, layers: int, ranks: int):
    """(cp, pp) pairs for ``ranks`` ranks per tensor-parallel group: pp dividing the layers."""
    for cp in _context_parallel_sizes(seq_length, ranks):
        for pp in _divisors(ranks // cp):
            if layers % pp == 0:
                yield cp, pp


def _expert_parallel_sizes(base: Config, ranks: int) -> list[int]:
    """The expert-model-parallel sizes to try: each divisor of the experts that also divides the data x context
    ranks of a tensor-parallel group (each expert split over the tensor ranks, ep x tp ranks hold one copy of
    every expert)."""
    experts = base.model.num_experts
    return [1] if experts is None else [e for e in _divisors(experts) if ranks % e == 0]
