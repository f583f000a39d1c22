"""One layout on one cluster: memory per GPU, step time, throughput, MFU."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.model import flops
from megatron_lite.planner.cluster import Cluster
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.memory import GB, MemoryEstimate, peak_memory, rank_memory
from megatron_lite.planner.step_time import StepTime, step_time, training_dtype
from megatron_lite.process_groups.parallel_state import RankLayout


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    cluster: Cluster
    memory: MemoryEstimate  # the fullest rank
    time: StepTime

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.cluster.gpu_memory_gb * GB

    @property
    def model_flops(self) -> float:
        """Per step, without recomputation (what MFU counts, as the training log does)."""
        model = self.layout.config.model
        return flops.num_floating_point_operations(
            model, self.layout.global_batch_size, model.padded_vocab_size(self.layout.tensor_model_parallel_size))

    @property
    def tokens_per_second(self) -> float:
        return self.layout.global_batch_size * self.layout.config.model.seq_length / self.time.step_time_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.time.step_time_s / self.cluster.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.cluster.peak(training_dtype(self.layout))

    def as_dict(self) -> dict:
        return {"step_time_s": self.time.step_time_s, "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "memory_gb_per_gpu": self.memory.total_bytes / GB, "bubble_fraction": self.time.bubble_fraction,
                "tokens_per_second": self.tokens_per_second, "fits": self.fits, "layout": self.layout.as_dict(),
                "flags": self.layout.flags(), "memory": self.memory.as_dict(),
                "time_breakdown_s": dict(self.time.breakdown)}


def estimate(layout: Layout, cluster: Cluster) -> Estimate:
    memory = peak_memory(layout, device=cluster.device, allowance_gb=cluster.memory_allowance_gb)
    return Estimate(layout=layout, cluster=cluster, memory=memory, time=step_time(layout, cluster))


def estimate_for_config(config: Config, world_size: int, *, rank: int = 0, device: str | None = None) -> MemoryEstimate:
    """The planner's memory estimate for global ``rank`` of a pretraining run (no allowance added).

    ``device`` picks whose kernels' activation accounting applies: "cuda" or "cpu"
    (default: where ``model.builder`` puts the model).
    """
    if device is None:
        from megatron_lite.model.builder import current_device
        device = current_device().type
    parallel = config.parallel
    grid = RankLayout(world_size, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                      context_parallel_size=parallel.context_parallel_size,
                      expert_model_parallel_size=parallel.expert_model_parallel_size,
                      expert_tensor_parallel_size=parallel.expert_tensor_parallel_size)
    where = grid.coordinates(rank)
    layout = Layout(config, world_size)
    # Its place in the data x context group (context ranks vary faster): which shard it owns.
    sharding_rank = where["data"] * parallel.context_parallel_size + where["context"]
    return rank_memory(layout, device=device, pipeline_rank=where["pipeline"], data_parallel_rank=sharding_rank,
                       expert_data_parallel_rank=where["expert_data"])


def format_memory_estimate(estimate: MemoryEstimate, measured: dict | None = None) -> str:
    """A start-up log line: the estimate beside ``optimizer.memory_report()``'s measured bytes."""
    mb = 2 ** 20

    def part(name: str, estimated: float, key: str) -> str:
        seen = f" (measured {measured[key] / mb:.1f})" if measured is not None else ""
        return f" {name}: {estimated / mb:.1f}{seen} |"

    static = estimate.static
    return (" planner estimate per rank (MB) |"
            + part("parameters", static.parameter_bytes, "parameter_bytes")
            # ZeRO-3's gathers: measured during iteration 1 (its memory line's "parameters (peak)").
            + (f" parameters at peak: {static.peak_parameter_bytes / mb:.1f} |"
               if static.peak_parameter_bytes != static.parameter_bytes else "")
            + part("gradients", static.gradient_bytes, "gradient_bytes")
            + part("optimizer state", static.optimizer_state_bytes, "optimizer_state_bytes")
            + f" activations at peak: {estimate.activation_bytes / mb:.1f} |"
            + f" loss working memory: {estimate.loss_transient_bytes / mb:.1f} |"
            + f" total: {estimate.total_bytes / mb:.1f} |")
