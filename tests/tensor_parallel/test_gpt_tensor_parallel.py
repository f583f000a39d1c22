"""The GPT model under tensor (and sequence) parallelism against the single-process model.

For tp in {2, 4}, with and without --sequence-parallel, for a GPT-2 and a Llama
(GQA, RoPE, SwiGLU, RMSNorm, untied) config: the per-token loss, every
parameter's gradient (gathered from the shards) and 5 training steps' losses
match tp=1 from the same seed. The vocabulary is chosen so that its padding is
the same at every tensor-parallel size (padded rows take part in the softmax).
"""
import functools

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import Config, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_lite.process_groups.collectives import count_collectives
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig, gather_shards
from megatron_lite.training import loop
from tests.parity import assert_relative_close

SEED, STEPS, BATCH = 7, 5, 2
GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256,
            make_vocab_size_divisible_by=64, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT2, hidden_size=64, num_attention_heads=8, num_query_groups=4, normalization="RMSNorm",
             position_embedding_type="rope", swiglu=True, ffn_hidden_size=96, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
ARCHS = {"gpt2": GPT2, "llama": LLAMA}


def _batch(step, config):
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _config(arch, tensor_model_parallel_size, sequence_parallel) -> Config:
    return Config(model=ModelConfig(**ARCHS[arch]),
                  parallel=ParallelConfig(tensor_model_parallel_size=tensor_model_parallel_size,
                                          sequence_parallel=sequence_parallel),
                  training=TrainingConfig(micro_batch_size=BATCH, global_batch_size=BATCH, train_iters=STEPS,
                                          seed=SEED),
                  optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0, lr_decay_style="constant"),
                  logging=LoggingConfig(log_memory=False))


def _train(arch, tensor_model_parallel_size, sequence_parallel):
    """First step's per-token loss and full gradients, and STEPS losses: the trainer's own set-up and
    ``train_step`` (its forward step, loss and ``finalize_model_grads``) at every tp."""
    config = _config(arch, tensor_model_parallel_size, sequence_parallel)
    state = initialize_model_parallel(tensor_model_parallel_size)
    chunks, optimizer, scheduler = loop.setup_model_and_optimizer(config, state)
    per_token_losses = []

    def forward_step(data_iterator, model):  # the trainer's, keeping the per-token loss it computes
        output, loss_func = loop.forward_step(data_iterator, model)
        per_token_losses.append(output.detach())
        return output, loss_func

    losses = []
    for step in range(STEPS):
        tokens, labels = _batch(step, config.model)
        batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens),
                 "position_ids": torch.arange(config.model.seq_length).expand_as(tokens)}
        loss, _, _ = loop.train_step(config, state, chunks, optimizer, scheduler, iter([batch]), 1,
                                     forward_step_func=forward_step)
        if step == 0:
            grads = {name: _gather(p.main_grad, p, state) for name, p in chunks[0].module.named_parameters()}
        losses.append(loss)
    return per_token_losses[0], grads, losses


def _gather(shard, param, state):
    if not getattr(param, "tensor_model_parallel", False) or state.tensor_model_parallel_group is None:
        return shard.clone()
    shards = [torch.empty_like(shard) for _ in range(state.tensor_model_parallel_world_size)]
    dist.all_gather(shards, shard.contiguous(), group=state.tensor_model_parallel_group)
    return gather_shards(shards, partition_dim=param.partition_dim, partition_stride=param.partition_stride)


def _decoder_collectives(model, config):
    """Collectives issued by the transformer layers alone, forward and backward."""
    tokens, _ = _batch(0, config)
    hidden = model.embedding(tokens, torch.arange(config.seq_length).expand_as(tokens))
    hidden = hidden.detach().requires_grad_()  # stop the backward at the layers' input
    with count_collectives() as forward:
        output = model.decoder(hidden)
    with count_collectives() as backward:
        output.backward(torch.ones_like(output))
    return dict(forward.calls), dict(backward.calls)


def _parallel_run(rank, world_size, arch, sequence_parallel):
    first_loss, grads, losses = _train(arch, world_size, sequence_parallel)
    config = ModelConfig(**ARCHS[arch])
    state = initialize_model_parallel(world_size)
    model = GPTModel(config, TensorParallelConfig(state.tensor_model_parallel_group, sequence_parallel))
    initialize_weights([model], config, state, seed=SEED)
    counts = _decoder_collectives(model, config)
    return first_loss, grads, losses, counts


@functools.lru_cache(maxsize=None)
def _reference(arch):
    return _train(arch, 1, False)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_matches_single_process(run_distributed, arch, world_size, sequence_parallel):
    expected_loss, expected_grads, expected_losses = _reference(arch)
    results = run_distributed(_parallel_run, world_size, args=(arch, sequence_parallel))
    for first_loss, grads, losses, counts in results:
        torch.testing.assert_close(first_loss, expected_loss, rtol=1e-5, atol=0)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            assert_relative_close(grad, expected_grads[name], what=name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)

        # Megatron's count per transformer layer (attention + MLP).
        layers = ARCHS[arch]["num_layers"]
        if sequence_parallel:
            per_direction = {("all_gather", "tensor"): 2 * layers, ("reduce_scatter", "tensor"): 2 * layers}
        else:
            per_direction = {("all_reduce", "tensor"): 2 * layers}
        assert counts == (per_direction, per_direction)
