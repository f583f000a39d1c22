"""Expert parallelism: the experts of a mixture-of-experts layer split over ranks, tokens sent to them.

    config.py            ExpertParallelConfig: the expert-model and expert-tensor groups a layer uses
    layers.py            ExpertLinear: one expert's linear, split over the expert-tensor ranks
    mappings.py          all-to-all and the uneven gathers and scatters of token rows, with their backward
    token_dispatcher.py  the tokens of each expert to the rank holding it, and the outputs back
"""
from megatron_lite.expert_parallel.config import ExpertParallelConfig
from megatron_lite.expert_parallel.layers import ExpertLinear
from megatron_lite.expert_parallel.token_dispatcher import AllToAllTokenDispatcher, DispatchPlan

__all__ = ["ExpertParallelConfig", "ExpertLinear", "AllToAllTokenDispatcher", "DispatchPlan"]
