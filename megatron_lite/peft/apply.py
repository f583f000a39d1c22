"""Turn a built model chunk into a PEFT model: freeze the base, attach the added weights by module name.

The added modules become children of the module they change, and forward hooks
(LoRA, adapters) or the attention's ``prefix`` slot (prefix tuning) put them to
work, so the base weights keep their names: initialisation, checkpoints, the
Hugging Face mapping and the architecture check see the same base model with or
without PEFT, and ``model/`` has no PEFT options. Which parameters train is
``requires_grad``: the data-parallel buffers, the optimizer and checkpoints take
only those.
"""
from __future__ import annotations

import contextlib

from torch import nn

from megatron_lite.config import Config
from megatron_lite.peft.adapter import BottleneckAdapter, apply_adapter
from megatron_lite.expert_parallel import ExpertLinear
from megatron_lite.peft.lora import ExpertLoRA, LoRA, add_lora_output
from megatron_lite.peft.prefix_tuning import KeyValuePrefix
from megatron_lite.tensor_parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear


def apply_peft(model: nn.Module, config: Config) -> None:
    """Freeze ``model`` (a GPTModel chunk) and add ``config.peft``'s trainable weights to its layers."""
    peft = config.peft
    if peft.peft is None:
        return
    for param in model.parameters():
        param.requires_grad_(False)
    layers = model.decoder.layers.values()
    if peft.peft == "lora":
        for name, module in model.decoder.named_modules():
            if name.rsplit(".", 1)[-1] in peft.lora_target_modules:
                _add_lora(module, peft)
    elif peft.peft == "adapter":
        for layer in layers:
            for block in (layer.self_attention, layer.mlp):
                block.adapter = BottleneckAdapter(config.model.hidden_size, peft.adapter_dim,
                                                  sequence_parallel=config.parallel.sequence_parallel,
                                                  params_dtype=config.params_dtype)
                block.register_forward_hook(apply_adapter)
    else:
        for layer in layers:
            attention = layer.self_attention
            attention.prefix = KeyValuePrefix(config.model, prefix_length=peft.prefix_length,
                                              projection_hidden_size=peft.prefix_projection_hidden_size,
                                              tp_group=attention.linear_qkv.tp_group, params_dtype=config.params_dtype)


@contextlib.contextmanager
def adapters_disabled(model_chunks: list):
    """The chunks compute their frozen base model inside the block: every LoRA is switched off (--dpo's
    reference under --peft lora, which is the base without a second copy)."""
    loras = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, (LoRA, ExpertLoRA))]
    for lora in loras:
        lora.enabled = False
    try:
        yield
    finally:
        for lora in loras:
            lora.enabled = True


def _add_lora(module: nn.Module, peft) -> None:
    """A LoRA on a column-parallel, row-parallel or replicated linear, or on one expert's linear (each expert its
    own)."""
    settings = dict(rank=peft.lora_rank, alpha=peft.lora_alpha, dropout=peft.lora_dropout)
    if isinstance(module, ExpertLinear):
        module.lora = ExpertLoRA(module, **settings)
    elif isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
        module.lora = LoRA(module, **settings)
    else:
        raise TypeError(f"--lora-target-modules names a {type(module).__name__}; LoRA adapts column-parallel, "
                        f"row-parallel and replicated linear layers and experts' linears.")
    module.register_forward_hook(add_lora_output)
