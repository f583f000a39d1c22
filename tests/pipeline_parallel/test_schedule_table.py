"""Schedule tables checked as plain data: no process group, no tensors."""
import pytest

from megatron_lite.pipeline_parallel.schedule_table import (OpKind, ScheduleOp, add_communication, build_schedule,
                                                            compute_order, in_flight_bound, num_warmup_microbatches,
                                                            peak_in_flight, rank_schedule, steps)
from megatron_lite.pipeline_parallel.timeline import ScheduleError, match_messages, simulate

# (p, v, m): 1F1B at m in {1, p, 2p+1}, interleaved at multiples of p, and some larger layouts.
LAYOUTS = ([(p, 1, m) for p in (2, 3, 4, 8) for m in (1, p, 2 * p + 1, 4 * p)]
           + [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)] + [(4, 4, 8), (8, 2, 16)])


def ops_string(ops):
    return " ".join(str(op) for op in ops)


def test_1f1b_rank_zero_warms_up_then_alternates_then_cools_down():
    ops = [op for op in rank_schedule(4, 0, 6) if op.is_compute]
    assert ops_string(ops) == "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0"
    last = [op for op in rank_schedule(4, 3, 6) if op.is_compute]
    assert ops_string(last) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0"


def test_1f1b_communication_sits_next_to_the_compute_that_needs_it():
    # Middle stage of 3, m=2: receive before each forward, send after; Megatron's batched
    # send_forward_recv_backward appears as the adjacent "sF rB" pairs.
    assert ops_string(rank_schedule(3, 1, 2)) == ("rF0.0 F0.0 sF0.0 rF1.0 F1.0 sF1.0 rB0.0 B0.0 sB0.0 "
                                                  "rB1.0 B1.0 sB1.0")
    assert ops_string(rank_schedule(3, 0, 2)) == "F0.0 sF0.0 F1.0 sF1.0 rB0.0 B0.0 rB1.0 B1.0"
    assert ops_string(rank_schedule(3, 2, 2)) == "rF0.0 F0.0 B0.0 sB0.0 rF1.0 F1.0 B1.0 sB1.0"


def test_no_pipelining_is_gradient_accumulation():
    assert ops_string(rank_schedule(1, 0, 3)) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert ops_string(rank_schedule(1, 0, 3, forward_only=True)) == "F0.0 F1.0 F2.0"


def test_interleaved_order_walks_microbatch_groups_through_chunks():
    forwards = [op for op in rank_schedule(2, 0, 4, 2) if op.kind == OpKind.FORWARD]
    assert ops_string(forwards) == "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 F2.1 F3.1"
    backwards = [op for op in rank_schedule(2, 0, 4, 2) if op.kind == OpKind.BACKWARD]
    assert ops_string(backwards) == "B0.1 B1.1 B0.0 B1.0 B2.1 B3.1 B2.0 B3.0"
    # Steady state pairs a forward with a backward, then exchanges everything at once.
    ops = rank_schedule(2, 1, 4, 2)
    steady = ops_string(ops[ops.index(ScheduleOp(OpKind.FORWARD, 2, 0)) - 2:][:8])
    assert steady == "rF2.0 rB0.0 F2.0 B0.0 sF2.0 sB0.0 rF3.0 rB1.0"


@pytest.mark.parametrize("p,v,m", LAYOUTS)
def test_every_microbatch_runs_once_forward_before_backward(p, v, m):
    for forward_only in (False, True):
        for rank, ops in enumerate(build_schedule(p, m, v, forward_only)):
            compute = [(op.kind, op.microbatch, op.chunk) for op in ops if op.is_compute]
            pairs = [(i, c) for i in range(m) for c in range(v)]
            assert sorted(x[1:] for x in compute if x[0] == OpKind.FORWARD) == pairs
            backward = [x[1:] for x in compute if x[0] == OpKind.BACKWARD]
            assert sorted(backward) == ([] if forward_only else pairs)
            for mb, chunk in backward:
                assert compute.index((OpKind.FORWARD, mb, chunk)) < compute.index((OpKind.BACKWARD, mb, chunk))
            # Within a chunk, micro-batches go in order (each chunk's data iterator is read in order).
            for chunk in range(v):
                assert [x[1] for x in compute if x[0] == OpKind.FORWARD and x[2] == chunk] == list(range(m))


