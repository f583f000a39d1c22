"""GRPOConfig: group relative policy optimisation (--grpo, ``training/grpo.py``): sampling, rewards and the loss.

The names follow TRL's GRPOConfig where Megatron-LM has none (``--grpo-group-size`` is TRL's num_generations,
``--grpo-iterations`` its num_iterations, mu); the sampling flags are the generate command's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.fields import check_choices, require

# --grpo-loss-type: how the per-token losses are averaged (TRL's loss_type; dapo is TRL 1.16's default).
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
# --grpo-scale-rewards: what the group-centred rewards are divided by (TRL's scale_rewards).
GRPO_SCALE_REWARDS = ("group", "batch", "none")


@dataclass(kw_only=True)
class GRPOConfig:
    # FILE.py:NAME, one per reward function, called as TRL calls them: f(prompts, completions, **columns).
    reward_function: list = field(default_factory=list, metadata={"action": "extend"})  # the flag may repeat
    reward_weights: Optional[list[float]] = None  # one per --reward-function (default: 1 each)
    grpo_group_size: int = 8  # completions sampled per prompt (TRL's num_generations)
    max_new_tokens: int = 64  # of each completion (TRL's max_completion_length)
    temperature: float = 1.0
    top_p: float = 0.0  # 0 (or 1): every token
    grpo_epsilon: float = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon-high]
    grpo_epsilon_high: Optional[float] = None  # default --grpo-epsilon (DAPO's clip-higher takes 0.28)
    grpo_beta: float = 0.0  # the KL penalty to the reference; 0: no reference model at all
    grpo_iterations: int = 1  # optimizer steps on each batch of completions (mu)
    grpo_loss_type: str = field(default="dapo", metadata={"choices": GRPO_LOSS_TYPES})
    grpo_scale_rewards: str = field(default="group", metadata={"choices": GRPO_SCALE_REWARDS})
    grpo_log_completions: Optional[str] = None  # JSONL: one line per completion (prompt, text, rewards)

    def __post_init__(self) -> None:
        check_choices(self)
        require(self.grpo_group_size >= 2, f"--grpo-group-size must be >= 2 (advantages compare the completions of "
                                           f"a prompt), got {self.grpo_group_size}.")
        require(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}.")
        require(self.temperature > 0, f"--temperature must be positive (GRPO samples), got {self.temperature}.")
        require(0.0 <= self.top_p <= 1.0, f"--top-p must be in [0, 1] (0 keeps every token), got {self.top_p}.")
        require(self.grpo_epsilon > 0 and (self.grpo_epsilon_high is None or self.grpo_epsilon_high > 0),
                 "--grpo-epsilon and --grpo-epsilon-high must be positive.")
        require(self.grpo_beta >= 0, f"--grpo-beta must be >= 0, got {self.grpo_beta}.")
        require(self.grpo_iterations >= 1, f"--grpo-iterations must be >= 1, got {self.grpo_iterations}.")
        require(all(":" in entry for entry in self.reward_function),
                 f"--reward-function takes FILE.py:NAME (the file and the function in it), got "
                 f"{' '.join(self.reward_function)}.")
        require(self.reward_weights is None or len(self.reward_weights) == len(self.reward_function),
                 f"--reward-weights gives {len(self.reward_weights or [])} weights for {len(self.reward_function)} "
                 f"--reward-function(s): give one per function.")

    @property
    def epsilon_high(self) -> float:
        return self.grpo_epsilon if self.grpo_epsilon_high is None else self.grpo_epsilon_high

    def weights(self) -> list[float]:
        return self.reward_weights if self.reward_weights is not None else [1.0] * len(self.reward_function)
