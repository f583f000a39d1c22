"""Checkpoints reshard across data-parallel sharding strategies (ZeRO stages) as across layouts.

A ZeRO-3 run at dp 4 saves at iteration 2 of 4; it resumes under ZeRO-3 on the same layout
(bit for bit), at dp 2 under ZeRO-3 and ZeRO-1 (weights and optimizer state exactly as saved) and
at tp2 x dp2 under ZeRO-1; a ZeRO-1 run at tp2 x dp2 resumes at dp 4 under ZeRO-3 and at
pp2 x dp2 under ZeRO-2. Iteration 3's loss checks the weights, iteration 4's the optimizer state.
GPT-2 style: biases, learned positions and a tied embedding.

ZeRO-3 is for models that do not fit whole on one rank, so its saves and loads must hold no more
whole parameters than training does: every rank's peak is measured around each save and load.
"""
import contextlib
import functools
from unittest import mock

import pytest
import torch

from megatron_lite.checkpointing import storage
from megatron_lite.distributed.param_and_grad_buffer import ParamAndGradBucket
from megatron_lite.optimizer.optimizer import merge_optimizer_state_dicts
from tests.checkpointing.common import GPT2, assert_continues, losses_of, tiny_config
from tests.distributed import run_distributed

ZERO3 = dict(tp=1, pp=1, strategy="optim_grads_params")  # the data-parallel size is the world size
ZERO1 = dict(tp=1, pp=1, strategy="optim")
ZERO1_TP2_DP2 = dict(tp=2, pp=1, strategy="optim", sequence_parallel=True)
SAVED_ITERATION = 2


@contextlib.contextmanager
def _peak_gathered_bytes(model_chunks):
    """The most whole-parameter bytes alive at once inside the block: the gathered buffers of all
    ZeRO-3 buckets, summed at every all-gather (measured here, not by the wrapper's bookkeeping)."""
    buckets = [b for chunk in model_chunks for b in chunk.buckets]
    peak = [0]
    gather = ParamAndGradBucket.gather_params

    def measured(bucket, async_op):
        gather(bucket, async_op)
        peak[0] = max(peak[0], sum(b.gathered.numel() * b.gathered.element_size()
                                   for b in buckets if b.gathered is not None))

    with mock.patch.object(ParamAndGradBucket, "gather_params", measured):
        yield peak


def _snapshot(model_chunks, optimizer) -> dict:
    """Whole weights (state_dict gathers ZeRO-3's, outside any measurement) and this rank's optimizer state."""
    weights = {name: value.clone() for chunk in model_chunks for name, value in chunk.state_dict().items()}
    return {"weights": weights, "optimizer": optimizer.state_dict()}


def _train_measured(rank, world_size, kwargs):
    """Rank body: train as configured; returns the losses (last stage) and, for each save and load,
    the peak whole-parameter bytes, the ZeRO-3 units' bytes and (saved iteration, after a load) a snapshot."""
    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import saving
    from megatron_lite.training.loop import pretrain

    records = {"save": [], "load": []}
    # A save gathers what it writes when it copies the state off the live tensors (take_snapshot).
    save, load = saving.take_snapshot, checkpointing.load_checkpoint_from

    def measured(what, fn):
        def call(config, parallel_state, model_chunks, optimizer, scheduler, *state):
            with _peak_gathered_bytes(model_chunks) as peak:
                result = fn(config, parallel_state, model_chunks, optimizer, scheduler, *state)
            sharded = [c.fully_sharded for c in model_chunks if c.fully_sharded is not None]
            record = {"peak": peak[0], "unit bytes": [sum(b.numel * b.param_shard.element_size() for b in buckets)
                                                      for units in sharded for buckets in units.buckets_of.values()]}
            if what == "load" or state[0].iteration == SAVED_ITERATION:
                record.update(_snapshot(model_chunks, optimizer))
            records[what].append(record)
            return result
        return call

    with mock.patch.object(saving, "take_snapshot", measured("save", save)), \
            mock.patch.object(checkpointing, "load_checkpoint_from",  # the trainer loads what its RunPlan found
                              lambda source, *args: measured("load", functools.partial(load, source))(*args)):
        state, _, _ = pretrain(tiny_config(arch=GPT2, **kwargs))
    return {"losses": state.losses or None, **records}


def _run_measured(world_size: int, **kwargs) -> tuple[list, list]:
    """The losses, and every rank's records."""
    results = run_distributed(_train_measured, world_size, args=(kwargs,))
    return losses_of([r["losses"] for r in results]), results


def _run(world_size: int, **kwargs) -> list:
    return _run_measured(world_size, **kwargs)[0]


def _source(tmp_path_factory, name: str, layout: dict):
    root = str(tmp_path_factory.mktemp(name))
    losses, records = _run_measured(4, save=root, save_interval=SAVED_ITERATION, **layout)
    storage.write_latest_iteration(root, SAVED_ITERATION)  # resume from iteration 2 (iteration 4 was saved too)
    return root, losses, records


def _assert_at_most_one_unit(records: list, what: str) -> None:
    for rank, record in enumerate(records):
        for event in record[what]:
            largest = max(event["unit bytes"], default=0)  # not ZeRO-3: nothing is gathered
            assert event["peak"] <= largest, (rank, what, event["peak"], event["unit bytes"])


def _merged_snapshot(records: list, what: str) -> tuple[dict, dict]:
    """The whole weights (every rank holds them in its snapshot) and the data-parallel ranks' optimizer
    states merged into whole parameters, at the saved iteration or after the load."""
    snapshots = [next(e for e in r[what] if "weights" in e) for r in records]
    return snapshots[0]["weights"], merge_optimizer_state_dicts([s["optimizer"] for s in snapshots])


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return _source(tmp_path_factory, "zero3", ZERO3)


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return _source(tmp_path_factory, "zero1", ZERO1_TP2_DP2)


