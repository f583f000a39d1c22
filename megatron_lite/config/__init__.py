"""Typed configuration: one dataclass per concern, validated on construction.

Every error names the command-line flag at fault and what to do about it, so a
user who mistypes a launch script learns the fix before any process group is
built. Each field is one flag (``megatron_lite/cli/`` maps Megatron-LM's flags onto these
dataclasses; how to add one is in its docstring): a field's ``choices`` metadata and its
section's ``__post_init__`` are the whole validation, so a Config built in code is checked
exactly as one parsed from flags. This package imports nothing of megatron_lite above it.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.batch_size_schedule import parse_step_batch_size_schedule, schedule_in_samples
from megatron_lite.config.errors import ConfigError, UserError  # noqa: F401 (imported from here everywhere)
from megatron_lite.config.moe import (GROUP_SCORES, LOAD_BALANCING_TYPES, ROUTER_SCORE_FUNCTIONS, TOKEN_DROP_POLICIES,
                                      check_moe_fields, moe_layer_pattern)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_choices(section) -> None:
    """Each field whose metadata lists ``choices`` holds one of them (every element, for a list field); the
    parser offers the same list. None passes where it is the field's default ("not given")."""
    for f in dataclasses.fields(section):
        choices, value = f.metadata.get("choices"), getattr(section, f.name)
        if choices is None or (value is None and f.default is None):
            continue
        bad = [v for v in (value if isinstance(value, list) else [value]) if v not in choices]
        _require(not bad, f"{flag_name(f.name)} must be one of {', '.join(map(str, choices))}, "
                          f"got {', '.join(map(repr, bad))}.")


# Fields that default to True are turned off by these flags (Megatron's spelling).
NEGATIVE_FLAGS = {"add_bias_linear": "--disable-bias-linear", "use_fused_kernels": "--no-fused-kernels",
                  "log_memory": "--no-log-memory", "mmap_bin_files": "--no-mmap-bin-files",
                  "manual_gc_eval": "--no-manual-gc-eval",
                  "check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
                  "yarn_correction_range_round_to_int": "--no-yarn-correction-range-round-to-int"}


def flag_name(field_name: str) -> str:
    """The command-line flag that sets a config field: ``norm_epsilon`` -> ``--norm-epsilon``."""
    return NEGATIVE_FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def flag_is_on(field_name: str, value: bool) -> bool:
    """Whether a boolean field's flag is given: ``--disable-bias-linear`` is on when add_bias_linear is False."""
    return value != (field_name in NEGATIVE_FLAGS)


def as_flags(values: dict) -> str:
    """Field values as the command line that sets them (switches only when on)."""
    parts = []
    for name, value in values.items():
        if isinstance(value, bool):
            parts += [flag_name(name)] if flag_is_on(name, value) else []
        elif isinstance(value, list):
            parts += [flag_name(name), *map(str, value)]
        elif value is not None:
            parts += [flag_name(name), str(value)]
    return " ".join(parts)


# Megatron's --attention-backend values. flash and fused name Transformer Engine kernels; here they,
# and auto, run torch's scaled_dot_product_attention (which picks a flash or memory-efficient kernel
# itself). unfused and local run the explicit QK^T -> masked softmax -> V path.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# yarn: rotary embeddings with YaRN's frequency scaling (model/rope_scaling.py), Megatron-LM's spelling for
# attention other than multi-latent, which picks its flavour of rotary embedding with --rope-type.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")
ROPE_TYPES = ("rope", "yarn")
# Megatron-LM's YaRN settings where their flags are not given.
YARN_DEFAULTS = {"yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's MLP width when --ffn-hidden-size is not given: 4h, or with SwiGLU (whose fc1 is two
    matrices) 2/3 of that rounded down to a multiple of 64, so the parameter count stays near the 4h MLP's."""
    if not swiglu:
        return 4 * hidden_size
    return int((4 * hidden_size * 2 / 3) / 64) * 64


