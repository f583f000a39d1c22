"""Expert parallelism: the experts of a mixture-of-experts layer split over ranks, tokens sent to them.

    config.py            ExpertParallelConfig: the expert-model and expert-tensor groups a layer uses
    mappings.py          all-to-all and the uneven gathers and scatters of token rows, with their backward
    token_dispatcher.py  the tokens of each expert to the rank holding it, and the outputs back
"""
from megatron_lite.expert_parallel.config import ExpertParallelConfig
from megatron_lite.expert_parallel.token_dispatcher import AllToAllTokenDispatcher, DispatchPlan

__all__ = ["ExpertParallelConfig", "AllToAllTokenDispatcher", "DispatchPlan"]
