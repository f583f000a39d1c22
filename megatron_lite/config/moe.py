"""The mixture-of-experts fields of ModelConfig: which layers are MoE, and whether the --moe-* flags agree.

``--moe-layer-freq`` is Megatron-LM's: an integer N (every Nth layer, counting from the first, is an
MoE layer) or a Python list expression of 0s and 1s, one per layer, such as ``([0]+[1]*23)`` (a first
dense layer, then 23 MoE layers: DeepSeek's first-k dense layers). Megatron-LM evaluates that text
with ``eval``; here it is parsed, and only lists, integers, ``+`` and ``*`` are accepted.
"""
from __future__ import annotations

import ast
import functools

from megatron_lite.config.errors import ConfigError
from megatron_lite.config.fields import require

ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "pooled_aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
GROUP_SCORES = ("topk_sum", "max")


def parse_moe_layer_freq(text: str, flag: str = "--moe-layer-freq",
                         ones: str = "MoE layers") -> int | list[int]:
    """``--moe-layer-freq``'s text -> N or the per-layer list of 0s and 1s; ``flag`` another flag of that form
    (--no-rope-freq), whose 1s are ``ones``."""
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        raise ConfigError(f"{flag} takes an integer N or a list of 0s and 1s such as \"([0]+[1]*23)\" "
                          f"(lists, integers, + and * only), got {text!r}.") from None
    require(isinstance(value, list) and all(v in (0, 1) for v in value),
             f"{flag} {text!r} must give a list of 0s and 1s ({ones}).")
    return value