@dataclass(kw_only=True)
class ModelConfig:
    """The GPT architecture. GPT-2 and Llama are both points in this space."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # unpadded; the embedding is padded, see padded_vocab_size
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size; with swiglu, see default_ffn_hidden_size
    num_query_groups: Optional[int] = None  # grouped-query attention; default = heads
    max_position_embeddings: Optional[int] = None  # default seq_length
    kv_channels: Optional[int] = None  # width of each head; default hidden_size / num_attention_heads
    normalization: str = field(default="LayerNorm", metadata={"choices": NORMALIZATIONS})
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False  # norm weights hold scale - 1 (Megatron's zero-centred gamma)
    position_embedding_type: str = field(default="learned_absolute", metadata={"choices": POSITION_EMBEDDING_TYPES})
    rotary_base: float = 10000.0
    # The sliding-window layers' own RoPE base, never scaled (Gemma 3's local layers; Megatron-Bridge's name).
    rotary_base_local: Optional[float] = None
    rotary_percent: float = 1.0  # fraction of each head's channels that rotary embeddings rotate
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS})
    swiglu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a bias on the fused QKV alone, even with --disable-bias-linear (Qwen2)
    qk_layernorm: bool = False  # each head's queries and keys normalised before RoPE (Qwen3)
    # With --qk-layernorm: one RMSNorm over all heads' queries (and one over the keys), OLMoE's.
    qk_layernorm_whole_projection: bool = False
    # Sliding-window attention, Megatron-LM's (left, right): query i sees keys i - left .. i + right.
    window_size: Optional[list[int]] = field(default=None, metadata={"nargs": 2, "metavar": ("LEFT", "RIGHT")})
    window_attn_skip_freq: Optional[int] = None  # Megatron-Core's: every Nth layer (1-based) attends globally
    softmax_scale: Optional[float] = None  # the attention scores' scale; default 1/sqrt(head width)
    attn_logit_softcapping: Optional[float] = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: Optional[float] = None  # the output logits likewise (Gemma 2)
    post_sublayer_norm: bool = False  # a norm on the attention and MLP outputs too, before the residual (Gemma 2)
    scale_embeddings: bool = False  # word embeddings times sqrt(hidden_size) (Gemma)
    geglu: bool = False  # --swiglu's gate through tanh GELU instead of SiLU (GeGLU, Gemma)
    rotary_seq_len_interpolation_factor: Optional[float] = None  # linear RoPE scaling: positions / factor
    use_rope_scaling: bool = False  # Llama 3.x's RoPE frequency scaling, by rope_scaling_factor
    rope_scaling_factor: float = 8.0
    # YaRN (--position-embedding-type yarn, or multi-latent attention's --rope-type yarn): the frequencies
    # stretched by rotary_scaling_factor between the corrections beta_fast and beta_slow of the original context,
    # and the "mscale" concentration of the scores (model/rope_scaling.py).
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: Optional[int] = None  # None: YARN_DEFAULTS' (so the two below)
    yarn_beta_fast: Optional[float] = None
    yarn_beta_slow: Optional[float] = None
    yarn_correction_range_round_to_int: bool = True
    # Multi-latent attention (DeepSeek-V2/V3, model/multi_latent_attention.py): queries and keys/values through
    # low-rank latents, each head's query/key split into qk_head_dim channels without and qk_pos_emb_head_dim
    # channels with rotary embedding (the key's shared by every head).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # None: queries projected straight from the hidden state (V2-Lite)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: Optional[str] = field(default=None, metadata={"choices": ROPE_TYPES})  # None: yarn for MLA, else rope
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    use_fused_kernels: bool = True
    # Mixture of experts (Megatron-LM's --num-experts and --moe-* flags; checked in config/moe.py).
    num_experts: Optional[int] = None  # None: every MLP is dense
    moe_ffn_hidden_size: Optional[int] = None  # each expert's inner width; default --ffn-hidden-size
    moe_layer_freq: str = "1"  # N (every Nth layer) or a 0/1 list expression, one per layer
    moe_router_topk: int = 2
    moe_router_score_function: str = field(default="softmax", metadata={"choices": ROUTER_SCORE_FUNCTIONS})
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k (no renormalisation)
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None  # group-limited routing: experts in this many groups ...
    moe_router_group_topk: Optional[int] = None  # ... of which each token may use this many
    # How a group is scored: the sum of its best k / g scores (Megatron-LM's, DeepSeek-V3's), or its best (V2's).
    moe_router_group_score: str = field(default="topk_sum", metadata={"choices": GROUP_SCORES})
    moe_router_load_balancing_type: str = field(default="aux_loss", metadata={"choices": LOAD_BALANCING_TYPES})
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3)
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = field(default="probs", metadata={"choices": TOKEN_DROP_POLICIES})
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_grouped_gemm: bool = False  # the experts as one grouped GEMM (torch._grouped_mm) instead of a loop

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
            _require(self.ffn_hidden_size > 0,
                     f"--swiglu's default --ffn-hidden-size (2/3 of 4 x --hidden-size {self.hidden_size}, rounded "
                     f"down to a multiple of 64, as Megatron-LM) is 0: give --ffn-hidden-size.")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for flag, value in [("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads),
                            ("--seq-length", self.seq_length), ("--vocab-size", self.vocab_size),
                            ("--ffn-hidden-size", self.ffn_hidden_size),
                            ("--num-query-groups", self.num_query_groups)]:
            _require(value > 0, f"{flag} must be positive, got {value}.")
        if self.kv_channels is None:
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                     f"({self.num_attention_heads}); pick a head count that divides the hidden size, or set the "
                     f"head width with --kv-channels.")
            self.kv_channels = self.hidden_size // self.num_attention_heads  # as Megatron-LM
        _require(self.kv_channels > 0, f"--kv-channels must be positive, got {self.kv_channels}.")
        _require(self.num_attention_heads % self.num_query_groups == 0,
                 f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                 f"--num-query-groups ({self.num_query_groups}): each query group shares one key/value head.")
        _require(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {self.rotary_percent}.")
        self._check_multi_latent_attention()
        rotated = (f"--qk-pos-emb-head-dim {self.rotary_dim}" if self.multi_latent_attention else
                   f"head dimension {self.head_dim} x --rotary-percent {self.rotary_percent} = {self.rotary_dim}")
        _require(not self.rotary or (self.rotary_dim > 0 and self.rotary_dim % 2 == 0),
                 f"rotary embeddings rotate pairs of channels: {rotated} channels must be even and positive.")
        _require(self.seq_length <= self.max_position_embeddings,
                 f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                 f"({self.max_position_embeddings}); raise --max-position-embeddings.")
        for flag, p in [("--hidden-dropout", self.hidden_dropout), ("--attention-dropout", self.attention_dropout)]:
            _require(0.0 <= p < 1.0, f"{flag} must be in [0, 1), got {p}.")
        _require(self.init_method_std > 0, f"--init-method-std must be positive, got {self.init_method_std}.")
        _require(self.window_size is None or (len(self.window_size) == 2 and self.window_size[0] >= 0
                                              and self.window_size[1] == 0),
                 f"--window-size takes LEFT 0 (a causal model sees no keys to its right), got {self.window_size}.")
        _require(self.rotary_base_local is None or (self.window_size is not None and self.rotary),
                 "--rotary-base-local is the RoPE base of the sliding-window layers: it needs --window-size and "
                 "--position-embedding-type rope (or yarn).")
        skip_freq = self.window_attn_skip_freq
        _require(skip_freq is None or (self.window_size is not None and skip_freq > 0),
                 f"--window-attn-skip-freq ({self.window_attn_skip_freq}) makes every Nth layer global among "
                 f"sliding-window ones: it needs --window-size and a positive N.")
        _require(not self.qk_layernorm_whole_projection or (
            self.qk_layernorm and self.normalization == "RMSNorm" and not self.apply_layernorm_1p),
                 "--qk-layernorm-whole-projection widens --qk-layernorm's RMSNorm to all heads at once (OLMoE): it "
                 "takes --qk-layernorm and --normalization RMSNorm, without --apply-layernorm-1p.")
        _require(not self.geglu or self.swiglu, "--geglu changes the gate of --swiglu's gated MLP: add --swiglu.")
        for flag, value in [("--attn-logit-softcapping", self.attn_logit_softcapping),
                            ("--final-logit-softcapping", self.final_logit_softcapping),
                            ("--softmax-scale", self.softmax_scale), ("--rotary-base-local", self.rotary_base_local)]:
            _require(value is None or value > 0, f"{flag} must be positive, got {value}.")
        self._check_rope_scaling()
        self.moe_layer_freq = str(self.moe_layer_freq)  # Megatron-LM's int or list, given in code
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size  # as Megatron-LM
        check_moe_fields(self)

    def _check_rope_scaling(self) -> None:
        scalings = [self.rotary_seq_len_interpolation_factor is not None, self.use_rope_scaling, self.yarn]
        _require(self.rotary or not any(scalings),
                 "--rotary-seq-len-interpolation-factor and --use-rope-scaling scale rotary embeddings: they need "
                 "--position-embedding-type rope.")
        _require(sum(scalings) <= 1, "give one RoPE scaling: --rotary-seq-len-interpolation-factor (linear), "
                                     "--use-rope-scaling (Llama 3.x) or YaRN (--position-embedding-type yarn), not "
                                     "two of them.")
        for flag, factor in [("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor),
                             ("--rope-scaling-factor", self.rope_scaling_factor),
                             ("--rotary-scaling-factor", self.rotary_scaling_factor)]:
            _require(factor is None or factor >= 1.0, f"{flag} must be >= 1 (it stretches positions), got {factor}.")
        for name, default in YARN_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        yarn_flags = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                      "yarn_correction_range_round_to_int": True, **YARN_DEFAULTS}
        given = [flag_name(name) for name, default in yarn_flags.items() if getattr(self, name) != default]
        _require(self.yarn or not given,
                 f"{', '.join(given)} configure YaRN: add --position-embedding-type yarn (with multi-latent "
                 f"attention, --rope-type yarn, its default).")
        _require(self.yarn_original_max_position_embeddings > 0,
                 f"--yarn-original-max-position-embeddings must be positive, got "
                 f"{self.yarn_original_max_position_embeddings}.")

    def _check_multi_latent_attention(self) -> None:
        if self.rope_type is None:
            self.rope_type = "yarn" if self.multi_latent_attention else "rope"
        if not self.multi_latent_attention:
            _require(self.rope_type == "rope", "--rope-type picks multi-latent attention's rotary embedding; other "
                                               "attention takes YaRN from --position-embedding-type yarn.")
            return
        for flag, value in [("--kv-lora-rank", self.kv_lora_rank), ("--qk-head-dim", self.qk_head_dim),
                            ("--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim), ("--v-head-dim", self.v_head_dim),
                            ("--q-lora-rank", 1 if self.q_lora_rank is None else self.q_lora_rank)]:
            _require(value > 0, f"{flag} must be positive, got {value}.")
        _require(self.position_embedding_type == "rope",
                 f"--multi-latent-attention rotates --qk-pos-emb-head-dim channels of each head: it needs "
                 f"--position-embedding-type rope (--rope-type picks rope or yarn), got "
                 f"{self.position_embedding_type}.")
        _require(self.num_query_groups == self.num_attention_heads,
                 "--multi-latent-attention gives every head its own keys and values from the shared latent: drop "
                 "--group-query-attention and --num-query-groups.")
        _require(self.rotary_percent == 1.0 and not self.add_qkv_bias,
                 "--multi-latent-attention has no --rotary-percent (it rotates --qk-pos-emb-head-dim channels) and "
                 "no fused QKV for --add-qkv-bias: drop them.")

    @property
    def head_dim(self) -> int:
        """Megatron's kv_channels: query/key/value projections are heads x head_dim wide, not always hidden."""
        return self.kv_channels

    @property
    def rotary(self) -> bool:
        """Whether positions enter as rotary embeddings (plain or YaRN-scaled)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def yarn(self) -> bool:
        """Whether the rotary embeddings are YaRN's: --position-embedding-type yarn, or MLA's --rope-type yarn."""
        return self.position_embedding_type == "yarn" or (self.multi_latent_attention and self.rope_type == "yarn")

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotary embeddings rotate (the first ones; the rest pass through), or
        multi-latent attention's rotary part of each head."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (global, 0-based) has a mixture of experts for its MLP."""
        return moe_layer_pattern(self.num_experts, self.moe_layer_freq, self.num_layers)[layer_number]

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron pads the vocabulary so every tensor-parallel shard is a multiple of 128."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple


# --cp-comm-type values: keys and values all-gathered, or passed around a ring (Megatron-LM's p2p). Megatron-LM
# spells the first "allgather"; both spellings are taken.
CP_COMM_TYPES = ("p2p", "all_gather", "allgather")

# Megatron-LM's names for ZeRO stages 0 to 3: nothing, optimizer state, + gradients, + parameters sharded.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is cut: tensor x context x data x pipeline (tensor-parallel ranks adjacent)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1  # every sequence split over this many ranks (megatron_lite/context_parallel/)
    # How context-parallel attention exchanges keys and values: one value for every layer, or one per layer.
    cp_comm_type: list = field(default_factory=lambda: ["p2p"], metadata={"choices": CP_COMM_TYPES})
    # Mixture-of-experts layers: experts split over expert-model-parallel ranks, each expert's weights over
    # expert-tensor-parallel ranks (None: the tensor-parallel size, as Megatron-LM).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False  # the same as data_parallel_sharding_strategy "optim"
    # What data-parallel ranks shard (ZeRO stages 0-3); None = "optim" with --use-distributed-optimizer,
    # else "no_shard". See megatron_lite/distributed/distributed_data_parallel.py.
    data_parallel_sharding_strategy: Optional[str] = field(default=None, metadata={"choices": SHARDING_STRATEGIES})
    grad_cpu_offload: bool = False  # ZeRO-2/3: the fp32 gradient shards live in host memory
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None  # elements; None = Megatron's default (max(40M, 1M * dp))
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False  # with --bf16: bf16 gradient buffers and reductions (main grads stay fp32)
    distributed_backend: Optional[str] = field(default=None, metadata={"choices": ("nccl", "gloo")})  # None: by device
    distributed_timeout_minutes: int = 10  # every process group's collective timeout

    def __post_init__(self) -> None:
        _check_choices(self)
        strategy = self.data_parallel_sharding_strategy
        _require(not (strategy == "no_shard" and self.use_distributed_optimizer),
                 "--use-distributed-optimizer shards the optimizer state, but --data-parallel-sharding-strategy is "
                 "no_shard: drop one of them (--use-distributed-optimizer is the same as the strategy optim).")
        if strategy is None:
            self.data_parallel_sharding_strategy = "optim" if self.use_distributed_optimizer else "no_shard"
        # Every strategy but no_shard shards the optimizer state: it is the distributed optimizer.
        self.use_distributed_optimizer = self.data_parallel_sharding_strategy != "no_shard"
        _require(not self.grad_cpu_offload or self.shards_gradients,
                 "--grad-cpu-offload keeps gradient shards in host memory, which needs sharded gradients: add "
                 "--data-parallel-sharding-strategy optim_grads (or optim_grads_params).")
        _require(self.tensor_model_parallel_size >= 1,
                 f"--tensor-model-parallel-size must be >= 1, got {self.tensor_model_parallel_size}.")
        _require(self.pipeline_model_parallel_size >= 1,
                 f"--pipeline-model-parallel-size must be >= 1, got {self.pipeline_model_parallel_size}.")
        _require(self.context_parallel_size >= 1,
                 f"--context-parallel-size must be >= 1, got {self.context_parallel_size}.")
        self.cp_comm_type = ["all_gather" if kind == "allgather" else kind for kind in self.cp_comm_type]
        _require(self.expert_model_parallel_size >= 1,
                 f"--expert-model-parallel-size must be >= 1, got {self.expert_model_parallel_size}.")
        _require(self.expert_tensor_parallel_size is None or self.expert_tensor_parallel_size >= 1,
                 f"--expert-tensor-parallel-size must be >= 1, got {self.expert_tensor_parallel_size}.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # As Megatron-LM: with one tensor-parallel rank there is no sequence to split.
            warnings.warn("--sequence-parallel has no effect at --tensor-model-parallel-size 1; turning it off.")
            self.sequence_parallel = False
        _require(not self.overlap_param_gather or self.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer (only sharded parameters are gathered).")
        vpp = self.virtual_pipeline_model_parallel_size
        _require(vpp is None or vpp >= 1, f"--virtual-pipeline-model-parallel-size must be >= 1, got {vpp}.")
        _require(vpp is None or vpp == 1 or self.pipeline_model_parallel_size > 1,
                 "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1.")
        _require(not (self.grad_reduce_in_bf16 and self.accumulate_allreduce_grads_in_fp32),
                 "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other; pick one.")
        _require(self.distributed_timeout_minutes > 0,
                 f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}.")

    @property
    def shards_gradients(self) -> bool:
        """ZeRO-2 and 3: each rank keeps only its shard of the averaged gradients."""
        return self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3: each rank keeps only its shard of the parameters between uses."""
        return self.data_parallel_sharding_strategy == "optim_grads_params"

    def check_interleaved_microbatches(self, num_microbatches: int) -> None:
        """With virtual pipeline stages, Megatron's interleaved schedule walks micro-batches in groups of p."""
        pp = self.pipeline_model_parallel_size
        _require((self.virtual_pipeline_model_parallel_size or 1) == 1 or num_microbatches % pp == 0,
                 f"the interleaved pipeline schedule needs the number of micro-batches (--global-batch-size / "
                 f"(--micro-batch-size x data-parallel size) = {num_microbatches}) to be a multiple of "
                 f"--pipeline-model-parallel-size ({pp}); change --global-batch-size or --micro-batch-size, or drop "
                 f"--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage.")

    @property
    def expert_tensor_size(self) -> int:
        """The expert-tensor-parallel size: --expert-tensor-parallel-size, else the tensor-parallel size."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = (self.tensor_model_parallel_size * self.context_parallel_size
                          * self.pipeline_model_parallel_size)
        context = (f" x --context-parallel-size ({self.context_parallel_size})"
                   if self.context_parallel_size > 1 else "")
        _require(world_size % model_parallel == 0,
                 f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                 f"({self.tensor_model_parallel_size}){context} x --pipeline-model-parallel-size "
                 f"({self.pipeline_model_parallel_size}) = {model_parallel}; launch a multiple of "
                 f"{model_parallel} processes or change the parallel sizes.")
        stage, experts = world_size // self.pipeline_model_parallel_size, (
            self.expert_tensor_size * self.expert_model_parallel_size)
        _require(stage % experts == 0,
                 f"the {stage} processes of each pipeline stage do not split into --expert-tensor-parallel-size "
                 f"({self.expert_tensor_size}) x --expert-model-parallel-size ({self.expert_model_parallel_size}) "
                 f"= {experts} expert shards; launch a multiple of {experts * self.pipeline_model_parallel_size} "
                 f"processes or change the expert sizes.")
        return world_size // model_parallel


@dataclass(kw_only=True)
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # default micro batch x data-parallel size
    # The run's length: iterations, or samples (Megatron's two ways); neither means 100 iterations.
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    # START INCREMENT SAMPLES: the global batch grows from START by INCREMENT, reaching
    # --global-batch-size after SAMPLES samples (Megatron's batch-size ramp-up).
    rampup_batch_size: Optional[list[int]] = field(
        default=None, metadata={"nargs": 3, "metavar": ("START", "INCREMENT", "SAMPLES")})
    # "THRESHOLD:BATCH ...": the global batch from THRESHOLD tokens consumed on (Megatron-Core 0.20's
    # replacement of the ramp-up; format in batch_size_schedule.py). Its last batch is the global batch.
    step_batch_size_schedule: Optional[str] = None
    calculate_per_token_loss: bool = False  # loss = sum over the global batch's tokens / their count
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    recompute_granularity: Optional[str] = field(default=None, metadata={"choices": ("full", "selective")})
    recompute_method: Optional[str] = field(default=None, metadata={"choices": ("uniform", "block")})
    recompute_num_layers: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_signal_handler: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    manual_gc: bool = False  # no automatic garbage collection: collect at the same iterations on every rank
    manual_gc_interval: int = 0  # with --manual-gc: collect every N iterations (0: only around evaluation)
    manual_gc_eval: bool = True
    # torch.cuda.empty_cache(): 1 after forward-backward, 2 also after the step.
    empty_unused_memory_level: int = field(default=0, metadata={"choices": (0, 1, 2)})
    check_for_nan_in_loss_and_grad: bool = True  # a non-finite loss or grad norm stops the run (training/nan_check.py)

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.train_iters is None and self.train_samples is None:
            self.train_iters = 100
        _require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}.")
        _require(self.global_batch_size is None or self.global_batch_size >= 1,
                 f"--global-batch-size must be >= 1, got {self.global_batch_size}.")
        _require(self.train_iters is None or self.train_samples is None,
                 "--train-iters and --train-samples are mutually exclusive: give the run's length in "
                 "iterations or in samples.")
        _require(self.train_iters is None or self.train_iters >= 0,
                 f"--train-iters must be >= 0, got {self.train_iters}.")
        _require(self.train_samples is None or self.train_samples > 0,
                 f"--train-samples must be positive, got {self.train_samples}.")
        _require(self.rampup_batch_size is None or len(self.rampup_batch_size) == 3,
                 f"--rampup-batch-size takes three numbers (START INCREMENT SAMPLES), got {self.rampup_batch_size}.")
        self._check_step_batch_size_schedule()
        _require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive; pick one.")
        _require(self.recompute_granularity == "full" or self.recompute_method is None,
                 "--recompute-method only applies with --recompute-granularity full.")
        _require(self.eval_interval >= 1, f"--eval-interval must be >= 1, got {self.eval_interval}.")
        interval = self.check_weight_hash_across_dp_replicas_interval
        _require(interval is None or interval >= 1,
                 f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got {interval}.")
        _require(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
                 f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}.")
        _require(self.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}.")

    def _check_step_batch_size_schedule(self) -> None:
        """The schedule's last batch is the global batch: --global-batch-size may repeat it (Megatron-LM's
        own 175B script does, which Megatron-LM itself rejects), never contradict it."""
        if self.step_batch_size_schedule is None:
            return
        _require(self.rampup_batch_size is None,
                 "--step-batch-size-schedule and --rampup-batch-size both set the batch as the run goes; give "
                 "only one (Megatron-Core 0.20 replaced the ramp-up by the schedule).")
        last_batch = parse_step_batch_size_schedule(self.step_batch_size_schedule)[-1][1]
        _require(self.global_batch_size in (None, last_batch),
                 f"--global-batch-size {self.global_batch_size} contradicts --step-batch-size-schedule, whose "
                 f"last batch ({last_batch}) is the global batch; drop --global-batch-size or make it {last_batch}.")
        self.global_batch_size = last_batch

    def step_schedule_in_samples(self, seq_length: int) -> list[tuple[int, int]] | None:
        """--step-batch-size-schedule as (threshold in samples, global batch) pairs; None without one."""
        if self.step_batch_size_schedule is None:
            return None
        return schedule_in_samples(parse_step_batch_size_schedule(self.step_batch_size_schedule), seq_length)

    def global_batch(self, data_parallel_size: int) -> int:
        """Sequences per iteration (after any ramp-up); without --global-batch-size, one micro-batch per replica."""
        return self.global_batch_size or self.micro_batch_size * data_parallel_size

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Gradient-accumulation steps: global batch = micro batch x steps x data-parallel size."""
        global_batch = self.global_batch(data_parallel_size)
        per_step = self.micro_batch_size * data_parallel_size
        source = ("the last batch of --step-batch-size-schedule" if self.step_batch_size_schedule
                  else "--global-batch-size")
        _require(global_batch % per_step == 0,
                 f"{source} ({global_batch}) must be divisible by --micro-batch-size "
                 f"({self.micro_batch_size}) x data-parallel size ({data_parallel_size}) = {per_step}.")
        return global_batch // per_step


# --lr-decay-style and --lr-wsd-decay-style values (Megatron-LM's); the formulas are in optimizer_param_scheduler.py.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
# --lr-warmup-style values: Megatron-LM's linear warmup, and DeepSpeed's log warmup (its WarmupLR default).
LR_WARMUP_STYLES = ("linear", "log")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(kw_only=True)
class OptimizerConfig:
    optimizer: str = field(default="adam", metadata={"choices": ("adam", "sgd")})
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = field(default="linear", metadata={"choices": LR_DECAY_STYLES})
    # Warmup and decay in iterations (with --train-iters) or in samples (with --train-samples);
    # --lr-warmup-fraction gives the warmup as a fraction of the decay instead.
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # default train_iters
    lr_warmup_samples: int = 0
    lr_decay_samples: Optional[int] = None  # default train_samples
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_init: float = 0.0  # warmup rises from this to --lr
    lr_warmup_style: str = field(default="linear", metadata={"choices": LR_WARMUP_STYLES})  # ours, not Megatron's
    # --lr-decay-style WSD: stable at --lr, then anneals over the last iterations (or samples) of the decay.
    lr_wsd_decay_style: str = field(default="exponential", metadata={"choices": WSD_DECAY_STYLES})
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    decoupled_lr: Optional[float] = None  # the word embedding and output layer's own peak learning rate
    decoupled_min_lr: Optional[float] = None  # ... and final one (default --min-lr)
    weight_decay: float = 0.01
    start_weight_decay: Optional[float] = None  # with end_weight_decay: a weight-decay schedule
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = field(default="constant", metadata={"choices": WEIGHT_DECAY_INCR_STYLES})
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    loss_scale: Optional[float] = None  # static loss scale for fp16; None = dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    optimizer_cpu_offload: bool = False
    override_opt_param_scheduler: bool = False  # on resume, this run's LR schedule replaces the checkpoint's
    use_checkpoint_opt_param_scheduler: bool = False  # on resume, the checkpoint's LR schedule replaces this run's

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(0 <= self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must be between 0 and --lr ({self.lr}).")
        _require(0 <= self.lr_warmup_init <= self.lr,
                 f"--lr-warmup-init ({self.lr_warmup_init}) must be between 0 and --lr ({self.lr}).")
        _require(self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}.")
        _require(self.lr_warmup_samples >= 0, f"--lr-warmup-samples must be >= 0, got {self.lr_warmup_samples}.")
        _require(self.lr_warmup_fraction is None or 0.0 <= self.lr_warmup_fraction < 1.0,
                 f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}.")
        _require(self.decoupled_min_lr is None or self.decoupled_lr is not None,
                 "--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak learning rate).")
        decoupled_min_lr = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        _require(self.decoupled_lr is None or 0 <= decoupled_min_lr <= self.decoupled_lr,
                 f"--decoupled-min-lr ({decoupled_min_lr}, default --min-lr) must be between 0 and "
                 f"--decoupled-lr ({self.decoupled_lr}).")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}.")
        for flag, beta in [("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)]:
            _require(0.0 <= beta < 1.0, f"{flag} must be in [0, 1), got {beta}.")
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}.")
        _require(self.loss_scale is None or self.loss_scale > 0,
                 f"--loss-scale must be positive, got {self.loss_scale}.")
        _require(self.hysteresis >= 1, f"--hysteresis must be >= 1, got {self.hysteresis}.")


# --sft-tokenizer-prompt-format: how a conversation becomes text (megatron_lite/data/sft/prompt_format.py).
SFT_PROMPT_FORMATS = ("plain", "chatml", "default")
# --sft-format: the records' shape, and the names --sft-data-keys NAME=COLUMN may read a column under
# (megatron_lite/data/sft/formats.py).
SFT_FORMATS = ("auto", "prompt_response", "messages", "alpaca", "sharegpt")
SFT_DATA_KEY_NAMES = ("prompt", "response", "messages", "instruction", "input", "output", "system", "history",
                      "conversations")
# --tokenizer-type values (megatron_lite/tokenizer/ builds each).
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "TikTokenizer",
                   "NullTokenizer")


@dataclass(kw_only=True)
class DataConfig:
    data_path: list = field(default_factory=list)  # [path] or [w1, path1, w2, path2, ...]
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: Optional[str] = field(default=None, metadata={"choices": TOKENIZER_TYPES})
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    # v1 or v2 pre-tokenisation; only TikTokenizer reads it.
    tiktoken_pattern: Optional[str] = field(default=None, metadata={"choices": ("v1", "v2")})
    tiktoken_num_special_tokens: int = 1000
    data_cache_path: Optional[str] = None
    mmap_bin_files: bool = True  # --no-mmap-bin-files reads .bin with file reads (for filesystems mmap is slow on)
    eod_mask_loss: bool = False
    num_workers: int = 0  # data-loader worker processes per rank (Megatron's default is 2)
    # Supervised fine-tuning: prompt/response or chat JSONL files (or preprocessed prefixes), one list per split.
    sft: bool = False
    train_data_path: list = field(default_factory=list)
    valid_data_path: list = field(default_factory=list)
    test_data_path: list = field(default_factory=list)
    sft_tokenizer_prompt_format: str = field(default="plain", metadata={"choices": SFT_PROMPT_FORMATS})
    sft_pack_sequences: bool = False
    sft_format: str = field(default="auto", metadata={"choices": SFT_FORMATS})  # per record, from its keys
    sft_data_keys: list = field(default_factory=list)  # NAME=COLUMN: read COLUMN as NAME (see SFT_DATA_KEY_NAMES)

    def __post_init__(self) -> None:
        _check_choices(self)
        # Megatron reads only the numbers in --split, so a launcher's literal quotes ('99,1,0', as
        # Megatron-LM's Llama 3 example passes them) are harmless there; strip them here too.
        self.split = self.split.strip("'\"")
        if self.sft:
            self._check_sft()
        else:
            _require(not (self.train_data_path or self.valid_data_path or self.test_data_path),
                     "--train-data-path/--valid-data-path/--test-data-path name fine-tuning data: add --sft "
                     "(pretraining reads --data-path with --split).")
            _require(not self.sft_pack_sequences, "--sft-pack-sequences needs --sft.")
            _require(self.sft_format == "auto" and not self.sft_data_keys,
                     "--sft-format and --sft-data-keys say how to read fine-tuning data: add --sft.")
            _require(self.mock_data or bool(self.data_path),
                     "no training data: give --data-path PREFIX (from tools/preprocess_data.py) or --mock-data.")
        _require(not (self.mock_data and self.data_path),
                 "--mock-data and --data-path both given: drop --mock-data to train on the data, or --data-path.")
        _require(self.tokenizer_type is not None or not (self.vocab_file or self.merge_file or self.tokenizer_model),
                 "--vocab-file/--merge-file/--tokenizer-model need --tokenizer-type to say how to read them "
                 "(GPT2BPETokenizer for GPT-2's vocab.json and merges.txt).")
        _require(not self.eod_mask_loss or self.tokenizer_type is not None,
                 "--eod-mask-loss needs --tokenizer-type (and its files) to know the end-of-document token.")
        _require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}.")
        parts = self.split.replace("/", ",").split(",")
        _require(all(p.strip().replace(".", "", 1).isdigit() for p in parts) and len(parts) <= 3,
                 f"--split must be up to three comma-separated weights like 969,30,1, got {self.split!r}.")

    def _check_sft(self) -> None:
        _require(bool(self.train_data_path),
                 "--sft needs --train-data-path: JSONL of {\"prompt\", \"response\"} or {\"messages\"} lines, or a "
                 "prefix written by tools/preprocess_data.py --sft.")
        _require(not (self.data_path or self.mock_data),
                 "--sft reads --train-data-path (and --valid-data-path, --test-data-path); "
                 "drop --data-path/--mock-data.")
        _require(self.tokenizer_type is not None, "--sft needs --tokenizer-type (and its files): the data is text.")
        check_sft_data_keys(self.sft_data_keys)


