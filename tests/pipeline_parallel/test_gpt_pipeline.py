"""The GPT model through the pipeline schedules: one iteration's losses and gradients vs one process.

Each layout builds the real model chunks (``training.loop.get_model``: layer split,
tied embeddings, data-parallel wrappers), reads the real mock-data iterators,
runs one forward-backward through ``get_forward_backward_func`` with the real
``finalize_model_grads``, and compares every parameter's final gradient,
reassembled from tensor-parallel shards, with the single-process run over the
same global batch. The tied word embedding is checked on both stages that hold
it: after the embedding-group all-reduce each copy carries the full gradient.
"""
import functools

import pytest
import torch

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.tensor_parallel import gather_shards
from tests.distributed import run_distributed
from tests.parity import assert_relative_close, tensor_parallel_split

MICRO_BATCH, SEQ, HIDDEN = 2, 16, 32
TIED = "embedding.word_embeddings.weight"


def _config(tp=1, pp=1, vpp=None, global_batch=4, sequence_parallel=False, first=None, recompute=False) -> Config:
    return Config(
        model=ModelConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, vocab_size=256,
                          hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel,
                                decoder_first_pipeline_num_layers=first),
        training=TrainingConfig(micro_batch_size=MICRO_BATCH, global_batch_size=global_batch, train_iters=1,
                                eval_iters=1, recompute_granularity="full" if recompute else None,
                                recompute_method="uniform" if recompute else None),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))


def _one_iteration(rank, world_size, layouts):
    from megatron_lite.training import data_iterators, loop
    from megatron_lite.training.run_plan import plan_run
    from megatron_lite.distributed import finalize_model_grads
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.pipeline_parallel import get_forward_backward_func

    results = []
    for layout in layouts:
        config = _config(**layout)
        par = config.parallel
        ps = initialize_model_parallel(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                       par.virtual_pipeline_model_parallel_size)
        chunks = loop.get_model(config, ps)
        data_iterator = data_iterators.build_data_iterators(config, ps, plan_run(config, ps), 0)[0]
        losses = get_forward_backward_func(ps)(
            forward_step_func=loop.forward_step, data_iterator=data_iterator, model=chunks,
            num_microbatches=config.training.num_microbatches(ps.data_parallel_world_size), seq_length=SEQ,
            micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, parallel_state=ps,
            sequence_parallel=par.sequence_parallel, no_sync_func=[chunk.no_sync for chunk in chunks],
            finalize_model_grads_func=functools.partial(finalize_model_grads, parallel_state=ps))
        grads = {name: (p.main_grad.clone(), *tensor_parallel_split(p))
                 for chunk in chunks for name, p in chunk.module.named_parameters()}
        # Each micro-batch's "lm loss" is [sum, count] of its token losses.
        results.append({"losses": [(d["lm loss"][0] / d["lm loss"][1]).item() for d in losses], "grads": grads,
                        "tp_rank": ps.tensor_model_parallel_rank, "dp_rank": ps.data_parallel_rank,
                        "stage": ps.pipeline_model_parallel_rank})
        destroy_model_parallel(ps)
    return results


def _full_gradients(rank_results: list) -> dict:
    """name -> list of full gradients, one per pipeline stage holding it (two for the tied embedding)."""
    shards: dict = {}
    for result in rank_results:
        if result["dp_rank"] != 0:
            continue
        for name, entry in result["grads"].items():
            name = TIED if name == "output_layer.weight" else name  # the last stage's copy of the tied weight
            shards.setdefault((name, result["stage"]), {})[result["tp_rank"]] = entry
    full: dict = {}
    for (name, _), by_tp in shards.items():
        grad, parallel, dim, stride = by_tp[0]
        if parallel:
            grad = gather_shards([by_tp[t][0] for t in sorted(by_tp)], partition_dim=dim, partition_stride=stride)
        full.setdefault(name, []).append(grad)
    return full


LAYOUTS = {
    2: [dict(pp=2, global_batch=2), dict(pp=2, global_batch=4), dict(pp=2, global_batch=10),
        dict(pp=2, vpp=2, global_batch=8), dict(pp=2, first=1, global_batch=6),
        dict(pp=2, vpp=2, recompute=True, global_batch=4)],  # backward from freed outputs through recomputation
    4: [dict(tp=2, pp=2, global_batch=6), dict(tp=2, pp=2, sequence_parallel=True, global_batch=6),
        dict(tp=2, pp=2, vpp=2, sequence_parallel=True, global_batch=4), dict(pp=4, global_batch=10),
        dict(pp=2, vpp=2, global_batch=8)],  # the last one with two data-parallel replicas
}


@pytest.fixture(scope="module")
def reference():
    batches = sorted({layout["global_batch"] for layouts in LAYOUTS.values() for layout in layouts})
    (results,) = run_distributed(_one_iteration, 1, args=([dict(global_batch=b) for b in batches],))
    return {b: (r["losses"], _full_gradients([r])) for b, r in zip(batches, results)}


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_gpt_pipeline_matches_single_process(reference, world_size):
    per_rank = run_distributed(_one_iteration, world_size, args=(LAYOUTS[world_size],), timeout=300)
    for index, layout in enumerate(LAYOUTS[world_size]):
        what = f"world {world_size} {layout}"
        results = [r[index] for r in per_rank]
        ref_losses, ref_grads = reference[layout["global_batch"]]
        # Micro-batch i of data-parallel replica d is micro-batch i * dp + d of the single process
        # (the sampler deals each step's samples out to the replicas).
        last = [r for r in results if r["losses"]]
        replicas = {r["dp_rank"]: r["losses"] for r in last}
        assert all(r["losses"] == replicas[r["dp_rank"]] for r in last), what  # tp peers agree
        dp = len(replicas)
        merged = [replicas[index % dp][index // dp] for index in range(len(ref_losses))]
        assert_relative_close(torch.tensor(merged), torch.tensor(ref_losses), what=f"{what} losses")
        grads = _full_gradients(results)
        assert sorted(grads) == sorted(ref_grads), what
        for name, copies in grads.items():
            assert len(copies) == (2 if name == TIED else 1), f"{what} {name} held by {len(copies)} stages"
            for grad in copies:
                assert_relative_close(grad, ref_grads[name][0], what=f"{what} {name}")
