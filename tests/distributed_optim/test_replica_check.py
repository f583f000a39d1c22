"""--check-weight-hash-across-dp-replicas-interval passes on healthy replicas and fails loudly, on every rank,
when one replica drifts."""
import pytest
import torch

from megatron_lite.training.loop import pretrain
from megatron_lite.cli.arguments import parse_args
from megatron_lite.distributed.replica_check import check_weight_hash_across_dp_replicas
from tests.distributed import run_distributed

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
         "--eval-interval", "100", "--check-weight-hash-across-dp-replicas-interval", "1"]


def _train_then_corrupt(rank, world_size, extra):
    state, chunks, parallel_state = pretrain(parse_args(FLAGS + extra), keep_process_group=True)
    assert state.iteration == 2  # the check ran after both iterations and passed
    if rank == 1:
        with torch.no_grad():
            next(chunks[0].parameters()).view(-1)[0] += 1e-3
    try:
        check_weight_hash_across_dp_replicas(chunks, parallel_state, iteration=3)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer", "--overlap-param-gather"]],
                         ids=["ddp", "distributed-optimizer"])
def test_replicas_agree_then_a_drift_is_caught_on_every_rank(extra):
    errors = run_distributed(_train_then_corrupt, world_size=2, args=(extra,))
    assert all(e is not None and "replicas disagree at iteration 3" in e and "global ranks [1]" in e
               for e in errors), errors
