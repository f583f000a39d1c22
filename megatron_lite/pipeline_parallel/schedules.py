"""Forward and backward over the micro-batches of one iteration, pipelined across stages.

The training loop calls ``get_forward_backward_func(parallel_state)`` once and
then, every iteration, the function it returns (Megatron-Core's contract):

    losses = forward_backward_func(forward_step_func=..., data_iterator=..., model=[chunks],
                                   num_microbatches=m, seq_length=s, micro_batch_size=b,
                                   hidden_size=h, parallel_state=ps)

All three schedules are one executor running a different table from
``schedule_table``: the table says what to do in which order, this module only
says how to do each op. The data-parallel code is never imported; it reaches
in through ``no_sync_func`` and ``finalize_model_grads_func``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_lite.config import ConfigError
from megatron_lite.pipeline_parallel import p2p
from megatron_lite.process_groups import collectives
from megatron_lite.pipeline_parallel.schedule_table import (OpKind, ScheduleOp, check_interleaved_microbatches,
                                                            is_first_virtual_stage, is_last_virtual_stage,
                                                            rank_schedule, steps)


def get_forward_backward_func(parallel_state) -> Callable:
    """The schedule for this layout: no pipelining, 1F1B, or interleaved 1F1B."""
    if parallel_state.pipeline_model_parallel_world_size == 1:
        return forward_backward_no_pipelining
    if (parallel_state.virtual_pipeline_model_parallel_size or 1) > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                                   micro_batch_size, hidden_size, parallel_state, forward_only=False,
                                   sequence_parallel=False, dtype=torch.float32, no_sync_func=None,
                                   finalize_model_grads_func=None, grad_scale_func=None,
                                   calculate_per_token_loss=False) -> list[dict]:
    """Gradient accumulation: forward then backward of each micro-batch on the whole model.

    Args:
        forward_step_func: ``(data_iterator, model_chunk) -> (output_tensor, loss_func)``, where
            ``loss_func(output_tensor)`` returns ``(loss_sum, num_tokens, {"lm loss": tensor([sum, count])})``
            (Megatron-Core's form) or ``(mean_loss, {"lm loss": detached mean})``.
        data_iterator: an iterator (or a list with one per model chunk) handed to ``forward_step_func``.
        model: the model chunks of this rank (a single module is taken as one chunk).
        num_microbatches: micro-batches in this iteration; each loss is divided by it before backward.
        seq_length, micro_batch_size, hidden_size: give the shape sent between stages.
        parallel_state: this rank's ``ParallelState``.
        forward_only: evaluation; no backward, no gradients.
        sequence_parallel: the tensors between stages are split along the sequence over tensor-parallel ranks.
        dtype: dtype of the tensors between stages.
        no_sync_func: returns a context manager that holds back data-parallel gradient reduction; it is left
            before the last backward. A list gives one per model chunk, each left before that chunk's last
            backward.
        finalize_model_grads_func: called with the model chunks and the number of loss tokens this rank's
            last stage saw (None unless ``calculate_per_token_loss``) once all backwards are done.
        grad_scale_func: scales the loss before backward (fp16 loss scaling).
        calculate_per_token_loss: backward from each micro-batch's loss *sum*; the finalize function then
            divides the gradients by the global batch's token count. Otherwise each micro-batch's loss is
            its own mean, divided by ``num_microbatches``.

    Returns:
        The loss dicts of the micro-batches, in order, on the last pipeline stage; ``[]`` elsewhere.
    """
    if parallel_state.pipeline_model_parallel_world_size != 1:
        raise ValueError("forward_backward_no_pipelining runs the whole model on one stage, but the pipeline has "
                         f"{parallel_state.pipeline_model_parallel_world_size}; use get_forward_backward_func.")
    return _run_schedule(**locals())


def forward_backward_pipelining_without_interleaving(*, forward_step_func, data_iterator, model, num_microbatches,
                                                     seq_length, micro_batch_size, hidden_size, parallel_state,
                                                     forward_only=False, sequence_parallel=False,
                                                     dtype=torch.float32, no_sync_func=None,
                                                     finalize_model_grads_func=None, grad_scale_func=None,
                                                     calculate_per_token_loss=False) -> list[dict]:
    """1F1B: warm-up forwards, then one forward one backward, then the remaining backwards.

    Arguments and return value as ``forward_backward_no_pipelining``; ``model`` holds one chunk.
    """
    return _run_schedule(**locals())


def forward_backward_pipelining_with_interleaving(*, forward_step_func, data_iterator, model, num_microbatches,
                                                  seq_length, micro_batch_size, hidden_size, parallel_state,
                                                  forward_only=False, sequence_parallel=False,
                                                  dtype=torch.float32, no_sync_func=None,
                                                  finalize_model_grads_func=None, grad_scale_func=None,
                                                  calculate_per_token_loss=False) -> list[dict]:
    """Interleaved 1F1B: each rank holds v model chunks (chunk c is virtual stage c * p + rank).

    Arguments and return value as ``forward_backward_no_pipelining``; ``model`` and
    ``data_iterator`` are lists of v, and ``num_microbatches`` must be a multiple of p.
    """
    arguments = dict(locals())
    vpp = parallel_state.virtual_pipeline_model_parallel_size
    if vpp is not None and len(_as_list(model)) != vpp:
        raise ValueError(f"the parallel state has {vpp} virtual pipeline stages per rank but this rank was given "
                         f"{len(_as_list(model))} model chunks; build one chunk per virtual stage.")
    check_interleaved_microbatches(num_microbatches, parallel_state.pipeline_model_parallel_world_size)
    return _run_schedule(**arguments)


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def _run_schedule(*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                  hidden_size, parallel_state, forward_only, sequence_parallel, dtype, no_sync_func,
                  finalize_model_grads_func, grad_scale_func, calculate_per_token_loss) -> list[dict]:
    """What all three entry points do once their own checks pass (they share one signature, Megatron's)."""
    model, data_iterator = _as_list(model), _as_list(data_iterator)
    if len(data_iterator) != len(model):
        raise ConfigError(f"got {len(model)} model chunks but {len(data_iterator)} data iterators; "
                          f"pass one data iterator per model chunk (None where a chunk reads no data).")
    p = parallel_state.pipeline_model_parallel_world_size
    rank = parallel_state.pipeline_model_parallel_rank
    shape = p2p.tensor_shape(seq_length=seq_length, micro_batch_size=micro_batch_size, hidden_size=hidden_size,
                             tensor_model_parallel_size=parallel_state.tensor_model_parallel_world_size,
                             sequence_parallel=sequence_parallel)
    ops = rank_schedule(p, rank, num_microbatches, len(model), forward_only)
    executor = ScheduleExecutor(
        forward_step_func=forward_step_func, data_iterators=data_iterator, model=model,
        num_microbatches=num_microbatches, parallel_state=parallel_state, tensor_shape=shape, dtype=dtype,
        forward_only=forward_only, grad_scale_func=grad_scale_func,
        calculate_per_token_loss=calculate_per_token_loss)
    losses = executor.run(ops, no_sync_func=None if forward_only else no_sync_func)
    if not forward_only and finalize_model_grads_func is not None:
        finalize_model_grads_func(model, executor.total_num_tokens if calculate_per_token_loss else None)
    return losses


def deallocate_output_tensor(output: torch.Tensor) -> None:
    """Free a sent activation's storage; keep the tensor object, whose ``grad_fn`` backward still needs.

    Backward starts from the output's autograd node and the gradient received
    from the next stage; the output's values are not needed any more once sent.
    A view is left alone: its storage belongs to its base.
    """
    if output._base is None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Backward from ``output`` with ``grad_output``, even when ``output``'s storage was freed.

    ``torch.autograd.backward`` insists the gradient has the output's current
    shape, which a freed output no longer has; the engine itself only checks
    against the shape recorded in the graph, so it is called directly.
    """
    if grad_output is None:
        if output.numel() != 1:
            raise ValueError(f"the last stage's loss_func must return a scalar loss, got shape {list(output.shape)}")
        grad_output = torch.ones_like(output)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class ScheduleExecutor:
    """Runs one rank's schedule table: each op touches the tensors of one (micro-batch, chunk).

    1F1B with p=2 stages and m=3 micro-batches, as ``steps`` hands each rank's table to
    ``run`` (F/B: forward/backward of ``<micro-batch>.<chunk>``; sF/rF: send/receive its
    activation, sB/rB its gradient; brackets: one batched exchange, posted and waited on
    together); "|" separates warm-up, steady state and cool-down::

        rank 0:  F0.0 [sF0.0] | F1.0 [sF1.0 rB0.0] B0.0 F2.0 [sF2.0 rB1.0] B1.0 | [rB2.0] B2.0
        rank 1:  (none) | [rF0.0] F0.0 B0.0 [sB0.0 rF1.0] F1.0 B1.0 [sB1.0 rF2.0] F2.0 B2.0 [sB2.0] | (none)

    Rank r warms up with p - r - 1 forwards, so that the first backward reaches it just as
    it would otherwise idle; in the steady state each forward's send travels with the
    receive of the next backward's gradient (Megatron's ``send_forward_recv_backward``);
    the cool-down runs the backwards still owed. A test holds this trace to the tables.
    """

    def __init__(self, *, forward_step_func, data_iterators: list, model: list, num_microbatches: int,
                 parallel_state, tensor_shape: tuple, dtype: torch.dtype, forward_only: bool,
                 grad_scale_func=None, calculate_per_token_loss: bool = False):
        self.forward_step_func = forward_step_func
        self.data_iterators = data_iterators
        self.model = model
        self.num_microbatches = num_microbatches
        self.parallel_state = parallel_state
        self.tensor_shape = tensor_shape
        self.dtype = dtype
        self.forward_only = forward_only
        self.grad_scale_func = grad_scale_func
        self.calculate_per_token_loss = calculate_per_token_loss
        self.pipeline_rank = parallel_state.pipeline_model_parallel_rank
        self.pipeline_size = parallel_state.pipeline_model_parallel_world_size
        first_param = next((p for chunk in model for p in chunk.parameters()), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")
        self.total_num_tokens = torch.zeros((), dtype=torch.long, device=self.device)  # last stage: loss tokens
        # Keyed by (micro-batch, chunk); entries live from the op that makes them to the op that consumes them.
        self.inputs: dict = {}  # received activation (absent on the first virtual stage)
        self.outputs: dict = {}  # chunk output (the scaled loss on the last virtual stage)
        self.output_grads: dict = {}  # received gradient of the output
        self.input_grads: dict = {}  # gradient of the input, to send back
        self.losses: list = []
        # Statistics a micro-batch carries through the stages besides its activation (a model chunk's
        # ``microbatch_statistics_size`` floats; 0: none): the running sum forward with the activation, the
        # total back with the gradient, so every stage has the total before that micro-batch's backward.
        self.statistics_size = 0 if forward_only else getattr(_unwrap(model[0]), "microbatch_statistics_size", 0)
        self.statistics: dict = {}  # begun at the forward, completed before the backward
        self.received_statistics: dict = {}  # from the previous stage (running sum) or the next (total)

    def _is_first(self, chunk: int) -> bool:
        return is_first_virtual_stage(self.pipeline_rank, chunk)

    def _is_last(self, chunk: int) -> bool:
        return is_last_virtual_stage(self.pipeline_rank, chunk, self.pipeline_size, len(self.model))

    def run(self, ops: list[ScheduleOp], no_sync_func=None) -> list[dict]:
        """Execute ``ops`` in order; returns the loss dicts (last stage only)."""
        # Gradient reduction is held back until the last backward of each chunk (of the rank, for a
        # single no_sync_func): reducing after every micro-batch would repeat it m times.
        backwards = [op for op in ops if op.kind == OpKind.BACKWARD]
        if no_sync_func is None or not backwards:
            release = {}
        elif isinstance(no_sync_func, list):
            if len(no_sync_func) != len(self.model):
                raise ConfigError(f"no_sync_func has {len(no_sync_func)} entries for {len(self.model)} model chunks.")
            last = {op.chunk: op for op in backwards}
            release = {last[c]: func() for c, func in enumerate(no_sync_func) if c in last}
        else:
            release = {backwards[-1]: no_sync_func()}
        for context in release.values():
            context.__enter__()
        with torch.set_grad_enabled(not self.forward_only):
            for step in steps(ops):
                if isinstance(step, tuple):
                    self.communicate(step)
                elif step.kind == OpKind.FORWARD:
                    self.forward(step)
                else:
                    if step in release:
                        release.pop(step).__exit__(None, None, None)
                    self.backward(step)
        return self.losses

    def forward(self, op: ScheduleOp) -> None:
        key, chunk = (op.microbatch, op.chunk), self.model[op.chunk]
        _unwrap(chunk).set_input_tensor(self.inputs.get(key))
        if self.statistics_size:
            self.statistics[key] = _unwrap(chunk).begin_microbatch(self.received_statistics.pop(key, None))
        output, loss_func = self.forward_step_func(self.data_iterators[op.chunk], chunk)
        if self.statistics_size and self._is_last(op.chunk):
            self.statistics[key].complete()
        if self._is_last(op.chunk):
            output, loss_dict = self._loss(loss_func(output))
            self.losses.append(loss_dict)
            if self.forward_only:
                return
        else:
            p2p.check_tensor(output, self.tensor_shape, self.dtype, f"stage output (micro-batch {op.microbatch}, "
                                                                    f"model chunk {op.chunk})")
        self.outputs[key] = output

    def _loss(self, outputs: tuple):
        """(what backward starts from, the loss dict) from what ``loss_func`` returned.

        Under context parallelism each rank's ``loss_func`` sees its own positions of the micro-batch: its
        sum and count are parts of the micro-batch's, and its loss dict holds its part (summed over the
        context-parallel ranks with the data-parallel ones when reported). The gradient reduction averages
        over data x context ranks, as if context-parallel ranks were replicas; they are parts of one
        sequence, whose gradients add up, hence the factor cp on a micro-batch mean (a per-token loss is
        scaled in finalize_model_grads)."""
        context_parallel = self.parallel_state.context_parallel_world_size
        if len(outputs) == 2:  # a micro-batch mean
            if context_parallel > 1:
                raise ValueError("under context parallelism loss_func sees only this rank's part of a micro-batch, "
                                 "whose mean is not the micro-batch's: return (loss sum, number of tokens, loss "
                                 "dict) instead of a mean.")
            loss, loss_dict = outputs
            return loss / self.num_microbatches, loss_dict
        loss_sum, num_tokens, loss_dict = outputs
        self.total_num_tokens += num_tokens.detach().long()
        if self.calculate_per_token_loss:
            return loss_sum, loss_dict  # the division by the global batch's token count comes in finalize
        # Each micro-batch's mean, divided by m: the accumulated gradient is that of the mean of the means.
        num_tokens = num_tokens.detach().clone()
        collectives.all_reduce(num_tokens, self.parallel_state.context_parallel_group)
        return loss_sum * context_parallel / num_tokens.clamp(min=1) / self.num_microbatches, loss_dict

    def backward(self, op: ScheduleOp) -> None:
        key = (op.microbatch, op.chunk)
        input_tensor, output = self.inputs.pop(key, None), self.outputs.pop(key)
        grad_output = self.output_grads.pop(key, None)
        if grad_output is None and self.grad_scale_func is not None:
            output = self.grad_scale_func(output)
        if self.statistics_size and not self._is_last(op.chunk):
            self.statistics[key].complete(self.received_statistics.pop(key))
        if self.statistics_size and self._is_first(op.chunk):  # nothing to send back
            del self.statistics[key]
        custom_backward(output, grad_output)
        if not self._is_first(op.chunk):
            if input_tensor.grad is None:
                raise RuntimeError(f"model chunk {op.chunk} did not use the tensor given to set_input_tensor, so "
                                   f"no gradient flows back to the previous pipeline stage; start the chunk's "
                                   f"forward from it when it is not the first stage.")
            self.input_grads[key] = input_tensor.grad

    def communicate(self, ops: tuple) -> None:
        """One batched exchange: this step's sends and receives are posted together and waited on.

        With micro-batch statistics, each message is followed by its statistics (the running sum with an
        activation, the total with a gradient), so both ends post the pairs in the same order however the
        schedule groups its messages into steps."""
        ps = self.parallel_state
        sends, receives = [], []  # (tensor, destination); (op, source, shape, dtype)
        statistics = ((self.statistics_size,), torch.float32)
        for op in ops:
            key = (op.microbatch, op.chunk)
            if op.kind == OpKind.SEND_FORWARD:
                sends.append((self.outputs[key], ps.pipeline_next_rank))
                if self.statistics_size:
                    sends.append((self.statistics[key].partial, ps.pipeline_next_rank))
            elif op.kind == OpKind.SEND_BACKWARD:
                gradient = self.input_grads.pop(key)
                p2p.check_tensor(gradient, self.tensor_shape, self.dtype, "input gradient")
                sends.append((gradient, ps.pipeline_prev_rank))
                if self.statistics_size:
                    sends.append((self.statistics.pop(key).total, ps.pipeline_prev_rank))
            else:
                source = ps.pipeline_prev_rank if op.kind == OpKind.RECV_FORWARD else ps.pipeline_next_rank
                receives.append((op, source, self.tensor_shape, self.dtype))
                if self.statistics_size:
                    receives.append((None, source, *statistics))
        received = p2p.exchange_tensors(sends=sends, receives=[r[1:] for r in receives], device=self.device,
                                        group=ps.pipeline_model_parallel_group)
        arrived = zip([op for op, *_ in receives], received)
        for op, tensor in arrived:
            key = (op.microbatch, op.chunk)
            if op.kind == OpKind.RECV_FORWARD:
                self.inputs[key] = tensor.requires_grad_(not self.forward_only)
            else:
                self.output_grads[key] = tensor
            if self.statistics_size:  # the message after it
                self.received_statistics[key] = next(arrived)[1]
        # Sends have completed: an activation that was sent is only needed for its autograd graph now.
        for op in ops:
            if op.kind == OpKind.SEND_FORWARD:
                key = (op.microbatch, op.chunk)
                if self.forward_only:
                    del self.outputs[key]
                else:
                    deallocate_output_tensor(self.outputs[key])


def _unwrap(chunk):
    """The model under data-parallel (or other) wrappers, which expose it as ``.module``."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
