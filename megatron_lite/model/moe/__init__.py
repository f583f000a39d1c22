"""Mixture-of-experts layers: a router, experts, and the layer that joins them to the token dispatcher.

    router.py              TopKRouter: scores, top-k (grouped, biased), capacity, the auxiliary losses
    aux_losses.py          the load-balancing and z losses, and how their gradient joins the backward
    experts.py             the experts a rank holds: a loop (the reference) or one grouped GEMM
    moe_layer.py           MoELayer, behind the dense MLP's interface; the shared expert
    routing_statistics.py  once per global batch: token counts, the expert-bias update, the log line
"""
from megatron_lite.model.moe.moe_layer import MoELayer

__all__ = ["MoELayer"]