def test_zero3_saves_and_loads_holding_at_most_one_unit(zero3):
    root, _, saved = zero3
    _assert_at_most_one_unit(saved, "save")
    assert len(saved[0]["save"]) == 2
    _, loaded = _run_measured(4, load=root, **ZERO3)
    _assert_at_most_one_unit(loaded, "load")


def test_zero3_resumes_bitwise_under_zero3(zero3):
    root, reference, _ = zero3
    assert _run(4, load=root, **ZERO3) == reference


@pytest.mark.parametrize("layout", [ZERO3, ZERO1], ids=["zero3-dp2", "zero1-dp2"])
def test_zero3_loads_exactly_at_dp2(zero3, layout):
    """Weights and optimizer state after the load equal the saved ones bit for bit; the run continues."""
    root, reference, saved = zero3
    losses, loaded = _run_measured(2, load=root, **layout)
    _assert_at_most_one_unit(loaded, "load")
    saved_weights, saved_optimizer = _merged_snapshot(saved, "save")
    loaded_weights, loaded_optimizer = _merged_snapshot(loaded, "load")
    assert saved_weights.keys() == loaded_weights.keys()
    assert all(torch.equal(saved_weights[k], loaded_weights[k]) for k in saved_weights)
    assert saved_optimizer["params"].keys() == loaded_optimizer["params"].keys()
    for name, entry in saved_optimizer["params"].items():
        other = loaded_optimizer["params"][name]
        assert torch.equal(entry["main_param"], other["main_param"]), name
        assert entry["state"].keys() == other["state"].keys()
        assert all(torch.equal(v, other["state"][k]) for k, v in entry["state"].items()), name
    assert_continues(losses, reference)


def test_zero3_checkpoint_reads_in_one_process_and_offline(zero3, tmp_path):
    """Its weights, stored as every data-parallel rank's slices, load whole into one process (as
    generation loads) and into the converter, which rewrites them for tp 2."""
    from megatron_lite.checkpointing.offline import reshard_checkpoint
    from megatron_lite.checkpointing.resharding import CheckpointReader
    from megatron_lite.config import ParallelConfig
    from megatron_lite.inference.loading import load_model, read_checkpoint_config
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel

    root, _, saved = zero3
    saved_weights, _ = _merged_snapshot(saved, "save")
    parallel_state = initialize_model_parallel(1, 1)
    try:
        model = load_model(read_checkpoint_config(root, ParallelConfig()), parallel_state)
    finally:
        destroy_model_parallel(parallel_state)
    named = dict(model.named_parameters())
    assert named and all(torch.equal(p, saved_weights[name]) for name, p in named.items())
    converted = reshard_checkpoint(root, str(tmp_path / "tp2"), tensor_model_parallel_size=2,
                                   pipeline_model_parallel_size=1)
    reader = CheckpointReader(converted)
    assert all(torch.equal(reader.read(name), saved_weights[name]) for name in named)
    assert all(shard["flat_range"] is None for name in named for shard in reader.entry(name)["shards"])


def _load_without_optimizer_state(rank, world_size, root):
    """Rank body: load a checkpoint's weights only (--no-load-optim) into a bf16 ZeRO-3 run."""
    from megatron_lite.checkpointing import load_checkpoint
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.training.loop import build_optimizer_and_scheduler, get_model

    config = tiny_config(arch=GPT2, load=root, no_load_optim=True, **ZERO3)
    config.training.bf16 = True
    parallel_state = initialize_model_parallel(1, 1)
    try:
        model_chunks = get_model(config, parallel_state)
        optimizer, scheduler = build_optimizer_and_scheduler(config, parallel_state, model_chunks)
        load_checkpoint(config, parallel_state, model_chunks, optimizer, scheduler)
        return _snapshot(model_chunks, optimizer)
    finally:
        destroy_model_parallel(parallel_state)


def test_zero3_no_load_optim_remakes_bf16_main_params_from_the_loaded_shards(zero3):
    """bf16 main parameters are fp32 copies of the weights, made before the load: they are remade
    from the shards just loaded; Adam starts afresh."""
    root, _, saved = zero3
    saved_weights, _ = _merged_snapshot(saved, "save")
    loaded = run_distributed(_load_without_optimizer_state, 2, args=(root,))
    weights = loaded[0]["weights"]
    assert all(torch.equal(weights[k], saved_weights[k].bfloat16()) for k in saved_weights)
    optimizer = merge_optimizer_state_dicts([r["optimizer"] for r in loaded])
    assert optimizer["params"].keys() == saved_weights.keys()
    for name, entry in optimizer["params"].items():
        assert torch.equal(entry["main_param"], weights[name].float().reshape(-1)), name
        assert all(not value.any() for value in entry["state"].values()), name


def test_zero3_resumes_at_tp2_dp2_under_zero1(zero3):
    root, reference, _ = zero3
    assert_continues(_run(4, load=root, **ZERO1_TP2_DP2), reference)


@pytest.mark.parametrize("layout", [ZERO3, dict(tp=1, pp=2, strategy="optim_grads")], ids=["zero3-dp4",
                                                                                               "zero2-pp2dp2"])
def test_zero1_resumes_under_zero2_and_zero3(zero1, layout):
    root, reference, _ = zero1
    assert_continues(_run(4, load=root, **layout), reference)