@pytest.mark.parametrize("p,v,m", LAYOUTS)
def test_tables_line_up_across_ranks_and_never_deadlock(p, v, m):
    for forward_only in (False, True):
        table = build_schedule(p, m, v, forward_only)
        match_messages(table)
        simulate(table)


@pytest.mark.parametrize("p,v,m", LAYOUTS)
def test_in_flight_activations_stay_within_the_bound(p, v, m):
    for rank, ops in enumerate(build_schedule(p, m, v)):
        peak = peak_in_flight(ops)
        assert peak == in_flight_bound(p, rank, m, v)
        if v == 1:
            assert peak == min(p - rank, m)  # 1F1B: at most p - stage, whatever m is
        elif m > p:
            assert peak == min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("p,v,m", [x for x in LAYOUTS if x[2] % x[0] == 0])
def test_simulated_bubble_matches_theory(p, v, m):
    # Forward 1, backward 2 per stage, free communication: (p-1)/m for 1F1B, (p-1)/(v*m) interleaved.
    timeline = simulate(build_schedule(p, m, v), forward_time=1.0, backward_time=2.0)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m))


def test_1f1b_bubble_holds_for_any_microbatch_count():
    for p, m in [(2, 1), (4, 9), (8, 3)]:
        assert simulate(build_schedule(p, m)).bubble_fraction == pytest.approx((p - 1) / m)


def test_forward_only_has_no_backward_traffic():
    for ops in build_schedule(4, 8, 2, forward_only=True):
        assert all(op.kind in (OpKind.FORWARD, OpKind.RECV_FORWARD, OpKind.SEND_FORWARD) for op in ops)


def test_interleaved_needs_microbatches_multiple_of_pipeline_size():
    # In its own terms; the command line's error names the flags (ParallelConfig.check_interleaved_microbatches).
    with pytest.raises(ValueError, match="6 micro-batches is not a multiple of 4 stages"):
        build_schedule(4, 6, 2)


def test_warmup_counts_follow_megatron():
    assert [num_warmup_microbatches(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches(4, r, 2) for r in range(4)] == [2, 2, 1, 0]
    assert [num_warmup_microbatches(4, r, 8, 2) for r in range(4)] == [10, 8, 6, 4]
    assert [num_warmup_microbatches(4, r, 4, 2) for r in range(4)] == [8] * 4  # m == p: all forwards first


def test_mismatched_messages_are_caught():
    table = build_schedule(2, 2)
    sends = [i for i, op in enumerate(table[0]) if op.kind == OpKind.SEND_FORWARD]
    a, b = sends[:2]
    table[0][a], table[0][b] = table[0][b], table[0][a]
    with pytest.raises(ScheduleError, match="from pipeline rank 0 to 1 do not line up"):
        match_messages(table)


def test_unpaired_interleaved_steady_state_deadlocks():
    # Why interleaved groups pair each forward with a backward: with one op per group,
    # the ring wrap-around makes ranks wait on each other's sends.
    p, m, v = 2, 4, 2
    table = [add_communication([(op,) for group in compute_order(p, r, m, v) for op in group], p, r, v)
             for r in range(p)]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(table)


def test_the_executors_docstring_trace_is_the_table():
    """The p=2, m=3 trace printed in ``ScheduleExecutor``'s docstring is what ``steps`` yields."""
    from megatron_lite.pipeline_parallel.schedules import ScheduleExecutor

    printed = {int(line.split(":")[0].split()[1]): line.split(":", 1)[1]
               for line in ScheduleExecutor.__doc__.splitlines() if line.strip().startswith("rank ")}
    assert set(printed) == {0, 1}
    for rank, line in printed.items():
        table = " ".join(f"[{' '.join(map(str, step))}]" if isinstance(step, tuple) else str(step)
                         for step in steps(rank_schedule(2, rank, 3)))
        assert " ".join(word for word in line.split() if word not in ("|", "(none)")) == table
        warmup = [word for word in line.split("|")[0].split() if word.startswith("F")]
        assert warmup == [f"F{k}.0" for k in range(num_warmup_microbatches(2, rank, 3))]