def check_sft_data_keys(entries: list[str]) -> None:
    """--sft-data-keys NAME=COLUMN ...: each NAME one the record formats read; the tools with their own parser
    (evaluate, preprocess_data) check theirs here too."""
    for entry in entries:
        name, _, column = entry.partition("=")
        _require(name in SFT_DATA_KEY_NAMES and bool(column),
                 f"--sft-data-keys takes NAME=COLUMN with NAME among {', '.join(SFT_DATA_KEY_NAMES)} "
                 f"(e.g. prompt=question), got {entry!r}.")


@dataclass(kw_only=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    pretrained_checkpoint: Optional[str] = None
    use_checkpoint_args: bool = False

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(self.save_interval is None or self.save_interval >= 1,
                 f"--save-interval must be >= 1, got {self.save_interval}.")
        _require(self.save_interval is None or self.save is not None,
                 "--save-interval needs --save DIR to know where to write checkpoints.")
        _require(not self.use_checkpoint_args or bool(self.load or self.pretrained_checkpoint),
                 "--use-checkpoint-args needs --load or --pretrained-checkpoint: the checkpoint whose model to use.")
        # Saving into the base would point its latest at the fine-tune's checkpoints (a PEFT run's: adapters
        # only), so a later run from that base silently starts from them.
        _require(not (self.save and self.pretrained_checkpoint
                      and os.path.realpath(self.save) == os.path.realpath(self.pretrained_checkpoint)),
                 f"--save {self.save} is the --pretrained-checkpoint directory: the fine-tune's checkpoints would "
                 f"replace the base as its latest. Give --save (and --load, to resume) a directory of their own.")


# --peft methods, and the linear layers --lora-target-modules may name (Megatron-Core's module names; the
# multi-latent attention ones after them).
PEFT_METHODS = ("lora", "adapter", "prefix")
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj",
                       "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


@dataclass(kw_only=True)
class PeftConfig:
    """Parameter-efficient fine-tuning: train small added weights, keep the base model frozen."""

    peft: Optional[str] = field(default=None, metadata={"choices": PEFT_METHODS})  # None: train every weight
    lora_rank: int = 8
    lora_alpha: float = 8.0  # the update is scaled by alpha / rank
    lora_dropout: float = 0.0
    # linear_qkv names multi-latent attention's query and key/value projections too (Config resolves it).
    lora_target_modules: list = field(default_factory=lambda: list(LORA_TARGET_MODULES[:4]),
                                      metadata={"choices": LORA_TARGET_MODULES})
    adapter_dim: int = 32
    prefix_length: int = 16
    prefix_projection_hidden_size: Optional[int] = None  # None: learn the prefixes directly
    # The command line refuses --peft with no checkpoint to start from (adapters on random frozen weights
    # learn nothing useful) unless this says it is meant (checkpointing/preflight.py).
    peft_without_base_checkpoint: bool = False

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}.")
        _require(self.lora_alpha > 0, f"--lora-alpha must be positive, got {self.lora_alpha}.")
        _require(0.0 <= self.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1), got {self.lora_dropout}.")
        _require(len(self.lora_target_modules) == len(set(self.lora_target_modules)) > 0,
                 f"--lora-target-modules must name each module once, got {self.lora_target_modules}.")
        self.lora_target_modules = [m for m in LORA_TARGET_MODULES if m in self.lora_target_modules]  # one order
        _require(self.adapter_dim >= 1, f"--adapter-dim must be >= 1, got {self.adapter_dim}.")
        _require(self.prefix_length >= 1, f"--prefix-length must be >= 1, got {self.prefix_length}.")
        hidden = self.prefix_projection_hidden_size
        _require(hidden is None or hidden >= 1, f"--prefix-projection-hidden-size must be >= 1, got {hidden}.")


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    # Weights & Biases, as Megatron-LM: a run is logged when --wandb-project is given (save dir default: --save/wandb).
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    wandb_entity: str = ""
    peak_tflops: Optional[float] = None  # per device; None = look up the device table
    log_memory: bool = True
    log_throughput: bool = False  # TFLOP/s per GPU in the iteration line, as Megatron
    # A torch.profiler trace of iterations [start, end) into --tensorboard-dir, on --profile-ranks (all if none).
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}.")
        _require(bool(self.wandb_project) or not (self.wandb_exp_name or self.wandb_save_dir or self.wandb_entity),
                 "--wandb-exp-name/--wandb-save-dir/--wandb-entity configure a W&B run, which --wandb-project "
                 "starts: add --wandb-project NAME.")
        _require(not self.profile or self.tensorboard_dir is not None,
                 "--profile writes its trace into --tensorboard-dir: give --tensorboard-dir DIR.")
        _require(not self.profile or 0 <= self.profile_step_start < self.profile_step_end,
                 f"--profile-step-start ({self.profile_step_start}) must be >= 0 and below --profile-step-end "
                 f"({self.profile_step_end}).")


