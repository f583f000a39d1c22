"""The parameters one model chunk holds, by name and size, without building it.

The list mirrors ``model/gpt_model.py`` in ``module.parameters()`` order, because
that order decides the data-parallel buckets (``distributed/param_and_grad_buffer``)
and so the padding a sharded optimizer adds. A test checks it against real chunks
of every kind (GPT-2, Llama, the per-layer tensors of the Hugging Face families, tensor/pipeline/virtual
splits, tied or not).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_lite.config import Config, ModelConfig
from megatron_lite.pipeline_parallel.layer_split import get_layer_numbers


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name in the chunk, its element count on this rank, and whether it is the
    word embedding that the first and last pipeline stages both hold (it gets its own bucket)."""

    name: str
    elements: int
    shared_embedding: bool = False
    expert: bool = False  # an expert's weight: in the expert buffers, sharded over the expert-data-parallel group
    matrix: tuple = ()  # (rows, columns) on this rank of a weight matrix, what --optimizer muon orthogonalises
    partition_dim: int | None = None  # the matrix dimension split over the tensor-parallel ranks (None: whole)

    def numel(self) -> int:  # what the bucket planner asks of a parameter
        return self.elements


def fsdp_unit(spec: ParamSpec) -> str:
    """Which ZeRO-3 unit gathers ``spec``: the outermost module of a class in ``model.builder.FSDP_UNIT_MODULES``
    holding it (the embedding, a transformer layer), or "" for the chunk itself (final norm, output layer)."""
    parts = spec.name.split(".")
    if parts[0] == "embedding":
        return "embedding"
    if parts[:2] == ["mtp", "layers"] and parts[3] == "mtp_model_layer":  # a multi-token prediction depth's layer
        return ".".join(parts[:4])
    return ".".join(parts[:3]) if parts[:2] == ["decoder", "layers"] else ""


def _norm(prefix: str, model: ModelConfig, width: int | None = None) -> list[ParamSpec]:
    """A norm over ``width`` channels (the hidden size unless given; --qk-layernorm's are one head wide)."""
    names = ["weight", "bias"] if model.normalization == "LayerNorm" else ["weight"]
    return [ParamSpec(f"{prefix}.{n}", width or model.hidden_size) for n in names]


def _linear(prefix: str, rows: int, columns: int, bias: int | None, partition_dim: int | None = None
            ) -> list[ParamSpec]:
    """A [rows, columns] weight (split along ``partition_dim``: 0 column-parallel, 1 row-parallel) and, when the
    layer has one, a bias of ``bias`` elements."""
    specs = [ParamSpec(f"{prefix}.weight", rows * columns, matrix=(rows, columns), partition_dim=partition_dim)]
    return specs + ([ParamSpec(f"{prefix}.bias", bias)] if bias is not None else [])


def layer_parameters(model: ModelConfig, layer_number: int, tensor_model_parallel_size: int, *,
                     expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                     prefix: str | None = None) -> list[ParamSpec]:
    """One transformer layer's shards: column-parallel weights and biases are split over the rows,
    row-parallel weights over the columns, row-parallel biases and norms are replicated; a
    mixture-of-experts layer's experts over the expert-model-parallel ranks, each over the expert-tensor ones.
    ``prefix``: its module path, by default decoder.layers.{layer_number}."""
    t = tensor_model_parallel_size
    prefix = prefix or f"decoder.layers.{layer_number}"
    attention = _latent_attention if model.multi_latent_attention else _attention
    if model.is_linear_attention_layer(layer_number):
        attention = _gated_delta_net
    if model.is_moe_layer(layer_number):
        mlp = _experts(f"{prefix}.mlp", model, t, expert_model_parallel_size, expert_tensor_parallel_size or t)
    else:
        mlp = _mlp(f"{prefix}.mlp", model, model.ffn_hidden_size, t)
    pre_norm = (lambda name: []) if model.no_pre_sublayer_norm else (lambda name: _norm(f"{prefix}.{name}", model))
    return (pre_norm("input_layernorm") + attention(f"{prefix}.self_attention", model, t)
            + pre_norm("pre_mlp_layernorm") + mlp
            + (_norm(f"{prefix}.post_self_attn_layernorm", model) + _norm(f"{prefix}.post_mlp_layernorm", model)
               if model.post_sublayer_norm else []))


