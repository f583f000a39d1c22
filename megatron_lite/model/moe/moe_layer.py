"""A mixture-of-experts layer: the MLP of a transformer layer, replaced by routed experts (and a shared one).

Behind the MLP's interface (``forward(hidden_states) -> (output, bias)``, input and output
[s, b, h], or [s/tp, b, h] under sequence parallelism), one forward is:

    route      TopKRouter: each token's experts and weights (fp32)
    dispatch   AllToAllTokenDispatcher: each token's row to the rank of each of its experts (weighted here
               with --moe-apply-probs-on-input, Llama 4's: the expert computes f(p x) rather than p f(x))
    compute    the local experts, each on its block of rows (a loop, or one grouped GEMM)
    combine    the rows back, each token the weighted sum of its experts' outputs
    shared     + the shared expert (a dense MLP on every token), optionally gated by sigmoid(x w)

Expert parallelism needs every rank of the layer to hold tokens no other rank holds. Under sequence
parallelism they do; without it, tensor-parallel ranks hold the same tokens, so each takes its own
slice of them here (``split_rows``) and the outputs are gathered back at the end: the layer runs
the same code, and its gradients are the same, either way.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig
from megatron_lite.expert_parallel import AllToAllTokenDispatcher, ExpertParallelConfig
from megatron_lite.expert_parallel.mappings import gather_rows, split_rows
from megatron_lite.model.mlp import MLP
from megatron_lite.model.moe.experts import GroupedExperts, SequentialExperts
from megatron_lite.model.moe.router import TokenLayout, TopKRouter
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import TensorParallelConfig


class SharedExpertMLP(MLP):
    """A dense MLP every token passes through (``--moe-shared-expert-intermediate-size`` wide), its output
    scaled by sigmoid(x gate_weight^T) with ``--moe-shared-expert-gate`` (Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, *, tp_config: TensorParallelConfig):
        super().__init__(config, tp_config=tp_config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=tp_config.params_dtype))
            self.gate_weight.sequence_parallel = tp_config.sequence_parallel  # each rank gates its own tokens

    def forward(self, hidden_states: torch.Tensor):
        output, bias = super().forward(hidden_states)
        if self.gate_weight is not None:
            output = output * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return output, bias


class MoELayer(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_config: TensorParallelConfig, ep_config: ExpertParallelConfig,
                 context_parallel: ContextParallelConfig | None = None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_config.tp_group, tp_config.sequence_parallel
        self.tp_size = collectives.world_size(self.tp_group)
        # Context-parallel ranks hold other chunks of the same sequences: the router balances them together.
        self.cp_group = None if context_parallel is None or context_parallel.size == 1 else context_parallel.cp_group
        self.cp_size = 1 if self.cp_group is None else context_parallel.size
        self.router = TopKRouter(config, tensor_parallel_size=self.tp_size, params_dtype=tp_config.params_dtype)
        self.token_dispatcher = AllToAllTokenDispatcher(config.num_experts, ep_group=ep_config.ep_group,
                                                        etp_group=ep_config.etp_group,
                                                        probs_on_input=config.moe_apply_probs_on_input)
        num_local = self.token_dispatcher.num_local_experts
        experts = GroupedExperts if config.moe_grouped_gemm else SequentialExperts
        self.experts = experts(config, first_expert=collectives.rank(ep_config.ep_group) * num_local,
                               num_local_experts=num_local, etp_size=collectives.world_size(ep_config.etp_group),
                               etp_rank=collectives.rank(ep_config.etp_group), params_dtype=tp_config.params_dtype)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, tp_config=tp_config)

    def forward(self, hidden_states: torch.Tensor):
        seq, batch, hidden = hidden_states.shape
        tokens, layout, sizes = self._own_tokens(hidden_states)
        probs, routing_map = self.router(tokens, layout)
        rows, tokens_per_expert, plan = self.token_dispatcher.dispatch(tokens, probs, routing_map)
        output = self.token_dispatcher.combine(self.experts(rows, tokens_per_expert), plan)
        if sizes is not None:
            output = gather_rows(output, sizes, self.tp_group, partial_grads=False)
        output = output.view(seq, batch, hidden)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)[0]
        return output, None

    def _own_tokens(self, hidden_states: torch.Tensor):
        """(the token rows only this rank routes [n, h], where they sit in the micro-batch, and the row count
        of each tensor-parallel rank when this rank took its slice of tokens all of them hold, else None)."""
        seq, batch, hidden = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden)  # row = position * batch + sequence
        sequence_ids = torch.arange(tokens.shape[0], device=tokens.device) % batch
        token_groups = tuple(group for group, size in ((self.tp_group, self.tp_size), (self.cp_group, self.cp_size))
                             if size > 1)
        if self.sequence_parallel or self.tp_size == 1:
            layout = TokenLayout(sequence_ids, batch, seq * self.tp_size * self.cp_size, token_groups)
            return tokens, layout, None
        sizes = [len(part) for part in torch.arange(tokens.shape[0]).tensor_split(self.tp_size)]
        own = sequence_ids.split(sizes)[collectives.rank(self.tp_group)]
        layout = TokenLayout(own, batch, seq * self.cp_size, token_groups)
        return split_rows(tokens, sizes, self.tp_group), layout, sizes