@dataclass(kw_only=True)
class Config:
    """Everything a run needs. Cross-section checks live here."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(mock_data=True))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)

    def __post_init__(self) -> None:
        model, parallel = self.model, self.parallel
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        _require(model.num_attention_heads % tp == 0,
                 f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole heads.")
        _require(model.num_query_groups % tp == 0,
                 f"--num-query-groups ({model.num_query_groups}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole key/value groups.")
        _require(model.ffn_hidden_size % tp == 0,
                 f"--ffn-hidden-size ({model.ffn_hidden_size}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}).")
        _check_expert_parallel(model, parallel)
        _require(model.num_experts is None or model.moe_router_load_balancing_type != "pooled_aux_loss"
                 or self.training.recompute_granularity != "full",
                 "--moe-router-load-balancing-type pooled_aux_loss pools each micro-batch's routing over all layers, "
                 "which a layer recomputed in backward (--recompute-granularity full) would not see again: use "
                 "--recompute-granularity selective, or aux_loss.")
        _check_expert_lora(model, parallel, self.peft)
        _require(not parallel.sequence_parallel or model.seq_length % tp == 0,
                 f"--sequence-parallel splits the sequence: --seq-length ({model.seq_length}) must be "
                 f"divisible by --tensor-model-parallel-size ({tp}).")
        _check_context_parallel(model, parallel)
        if parallel.num_layers_per_virtual_pipeline_stage is not None:
            per_stage = model.num_layers // pp
            _require(per_stage % parallel.num_layers_per_virtual_pipeline_stage == 0,
                     f"--num-layers-per-virtual-pipeline-stage ({parallel.num_layers_per_virtual_pipeline_stage}) "
                     f"must divide the layers per pipeline stage ({model.num_layers} / {pp} = {per_stage}).")
            parallel.virtual_pipeline_model_parallel_size = (
                per_stage // parallel.num_layers_per_virtual_pipeline_stage)
        _require(not parallel.grad_cpu_offload or self.optimizer.optimizer_cpu_offload,
                 "--grad-cpu-offload hands host-memory gradient shards to the optimizer, which then must step on "
                 "the host too: add --optimizer-cpu-offload.")
        _require(not parallel.shards_parameters or self.training.check_weight_hash_across_dp_replicas_interval is None,
                 "--check-weight-hash-across-dp-replicas-interval compares the data-parallel replicas' weights, but "
                 "--data-parallel-sharding-strategy optim_grads_params keeps no replicas (each rank holds a "
                 "different shard): drop the flag or pick a strategy that keeps whole parameters.")
        _check_peft_on_model(self.peft, model)
        _check_schedule_units(self.training, self.optimizer)
        self.training.step_schedule_in_samples(model.seq_length)  # thresholds closer than a sequence fail here
        if self.training.train_iters is not None and self.optimizer.lr_decay_iters is None:
            self.optimizer.lr_decay_iters = self.training.train_iters
        if self.training.train_samples is not None and self.optimizer.lr_decay_samples is None:
            self.optimizer.lr_decay_samples = self.training.train_samples
        _check_warmup_before_decay(self.optimizer)

    @property
    def params_dtype(self):
        import torch
        if self.training.bf16:
            return torch.bfloat16
        if self.training.fp16:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{name: section(**d[name]) for name, section in SECTIONS.items() if name in d})


def lora_targets_of(model: ModelConfig) -> tuple[str, ...]:
    """The linear layers of ``model`` that --lora-target-modules may name."""
    if not model.multi_latent_attention:
        return LORA_TARGET_MODULES[:4]
    return (*_latent_projections(model), "linear_proj", "linear_fc1", "linear_fc2")


def _latent_projections(model: ModelConfig) -> tuple[str, ...]:
    """Multi-latent attention's query and key/value projections: what ``linear_qkv`` means there."""
    query = ("linear_q_down_proj", "linear_q_up_proj") if model.q_lora_rank is not None else ("linear_q_proj",)
    return (*query, "linear_kv_down_proj", "linear_kv_up_proj")


