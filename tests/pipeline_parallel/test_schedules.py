"""The executor on real gloo ranks with a toy model, against single-process gradient accumulation."""
import contextlib

import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.process_groups.parallel_state import initialize_model_parallel, mock_parallel_state
from megatron_lite.pipeline_parallel import get_forward_backward_func, get_layer_numbers
from megatron_lite.pipeline_parallel.schedule_table import OpKind, in_flight_bound, rank_schedule
from megatron_lite.pipeline_parallel.schedules import (forward_backward_no_pipelining,
                                                       forward_backward_pipelining_with_interleaving,
                                                       forward_backward_pipelining_without_interleaving)
from tests.distributed import DistributedTestError, run_distributed
from tests.pipeline_parallel.toy_model import (BATCH, HIDDEN, NUM_LAYERS, SEQ, ToyChunk, forward_step,
                                               make_batches, reference)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def _build_chunks(ps, vpp):
    p, r = ps.pipeline_model_parallel_world_size, ps.pipeline_model_parallel_rank
    chunks = [ToyChunk(get_layer_numbers(NUM_LAYERS, pipeline_model_parallel_size=p, pipeline_rank=r,
                                         virtual_pipeline_model_parallel_size=vpp, virtual_pipeline_rank=c),
                       is_first=(r == 0 and c == 0), is_last=(r == p - 1 and c == vpp - 1), chunk_id=c)
              for c in range(vpp)]
    for chunk in chunks[1:]:
        chunk.trace = chunks[0].trace  # one trace per rank, in execution order
    return chunks


def _run(ps, vpp, num_microbatches, forward_only=False, seq_length=SEQ, **hooks):
    chunks = _build_chunks(ps, vpp)
    batches = make_batches(num_microbatches)
    losses = get_forward_backward_func(ps)(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=BATCH, hidden_size=HIDDEN,
        parallel_state=ps, forward_only=forward_only, **hooks)
    return chunks, losses


def _pipeline_body(rank, world_size, vpp, microbatch_counts):
    ps = initialize_model_parallel(1, world_size, vpp if vpp > 1 else None)
    results = []
    for m, forward_only in microbatch_counts:
        chunks, losses = _run(ps, vpp, m, forward_only)
        results.append({
            "losses": [d["lm loss"].item() for d in losses],
            "grads": {name: p.grad for chunk in chunks for name, p in chunk.named_parameters()},
            "trace": chunks[0].trace,
            "sent": [tuple(o.shape) for chunk in chunks for o in chunk.sent_outputs],
        })
    return results


