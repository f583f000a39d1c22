"""Prefix tuning (Li and Liang 2021): learned key and value vectors in front of every layer's own.

Each layer gets ``--prefix-length`` p keys and values per key/value head; every
token attends to all of them and, causally, to the real tokens before it. The
real tokens keep their positions (the prefixes are added after the rotary
embedding, and carry none). Directly learned prefixes can train unstably, so with
``--prefix-projection-hidden-size`` they are produced during training by a
two-layer MLP from a learned p x hidden embedding (the reparametrisation);
``tools/checkpoint_convert.py --fold-prefix-projection`` replaces the MLP by the
prefix it computes, for inference.

Under tensor parallelism the prefixes are split by key/value head (query group)
like the attention they join: the prefix tensor is laid out [p, groups, 2 (key,
value), head_dim] and a rank holds its groups. The reparametrising MLP's output
projection is column-parallel for the same reason; its embedding and first
projection are replicated, and the copy into the column-parallel layer sums
their gradients over the tensor-parallel ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.peft.lora import kaiming_uniform
from megatron_lite.tensor_parallel.replicated_linear import ReplicatedLinear
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import (ColumnParallelLinear, TensorParallelConfig,
                                           set_tensor_model_parallel_attributes)


def standard_normal(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """nn.Embedding's init, which PEFT's prefix encoder keeps."""
    return torch.randn(shape, generator=generator)


class KeyValuePrefix(nn.Module):
    """One layer's prefix; ``forward(key, value)`` prepends it to this rank's key/value heads.

    Args:
        config: the model (hidden size, key/value heads, head dimension).
        prefix_length: --prefix-length.
        projection_hidden_size: --prefix-projection-hidden-size, or None to learn the prefix directly.
        tp_group: the tensor-parallel group the attention heads are split over.
    """

    def __init__(self, config: ModelConfig, *, prefix_length: int, projection_hidden_size: int | None, tp_group,
                 params_dtype: torch.dtype):
        super().__init__()
        self.head_dim = config.head_dim
        self.local_query_groups = config.num_query_groups // collectives.world_size(tp_group)
        width = 2 * config.num_query_groups * config.head_dim  # [groups, key/value, head_dim] per position
        if projection_hidden_size is None:
            self.key_value = nn.Parameter(torch.empty(prefix_length, width // collectives.world_size(tp_group),
                                                      dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.key_value, is_parallel=True, partition_dim=1)
            self.key_value.full_init = standard_normal
            return
        self.embedding = nn.Parameter(torch.empty(prefix_length, config.hidden_size, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.embedding, is_parallel=False)
        self.embedding.full_init = standard_normal
        self.linear_in = ReplicatedLinear(config.hidden_size, projection_hidden_size, bias=True,
                                          sequence_parallel=False, params_dtype=params_dtype)
        self.linear_out = ColumnParallelLinear(projection_hidden_size, width, bias=True,
                                               tp_config=TensorParallelConfig(tp_group, params_dtype=params_dtype))
        for linear in (self.linear_in, self.linear_out):
            linear.weight.full_init = kaiming_uniform

    def prefix(self) -> torch.Tensor:
        """This rank's [p, local groups x 2 x head_dim] prefix (through the MLP when reparametrised)."""
        if hasattr(self, "key_value"):
            return self.key_value
        output, _ = self.linear_out(torch.tanh(self.linear_in(self.embedding)))
        return output

    def keys_and_values(self, batch: int, dtype: torch.dtype) -> tuple:
        """The prefix's keys and values, each [p, batch, local groups, head_dim]."""
        prefix = self.prefix().to(dtype).view(-1, 1, self.local_query_groups, 2, self.head_dim)
        prefix = prefix.expand(-1, batch, -1, -1, -1)
        return prefix[..., 0, :], prefix[..., 1, :]

    def forward(self, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple:
        """key, value: [s, b, local groups, head_dim] -> [p + s, b, local groups, head_dim]; a given attention
        mask ([b, 1, s, s] or, generating, [b, 1, s, cached + s]; True = may not attend) widens by p columns
        that every query sees: packed sequences and padded batches each see the whole prefix."""
        prefix_key, prefix_value = self.keys_and_values(key.shape[1], key.dtype)
        if attention_mask is not None:
            attention_mask = F.pad(attention_mask, (prefix_key.shape[0], 0), value=False)
        return torch.cat([prefix_key, key]), torch.cat([prefix_value, value]), attention_mask



def fold_projection(embedding: torch.Tensor, linear_in: tuple, linear_out: tuple) -> torch.Tensor:
    """The prefix the reparametrising MLP computes, from whole tensors: ``linear_*`` are (weight, bias)."""
    hidden = torch.tanh(embedding.float() @ linear_in[0].float().t() + linear_in[1].float())
    return (hidden @ linear_out[0].float().t() + linear_out[1].float()).to(embedding.dtype)
