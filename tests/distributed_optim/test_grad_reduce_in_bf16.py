"""--grad-reduce-in-bf16: bf16 models accumulate and reduce gradients in bf16 (half the bytes on the
wire); the optimizer still gets fp32 main gradients, and training stays close to fp32 reduction."""
import pytest
import torch

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.process_groups import collectives
from tests.distributed import run_distributed
from tests.distributed_optim import toy

STEPS = 8


def _train(rank, world_size, grad_reduce_in_bf16, strategy):
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel

    parallel_state = initialize_model_parallel(1, 1)
    run = toy.build(parallel_state, dtype=torch.bfloat16, grad_reduce_in_bf16=grad_reduce_in_bf16,
                    data_parallel_sharding_strategy=strategy)
    losses = []
    with collectives.count_collectives() as counter:
        for step in range(STEPS):
            loss, ok, _ = toy.train_step(run, parallel_state, step)
            assert ok
            losses.append(loss)
    operation = "all_reduce" if strategy == "no_shard" else "reduce_scatter"
    # The trainer all-reduces each step's loss report too ([sum, count] in fp32, over the same group).
    loss_report_bytes = STEPS * 2 * 4 if operation == "all_reduce" else 0
    return {"losses": losses, "grad_dtypes": {str(b.grad_dtype) for b in run.ddp.grad_buffers},
            # What the optimizer reads: ZeRO-2/3's gradient shards, or slices of the full buffer.
            "slice_dtypes": {str(s.grad.dtype) for s in run.ddp.param_slices()},
            "main_grad_dtypes": {str(m.grad_copy.dtype) for m in run.optimizer.main_params if m.grad_copy is not None},
            "reduced_bytes": counter.bytes[(operation, "data")] - loss_report_bytes}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_bf16_reduction_halves_the_bytes_and_tracks_fp32(strategy):
    """Also under ZeRO-2/3, whose gradient shards and reduce-scatter staging take the buffer's dtype."""
    fp32, bf16 = (run_distributed(_train, 2, args=(flag, strategy)) for flag in (False, True))
    for reference, result in zip(fp32, bf16):
        assert reference["grad_dtypes"] == reference["slice_dtypes"] == {"torch.float32"}
        assert result["grad_dtypes"] == result["slice_dtypes"] == {"torch.bfloat16"}
        assert result["main_grad_dtypes"] == {"torch.float32"}  # Adam still steps on fp32 gradients
        # The same reductions, each of half the bytes.
        assert 2 * result["reduced_bytes"] == reference["reduced_bytes"] > 0
        relative = [abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"])]
        # bf16 keeps 8 bits of mantissa: the reductions differ by rounding, not by a wrong sum.
        assert 0 < max(relative) < 2e-2, relative


def test_contradicting_flags_are_refused():
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32"):
        ParallelConfig(grad_reduce_in_bf16=True, accumulate_allreduce_grads_in_fp32=True)