def _check_peft_on_model(peft: PeftConfig, model: ModelConfig) -> None:
    """Multi-latent attention has no prefix slot, and ``linear_qkv`` there means its query and key/value
    projections; a target the model lacks is an error naming those it has."""
    _require(not (peft.peft == "prefix" and model.multi_latent_attention),
             "--peft prefix prepends keys and values to each head's, which --multi-latent-attention expands from a "
             "latent: fine-tune it with --peft lora or adapter.")
    if peft.peft != "lora":
        return
    targets = set(peft.lora_target_modules)
    if model.multi_latent_attention and "linear_qkv" in targets:
        targets = (targets - {"linear_qkv"}) | set(_latent_projections(model))
    missing = sorted(targets - set(lora_targets_of(model)))
    _require(not missing, f"--lora-target-modules {' '.join(missing)}: this model's linear layers are "
                          f"{' '.join(lora_targets_of(model))}.")
    peft.lora_target_modules = [m for m in LORA_TARGET_MODULES if m in targets]


def _check_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The sequence splits into 2 x cp chunks (rank i holds chunks i and 2cp - 1 - i, which balances causal
    attention), each rank's share again over tensor-parallel ranks under sequence parallelism."""
    cp, tp = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    _require(len(parallel.cp_comm_type) in (1, model.num_layers),
             f"--cp-comm-type takes one value for every layer or one per layer ({model.num_layers}), got "
             f"{len(parallel.cp_comm_type)}.")
    if cp == 1:
        return
    _require(model.seq_length % (2 * cp) == 0,
             f"--context-parallel-size {cp} splits each sequence into 2 x {cp} = {2 * cp} equal chunks (rank i holds "
             f"chunks i and {2 * cp - 1} - i, which balances causal attention): --seq-length ({model.seq_length}) must "
             f"be divisible by {2 * cp}.")
    _require(not parallel.sequence_parallel or (model.seq_length // cp) % tp == 0,
             f"--sequence-parallel splits each context-parallel rank's {model.seq_length // cp} positions over "
             f"--tensor-model-parallel-size ({tp}) ranks: make --seq-length divisible by {cp} x {tp}.")
    _require("p2p" not in parallel.cp_comm_type or model.attention_dropout == 0,
             f"--cp-comm-type p2p computes attention block by block without keeping the probabilities, so it has no "
             f"attention dropout: give --attention-dropout 0 (--attention-dropout {model.attention_dropout} now; "
             f"Megatron-LM's default is 0.1), or --cp-comm-type all_gather.")


def _check_expert_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_size
    if model.num_experts is None:
        _require(ep == 1, "--expert-model-parallel-size splits the experts of mixture-of-experts layers: add "
                          "--num-experts N, or drop it.")
        return
    _require(model.num_experts % ep == 0,
             f"--num-experts ({model.num_experts}) must be divisible by --expert-model-parallel-size ({ep}): each "
             f"expert-parallel rank holds the same number of experts.")
    _require(model.moe_ffn_hidden_size % etp == 0,
             f"--moe-ffn-hidden-size ({model.moe_ffn_hidden_size}) must be divisible by the expert-tensor-parallel "
             f"size ({etp}, --expert-tensor-parallel-size, default --tensor-model-parallel-size).")
    shared = model.moe_shared_expert_intermediate_size
    _require(shared is None or shared % parallel.tensor_model_parallel_size == 0,
             f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by --tensor-model-parallel-size "
             f"({parallel.tensor_model_parallel_size}): the shared expert is split as a dense MLP.")


def _check_expert_lora(model: ModelConfig, parallel: ParallelConfig, peft: PeftConfig) -> None:
    """LoRA on experts' linear_fc1 / linear_fc2 (each expert its own adapters) runs with the loop over experts and
    experts whole or split like the dense layers (their adapters' whole factors are summed over tensor ranks)."""
    mlp_targets = sorted({"linear_fc1", "linear_fc2"} & set(peft.lora_target_modules))
    if model.num_experts is None or peft.peft != "lora" or not mlp_targets:
        return
    _require(not model.moe_grouped_gemm,
             f"--peft lora on experts ({' '.join(mlp_targets)}) adapts each expert's linears, which "
             f"--moe-grouped-gemm bypasses: drop --moe-grouped-gemm, or target linear_qkv linear_proj only.")
    etp, tp = parallel.expert_tensor_size, parallel.tensor_model_parallel_size
    _require(etp in (1, tp), f"--peft lora on experts needs --expert-tensor-parallel-size 1 or the tensor-parallel "
                             f"size ({tp}), got {etp}.")


def _check_schedule_units(training: TrainingConfig, optimizer: OptimizerConfig) -> None:
    """Megatron's rule: a run counts in iterations or in samples, and its LR schedule in the same unit."""
    if training.train_iters is not None:
        unit, other = "iters", "samples"
        given = {"--lr-decay-samples": optimizer.lr_decay_samples is not None,
                 "--lr-warmup-samples": optimizer.lr_warmup_samples > 0,
                 "--lr-wsd-decay-samples": optimizer.lr_wsd_decay_samples is not None}
    else:
        unit, other = "samples", "iters"
        given = {"--lr-decay-iters": optimizer.lr_decay_iters is not None,
                 "--lr-warmup-iters": optimizer.lr_warmup_iters > 0,
                 "--lr-wsd-decay-iters": optimizer.lr_wsd_decay_iters is not None}
    for flag, present in given.items():
        _require(not present, f"{flag} counts {other}, but the run is given in {unit} (--train-{unit}): use "
                              f"{flag.replace(other, unit)} instead, or --train-{other}.")
    warmup_flag = f"--lr-warmup-{unit}"
    warmup = optimizer.lr_warmup_iters if unit == "iters" else optimizer.lr_warmup_samples
    _require(optimizer.lr_warmup_fraction is None or warmup == 0,
             f"--lr-warmup-fraction and {warmup_flag} both set the warmup; give only one.")
    wsd_decay = optimizer.lr_wsd_decay_iters if unit == "iters" else optimizer.lr_wsd_decay_samples
    _require(optimizer.lr_decay_style != "WSD" or (wsd_decay is not None and wsd_decay > 0),
             f"--lr-decay-style WSD anneals over the last --lr-wsd-decay-{unit} of the decay: give a positive "
             f"--lr-wsd-decay-{unit}.")


def _check_warmup_before_decay(optimizer: OptimizerConfig) -> None:
    in_samples = optimizer.lr_decay_samples is not None
    decay = optimizer.lr_decay_samples if in_samples else optimizer.lr_decay_iters
    warmup = optimizer.lr_warmup_samples if in_samples else optimizer.lr_warmup_iters
    unit = "samples" if in_samples else "iters"
    _require(warmup < decay or (warmup == 0 and decay == 0),
             f"--lr-warmup-{unit} ({warmup}) must be smaller than --lr-decay-{unit} ({decay}, default "
             f"--train-{unit}): lower the warmup or lengthen the decay.")


# Config's sections by field name (``cli/arguments.py`` makes one flag group of each).
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
            "optimizer": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
            "logging": LoggingConfig, "peft": PeftConfig}


def section_values(values: dict, section) -> dict:
    """The entries of a flat field-name -> value dict that belong to the dataclass ``section``."""
    names = {f.name for f in dataclasses.fields(section)}
    return {k: v for k, v in values.items() if k in names}


def missing_model_flags(values: dict) -> list[str]:
    """The flags of the ModelConfig fields without a default that ``values`` (by field name) lacks."""
    return [flag_name(f.name) for f in dataclasses.fields(ModelConfig)
            if f.default is dataclasses.MISSING and f.name not in values]