def _evaluate(node):
    """A list expression of integer literals, ``+`` and ``*``: nothing else is evaluated."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) == isinstance(right, list):
            raise ValueError("a list is repeated by an integer")
        if isinstance(node.op, ast.Mult) and (right if isinstance(left, list) else left) > 100_000:
            raise ValueError("too many layers")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a list expression")


@functools.lru_cache(maxsize=64)
def moe_layer_pattern(num_experts: int | None, moe_layer_freq: str, num_layers: int) -> tuple[bool, ...]:
    """For each layer (0-based), whether its MLP is a mixture of experts. Cached: the planner asks it of every
    layer of every layout it weighs (millions of calls for a 1,024-GPU search)."""
    if num_experts is None:
        return (False,) * num_layers
    freq = parse_moe_layer_freq(moe_layer_freq)
    if isinstance(freq, int):
        return tuple(layer % freq == 0 for layer in range(num_layers))
    return tuple(bool(v) for v in freq)


def check_moe_fields(model) -> None:
    """The --num-experts and --moe-* flags of a ModelConfig agree with each other and the model."""
    if model.num_experts is None:
        given = [name for name, value in _moe_only_settings(model).items() if value]
        require(not given, f"{', '.join(given)} configure mixture-of-experts layers: add --num-experts N.")
        return
    experts, topk = model.num_experts, model.moe_router_topk
    require(experts >= 1, f"--num-experts must be >= 1, got {experts}.")
    require(1 <= topk <= experts, f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts}).")
    freq = parse_moe_layer_freq(model.moe_layer_freq)
    # One spelling of a pattern ("[0,1]", "([0]+[1])" and Megatron-LM's list are the same layers), so that
    # checkpoints and exports compare patterns, not texts.
    model.moe_layer_freq = str(freq)
    if isinstance(freq, int):
        require(freq >= 1, f"--moe-layer-freq must be >= 1 (every Nth layer is an MoE layer), got {freq}.")
    else:
        require(len(freq) == model.num_layers,
                 f"--moe-layer-freq {model.moe_layer_freq!r} gives {len(freq)} layers, but --num-layers is "
                 f"{model.num_layers}: give one 0 or 1 per layer.")
    require(model.moe_ffn_hidden_size > 0, f"--moe-ffn-hidden-size must be positive, got {model.moe_ffn_hidden_size}.")
    shared = model.moe_shared_expert_intermediate_size
    require(shared is None or shared > 0, f"--moe-shared-expert-intermediate-size must be positive, got {shared}.")
    require(not model.moe_shared_expert_gate or shared is not None,
             "--moe-shared-expert-gate gates the shared expert: add --moe-shared-expert-intermediate-size.")
    _check_router(model)


def _check_router(model) -> None:
    experts, topk = model.num_experts, model.moe_router_topk
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    require((groups is None) == (group_topk is None),
             "group-limited routing takes both --moe-router-num-groups and --moe-router-group-topk.")
    require(groups is not None or model.moe_router_group_score == "topk_sum",
             "--moe-router-group-score scores the groups of group-limited routing: add --moe-router-num-groups and "
             "--moe-router-group-topk.")
    if groups is not None:
        require(groups >= 1 and experts % groups == 0,
                 f"--moe-router-num-groups ({groups}) must divide --num-experts ({experts}).")
        if model.moe_router_group_score == "topk_sum":
            require(1 <= group_topk <= groups and topk % group_topk == 0 and topk // group_topk <= experts // groups,
                     f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups ({groups}) "
                     f"and divide --moe-router-topk ({topk}) into at most {experts // groups} experts per group.")
        else:  # a group's best expert scores it: the chosen groups need only hold k experts
            require(1 <= group_topk <= groups and topk <= group_topk * (experts // groups),
                     f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups ({groups}) "
                     f"and its groups hold --moe-router-topk ({topk}) experts.")
    require(model.moe_aux_loss_coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {model.moe_aux_loss_coeff}.")
    require(model.moe_z_loss_coeff is None or model.moe_z_loss_coeff >= 0,
             f"--moe-z-loss-coeff must be >= 0, got {model.moe_z_loss_coeff}.")
    require(not model.moe_router_enable_expert_bias or model.moe_router_score_function == "sigmoid",
             "--moe-router-enable-expert-bias biases the sigmoid scores (DeepSeek-V3's aux-loss-free balancing): add "
             "--moe-router-score-function sigmoid.")
    require(not model.moe_apply_probs_on_input or topk == 1,
            f"--moe-apply-probs-on-input scales each expert's input by its routing weight, which Megatron-LM allows "
            f"with --moe-router-topk 1 only, got {topk}.")
    require(model.moe_router_bias_update_rate >= 0,
             f"--moe-router-bias-update-rate must be >= 0, got {model.moe_router_bias_update_rate}.")
    require(not model.moe_router_pre_softmax or model.moe_router_score_function == "softmax",
             "--moe-router-pre-softmax applies to --moe-router-score-function softmax.")
    factor = model.moe_expert_capacity_factor
    require(factor is None or factor > 0, f"--moe-expert-capacity-factor must be positive, got {factor}.")
    require(not model.moe_pad_expert_input_to_capacity or factor is not None,
             "--moe-pad-expert-input-to-capacity pads each expert to its capacity: add --moe-expert-capacity-factor.")


def _moe_only_settings(model) -> dict:
    """The --moe-* settings that mean something only with experts, keyed by flag, truthy when given."""
    return {"--moe-ffn-hidden-size": model.moe_ffn_hidden_size is not None,
            "--moe-shared-expert-intermediate-size": model.moe_shared_expert_intermediate_size is not None,
            "--moe-shared-expert-gate": model.moe_shared_expert_gate,
            "--moe-router-num-groups": model.moe_router_num_groups is not None,
            "--moe-router-group-score": model.moe_router_group_score != "topk_sum",
            "--moe-router-enable-expert-bias": model.moe_router_enable_expert_bias,
            "--moe-expert-capacity-factor": model.moe_expert_capacity_factor is not None,
            "--moe-grouped-gemm": model.moe_grouped_gemm,
            "--moe-apply-probs-on-input": model.moe_apply_probs_on_input}