@pytest.mark.parametrize("pp,vpp", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_pipeline_matches_single_process(pp, vpp):
    counts = [1, pp, 2 * pp + 1] if vpp == 1 else [pp, 2 * pp]
    configs = [(m, False) for m in counts] + [(counts[-1], True)]
    per_rank = run_distributed(_pipeline_body, world_size=pp, args=(vpp, configs))
    for index, (m, forward_only) in enumerate(configs):
        ref_losses, ref_grads = reference(make_batches(m))
        results = [r[index] for r in per_rank]
        assert all(res["losses"] == [] for res in results[:-1])  # losses live on the last stage only
        close(torch.tensor(results[-1]["losses"]), torch.tensor(ref_losses))
        grads = {name: g for res in results for name, g in res["grads"].items()}
        assert sorted(grads) == sorted(ref_grads)  # every layer on exactly one rank
        for name, grad in grads.items():
            if forward_only:
                assert grad is None
            else:
                close(grad, ref_grads[name])
        for stage, res in enumerate(results):
            # The executed order of forwards and backwards is the table's order.
            table = [(op.kind, op.microbatch, op.chunk) for op in rank_schedule(pp, stage, m, vpp, forward_only)
                     if op.is_compute]
            assert res["trace"] == table
            alive = peak = 0
            for kind, _, _ in res["trace"]:
                alive += 1 if kind == OpKind.FORWARD else -1
                peak = max(peak, alive)
            if not forward_only:
                assert peak <= in_flight_bound(pp, stage, m, vpp)
                assert vpp > 1 or peak <= pp - stage
            # Every activation sent to the next stage was freed (its storage replaced by one element).
            non_last_chunks = vpp - (1 if stage == pp - 1 else 0)
            assert res["sent"] == ([] if forward_only else [(1,)] * (m * non_last_chunks))


class _RecordingNoSync:
    """no_sync_func stand-in: records in the rank's trace when gradient reduction is re-enabled."""

    def __init__(self, trace, name):
        self.trace, self.name = trace, name

    def __call__(self):
        @contextlib.contextmanager
        def context():
            self.trace.append(("no_sync enter", self.name))
            yield
            self.trace.append(("no_sync exit", self.name))
        return context()


def _hooks_body(rank, world_size, vpp, per_chunk_no_sync):
    ps = initialize_model_parallel(1, world_size, vpp if vpp > 1 else None)
    trace, finalized = [], []
    no_sync = ([_RecordingNoSync(trace, c) for c in range(vpp)] if per_chunk_no_sync
               else _RecordingNoSync(trace, "all"))

    def finalize(model_chunks, num_tokens):
        finalized.append(len(model_chunks))
        trace.append(("finalize",))

    chunks = _build_chunks(ps, vpp)
    for chunk in chunks:
        chunk.trace = trace
    batches = make_batches(2 * world_size)
    losses = get_forward_backward_func(ps)(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH, hidden_size=HIDDEN,
        parallel_state=ps, no_sync_func=no_sync, finalize_model_grads_func=finalize,
        grad_scale_func=lambda loss: loss * 4.0)
    return {"trace": trace, "finalized": finalized, "losses": [d["lm loss"].item() for d in losses],
            "grads": {name: p.grad for chunk in chunks for name, p in chunk.named_parameters()}}


@pytest.mark.parametrize("vpp,per_chunk_no_sync", [(1, False), (2, False), (2, True)])
def test_no_sync_finalize_and_grad_scale_hooks(vpp, per_chunk_no_sync):
    pp = 2
    per_rank = run_distributed(_hooks_body, world_size=pp, args=(vpp, per_chunk_no_sync))
    ref_losses, ref_grads = reference(make_batches(2 * pp), grad_scale=4.0)
    close(torch.tensor(per_rank[-1]["losses"]), torch.tensor(ref_losses))  # the scale touches gradients only
    for res in per_rank:
        for name, grad in res["grads"].items():
            close(grad, ref_grads[name])
        trace = res["trace"]
        assert res["finalized"] == [vpp] and trace[-1] == ("finalize",)
        names = range(vpp) if per_chunk_no_sync else ["all"]
        assert [t for t in trace if t[0] == "no_sync enter"] == [("no_sync enter", n) for n in names]
        assert trace.index(("no_sync enter", names[0])) == 0
        for name in names:
            # Reduction comes back on right before the last backward of the chunk (of the rank for "all").
            exit_at = trace.index(("no_sync exit", name))
            covered = [i for i, t in enumerate(trace) if t[0] == OpKind.BACKWARD and name in ("all", t[2])]
            assert covered[-1] == exit_at + 1


def _bad_shape_body(rank, world_size):
    ps = initialize_model_parallel(1, world_size)
    _run(ps, 1, 2, seq_length=SEQ + 1)


def test_stage_output_shape_mismatch_is_a_clear_error():
    with pytest.raises(DistributedTestError, match="rank 0 of 2 failed(.|\n)*\\[sequence(.|\n)*micro-batch, hidden\\]"):
        run_distributed(_bad_shape_body, world_size=2, timeout=60)


def test_no_pipelining_matches_plain_gradient_accumulation():
    ps = initialize_model_parallel()
    for forward_only in (False, True):
        chunks, losses = _run(ps, 1, 3, forward_only=forward_only, grad_scale_func=lambda loss: loss * 2.0)
        ref_losses, ref_grads = reference(make_batches(3), grad_scale=2.0)
        close(torch.tensor([d["lm loss"].item() for d in losses]), torch.tensor(ref_losses))
        for name, p in chunks[0].named_parameters():
            assert (p.grad is None) if forward_only else torch.equal(p.grad, ref_grads[name])


def test_schedule_choice_and_argument_checks():
    ps = mock_parallel_state(0, 4, pipeline_model_parallel_size=4)
    assert get_forward_backward_func(mock_parallel_state(0, 2)) is forward_backward_no_pipelining
    assert get_forward_backward_func(ps) is forward_backward_pipelining_without_interleaving
    ps.virtual_pipeline_model_parallel_size = 2
    assert get_forward_backward_func(ps) is forward_backward_pipelining_with_interleaving
    chunks = _build_chunks(ps, 2)
    common = dict(forward_step_func=forward_step, seq_length=SEQ, micro_batch_size=BATCH, hidden_size=HIDDEN,
                  parallel_state=ps)
    # Caught before any communication, so every rank fails the same way instead of hanging.
    with pytest.raises(ValueError, match="6 micro-batches is not a multiple of 4 stages"):
        forward_backward_pipelining_with_interleaving(data_iterator=[None, None], model=chunks, num_microbatches=6,
                                                      **common)
    with pytest.raises(ConfigError, match="2 model chunks but 1 data iterators"):
        forward_backward_pipelining_with_interleaving(data_iterator=[None], model=chunks, num_microbatches=4,
                                                      **common)
    with pytest.raises(ValueError, match="2 virtual pipeline stages per rank but this rank was given 1 model chunks"):
        forward_backward_pipelining_with_interleaving(data_iterator=[None], model=chunks[:1], num_microbatches=4,
                                                      **common)
