"""A checkpoint loaded into one process, as generation loads it (adapter checkpoints bring their base)."""
from megatron_lite.config import ParallelConfig
from megatron_lite.inference.loading import load_model, read_checkpoint_config
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel


def load_single_process(root: str):
    """(model in eval mode, its config)."""
    config = read_checkpoint_config(root, ParallelConfig())
    parallel_state = initialize_model_parallel(1, 1)
    try:
        return load_model(config, parallel_state), config
    finally:
        destroy_model_parallel(parallel_state)
