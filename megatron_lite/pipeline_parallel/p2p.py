"""Point-to-point exchange of activations and gradients between neighbouring stages.

Every tensor that crosses a stage boundary has one shape, known from the config
before anything runs: ``[seq_length (/ tp under sequence parallelism),
micro_batch_size, hidden_size]``. The receiver allocates its buffer from that
shape, so nothing but the data travels. A sender whose tensor does not match
would leave the receiver with a garbled or never-completing message; the shape
is therefore checked on the sending side, before anything is posted (the flags
that set the shape are validated in ``config``, before any of this runs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives


def tensor_shape(*, seq_length: int, micro_batch_size: int, hidden_size: int,
                 tensor_model_parallel_size: int = 1, sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the hidden state passed between pipeline stages ([sequence, batch, hidden])."""
    if sequence_parallel:
        if seq_length % tensor_model_parallel_size != 0:
            raise ValueError(f"sequence parallelism splits the sequence over the tensor-parallel ranks: a sequence "
                             f"of {seq_length} positions does not split over {tensor_model_parallel_size} ranks.")
        seq_length //= tensor_model_parallel_size
    return (seq_length, micro_batch_size, hidden_size)


def check_tensor(tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, what: str) -> None:
    """Raise if ``tensor`` is not what the neighbouring stage will allocate for it."""
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(
            f"pipeline {what} has shape {list(tensor.shape)} and dtype {tensor.dtype}, but the neighbouring stage "
            f"expects {list(shape)} {dtype}: [sequence (divided by the tensor-parallel size under sequence "
            f"parallelism), micro-batch, hidden] in the schedule's dtype. Make every model chunk return its hidden "
            f"state as [sequence, batch, hidden], or fix the sizes passed to the schedule.")


def exchange(*, sends: list[tuple[torch.Tensor, int]], receives: list[int], shape: tuple, dtype: torch.dtype,
             device: torch.device, group) -> list[torch.Tensor]:
    """Post all ``sends`` (tensor, global destination rank) and ``receives`` (global source ranks) together.

    Posting both directions in one batch is what lets two neighbours that each
    have something for the other proceed: a lone blocking send on each side
    would wait forever for the other's receive. Messages between a pair of ranks
    are matched in posting order, so the caller must post them in an order both
    ends agree on (``timeline.match_messages`` checks the schedule tables for it).
    Returns the received tensors in the order of ``receives``, after completion.
    """
    return exchange_tensors(sends=sends, receives=[(source, shape, dtype) for source in receives], device=device,
                            group=group)


def exchange_tensors(*, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[int, tuple, torch.dtype]],
                     device: torch.device, group) -> list[torch.Tensor]:
    """``exchange`` with a shape and dtype per receive (source, shape, dtype): a message with a small tensor of
    its own after it (the schedule's micro-batch statistics) is posted as two, in the same order at both ends."""
    received = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in receives]
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), destination, group=group) for tensor, destination in sends]
    ops += [dist.P2POp(dist.irecv, buffer, source, group=group)
            for buffer, (source, _, _) in zip(received, receives)]
    for request in collectives.batch_isend_irecv(ops):
        request.wait()
    return received
