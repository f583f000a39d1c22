"""ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params) on a GPT: exactly the collectives
the design says, and no more whole parameters alive than the running unit and the prefetched one.

Units: the embedding, each of the 4 transformer layers, and the root (final norm and output
layer), one bucket each. Per micro-batch every unit is all-gathered for its forward and again for
its backward, and reduce-scattered once; a tied embedding is gathered once more in forward (the
output layer borrows it) and stays gathered through the backward.
"""
import contextlib

import pytest
import torch

from megatron_lite.config import Config, ModelConfig, ParallelConfig
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.model.builder import FSDP_UNIT_MODULES, build_model
from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from tests.distributed import run_distributed

LAYERS = 4


def _model_config(tied: bool) -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256,
                       hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=not tied)


def _micro_batch(rank: int):
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (2, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _run(rank, world_size, tied, prefetch, recompute):
    parallel_state = initialize_model_parallel(1, 1)
    config = Config(model=_model_config(tied),
                    parallel=ParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                            overlap_grad_reduce=prefetch, overlap_param_gather=prefetch))
    config.training.recompute_granularity = recompute
    (chunk,) = build_model(config, parallel_state)
    ddp = DistributedDataParallel(chunk, config=config.parallel, data_parallel_group=parallel_state.data_parallel_group,
                                  fsdp_unit_modules=FSDP_UNIT_MODULES)
    unit_bytes = [sum(b.numel for b in buckets) * 4 for buckets in ddp.fully_sharded.buckets_of.values()]
    result = {"buckets": len(ddp.buckets), "unit bytes": unit_bytes,
              "shard numel": sum(buffer.param_shard_data.numel() for buffer in ddp.grad_buffers),
              "total numel": sum(b.numel for b in ddp.buckets),
              "empty between uses": all(p.numel() == 0 for p in ddp.module.parameters())}
    tokens, labels = _micro_batch(parallel_state.data_parallel_rank)
    for micro_batch in range(2):  # the second inside no_sync(), which ZeRO-3 ignores
        with ddp.no_sync() if micro_batch == 0 else contextlib.nullcontext():
            with collectives.count_collectives() as forward:
                loss = ddp(tokens, labels=labels).mean()
            result[f"forward {micro_batch}"] = dict(forward.calls)
            result[f"empty after forward {micro_batch}"] = all(p.numel() == 0 for p in ddp.module.parameters())
            with collectives.count_collectives() as backward:
                loss.backward()
            result[f"backward {micro_batch}"] = dict(backward.calls)
    with collectives.count_collectives() as finalize:
        finalize_model_grads([ddp], parallel_state=parallel_state)
    result["finalize"] = dict(finalize.calls)
    result["empty after backward"] = all(p.numel() == 0 for p in ddp.module.parameters())
    result["peak gathered bytes"] = ddp.fully_sharded.peak_gathered_bytes
    return result


@pytest.mark.parametrize("tied, prefetch, recompute", [(False, False, None), (False, True, None),
                                                       (True, True, None), (False, True, "full")])
def test_collectives_per_unit_and_peak_parameter_memory(tied, prefetch, recompute):
    result = run_distributed(_run, 2, args=(tied, prefetch, recompute))[0]
    units = LAYERS + 2  # embedding, layers, root
    assert result["buckets"] == units
    # Each rank stores 1/dp of every bucket, and no parameter is whole between uses.
    assert result["shard numel"] * 2 == result["total numel"]
    assert result["empty between uses"] and result["empty after backward"]
    for micro_batch in range(2):
        assert result[f"empty after forward {micro_batch}"]
        assert result[f"forward {micro_batch}"] == {("all_gather", "data"): units + tied}
        assert result[f"backward {micro_batch}"] == {("all_gather", "data"): units, ("reduce_scatter", "data"): units}
    assert result["finalize"] == {}  # every bucket was reduced as its backward finished
    largest_two = sum(sorted(result["unit bytes"])[-2:])
    # The running unit and the prefetched one (without prefetch, one at a time); a tied embedding
    # on one stage stays whole through the backward, on top.
    bound = largest_two if prefetch else max(result["unit bytes"])
    embedding = result["unit bytes"][0]
    assert result["peak gathered bytes"] <= bound + (embedding if tied else 0), result
    assert result["peak gathered bytes"] >= (largest_two if prefetch else max(result["unit bytes"]))
