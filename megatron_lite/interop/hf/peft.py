"""LoRA adapter checkpoints <-> Hugging Face PEFT adapter directories.

A PEFT directory is ``adapter_config.json`` (r, lora_alpha, target_modules, ...) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` (r x in)
and ``lora_B.weight`` (out x r) for every adapted Hugging Face module. PEFT adapts one
module with one A; our fused layers are several Hugging Face modules at once:

    linear_qkv  GPT-2: attn.c_attn (its rows [q; k; v])   Llama: self_attn.q_proj, k_proj, v_proj
    linear_fc1  GPT-2: mlp.c_fc                           Llama: mlp.gate_proj, mlp.up_proj (SwiGLU)

Export: each of those modules gets a copy of our shared A and its rows of our B
(``weights``'s q/k/v and gate/up split), so PEFT computes exactly our update. The experts of a
mixture-of-experts layer (Mixtral, Qwen3-MoE, OLMoE under transformers 5, gpt-oss) are 3-D parameters, which PEFT
adapts as ``target_parameters``, each expert with its own factors (``_EXPERT_PARAMETERS``); the dense MLPs of
such a model have no PEFT form (``_check_dense_mlps_of_experts``), and no expert adapter is imported.
Import: PEFT trains a separate A for q, k and v (and may adapt only some of them,
scale modules differently or use rsLoRA), which one shared A of the same rank cannot
hold. The modules' updates are stacked instead, A = [A_q; A_k; A_v] and B
block-diagonal in our row layout, each block already scaled: exact, at rank
r x (modules per fused layer), padded with zeros to the largest such rank, and
alpha = that rank (scale 1). Adapters that share A, rank and scale (ours, exported)
come back unchanged.

DeepSeek's multi-latent attention projections are one Hugging Face module each (q_a_proj,
q_b_proj, kv_a_proj_with_mqa, ...; ``latent_attention``); B's rows of the projections that
produce rotated channels are reordered as the weights' are (files interleave the rotary rows, on
import taken to be as DeepSeek's released weights have them). So are Llama 4's q_proj and k_proj rows
(``llama4_weights``), whose MLPs are feed_forward, the shared expert's (feed_forward.shared_expert) exported beside
the experts'.
"""
from __future__ import annotations

import json
import math
import os

import safetensors
import safetensors.torch
import torch

from megatron_lite.interop.hf.checkpoint import imported_from
from megatron_lite.interop.hf.gpt_oss_weights import interleaved_rows
from megatron_lite.interop.hf.weights import hf_family, pack_qkv, unpack_qkv
from megatron_lite.interop.hf.latent_attention import latent_rotary_rows, query_rotary_rows
from megatron_lite.interop.hf.llama4_weights import llama4_rotary_rows
from megatron_lite.interop.hf.tokenizer import write_json
from megatron_lite.checkpointing.offline import write_checkpoint
from megatron_lite.checkpointing.peft_base import adapter_reader, pointer_to
from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir
from megatron_lite.config import Config, ConfigError, ModelConfig, ParallelConfig, PeftConfig
from megatron_lite.peft.lora import factor_names

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# Our LoRA target -> the Hugging Face modules it is, each with the row blocks of our B it holds (None: all rows).
_MODULES = {
    "gpt2": {"linear_qkv": [("attn.c_attn", ("q", "k", "v"))], "linear_proj": [("attn.c_proj", None)],
             "linear_fc1": [("mlp.c_fc", None)], "linear_fc2": [("mlp.c_proj", None)]},
    "llama": {"linear_qkv": [("self_attn.q_proj", ("q",)), ("self_attn.k_proj", ("k",)),
                             ("self_attn.v_proj", ("v",))],
              "linear_proj": [("self_attn.o_proj", None)],
              "linear_fc1": [("mlp.gate_proj", ("gate",)), ("mlp.up_proj", ("up",))],
              "linear_fc2": [("mlp.down_proj", None)]},
    "phi3": {"linear_qkv": [("self_attn.qkv_proj", ("q", "k", "v"))], "linear_proj": [("self_attn.o_proj", None)],
             "linear_fc1": [("mlp.gate_up_proj", ("gate", "up"))], "linear_fc2": [("mlp.down_proj", None)]},
}
# GPT-NeoX's modules are ours one for one, rows in our order (its query_key_value is laid out per head, as ours).
_MODULES["gpt_neox"] = {"linear_qkv": [("attention.query_key_value", None)], "linear_proj": [("attention.dense", None)],
                        "linear_fc1": [("mlp.dense_h_to_4h", None)], "linear_fc2": [("mlp.dense_4h_to_h", None)]}