def _mlp(prefix: str, model: ModelConfig, width: int, t: int) -> list[ParamSpec]:
    """A dense MLP ``width`` wide: column-parallel fc1 (SwiGLU's two halves), row-parallel fc2."""
    h, bias = model.hidden_size, model.add_bias_linear
    fc1 = width * (2 if model.swiglu else 1) // t
    return (_linear(f"{prefix}.linear_fc1", fc1, h, fc1 if bias else None, partition_dim=0)
            + _linear(f"{prefix}.linear_fc2", h, width // t, h if bias else None, partition_dim=1))


def _experts(prefix: str, model: ModelConfig, t: int, ep: int, etp: int) -> list[ParamSpec]:
    """``moe/moe_layer.py``'s: the router (whole on every rank), this rank's E / ep experts (the first
    expert-model-parallel rank's numbers: every rank holds the same sizes), each split over etp ranks,
    and the shared expert (a dense MLP over the tensor ranks, its gate first)."""
    h, width, bias = model.hidden_size, model.moe_ffn_hidden_size, model.add_bias_linear
    specs = _linear(f"{prefix}.router", model.num_experts, h, model.num_experts if bias else None)
    fc1 = width * (2 if model.swiglu else 1) // etp
    for e in range(model.num_experts // ep):
        expert = f"{prefix}.experts.local_experts.{e}"  # with --add-bias-linear fc2's bias whole (gpt-oss)
        specs += [dataclasses.replace(s, name=f"{expert}.{s.name}", expert=True)
                  for s in _linear("linear_fc1", fc1, h, fc1 if bias else None, partition_dim=0)
                  + _linear("linear_fc2", h, width // etp, h if bias else None, partition_dim=1)]
    if model.moe_shared_expert_intermediate_size is not None:
        gate = ([ParamSpec(f"{prefix}.shared_experts.gate_weight", h, matrix=(1, h))] if model.moe_shared_expert_gate
                else [])
        specs += gate + _mlp(f"{prefix}.shared_experts", model, model.moe_shared_expert_intermediate_size, t)
    return specs


def active_parameters(model: ModelConfig, total: int) -> int:
    """Of a model's ``total`` parameters, those one token passes through: all but the experts it is not
    routed to (E - k of each mixture-of-experts layer)."""
    if model.num_experts is None:
        return total
    fc1 = model.moe_ffn_hidden_size * (2 if model.swiglu else 1)
    expert = (model.hidden_size + model.add_bias_linear) * fc1 + model.moe_ffn_hidden_size * model.hidden_size + (
        model.hidden_size if model.add_bias_linear else 0)
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    return total - moe_layers * (model.num_experts - model.moe_router_topk) * expert


def _attention(prefix: str, model: ModelConfig, t: int) -> list[ParamSpec]:
    """``model/attention.py``'s: the sinks (--softmax-type learnable, split with the heads, the module's own
    parameter and so first), the fused QKV, the output projection, the q/k norms: per head (shared by the heads),
    or over a whole projection (split with the heads)."""
    h, bias = model.hidden_size, model.add_bias_linear
    sinks = ([ParamSpec(f"{prefix}.softmax_offset", model.num_attention_heads // t)]
             if model.softmax_type == "learnable" else [])
    query_heads = model.num_attention_heads * (2 if model.attention_output_gate else 1)  # gated: the gates too
    qkv = (query_heads + 2 * model.num_query_groups) * model.head_dim // t
    widths = ((model.num_attention_heads * model.head_dim // t, model.num_query_groups * model.head_dim // t)
              if model.qk_layernorm_whole_projection else (model.head_dim, model.head_dim))
    return (sinks + _linear(f"{prefix}.linear_qkv", qkv, h, qkv if bias or model.add_qkv_bias else None,
                            partition_dim=0)
            + _linear(f"{prefix}.linear_proj", h, model.num_attention_heads * model.head_dim // t, h if bias else None,
                      partition_dim=1)
            + (_norm(f"{prefix}.q_layernorm", model, widths[0]) + _norm(f"{prefix}.k_layernorm", model, widths[1])
               if model.qk_layernorm else []))


def _gated_delta_net(prefix: str, model: ModelConfig, t: int) -> list[ParamSpec]:
    """``model/gated_delta_net.py``'s, split with the key heads: A_log and dt_bias (the module's own parameters
    come first), in_proj, the convolution, the gated norm (one head wide, replicated), out_proj."""
    h, key_heads, value_heads = model.hidden_size, model.linear_num_key_heads // t, model.linear_num_value_heads // t
    keys, values = key_heads * model.linear_key_head_dim, value_heads * model.linear_value_head_dim
    return ([ParamSpec(f"{prefix}.A_log", value_heads), ParamSpec(f"{prefix}.dt_bias", value_heads)]
            + _linear(f"{prefix}.in_proj", 2 * keys + 2 * values + 2 * value_heads, h, None)
            + [ParamSpec(f"{prefix}.conv1d.weight", (2 * keys + values) * model.linear_conv_kernel_dim),
               ParamSpec(f"{prefix}.out_norm.weight", model.linear_value_head_dim)]
            + _linear(f"{prefix}.out_proj", h, values, None))


def _latent_attention(prefix: str, model: ModelConfig, t: int) -> list[ParamSpec]:
    """``model/multi_latent_attention.py``'s: replicated down-projections (and latent norms), column-parallel
    up-projections, the row-parallel output projection."""
    h, heads, rotary = model.hidden_size, model.num_attention_heads, model.qk_pos_emb_head_dim
    query_rows = heads * (model.qk_head_dim + rotary) // t
    norm = _norm if model.qk_layernorm else (lambda *args: [])
    if model.q_lora_rank is None:
        query = _linear(f"{prefix}.linear_q_proj", query_rows, h, None, partition_dim=0)
    else:
        query = (_linear(f"{prefix}.linear_q_down_proj", model.q_lora_rank, h, None)
                 + norm(f"{prefix}.q_layernorm", model, model.q_lora_rank)
                 + _linear(f"{prefix}.linear_q_up_proj", query_rows, model.q_lora_rank, None, partition_dim=0))
    return (query + _linear(f"{prefix}.linear_kv_down_proj", model.kv_lora_rank + rotary, h, None)
            + norm(f"{prefix}.kv_layernorm", model, model.kv_lora_rank)
            + _linear(f"{prefix}.linear_kv_up_proj", heads * (model.qk_head_dim + model.v_head_dim) // t,
                      model.kv_lora_rank, None, partition_dim=0)
            + _linear(f"{prefix}.linear_proj", h, heads * model.v_head_dim // t, h if model.add_bias_linear else None,
                      partition_dim=1))


def chunk_parameters(model: ModelConfig, *, tensor_model_parallel_size: int, layer_numbers: range,
                     pre_process: bool, post_process: bool, expert_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: int | None = None) -> list[ParamSpec]:
    """Every parameter of one model chunk, in ``module.parameters()`` order."""
    t, h = tensor_model_parallel_size, model.hidden_size
    vocab = model.padded_vocab_size(t) // t
    tied, mtp = not model.untie_embeddings_and_output_weights, model.mtp_num_layers is not None
    shared = tied and pre_process != post_process  # both end stages hold a copy of the word embedding
    # Multi-token prediction reads the embedding on the last stage: a copy of the whole of it there.
    holds_embedding, copied = pre_process or (post_process and mtp), mtp and pre_process != post_process
    experts = dict(expert_model_parallel_size=expert_model_parallel_size,
                   expert_tensor_parallel_size=expert_tensor_parallel_size)
    specs = []
    if holds_embedding:
        specs.append(ParamSpec("embedding.word_embeddings.weight", vocab * h, shared_embedding=shared or copied))
        if model.position_embedding_type == "learned_absolute":
            # Muon orthogonalises it: only the word embedding and the output layer are left to the scalar optimizer,
            # as in Megatron-LM.
            specs.append(ParamSpec("embedding.position_embeddings.weight", model.max_position_embeddings * h,
                                   shared_embedding=copied, matrix=(model.max_position_embeddings, h)))
    for n in layer_numbers:
        specs += layer_parameters(model, n, t, **experts)
    if post_process:
        specs += _norm("final_layernorm", model)
        if not (tied and holds_embedding):  # a tied output layer beside the embedding reuses it
            specs.append(ParamSpec("output_layer.weight", vocab * h, shared_embedding=shared))
        for depth in range(model.mtp_num_layers if mtp else 0):  # model/multi_token_prediction.py
            prefix = f"mtp.layers.{depth}"
            specs += (_norm(f"{prefix}.enorm", model) + _norm(f"{prefix}.hnorm", model)
                      + _linear(f"{prefix}.eh_proj", h // t, 2 * h, None, partition_dim=0)
                      + layer_parameters(model, model.num_layers + depth, t, prefix=f"{prefix}.mtp_model_layer",
                                         **experts)
                      + _norm(f"{prefix}.final_layernorm", model))
    return specs


@dataclass(frozen=True)
class ChunkShape:
    """What one model chunk holds: which layers, and whether the embedding and the output layer."""

    layer_numbers: range
    pre_process: bool
    post_process: bool


def rank_chunk_shapes(config: Config, pipeline_rank: int) -> list[ChunkShape]:
    """The chunks pipeline stage ``pipeline_rank`` holds, one per virtual stage (``model/builder.py``'s split)."""
    parallel = config.parallel
    return list(_chunk_shapes(config.model.num_layers, parallel.pipeline_model_parallel_size,
                              parallel.virtual_pipeline_model_parallel_size, parallel.decoder_first_pipeline_num_layers,
                              parallel.decoder_last_pipeline_num_layers, pipeline_rank))


@functools.lru_cache(maxsize=65536)  # a plan asks for the same stages of thousands of layouts
def _chunk_shapes(num_layers: int, p: int, virtual: int | None, first: int | None, last: int | None,
                  pipeline_rank: int) -> tuple[ChunkShape, ...]:
    v = virtual or 1
    return tuple(ChunkShape(get_layer_numbers(
                     num_layers, pipeline_model_parallel_size=p, pipeline_rank=pipeline_rank,
                     virtual_pipeline_model_parallel_size=virtual, virtual_pipeline_rank=virtual_rank,
                     decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last),
                 pre_process=pipeline_rank == 0 and virtual_rank == 0,
                 post_process=pipeline_rank == p - 1 and virtual_rank == v - 1)
                 for virtual_rank in range(v))


def distinct_stages(config: Config) -> dict[tuple, list[int]]:
    """Pipeline ranks grouped by what they hold: ranks with the same kinds of layers (dense or mixture of
    experts, in order) and the same end pieces (embedding, output layer) hold parameters of the same sizes
    and cost the same."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(config.parallel.pipeline_model_parallel_size):
        shapes = rank_chunk_shapes(config, rank)
        key = tuple((tuple(config.model.is_moe_layer(n) for n in s.layer_numbers), s.pre_process, s.post_process)
                    for s in shapes)
        groups.setdefault(key, []).append(rank)
    return groups


def rank_chunks(config: Config, pipeline_rank: int) -> list[list[ParamSpec]]:
    """The parameter lists of the model chunks pipeline stage ``pipeline_rank`` holds."""
    parallel = config.parallel
    return [chunk_parameters(config.model, tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                             layer_numbers=shape.layer_numbers, pre_process=shape.pre_process,
                             post_process=shape.post_process,
                             expert_model_parallel_size=parallel.expert_model_parallel_size,
                             expert_tensor_parallel_size=parallel.expert_tensor_size)
            for shape in rank_chunk_shapes(config, pipeline_rank)]
