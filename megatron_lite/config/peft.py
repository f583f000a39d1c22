"""PeftConfig: parameter-efficient fine-tuning (LoRA, adapters, prefixes), and the linear layers a model's
LoRA may target."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from megatron_lite.config.fields import check_choices, require

if TYPE_CHECKING:
    from megatron_lite.config.model import ModelConfig


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
        check_choices(self)
        require(self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}.")
        require(self.lora_alpha > 0, f"--lora-alpha must be positive, got {self.lora_alpha}.")
        require(0.0 <= self.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1), got {self.lora_dropout}.")
        require(len(self.lora_target_modules) == len(set(self.lora_target_modules)) > 0,
                 f"--lora-target-modules must name each module once, got {self.lora_target_modules}.")
        self.lora_target_modules = [m for m in LORA_TARGET_MODULES if m in self.lora_target_modules]  # one order
        require(self.adapter_dim >= 1, f"--adapter-dim must be >= 1, got {self.adapter_dim}.")
        require(self.prefix_length >= 1, f"--prefix-length must be >= 1, got {self.prefix_length}.")
        hidden = self.prefix_projection_hidden_size
        require(hidden is None or hidden >= 1, f"--prefix-projection-hidden-size must be >= 1, got {hidden}.")


def lora_targets_of(model: ModelConfig) -> tuple[str, ...]:
    """The linear layers of ``model`` that --lora-target-modules may name."""
    if not model.multi_latent_attention:
        return LORA_TARGET_MODULES[:4]
    return (*latent_projections(model), "linear_proj", "linear_fc1", "linear_fc2")


def latent_projections(model: ModelConfig) -> tuple[str, ...]:
    """Multi-latent attention's query and key/value projections: what ``linear_qkv`` means there."""
    query = ("linear_q_down_proj", "linear_q_up_proj") if model.q_lora_rank is not None else ("linear_q_proj",)
    return (*query, "linear_kv_down_proj", "linear_kv_up_proj")