for _naming in ("gemma", "olmo2", "mixtral", "qwen_moe", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5"):
    _MODULES[_naming] = _MODULES["llama"]
# Llama 4's MLPs are feed_forward; its shared expert (our mlp.shared_experts) feed_forward.shared_expert.
_MODULES["llama4"] = {**_MODULES["llama"], "linear_fc1": [("feed_forward.gate_proj", ("gate",)),
                                                          ("feed_forward.up_proj", ("up",))],
                      "linear_fc2": [("feed_forward.down_proj", None)]}
_SHARED_EXPERT_MODULES = {"llama4": {"linear_fc1": [("feed_forward.shared_expert.gate_proj", ("gate",)),
                                                    ("feed_forward.shared_expert.up_proj", ("up",))],
                                     "linear_fc2": [("feed_forward.shared_expert.down_proj", None)]}}
_MODULES["deepseek"] = {"linear_q_proj": [("self_attn.q_proj", None)],
                        "linear_q_down_proj": [("self_attn.q_a_proj", None)],
                        "linear_q_up_proj": [("self_attn.q_b_proj", None)],
                        "linear_kv_down_proj": [("self_attn.kv_a_proj_with_mqa", None)],
                        "linear_kv_up_proj": [("self_attn.kv_b_proj", None)],
                        **{target: _MODULES["llama"][target] for target in ("linear_proj", "linear_fc1", "linear_fc2")}}
_OUR_MODULE = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
               "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2",
               **{target: f"self_attention.{target}" for target in ("linear_q_proj", "linear_q_down_proj",
                                                                   "linear_q_up_proj", "linear_kv_down_proj",
                                                                   "linear_kv_up_proj")}}
_LAYERS = {"gpt2": "base_model.model.transformer.h.", "gpt_neox": "base_model.model.gpt_neox.layers.",
           "llama": "base_model.model.model.layers.",
           "phi3": "base_model.model.model.layers.", "gemma": "base_model.model.model.layers.",
           "olmo2": "base_model.model.model.layers.",
           "mixtral": "base_model.model.model.layers.", "qwen_moe": "base_model.model.model.layers.",
           "deepseek": "base_model.model.model.layers.", "glm4_moe": "base_model.model.model.layers.",
           "gpt_oss": "base_model.model.model.layers.", "qwen3_next": "base_model.model.model.layers.",
           "qwen3_5": "base_model.model.model.layers.", "llama4": "base_model.model.model.layers."}
# A mixture-of-experts layer's experts in transformers 5 (Mixtral, Qwen3-MoE, OLMoE): one 3-D parameter per
# projection, [experts, out, in], which PEFT adapts as ``target_parameters`` (its ParamWrapper), every expert
# with its own rank-r factors: A [E r, in] (expert e's rows e r .. e r + r - 1) and B [out, r E] (expert e's
# columns e, E + e, ...). Both targeted, PEFT wraps gate_up_proj first, so its factors sit under base_layer.
# gpt-oss's are [experts, in, out] (transformers marks them transposed, which PEFT reads), gate_up_proj's outputs
# gate and up in turn: B's rows are interleaved so (``interleaved_rows``). Llama 4's (feed_forward.experts) are
# [experts, in, out] too, unmarked: PEFT takes their inputs for outputs, and factors the transposed update, B^T A^T,
# so our B^T is its A and our A^T its B.
_EXPERT_PARAMETERS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_EXPERTS_MODULE = {"llama4": "feed_forward.experts"}  # default: mlp.experts
# DeepSeek's rotary rows are interleaved in its files, rotate-half in ours (latent_attention): B's rows follow.
_ROTARY_ROWS = {"linear_q_proj": query_rotary_rows, "linear_q_up_proj": query_rotary_rows,
                "linear_kv_down_proj": latent_rotary_rows}


def _hf_rows(target: str, lora_b: torch.Tensor, config: ModelConfig, *, to_hf: bool) -> torch.Tensor:
    """B's rows in the other naming's order (only DeepSeek's rotary rows move)."""
    reorder = _ROTARY_ROWS.get(target)
    return lora_b if reorder is None else reorder(lora_b, config, to_interleaved=to_hf)


def _hf_block(naming: str, block: str, rows: torch.Tensor, config: ModelConfig, *, to_hf: bool) -> torch.Tensor:
    """The rows of one block of B (q, k, v, gate, up) in the other naming's order: Llama 4's q and k rotate
    interleaved pairs."""
    if naming == "llama4" and block in ("q", "k"):
        return llama4_rotary_rows(rows, config, to_interleaved=to_hf)
    return rows


def _row_blocks(target: str, rows: torch.Tensor, config: ModelConfig) -> dict:
    """Our fused rows (of B, or of the weight) as named blocks: q/k/v, gate/up."""
    if target == "linear_qkv":
        return dict(zip(("q", "k", "v"), unpack_qkv(rows, config)))
    if target == "linear_fc1" and config.swiglu:
        return dict(zip(("gate", "up"), rows.chunk(2)))
    return {}


def _join_blocks(target: str, blocks: dict, config: ModelConfig) -> torch.Tensor:
    if target == "linear_qkv":
        return pack_qkv(blocks["q"], blocks["k"], blocks["v"], config)
    return torch.cat([blocks["gate"], blocks["up"]])


def _block_rows(target: str, config: ModelConfig) -> dict:
    """How many rows each block of ``target`` has."""
    gated = 2 if config.attention_output_gate else 1  # a gated attention's q_proj holds each head's gate too
    sizes = {"q": gated * config.num_attention_heads * config.head_dim, "k": config.num_query_groups * config.head_dim,
             "v": config.num_query_groups * config.head_dim, "gate": config.ffn_hidden_size,
             "up": config.ffn_hidden_size}
    return {block: sizes[block] for block in ("q", "k", "v")} if target == "linear_qkv" else {
        "gate": sizes["gate"], "up": sizes["up"]}


def _inputs(target: str, config: ModelConfig) -> int:
    heads = config.num_attention_heads
    value_width = config.v_head_dim if config.multi_latent_attention else config.head_dim
    return {"linear_qkv": config.hidden_size, "linear_fc1": config.hidden_size, "linear_proj": heads * value_width,
            "linear_fc2": config.ffn_hidden_size, "linear_q_proj": config.hidden_size,
            "linear_q_down_proj": config.hidden_size, "linear_q_up_proj": config.q_lora_rank,
            "linear_kv_down_proj": config.hidden_size, "linear_kv_up_proj": config.kv_lora_rank}[target]


def _full_rows(target: str, config: ModelConfig) -> int:
    heads, rotary = config.num_attention_heads, config.qk_pos_emb_head_dim
    query_heads = heads * (2 if config.attention_output_gate else 1)  # a gated attention's gates too
    return {"linear_qkv": (query_heads + 2 * config.num_query_groups) * config.head_dim,
            "linear_proj": config.hidden_size, "linear_fc2": config.hidden_size,
            "linear_fc1": config.ffn_hidden_size * (2 if config.swiglu else 1),
            "linear_q_proj": heads * (config.qk_head_dim + rotary), "linear_q_down_proj": config.q_lora_rank,
            "linear_q_up_proj": heads * (config.qk_head_dim + rotary),
            "linear_kv_down_proj": config.kv_lora_rank + rotary,
            "linear_kv_up_proj": heads * (config.qk_head_dim + config.v_head_dim)}[target]


# ---------------------------------------------------------------------------------------------
# Export


def export_peft_adapters(load_dir: str, save_dir: str, *, base_model_name_or_path: str | None = None,
                         hf_model_type: str | None = None) -> None:
    """A LoRA adapter checkpoint (any layout) -> a PEFT directory for the Hugging Face export of its base (as
    the family ``hf_model_type``, by default the one its features call for)."""
    reader, config = adapter_reader(resolve_checkpoint_dir(load_dir), "lora")
    if base_model_name_or_path is None:
        base_model_name_or_path = _hf_base(reader.metadata["training_state"].get("peft_base"))
    model, peft = config.model, config.peft
    family = hf_family(model, hf_model_type)
    architecture = family.naming
    _check_peft_loads(model, peft.lora_target_modules, family)
    tensors, targets, expert_targets = {}, set(), set()
    experts_module = _EXPERTS_MODULE.get(architecture, "mlp.experts")
    for layer in range(model.num_layers):
        experts = [t for t in peft.lora_target_modules if t in _EXPERT_PARAMETERS and model.is_moe_layer(layer)]
        if experts:
            tensors.update(_expert_adapters(reader, model, layer, experts, architecture, peft))
            expert_targets.update(f"{experts_module}.{_EXPERT_PARAMETERS[t]}" for t in experts)
        modules = [(t, _OUR_MODULE[t], _MODULES[architecture][t]) for t in peft.lora_target_modules
                   if t not in experts and _has_target(model, layer, t)]
        if model.moe_shared_expert_intermediate_size is not None and architecture in _SHARED_EXPERT_MODULES:
            modules += [(t, f"mlp.shared_experts.{t}", _SHARED_EXPERT_MODULES[architecture][t]) for t in experts]
        for target, ours, hf_modules in modules:
            lora_a, lora_b = (reader.read(n) for n in factor_names(f"decoder.layers.{layer}.{ours}"))
            lora_b = _hf_rows(target, lora_b, model, to_hf=True)
            blocks = {name: _hf_block(architecture, name, rows, model, to_hf=True)
                      for name, rows in _row_blocks(target, lora_b, model).items()}
            for hf_module, covered in hf_modules:
                prefix = f"{_LAYERS[architecture]}{layer}.{hf_module}"
                tensors[f"{prefix}.lora_A.weight"] = lora_a.clone()  # one file entry per module
                tensors[f"{prefix}.lora_B.weight"] = lora_b if covered is None else torch.cat(
                    [blocks[b] for b in covered])
                targets.add(hf_module)
    os.makedirs(save_dir, exist_ok=True)
    write_json(os.path.join(save_dir, CONFIG_FILE), {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": peft.lora_rank, "lora_alpha": peft.lora_alpha, "lora_dropout": peft.lora_dropout,
        "target_modules": sorted(targets), "target_parameters": sorted(expert_targets) or None,
        "fan_in_fan_out": architecture == "gpt2",  # GPT-2's Conv1D is [in, out]
        "bias": "none", "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None})
    safetensors.torch.save_file({k: v.float().contiguous() for k, v in tensors.items()},
                                os.path.join(save_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        os.chmod(os.path.join(save_dir, name), 0o644)


# Namings whose gate_proj, up_proj and down_proj peft (0.21, for transformers 5) takes for a mixture of experts'
# fused parameters, in every layer: Qwen3-MoE, OLMoE, DeepSeek, GLM-4.5 and Qwen3-Next (not Mixtral, whose experts
# are w1, w3, w2).
_PEFT_REMAPS_MLPS = frozenset({"qwen_moe", "deepseek", "glm4_moe", "qwen3_next"})


def _has_target(model: ModelConfig, layer: int, target: str) -> bool:
    """Whether layer ``layer`` has the linear ``target``: a gated DeltaNet layer has no attention projections."""
    attention = target == "linear_proj" or target.startswith(("linear_q", "linear_kv"))
    return not (attention and model.is_linear_attention_layer(layer))


def _check_peft_loads(model: ModelConfig, targets: list, family) -> None:
    """Adapters on a dense MLP (a dense layer, a shared expert) of a model peft remaps would load onto nothing,
    silently: refused."""
    mlp = [target for target in targets if target in ("linear_fc1", "linear_fc2")]
    dense = [layer for layer in range(model.num_layers) if not model.is_moe_layer(layer)]
    shared = model.moe_shared_expert_intermediate_size is not None
    if family.naming not in _PEFT_REMAPS_MLPS or not mlp or not (dense or shared):
        return
    where = ", ".join(([f"layers {dense}"] if dense else []) + (["the shared experts"] if shared else []))
    raise ConfigError(f"LoRA on {' and '.join(mlp)} of a {family.model_type} model's dense MLPs ({where}) has no PEFT "
                      f"form that peft loads: it remaps the model's mlp.gate_proj/up_proj/down_proj to "
                      f"mixture-of-experts parameters and drops the adapters of dense MLPs. Export adapters trained "
                      f"with --lora-target-modules linear_qkv linear_proj (attention), or merge them into the base "
                      f"(--merge-lora).")


def _expert_adapters(reader, model: ModelConfig, layer: int, targets: list, architecture: str, peft) -> dict:
    """The PEFT tensors of layer ``layer``'s per-expert adapters on ``targets`` (linear_fc1, linear_fc2): each
    expert's A and B stacked as ``_EXPERT_PARAMETERS`` says."""
    if peft.lora_dropout:
        raise ConfigError(f"the adapters adapt experts with --lora-dropout {peft.lora_dropout}, which PEFT's "
                          f"adapters on expert weights (target_parameters) refuse: export with --merge-lora (the "
                          f"dropout does not change the merged model), or train with --lora-dropout 0.")
    tensors = {}
    for target in targets:
        factors = [[reader.read(n) for n in factor_names(
            f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{target}")] for e in range(model.num_experts)]
        inner = len(targets) > 1 and target == "linear_fc1"
        module = _EXPERTS_MODULE.get(architecture, "mlp.experts")
        prefix = f"{_LAYERS[architecture]}{layer}.{module}.{'base_layer.' if inner else ''}"
        if architecture == "gpt_oss" and target == "linear_fc1":
            factors = [(a, interleaved_rows(b)) for a, b in factors]
        if architecture == "llama4":
            factors = [(b.t(), a.t()) for a, b in factors]
        tensors[prefix + "lora_A.weight"] = torch.cat([a for a, _ in factors])
        tensors[prefix + "lora_B.weight"] = torch.stack([b for _, b in factors], dim=-1).flatten(1)
    return tensors


def _hf_base(pointer: dict | None) -> str:
    """The Hugging Face directory the adapters' base was imported from, for ``AutoPeftModelForCausalLM`` (which
    otherwise tries to download a model named "None")."""
    base_root = os.path.dirname(pointer["directory"]) if pointer and "directory" in pointer else None
    source = imported_from(base_root) if base_root else None
    if source is None:
        raise ConfigError(f"the adapters' base ({base_root or 'a random initialisation'}) was not imported from a "
                          f"Hugging Face directory, so there is no base to record in adapter_config.json: export "
                          f"the base with --target-format hf and give --base-model-name-or-path with that directory "
                          f"(or a hub name).")
    if not os.path.isdir(source):
        raise ConfigError(f"the adapters' base was imported from {source}, which no longer exists: give "
                          f"--base-model-name-or-path with where it is now (or a hub name).")
    return source


# ---------------------------------------------------------------------------------------------
# Import


def import_peft_adapters(load_dir: str, save_dir: str, *, base_checkpoint: str, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1) -> str:
    """A PEFT LoRA directory -> a LoRA adapter checkpoint on ``base_checkpoint`` (the megatron_lite
    checkpoint of the Hugging Face base model, e.g. imported by this converter)."""
    peft_config, tensors = _read_peft_directory(load_dir)
    base_dir = resolve_checkpoint_dir(base_checkpoint)
    base = CheckpointReader(base_dir)
    config = Config.from_dict(base.metadata["config"])
    if config.peft.peft is not None:
        raise ConfigError(f"--base-checkpoint {base_checkpoint} is itself an adapter checkpoint; give the full "
                          f"checkpoint of the base model.")
    model = config.model
    architecture = hf_family(model).naming
    updates = _updates_by_target(peft_config, tensors, architecture, model)
    shared = _shared_factors(updates, peft_config, architecture)
    rank = (peft_config["r"] if shared else
            max(sum(a.shape[0] for a, _, _ in members.values()) for members in updates.values()))
    weights = {}
    for (layer, target), members in updates.items():
        module = f"decoder.layers.{layer}.{_OUR_MODULE[target]}"
        lora_a, lora_b = (_shared(target, members, model) if shared else _stacked(target, members, model, rank))
        weights.update(zip(factor_names(module), (lora_a, lora_b)))
    targets = sorted({target for _, target in updates}, key=list(_OUR_MODULE).index)
    for layer in range(model.num_layers):  # a layer PEFT left alone (layers_to_transform): a zero update
        for target in targets:
            if (layer, target) not in updates:
                names = factor_names(f"decoder.layers.{layer}.{_OUR_MODULE[target]}")
                weights.update({names[0]: torch.zeros(rank, _inputs(target, model)),
                                names[1]: torch.zeros(_full_rows(target, model), rank)})
    peft = PeftConfig(peft="lora", lora_rank=rank, lora_alpha=float(peft_config["lora_alpha"] if shared else rank),
                      lora_dropout=float(peft_config.get("lora_dropout", 0.0)), lora_target_modules=targets)
    config = Config(model=model, data=config.data, peft=peft, parallel=ParallelConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size))
    return write_checkpoint(save_dir, config, weights.__getitem__, iteration=0,
                            training_state={"iteration": 0, "peft_base": pointer_to(base_dir, base.metadata)})


def _read_peft_directory(directory: str) -> tuple[dict, dict]:
    config_path, weights_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: it needs {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE} (save_pretrained with safetensors; pickles are not read).")
    with open(config_path) as f:
        config = json.load(f)
    unsupported = [what for what, used in (
        (f"peft_type {config.get('peft_type')}", config.get("peft_type") != "LORA"),
        ("DoRA (use_dora)", config.get("use_dora")),
        (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
        ("modules_to_save", config.get("modules_to_save")), ("lora_bias", config.get("lora_bias")),
        ("target_parameters (adapters on experts' weights: export only)", config.get("target_parameters"))) if used]
    if unsupported:
        raise ConfigError(f"the PEFT adapter in {directory} uses {', '.join(unsupported)}; megatron_lite imports "
                          f"plain LoRA on the attention and MLP projections.")
    with safetensors.safe_open(weights_path, framework="pt") as f:
        tensors = {key: f.get_tensor(key).float() for key in f.keys()}
    return config, tensors


def _scale(peft_config: dict, hf_module_key: str, rank: int) -> float:
    """PEFT's scale of one module: lora_alpha (or its alpha_pattern entry) over r, or over sqrt(r) with rsLoRA."""
    alpha = next((a for pattern, a in peft_config.get("alpha_pattern", {}).items()
                  if hf_module_key == pattern or hf_module_key.endswith("." + pattern)), peft_config["lora_alpha"])
    return alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)


def _updates_by_target(peft_config: dict, tensors: dict, architecture: str, model: ModelConfig) -> dict:
    """{(layer, our target): {covered blocks: (A, B, scale)}} for every adapted module; leftovers are refused."""
    updates: dict = {}
    used = set()
    for layer in range(model.num_layers):
        for target, modules in _MODULES[architecture].items():
            for hf_module, covered in modules:
                key = f"{_LAYERS[architecture]}{layer}.{hf_module}"
                names = (f"{key}.lora_A.weight", f"{key}.lora_B.weight")
                if names[0] not in tensors:
                    continue
                lora_a, lora_b = tensors[names[0]], _hf_rows(target, tensors[names[1]], model, to_hf=False)
                if covered is not None:
                    sizes = _block_rows(target, model)
                    lora_b = torch.cat([_hf_block(architecture, block, rows, model, to_hf=False) for block, rows in
                                        zip(covered, lora_b.split([sizes[block] for block in covered]))])
                updates.setdefault((layer, target), {})[covered] = (
                    lora_a, lora_b, _scale(peft_config, key.removeprefix("base_model.model."), lora_a.shape[0]))
                used.update(names)
    leftover = sorted(set(tensors) - used)
    if leftover or not updates:
        raise ConfigError(f"PEFT weights not understood for a {architecture} model of {model.num_layers} layers: "
                          f"{leftover[:4] or 'no LoRA on attention or MLP projections'}; megatron_lite imports "
                          f"LoRA on {', '.join(m for ms in _MODULES[architecture].values() for m, _ in ms)}.")
    return updates


def _shared_factors(updates: dict, peft_config: dict, architecture: str) -> bool:
    """Whether our shape holds the adapter as is: one rank and scale throughout, each fused layer's
    modules all present and sharing one A (as our export writes them)."""
    scales = {(a.shape[0], scale) for members in updates.values() for a, _, scale in members.values()}
    if len(scales) != 1 or next(iter(scales)) != (peft_config["r"], peft_config["lora_alpha"] / peft_config["r"]):
        return False
    for (_, target), members in updates.items():
        factors = [a for a, _, _ in members.values()]
        if len(members) != len(_MODULES[architecture][target]) or any(not torch.equal(a, factors[0]) for a in factors):
            return False
    return True



def _shared(target: str, members: dict, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    lora_a = next(iter(members.values()))[0]
    if None in members:
        return lora_a, members[None][1]
    blocks = {}
    for covered, (_, lora_b, _) in members.items():
        sizes = _block_rows(target, model)
        blocks.update(zip(covered, lora_b.split([sizes[b] for b in covered])))
    return lora_a, _join_blocks(target, blocks, model)


def _stacked(target: str, members: dict, model: ModelConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A = [A_1; A_2; ...; 0], B with each module's scaled B_m in its rows and its A_m's columns."""
    inputs = next(iter(members.values()))[0].shape[1]
    lora_a = torch.zeros(rank, inputs)
    if None in members:
        lora_b = torch.zeros(_full_rows(target, model), rank)
    else:
        sizes = _block_rows(target, model)
        blocks = {b: torch.zeros(n, rank) for b, n in sizes.items()}
    column = 0
    for covered, (a, b, scale) in members.items():
        r = a.shape[0]
        lora_a[column:column + r] = a
        if covered is None:
            lora_b[:, column:column + r] = scale * b
        else:
            for name, rows in zip(covered, (scale * b).split([sizes[n] for n in covered])):
                blocks[name][:, column:column + r] = rows
        column += r
    return lora_a, (lora_b if None in members else _join_blocks(target, blocks, model))
