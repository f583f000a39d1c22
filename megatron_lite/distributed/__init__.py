"""Data parallelism: flat gradient buckets, the DDP wrapper, and gradient finalisation."""
from megatron_lite.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_lite.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "finalize_model_grads"]
