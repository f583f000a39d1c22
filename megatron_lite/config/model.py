"""ModelConfig: the architecture's fields (--num-layers, --hidden-size, attention, RoPE, experts ...) and
their checks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.fields import check_choices, flag_name, require
from megatron_lite.config.moe import (GROUP_SCORES, LOAD_BALANCING_TYPES, ROUTER_SCORE_FUNCTIONS, TOKEN_DROP_POLICIES,
                                      check_moe_fields, moe_layer_pattern, parse_moe_layer_freq)

# Megatron's --attention-backend values. flash and fused name Transformer Engine kernels; here they,
# and auto, run torch's scaled_dot_product_attention (which picks a flash or memory-efficient kernel
# itself). unfused and local run the explicit QK^T -> masked softmax -> V path.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# yarn: rotary embeddings with YaRN's frequency scaling (model/rope_scaling.py), Megatron-LM's spelling for
# attention other than multi-latent, which picks its flavour of rotary embedding with --rope-type.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")
# Megatron-LM's --softmax-type: vanilla, or a sink logit per head in the softmax's denominator that no value
# follows, fixed at 0 (off-by-one) or learned (learnable, gpt-oss's sinks; model/attention_sinks.py).
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
ROPE_TYPES = ("rope", "yarn")
# Megatron-LM's --experimental-attention-variant values we have: gdn, the gated DeltaNet (its older spelling
# gated_delta_net is the same).
ATTENTION_VARIANTS = ("gdn",)
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
    # Megatron-LM's NoPE layers: N (every Nth layer, counting from 1, has no rotary embedding) or a 0/1 list
    # expression, 1 for a layer without (SmolLM3's no_rope_layers, inverted).
    no_rope_freq: Optional[str] = None
    # Llama 4's attention (model/chunked_attention.py): the layers with rotary embeddings attend within chunks of
    # this many positions (a query sees the keys of its own chunk, counted from the sequence's first position);
    # the NoPE layers attend to the whole sequence.
    attention_chunk_size: Optional[int] = None
    # Megatron-LM's --qk-l2-norm: each head's queries and keys divided by their root mean square, no weight (Llama
    # 4's use_qk_norm), on every layer but the NoPE ones (which Megatron-LM normalises too; Llama 4 does not).
    qk_l2_norm: bool = False
    # Llama 4's temperature tuning of the NoPE layers' attention: each query times
    # 1 + scale * ln(1 + floor((position + 1) / floor_scale)), which sharpens the softmax far into a long context.
    attn_temperature_tuning: bool = False
    attn_temperature_floor_scale: int = 8192
    attn_temperature_scale: float = 0.1
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
    # With --post-sublayer-norm, no norm before the sublayers: x + Norm(Attn(x)) (OLMo 2's reordered norms).
    no_pre_sublayer_norm: bool = False
    # Attention and MLP both read the layer's input, x + Attn(Norm(x)) + MLP(Norm(x)) (GPT-NeoX's
    # use_parallel_residual, GPT-J; Transformer Engine's TransformerLayer name).
    parallel_attention_mlp: bool = False
    scale_embeddings: bool = False  # word embeddings times sqrt(hidden_size) (Gemma)
    geglu: bool = False  # --swiglu's gate through tanh GELU instead of SiLU (GeGLU, Gemma)
    # gpt-oss's attention and MLP, Megatron-LM's flags: the softmax's sinks (--softmax-type), and the gated MLP's
    # gate through quick GELU x sigmoid(1.702 x) (--quick-geglu), its linear half offset (--glu-linear-offset: gate
    # x (up + offset)), both halves clamped first (--activation-func-clamp-value c: gate to at most c, up to
    # [-c, c]).
    softmax_type: str = field(default="vanilla", metadata={"choices": SOFTMAX_TYPES})
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    # The exact (erf) GELU instead of its tanh approximation: Megatron-LM's MLP without --bias-gelu-fusion
    # (Megatron-Core's F.gelu), GPT-2 configs with activation_function "gelu".
    gelu_exact: bool = False
    rotary_seq_len_interpolation_factor: Optional[float] = None  # linear RoPE scaling: positions / factor
    use_rope_scaling: bool = False  # Llama 3.x's RoPE frequency scaling, by rope_scaling_factor
    rope_scaling_factor: float = 8.0
    # Its low and high frequency factors (Megatron-LM fixes them at 1 and 4, Llama 3.1's; Llama 4 Scout's are 1, 1).
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
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
    # The padding token (an imported model's config.json pad_token_id) and whether its input-embedding row is
    # trained: by default every row is, as in Megatron-LM; frozen, as transformers' nn.Embedding(padding_idx=...).
    pad_token_id: Optional[int] = None
    freeze_padding_embedding: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    use_fused_kernels: bool = True
    # The Hugging Face family the model was imported as (checkpoint_convert's hf import sets it): its export
    # writes that family again, Phi-3 as Phi-3 rather than the Llama it computes. None: chosen by features.
    hf_model_type: Optional[str] = None
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
    # Megatron-LM's: the routing weight scales each expert's input rather than its output (Llama 4; top-1 only).
    moe_apply_probs_on_input: bool = False
    moe_grouped_gemm: bool = False  # the experts as one grouped GEMM (torch._grouped_mm) instead of a loop
    # Multi-token prediction (DeepSeek-V3; Megatron-LM's flags, model/multi_token_prediction.py): this many more
    # layers on the last pipeline stage, depth k predicting the token k + 1 after each position, their mean
    # cross entropy times mtp_loss_scaling_factor / mtp_num_layers added to the training loss.
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # Gated attention (Qwen3-Next): each head's output times sigmoid of a gate its query projection also makes.
    attention_output_gate: bool = False
    # Gated DeltaNet linear attention on some layers (Qwen3-Next, Qwen3.5; model/gated_delta_net.py), Megatron-LM's
    # --experimental-attention-variant gdn: --linear-attention-freq N (every Nth layer, counting from 1, keeps
    # softmax attention) or a 0/1 list, 1 for a linear-attention layer; the heads' sizes and the convolution's width.
    experimental_attention_variant: Optional[str] = field(default=None, metadata={"choices": ATTENTION_VARIANTS})
    linear_attention_freq: Optional[str] = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    def __post_init__(self) -> None:
        """Megatron-LM's defaults filled in, then every field checked, one concern at a time."""
        check_choices(self)
        self._fill_size_defaults()
        self._check_sizes()
        self._check_attention_heads()
        self._check_positions()
        self._check_dropout_and_init()
        self._check_padding_embedding()
        self._check_sliding_window()
        self._check_sublayer_norms()
        self._check_mlp_activation()
        self._check_positive_scales()
        self._check_rope_scaling()
        self._check_no_rope_freq()
        self._check_llama4_attention()
        self._check_linear_attention()
        self._fill_moe_defaults()
        check_moe_fields(self)
        self._check_multi_token_prediction()

    def _fill_size_defaults(self) -> None:
        """Sizes left out take Megatron-LM's defaults."""
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
            require(self.ffn_hidden_size > 0,
                     f"--swiglu's default --ffn-hidden-size (2/3 of 4 x --hidden-size {self.hidden_size}, rounded "
                     f"down to a multiple of 64, as Megatron-LM) is 0: give --ffn-hidden-size.")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    def _check_sizes(self) -> None:
        for flag, value in [("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads),
                            ("--seq-length", self.seq_length), ("--vocab-size", self.vocab_size),
                            ("--ffn-hidden-size", self.ffn_hidden_size),
                            ("--num-query-groups", self.num_query_groups)]:
            require(value > 0, f"{flag} must be positive, got {value}.")

    def _check_attention_heads(self) -> None:
        """The head width (--kv-channels, by default --hidden-size over the heads) and the query groups."""
        if self.kv_channels is None:
            require(self.hidden_size % self.num_attention_heads == 0,
                     f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                     f"({self.num_attention_heads}); pick a head count that divides the hidden size, or set the "
                     f"head width with --kv-channels.")
            self.kv_channels = self.hidden_size // self.num_attention_heads  # as Megatron-LM
        require(self.kv_channels > 0, f"--kv-channels must be positive, got {self.kv_channels}.")
        require(self.num_attention_heads % self.num_query_groups == 0,
                 f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                 f"--num-query-groups ({self.num_query_groups}): each query group shares one key/value head.")

    def _check_positions(self) -> None:
        """The rotary channels (pairs) and the sequence against --max-position-embeddings."""
        require(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {self.rotary_percent}.")
        self._check_multi_latent_attention()
        rotated = (f"--qk-pos-emb-head-dim {self.rotary_dim}" if self.multi_latent_attention else
                   f"head dimension {self.head_dim} x --rotary-percent {self.rotary_percent} = {self.rotary_dim}")
        require(not self.rotary or (self.rotary_dim > 0 and self.rotary_dim % 2 == 0),
                 f"rotary embeddings rotate pairs of channels: {rotated} channels must be even and positive.")
        require(self.seq_length <= self.max_position_embeddings,
                 f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                 f"({self.max_position_embeddings}); raise --max-position-embeddings.")

    def _check_dropout_and_init(self) -> None:
        for flag, p in [("--hidden-dropout", self.hidden_dropout), ("--attention-dropout", self.attention_dropout)]:
            require(0.0 <= p < 1.0, f"{flag} must be in [0, 1), got {p}.")
        require(self.init_method_std > 0, f"--init-method-std must be positive, got {self.init_method_std}.")

    def _check_sliding_window(self) -> None:
        require(self.window_size is None or (len(self.window_size) == 2 and self.window_size[0] >= 0
                                              and self.window_size[1] == 0),
                 f"--window-size takes LEFT 0 (a causal model sees no keys to its right), got {self.window_size}.")
        require(self.rotary_base_local is None or (self.window_size is not None and self.rotary),
                 "--rotary-base-local is the RoPE base of the sliding-window layers: it needs --window-size and "
                 "--position-embedding-type rope (or yarn).")
        skip_freq = self.window_attn_skip_freq
        require(skip_freq is None or (self.window_size is not None and skip_freq > 0),
                 f"--window-attn-skip-freq ({self.window_attn_skip_freq}) makes every Nth layer global among "
                 f"sliding-window ones: it needs --window-size and a positive N.")

    def _check_sublayer_norms(self) -> None:
        require(not self.qk_layernorm_whole_projection or (
            self.qk_layernorm and self.normalization == "RMSNorm" and not self.apply_layernorm_1p),
                 "--qk-layernorm-whole-projection widens --qk-layernorm's RMSNorm to all heads at once (OLMoE): it "
                 "takes --qk-layernorm and --normalization RMSNorm, without --apply-layernorm-1p.")
        require(not self.no_pre_sublayer_norm or self.post_sublayer_norm,
                "--no-pre-sublayer-norm leaves the post-sublayer norms alone to normalise (OLMo 2): add "
                "--post-sublayer-norm.")

    def _check_positive_scales(self) -> None:
        for flag, value in [("--attn-logit-softcapping", self.attn_logit_softcapping),
                            ("--final-logit-softcapping", self.final_logit_softcapping),
                            ("--softmax-scale", self.softmax_scale), ("--rotary-base-local", self.rotary_base_local)]:
            require(value is None or value > 0, f"{flag} must be positive, got {value}.")

    def _fill_moe_defaults(self) -> None:
        """One spelling of --moe-layer-freq, and the experts' width that of the dense MLP unless given."""
        self.moe_layer_freq = str(self.moe_layer_freq)  # Megatron-LM's int or list, given in code
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size  # as Megatron-LM

    def _check_multi_token_prediction(self) -> None:
        if self.mtp_num_layers is None:
            return
        require(self.mtp_num_layers >= 1, f"--mtp-num-layers must be at least 1 (or left out), got "
                                          f"{self.mtp_num_layers}.")
        require(self.mtp_loss_scaling_factor >= 0,
                f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}.")
        require(self.num_experts is None or self.moe_router_load_balancing_type != "pooled_aux_loss"
                or self.moe_aux_loss_coeff == 0,
                "--moe-router-load-balancing-type pooled_aux_loss pools the routing of the decoder's layers "
                "(transformers' loss, which has no multi-token prediction layers): drop --mtp-num-layers, or "
                "balance with aux_loss or seq_aux_loss.")

    def _check_mlp_activation(self) -> None:
        """The gated MLP's variants (GeGLU, its quick form, offset, clamp) need --swiglu; exact GELU is no SiLU gate."""
        require(not self.geglu or self.swiglu, "--geglu changes the gate of --swiglu's gated MLP: add --swiglu.")
        require(not (self.geglu and self.quick_geglu), "--geglu and --quick-geglu each pick the gate: give one.")
        given = [flag for flag, on in [("--quick-geglu", self.quick_geglu),
                                       ("--glu-linear-offset", self.glu_linear_offset != 0.0),
                                       ("--activation-func-clamp-value", self.activation_func_clamp_value is not None)]
                 if on]
        require(self.swiglu or not given, f"{', '.join(given)} change(s) the gated MLP of --swiglu: add --swiglu.")
        clamp = self.activation_func_clamp_value
        require(clamp is None or (math.isfinite(clamp) and clamp > 0),
                f"--activation-func-clamp-value must be finite and positive, got {clamp}.")
        require(not self.gelu_exact or not self.swiglu or self.geglu,
                "--gelu-exact changes the GELU, and --swiglu's gate is SiLU: drop one (or add --geglu).")

    def _check_no_rope_freq(self) -> None:
        if self.no_rope_freq is None:
            return
        require(self.rotary and not self.multi_latent_attention,
                "--no-rope-freq leaves some layers without rotary embeddings: it needs --position-embedding-type "
                "rope (or yarn), and not --multi-latent-attention (whose keys take position from their rotary part "
                "only).")
        freq = parse_moe_layer_freq(self.no_rope_freq, "--no-rope-freq", "layers without rotary embeddings")
        self.no_rope_freq = str(freq)  # one spelling of a pattern (Megatron-LM's int or list, given in code too)
        require(freq >= 1 if isinstance(freq, int) else len(freq) == self.num_layers,
                f"--no-rope-freq {self.no_rope_freq!r} must be N >= 1 or give one 0 or 1 per layer (--num-layers "
                f"{self.num_layers}).")

    def _check_llama4_attention(self) -> None:
        chunk = self.attention_chunk_size
        require(chunk is None or chunk > 0, f"--attention-chunk-size must be positive, got {chunk}.")
        require(chunk is None or (self.rotary and not self.multi_latent_attention and self.window_size is None),
                "--attention-chunk-size makes the layers with rotary embeddings attend within chunks: it needs "
                "--position-embedding-type rope (or yarn), and neither --multi-latent-attention nor --window-size.")
        require(not self.qk_l2_norm or not (self.qk_layernorm or self.multi_latent_attention),
                "--qk-l2-norm normalises each head's queries and keys without a weight: drop --qk-layernorm (it "
                "normalises them with one), and --multi-latent-attention (its latents have their own norms).")
        require(not self.attn_temperature_tuning or self.no_rope_freq is not None,
                "--attn-temperature-tuning scales the queries of the NoPE layers: add --no-rope-freq.")
        require(self.attn_temperature_floor_scale > 0 and self.attn_temperature_scale >= 0,
                f"--attn-temperature-floor-scale must be positive and --attn-temperature-scale >= 0, got "
                f"{self.attn_temperature_floor_scale} and {self.attn_temperature_scale}.")

    def _check_linear_attention(self) -> None:
        if self.experimental_attention_variant is None:
            require(self.linear_attention_freq is None, "--linear-attention-freq places gated DeltaNet layers: add "
                                                         "--experimental-attention-variant gdn.")
            return
        require(self.linear_attention_freq is not None, "--experimental-attention-variant gdn needs "
                                                         "--linear-attention-freq (which layers are linear attention).")
        freq = parse_moe_layer_freq(self.linear_attention_freq, "--linear-attention-freq", "linear-attention layers")
        self.linear_attention_freq = str(freq)  # one spelling of a pattern, as --no-rope-freq
        require(freq >= 1 if isinstance(freq, int) else len(freq) == self.num_layers,
                f"--linear-attention-freq {self.linear_attention_freq!r} must be N >= 1 or give one 0 or 1 per layer "
                f"(--num-layers {self.num_layers}).")
        for flag, value in [("--linear-conv-kernel-dim", self.linear_conv_kernel_dim),
                            ("--linear-key-head-dim", self.linear_key_head_dim),
                            ("--linear-value-head-dim", self.linear_value_head_dim),
                            ("--linear-num-key-heads", self.linear_num_key_heads),
                            ("--linear-num-value-heads", self.linear_num_value_heads)]:
            require(value > 0, f"{flag} must be positive, got {value}.")
        require(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                f"--linear-num-value-heads ({self.linear_num_value_heads}) must be a multiple of "
                f"--linear-num-key-heads ({self.linear_num_key_heads}): each key head serves whole value heads.")
        require(not self.multi_latent_attention, "--experimental-attention-variant gdn mixes gated DeltaNet with "
                                                  "grouped-query attention: drop --multi-latent-attention.")

    def _check_padding_embedding(self) -> None:
        require(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
                 f"--pad-token-id ({self.pad_token_id}) must be a token of the vocabulary (0 to "
                 f"{self.vocab_size - 1}).")
        require(not self.freeze_padding_embedding or self.pad_token_id is not None,
                 "--freeze-padding-embedding freezes the pad token's embedding row, but no pad token is known: add "
                 "--use-checkpoint-args to take an imported model's (its config.json's pad_token_id), or give "
                 "--pad-token-id.")

    def _check_rope_scaling(self) -> None:
        scalings = [self.rotary_seq_len_interpolation_factor is not None, self.use_rope_scaling, self.yarn]
        require(self.rotary or not any(scalings),
                 "--rotary-seq-len-interpolation-factor and --use-rope-scaling scale rotary embeddings: they need "
                 "--position-embedding-type rope.")
        require(sum(scalings) <= 1, "give one RoPE scaling: --rotary-seq-len-interpolation-factor (linear), "
                                     "--use-rope-scaling (Llama 3.x) or YaRN (--position-embedding-type yarn), not "
                                     "two of them.")
        for flag, factor in [("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor),
                             ("--rope-scaling-factor", self.rope_scaling_factor),
                             ("--rotary-scaling-factor", self.rotary_scaling_factor)]:
            require(factor is None or factor >= 1.0, f"{flag} must be >= 1 (it stretches positions), got {factor}.")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        require(self.use_rope_scaling or (low, high) == (1.0, 4.0),
                "--rope-scaling-low-freq-factor and --rope-scaling-high-freq-factor configure --use-rope-scaling: "
                "add it.")
        require(0 < low <= high, f"--rope-scaling-low-freq-factor ({low}) must be positive and at most "
                                 f"--rope-scaling-high-freq-factor ({high}).")
        for name, default in YARN_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        yarn_flags = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                      "yarn_correction_range_round_to_int": True, **YARN_DEFAULTS}
        given = [flag_name(name) for name, default in yarn_flags.items() if getattr(self, name) != default]
        require(self.yarn or not given,
                 f"{', '.join(given)} configure YaRN: add --position-embedding-type yarn (with multi-latent "
                 f"attention, --rope-type yarn, its default).")
        require(self.yarn_original_max_position_embeddings > 0,
                 f"--yarn-original-max-position-embeddings must be positive, got "
                 f"{self.yarn_original_max_position_embeddings}.")

    def _check_multi_latent_attention(self) -> None:
        if self.rope_type is None:
            self.rope_type = "yarn" if self.multi_latent_attention else "rope"
        if not self.multi_latent_attention:
            require(self.rope_type == "rope", "--rope-type picks multi-latent attention's rotary embedding; other "
                                               "attention takes YaRN from --position-embedding-type yarn.")
            return
        for flag, value in [("--kv-lora-rank", self.kv_lora_rank), ("--qk-head-dim", self.qk_head_dim),
                            ("--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim), ("--v-head-dim", self.v_head_dim),
                            ("--q-lora-rank", 1 if self.q_lora_rank is None else self.q_lora_rank)]:
            require(value > 0, f"{flag} must be positive, got {value}.")
        require(self.position_embedding_type == "rope",
                 f"--multi-latent-attention rotates --qk-pos-emb-head-dim channels of each head: it needs "
                 f"--position-embedding-type rope (--rope-type picks rope or yarn), got "
                 f"{self.position_embedding_type}.")
        require(self.num_query_groups == self.num_attention_heads,
                 "--multi-latent-attention gives every head its own keys and values from the shared latent: drop "
                 "--group-query-attention and --num-query-groups.")
        require(self.softmax_type == "vanilla",
                f"--softmax-type {self.softmax_type} puts sinks in grouped-query attention's softmax; "
                f"--multi-latent-attention has none: drop one.")
        require(self.rotary_percent == 1.0 and not self.add_qkv_bias,
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

    def is_nope_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (global, 0-based) attends without rotary embeddings (--no-rope-freq)."""
        if self.no_rope_freq is None:
            return False
        freq = parse_moe_layer_freq(self.no_rope_freq, "--no-rope-freq", "layers without rotary embeddings")
        layer_number = self.pattern_layer(layer_number)
        return (layer_number + 1) % freq == 0 if isinstance(freq, int) else bool(freq[layer_number])

    def is_linear_attention_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (global, 0-based) is a gated DeltaNet layer (--linear-attention-freq):
        with N, every layer but each Nth (counting from 1) is."""
        if self.experimental_attention_variant is None:
            return False
        freq = parse_moe_layer_freq(self.linear_attention_freq, "--linear-attention-freq", "linear-attention layers")
        layer_number = self.pattern_layer(layer_number)
        return (layer_number + 1) % freq != 0 if isinstance(freq, int) else bool(freq[layer_number])

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (global, 0-based) has a mixture of experts for its MLP."""
        return moe_layer_pattern(self.num_experts, self.moe_layer_freq, self.num_layers)[
            self.pattern_layer(layer_number)]

    def pattern_layer(self, layer_number: int) -> int:
        """The decoder layer whose kind layer ``layer_number`` has: itself, or for a multi-token prediction layer
        (numbered on after the decoder's, num_layers + depth) the decoder's last, as Megatron-LM builds its MTP
        layers from the decoder's last layer spec (DeepSeek-V3's and GLM-4.5's MTP layers have experts)."""
        return min(layer_number, self.num_layers - 1)

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron pads the vocabulary so every tensor-parallel shard is a multiple of 128."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple
