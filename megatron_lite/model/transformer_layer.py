"""One pre-norm transformer layer: x + Attn(Norm(x)), then x + MLP(Norm(x)).

Which attention and which MLP (dense or a mixture of experts, ``--moe-layer-freq``) the layer has is
its spec's choice (``layer_spec.py``).

With ``--post-sublayer-norm`` (Gemma 2) each sublayer's output is normalised too before it joins the
residual: x + Norm(Attn(Norm(x))), then x + Norm(MLP(Norm(x))); the norms are named as Megatron-Core's
``post_self_attn_layernorm`` and ``post_mlp_layernorm``. With ``--no-pre-sublayer-norm`` as well (OLMo 2's
reordered norms) the sublayers read the residual unnormalised, x + Norm(Attn(x)), then x + Norm(MLP(x)).

With ``--parallel-attention-mlp`` (GPT-NeoX's parallel residual) the MLP reads the layer's input rather than
the residual after attention, x + Attn(Norm(x)) + MLP(Norm(x)): the two sublayers are independent, each with
its own norm, and their outputs join the same residual.
"""
import contextlib

import torch
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.layer_spec import transformer_layer_spec
from megatron_lite.model.norm import Norm
from megatron_lite.model.sliding_window import is_local_layer
from megatron_lite.tensor_parallel import TensorParallelConfig
from megatron_lite.tensor_parallel.random import get_rng_tracker


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, layer_number: int, tp_config: TensorParallelConfig,
                 context_parallel: ContextParallelConfig | None = None,
                 ep_config: ExpertParallelConfig = ExpertParallelConfig(), checkpoint_core_attention: bool = False):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based: names and init do not depend on the stage
        self.local_attention = is_local_layer(config, layer_number)  # attends through a sliding window
        self.nope = config.is_nope_layer(layer_number)  # attends without rotary embeddings (--no-rope-freq)
        self.hidden_dropout = config.hidden_dropout
        self.parallel_attention_mlp = config.parallel_attention_mlp
        self.sequence_parallel = tp_config.sequence_parallel
        norm = dict(normalization=config.normalization, eps=config.norm_epsilon,
                    apply_layernorm_1p=config.apply_layernorm_1p, sequence_parallel=tp_config.sequence_parallel,
                    params_dtype=tp_config.params_dtype)
        spec = transformer_layer_spec(config, layer_number, ep_config=ep_config, context_parallel=context_parallel)
        # --no-pre-sublayer-norm (OLMo 2): the sublayers read the residual as it is.
        self.input_layernorm = nn.Identity() if config.no_pre_sublayer_norm else Norm(config.hidden_size, **norm)
        self.self_attention = spec.self_attention(config, layer_number=layer_number, tp_config=tp_config,
                                                  context_parallel=context_parallel,
                                                  checkpoint_core_attention=checkpoint_core_attention)
        self.pre_mlp_layernorm = nn.Identity() if config.no_pre_sublayer_norm else Norm(config.hidden_size, **norm)
        self.mlp = spec.mlp(config, tp_config=tp_config)
        if config.post_sublayer_norm:
            self.post_self_attn_layernorm = Norm(config.hidden_size, **norm)
            self.post_mlp_layernorm = Norm(config.hidden_size, **norm)
        else:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None

    def forward(self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inference_context=None, positions_are_columns: bool = False) -> torch.Tensor:
        """``position_ids`` [b, s]: the tokens' positions, which Llama 4's attention reads (``SelfAttention``, with
        ``positions_are_columns``)."""
        layer_input = hidden_states
        attention_output, attention_bias = self.self_attention(self.input_layernorm(hidden_states), rotary_freqs,
                                                               attention_mask, position_ids, inference_context,
                                                               positions_are_columns)
        attention_output, attention_bias = _post_norm(self.post_self_attn_layernorm, attention_output, attention_bias)
        hidden_states = self._bias_dropout_add(attention_output, attention_bias, hidden_states)
        mlp_input = layer_input if self.parallel_attention_mlp else hidden_states
        mlp_output, mlp_bias = self.mlp(self.pre_mlp_layernorm(mlp_input))
        mlp_output, mlp_bias = _post_norm(self.post_mlp_layernorm, mlp_output, mlp_bias)
        return self._bias_dropout_add(mlp_output, mlp_bias, hidden_states)

    def _bias_dropout_add(self, x, bias, residual):
        # Under sequence parallelism each rank holds different tokens: draw its own mask.
        forked = self.sequence_parallel and self.training and self.hidden_dropout > 0
        with get_rng_tracker().fork() if forked else contextlib.nullcontext():
            return kernels.bias_dropout_add(x, bias, residual, self.hidden_dropout, self.training)


def _post_norm(norm, output, bias):
    """(output, bias) of a sublayer, normalised (bias included) when the layer has a post-sublayer norm."""
    if norm is None:
        return output, bias
    return norm(output if bias is None else output + bias), None
