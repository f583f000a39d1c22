"""One training iteration of Megatron-Core on CPU with gloo, as Megatron-LM's ``train_step`` runs it.

Megatron-Core's ``GPTModel`` with its local layer spec (``get_gpt_layer_local_spec``: no
Transformer Engine), wrapped in its ``DistributedDataParallel``, trained by its
``get_megatron_optimizer`` (Adam, gradient clipping, with ``use_distributed_optimizer`` the
distributed optimizer) under its ``OptimizerParamScheduler``; the micro-batches go through its
``get_forward_backward_func`` (1F1B at pipeline size 2), with the hooks Megatron-LM's
``setup_model_and_optimizer`` installs (``no_sync_func``, ``finalize_model_grads_func``,
``grad_scale_func``). The model's weights are read from a legacy Megatron-LM checkpoint (our
export of our initial weights, ``bench_vs_megatron.py``), whose ``args`` give the architecture.

This module imports Megatron from the directory it is handed (a snapshot outside this
repository) and only inside the benchmark's worker processes. On a CPU:

- ``tools/megatron_cpu_stand_ins.py``'s ``cpu_stand_ins`` answer what Megatron asks of CUDA
  (RNG states, synchronisation, the current device, tensors created on ``"cuda"``), and
  ``training_stand_ins`` what its training path asks beyond the fixtures' forward;
- Megatron's ``jit_fuser`` (``torch.compile``) runs eagerly, as in the fixtures: inductor's CPU
  code generation is not what a Megatron-Core user runs;
- CUDA-only fusions are off (masked softmax, RoPE, gradient-accumulation fusion); the bias-GeLU
  and bias-SwiGLU fusions are on, as Megatron-LM's arguments default them (they are Python
  functions under ``jit_fuser``, and select the tanh GeLU that our GPT-2 computes too);
- pipeline stages exchange activations with ``isend``/``irecv`` one by one (``batch_p2p_comm``
  off: gloo has no batched point-to-point).
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

import torch
import torch.distributed as dist

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_megatron(megatron_lm: str) -> None:
    """Make ``megatron`` importable from ``megatron_lm`` and ready for a CPU (see the module docstring)."""
    sys.path.insert(0, os.path.abspath(megatron_lm))
    sys.path.insert(0, REPOSITORY)
    import torch._dynamo

    warnings.filterwarnings("ignore", module=r"megatron\.")  # its notes on the CPU fallbacks, every process

    torch._dynamo.config.disable = True  # Megatron's jit_fuser is torch.compile
    from tools.megatron_cpu_stand_ins import cpu_stand_ins

    cpu_stand_ins()
    training_stand_ins()


def training_stand_ins() -> None:
    """What Megatron's training path asks of CUDA beyond the fixtures' forward: its gradient clipping
    asserts that each gradient's ``type()`` is ``torch.cuda.FloatTensor``; a CPU tensor answers with the
    name of its CUDA counterpart."""
    cpu_type = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        if args or kwargs:  # a conversion, not the question
            return cpu_type(self, *args, **kwargs)
        return cpu_type(self).replace("torch.", "torch.cuda.", 1)
    torch.Tensor.type = tensor_type


def init_process_group(world_size: int) -> None:
    """gloo over the environment's rendezvous (torchrun's variables); a world of one in memory, since
    Megatron's parallel state needs a process group even for one process."""
    if world_size > 1:
        dist.init_process_group("gloo", init_method="env://")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def transformer_config(args, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int):
    """Megatron-Core's TransformerConfig for the model a legacy checkpoint's ``args`` describe."""
    from megatron.core.transformer import TransformerConfig

    activation = torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=activation, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, bias_activation_fusion=True,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, batch_p2p_comm=False)


def rank_checkpoint(export_dir: str, tensor_rank: int, pipeline_rank: int, pipeline_size: int) -> dict:
    """This rank's file of the legacy checkpoint ``export_dir`` (``model`` and ``args``), read as our importer
    reads one."""
    from megatron_lite.interop.megatron import legacy

    return legacy.read_rank_file(os.path.join(legacy.iteration_dir(export_dir), legacy.rank_dir_name(
        tensor_rank, pipeline_rank, pipeline_size), legacy.MODEL_FILE))


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's pretrain_gpt loss: (sum of the masked token losses, their count, the logged pair)."""
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1))
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])}


def forward_step(attention_mask, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], attention_mask, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def build(megatron_lm: str, export_dir: str, layout, micro_batches: list):
    """(one training iteration of Megatron-Core on this rank's micro-batches, its parameter count) for this
    rank of a world of ``layout.world_size`` gloo processes (rank and world from the environment).

    ``micro_batches``: the global batch's micro-batches, each {tokens, labels, loss_mask, position_ids};
    data-parallel rank d takes the d-th run of num_microbatches / dp of them."""
    import_megatron(megatron_lm)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_process_group(layout.world_size)
    tp, pp, dp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.data_parallel_size
    mpu.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)
    pipeline_rank = mpu.get_pipeline_model_parallel_rank()
    checkpoint = rank_checkpoint(export_dir, mpu.get_tensor_model_parallel_rank(), pipeline_rank, pp)
    args = checkpoint["args"]
    config = transformer_config(args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    model.load_state_dict(checkpoint["model"], strict=True)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=layout.distributed_optimizer)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, min_lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        clip_grad=1.0, use_distributed_optimizer=layout.distributed_optimizer), chunks)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=1e-4, max_lr=1e-4, min_lr=1e-4, lr_warmup_steps=0,
                                        lr_decay_steps=10_000, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=10_000, wd_incr_style="constant")
    # What Megatron-LM's setup_model_and_optimizer hands the schedules through the model's config.
    config.no_sync_func = chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    per_rank = len(micro_batches) // dp
    data_rank = mpu.get_data_parallel_rank()
    mine = micro_batches[data_rank * per_rank:(data_rank + 1) * per_rank]
    seq_length = mine[0]["tokens"].shape[1]
    mask = torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool), diagonal=1)
    forward_backward = get_forward_backward_func()
    micro_batch_size = mine[0]["tokens"].shape[0]

    def iteration():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=functools.partial(forward_step, mask), data_iterator=iter(mine),
                                  model=chunks, num_microbatches=per_rank, seq_length=seq_length,
                                  micro_batch_size=micro_batch_size, forward_only=False)
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=per_rank * micro_batch_size * dp)
        if not mpu.is_pipeline_last_stage():
            return None
        total = torch.stack([entry["lm loss"] for entry in losses]).sum(dim=0)
        dist.all_reduce(total, group=mpu.get_data_parallel_group())  # Megatron-LM's train_step reports this mean
        return {"loss": (total[0] / total[1]).item(), "grad_norm": grad_norm}

    return iteration, sum(p.numel() for p in model.parameters())
