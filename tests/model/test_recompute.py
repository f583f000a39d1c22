"""Activation recomputation changes memory, never results: gradients match exactly, dropout included."""
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig, gather_shards, get_rng_tracker, model_parallel_seed
from tests.distributed import run_distributed

# Local and global layers with their own RoPE bases (Gemma 3): recomputed layers get their kind's angles too.
ARCH = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
            hidden_dropout=0.2, attention_dropout=0.2, position_embedding_type="rope", window_size=[5, 0],
            window_attn_skip_freq=2, rotary_base_local=100.0)
RECOMPUTE = {
    "none": {},
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective"),
}


def _gradients(tp: int, recompute: dict, sequence_parallel: bool = False) -> dict:
    """Full (gathered) gradients after one forward/backward with dropout on."""
    config = ModelConfig(**ARCH)
    state = initialize_model_parallel(tp, 1)
    get_rng_tracker().reset()
    torch.manual_seed(7)
    model_parallel_seed(7, state.tensor_model_parallel_rank)
    model = GPTModel(config, TensorParallelConfig(state.tensor_model_parallel_group, sequence_parallel), **recompute)
    initialize_weights([model], config, state, seed=3)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            shards = [torch.empty_like(grad) for _ in range(tp)]
            torch.distributed.all_gather(shards, grad.contiguous(), group=state.tensor_model_parallel_group)
            grad = gather_shards(shards, partition_dim=param.partition_dim, partition_stride=param.partition_stride)
        grads[name] = grad
    return grads


@pytest.mark.parametrize("name", [n for n in RECOMPUTE if n != "none"])
def test_recompute_matches_single_process(name):
    reference, recomputed = _gradients(1, {}), _gradients(1, RECOMPUTE[name])
    for key in reference:
        torch.testing.assert_close(recomputed[key], reference[key], rtol=0, atol=0, msg=key)


def _tp_body(rank, world_size, name, sequence_parallel):
    reference = _gradients(world_size, {}, sequence_parallel)
    recomputed = _gradients(world_size, RECOMPUTE[name], sequence_parallel)
    return {k: (reference[k] - recomputed[k]).abs().max().item() for k in reference}


@pytest.mark.parametrize("name, sequence_parallel", [("full-uniform-1", False), ("selective", True)])
def test_recompute_under_tensor_parallel_replays_rng(name, sequence_parallel):
    """Dropout inside tensor-parallel regions draws from the tracker; recomputation must replay it."""
    for differences in run_distributed(_tp_body, world_size=2, args=(name, sequence_parallel)):
        assert max(differences.values()) == 0.0, differences


def _saved_activation_bytes(recompute: dict) -> int:
    config = ModelConfig(**ARCH)
    state = initialize_model_parallel(1, 1)
    get_rng_tracker().reset()
    model_parallel_seed(7, 0)
    model = GPTModel(config, TensorParallelConfig(), **recompute)
    initialize_weights([model], config, state, seed=3)
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in params:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, :-1], labels=ids[:, 1:]).mean()
    return sum(saved)


def test_recompute_saves_less_activation_memory():
    none = _saved_activation_bytes({})
    full = _saved_activation_bytes(RECOMPUTE["full-uniform-1"])
    selective = _saved_activation_bytes(RECOMPUTE["selective"])
    assert full < 0.5 * none and selective < none, (none, selective, full)
