"""Group relative policy optimisation (Shao et al. 2024) on the training loop's schedules and layouts.

Every --grpo-iterations (mu) iterations a new batch of completions is sampled: each of the global batch /
--grpo-group-size prompts (``data/sft/prompts.py``) gets G completions from the policy itself (the live
training weights at the training layout, through the key/value-cache generator of
``inference/text_generation.py``; no second copy, no reload), each data-parallel rank sampling its share of the
prompts. A prompt's sampling generator is seeded by the run's --seed, the batch and the prompt's place in the
run, so a run is reproducible and its completions do not depend on the layout. The reward functions
(``rewards.py``) score them, and each completion's advantage is its reward against its group's:

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)         (--grpo-scale-rewards group; batch: the batch's std)

A completion is one sequence, prompt then completion, its loss mask over the completion's tokens. With
log-probabilities of logits / --temperature (what was sampled from), per completion token

    ratio = exp(log pi - log pi_old)        loss = -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A) + beta kl
    kl = ratio (exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1)      (k3, times the ratio: TRL's default
                                                                               bias-corrected estimator)

where pi_old is the policy that sampled the batch (mu > 1: scored once, after sampling; mu = 1: the policy
itself, detached, so ratio = 1). --grpo-loss-type averages the per-token losses over the global batch's
completion tokens (dapo, TRL 1.16's default), per completion then over completions (grpo), over completions x
--max-new-tokens (dr_grpo), or over each micro-batch's completion tokens then over micro-batches (bnpo: TRL's
"local batch" is a micro-batch, so it depends on --micro-batch-size as TRL's does on its per-device batch): each
is the per-token loss contract of ``loop.loss_func`` with its own count. The reference pi_ref
(``reference_model``, only when --grpo-beta > 0) is scored once per batch of completions, in a forward-only pass
of the schedule, as --dpo's.

The logged line carries TRL's numbers: ``reward`` (the mean of the batch's rewards), ``reward std`` (their
standard deviation), ``kl`` (the mean of kl over completion tokens, with --grpo-beta > 0), ``entropy`` (the
mean over completion tokens of the entropy of the distribution each was scored with, logits / --temperature),
``completion length`` (mean tokens per completion, its EOD included) and ``clip ratio`` (the share of completion tokens
whose ratio is clipped on the side its advantage pushes).
"""
from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import torch
import torch.distributed as dist

from megatron_lite.config import Config, ConfigError
from megatron_lite.data.sft.prompt_format import response_text
from megatron_lite.data.sft.prompts import PromptDataset, load_prompts
from megatron_lite.data.sft.sft_dataset import build_sample
from megatron_lite.inference.text_generation import generate
from megatron_lite.process_groups import collectives, failures
from megatron_lite.tokenizer import build_model_tokenizer
from megatron_lite.training import rewards
from megatron_lite.training.logger import print_rank_last
from megatron_lite.training.reference_model import build_reference, forward_only_outputs, to_device

OLD_KEY, REFERENCE_KEY = "old_log_probs", "reference_log_probs"  # per-token log-probabilities a batch carries
ADVANTAGE_STD_EPSILON = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not a division by 0


@dataclasses.dataclass(frozen=True)
class LossSettings:
    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    temperature: float
    max_new_tokens: int

    @classmethod
    def of(cls, config: Config) -> "LossSettings":
        grpo = config.grpo
        return cls(loss_type=grpo.grpo_loss_type, beta=grpo.grpo_beta, epsilon_low=grpo.grpo_epsilon,
                   epsilon_high=grpo.epsilon_high, temperature=grpo.temperature, max_new_tokens=grpo.max_new_tokens)


def per_token_losses(log_probs: torch.Tensor, old_log_probs: torch.Tensor, reference_log_probs: torch.Tensor | None,
                     advantages: torch.Tensor, settings: LossSettings):
    """(per-token losses, kl or None, clipped) of the module docstring, all [b, s]; ``advantages`` [b]."""
    ratio = torch.exp(log_probs - old_log_probs)
    advantages = advantages[:, None]
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    losses = -torch.min(ratio * advantages, clipped_ratio * advantages)
    clipped = (((ratio < 1 - settings.epsilon_low) & (advantages < 0))
               | ((ratio > 1 + settings.epsilon_high) & (advantages > 0)))
    kl = None
    if settings.beta != 0:
        difference = reference_log_probs - log_probs
        kl = (torch.exp(difference) - difference - 1) * ratio
        losses = losses + settings.beta * kl
    return losses, kl, clipped


def logged_names(settings: LossSettings) -> tuple[str, ...]:
    kl = ("kl",) if settings.beta != 0 else ()
    return ("grpo loss", "reward", "reward std", *kl, "entropy", "completion length", "clip ratio")


def completion_log_probs(output_tensor: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] log-probabilities of the completion tokens from the per-token losses, 0 elsewhere (so that no
    padding position's value reaches an exp)."""
    return torch.where(loss_mask > 0, -output_tensor.float(), torch.zeros((), device=output_tensor.device))


def grpo_loss_func(settings: LossSettings, batch: dict, outputs: tuple[torch.Tensor, torch.Tensor]):
    """(sum of the micro-batch's losses, its count, the logged sums and counts): ``loop.loss_func``'s contract,
    counting completion tokens (dapo), completions (grpo, dr_grpo) or micro-batches (bnpo). ``outputs``: the
    model's per-token loss and entropy."""
    output_tensor, entropy = outputs
    mask = batch["loss_mask"].float()
    log_probs = completion_log_probs(output_tensor, mask)
    old = batch[OLD_KEY] if OLD_KEY in batch else log_probs.detach()
    losses, kl, clipped = per_token_losses(log_probs, old, batch.get(REFERENCE_KEY), batch["advantages"], settings)
    masked, tokens = losses * mask, mask.sum(dim=1)
    completions = torch.tensor(float(len(mask)), device=mask.device)
    if settings.loss_type == "dapo":
        loss_sum, count = masked.sum(), mask.sum()
    elif settings.loss_type == "grpo":
        loss_sum, count = (masked.sum(dim=1) / tokens.clamp(min=1)).sum(), completions
    elif settings.loss_type == "bnpo":  # TRL's local batch is a micro-batch: its token mean, one count each
        loss_sum, count = masked.sum() / mask.sum().clamp(min=1), torch.ones((), device=mask.device)
    else:  # dr_grpo
        loss_sum, count = masked.sum() / settings.max_new_tokens, completions
    # Means over the global batch: of completions (the batch's reward statistics each completion carries) or of
    # completion tokens.
    sums = {"grpo loss": (loss_sum.detach(), count), "reward": (batch["rewards"].sum(), completions),
            "reward std": (batch["reward_std"].sum(), completions),
            "kl": ((kl * mask).sum().detach() if kl is not None else None, mask.sum()),
            "entropy": ((entropy * mask).sum(), mask.sum()),
            "completion length": (tokens.sum(), completions), "clip ratio": ((clipped * mask).sum(), mask.sum())}
    reported = {name: torch.stack([sums[name][0].float(), sums[name][1].float()]) for name in logged_names(settings)}
    return loss_sum, count.long(), reported


def grpo_forward_step(settings: LossSettings, data_iterator, model):
    """The policy's forward of one micro-batch (``loop.forward_step``'s contract) and its GRPO loss."""
    batch = to_device(next(data_iterator))
    outputs = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                    temperature=settings.temperature, entropy=True)
    return outputs, functools.partial(grpo_loss_func, settings, batch)


def log_probs_forward_step(key: str, temperature: float, data_iterator, model):
    """A forward of one micro-batch whose 'loss' dict carries its completion tokens' log-probabilities."""
    batch = to_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], temperature=temperature)

    def keep_log_probs(output_tensor):
        zero = torch.zeros((), device=output_tensor.device)
        return zero, zero.long(), {key: completion_log_probs(output_tensor, batch["loss_mask"])}
    return output, keep_log_probs


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What --grpo reads besides the model: the tokenizer, the prompts and the reward functions."""
    tokenizer: object
    prompts: PromptDataset
    reward_functions: list


def read_inputs(config: Config, parallel_state, train_iters: int) -> Inputs:
    """The prompts and reward functions, checked against the batch and --seq-length: at start-up, before the model
    is built, so that a typo costs seconds."""
    grpo, training = config.grpo, config.training
    dp = parallel_state.data_parallel_world_size
    global_batch = training.global_batch(dp)
    if global_batch % (grpo.grpo_group_size * dp):
        raise ConfigError(f"--grpo: the global batch ({global_batch} completions) must be a multiple of "
                          f"--grpo-group-size ({grpo.grpo_group_size}) x data-parallel size ({dp}): each rank "
                          f"samples whole groups of completions.")
    tokenizer = build_model_tokenizer(dataclasses.asdict(config.data), config.model.vocab_size)
    prompts, descriptions = load_prompts(config.data.train_data_path, tokenizer,
                                         config.data.sft_tokenizer_prompt_format)
    dataset = PromptDataset(prompts, seed=training.seed, num_batches=-(-train_iters // grpo.grpo_iterations),
                            prompts_per_batch=global_batch // grpo.grpo_group_size, descriptions=descriptions)
    _check_lengths(config, dataset.longest)
    print_rank_last(f" data: train {dataset.describe()}")
    return Inputs(tokenizer, dataset, rewards.load_reward_functions(grpo.reward_function))


class GroupRelativePolicyOptimization:
    """The --grpo forward and backward: every mu iterations a new batch of completions (sampled, scored, and
    scored by the old policy and the reference where the loss needs them), then the policy's pass over it.

    ``forward_backward`` has ``loop._forward_backward``'s signature, so ``train_step_with_losses`` takes it in
    that one's place; ``data_iterator`` is not read (the prompts are this object's) and neither is
    ``forward_step_func``."""

    def __init__(self, config: Config, parallel_state, model_chunks: list, inputs: Inputs, *, run_schedule,
                 start_iteration: int):
        grpo = config.grpo
        self.settings = LossSettings.of(config)
        self.run_schedule, self.iteration = run_schedule, start_iteration
        self.tokenizer, self.prompts, self.reward_functions = inputs.tokenizer, inputs.prompts, inputs.reward_functions
        self.weights = torch.tensor(grpo.weights(), dtype=torch.float32)
        self.adapters_off = config.peft.peft == "lora"
        self.reference_chunks = None
        if grpo.grpo_beta != 0:
            self.reference_chunks = model_chunks if self.adapters_off else build_reference(config, parallel_state)
        # The sampling ranks gather the completions of every replica; the first of them writes them.
        self.logs_completions = bool(grpo.grpo_log_completions) and parallel_state.rank == _sampling_source(
            parallel_state)
        self.completions_log = None
        if self.logs_completions and parallel_state.data_parallel_rank == 0:
            self.completions_log = open(grpo.grpo_log_completions, "w" if start_iteration == 0 else "a")
        self.batches = None

    def forward_backward(self, config: Config, parallel_state, model_chunks, data_iterator, num_microbatches, *,
                         forward_only: bool, grad_scale_func=None, forward_step_func=None):
        if self.batches is None or self.iteration % config.grpo.grpo_iterations == 0:
            self.batches = self._new_batches(config, parallel_state, model_chunks, num_microbatches)
        self.iteration += 1
        return self.run_schedule(config, parallel_state, model_chunks, iter(self.batches), num_microbatches,
                                 forward_only=forward_only, grad_scale_func=grad_scale_func,
                                 forward_step_func=functools.partial(grpo_forward_step, self.settings))

    def _new_batches(self, config: Config, parallel_state, model_chunks, num_microbatches: int) -> list[dict]:
        """This rank's micro-batches of a new batch of completions, with the log-probabilities the loss needs."""
        index = self.iteration // config.grpo.grpo_iterations
        prompts = self.prompts.batch(index, parallel_state.data_parallel_rank, parallel_state.data_parallel_world_size)
        completions = sample_completions(config, parallel_state, model_chunks[0], prompts, index, self.tokenizer.eod)
        group = config.grpo.grpo_group_size
        repeated = [prompt for _, prompt in prompts for _ in range(group)]
        texts = [response_text(ids, self.tokenizer, config.data.sft_tokenizer_prompt_format) for ids in completions]
        scores = self._scores(parallel_state, repeated, texts, completions)
        reward = scores @ self.weights
        every_reward = _gathered(reward, parallel_state.data_parallel_group)
        advantages = group_advantages(reward, every_reward, group, config.grpo.grpo_scale_rewards)
        if self.logs_completions:
            self._log_completions(parallel_state, repeated, texts, completions, scores, reward, advantages)
        batches = micro_batches(repeated, completions, config.model.seq_length, self.tokenizer.pad,
                                config.training.micro_batch_size, reward=reward, advantages=advantages,
                                reward_std=every_reward.std().item())
        if config.grpo.grpo_iterations > 1:
            self._score(config, parallel_state, model_chunks, batches, num_microbatches, OLD_KEY, adapters_off=False)
        if self.reference_chunks is not None:
            self._score(config, parallel_state, self.reference_chunks, batches, num_microbatches, REFERENCE_KEY,
                        adapters_off=self.adapters_off)
        return batches

    def _scores(self, parallel_state, prompts: list, texts: list[str], completions: list[list[int]]) -> torch.Tensor:
        """[completions, functions] rewards, computed once per data-parallel replica (on the rank whose tokens
        generation broadcast) and broadcast over its model-parallel group; a failure stops every rank."""
        source = _sampling_source(parallel_state)
        columns = {key: [prompt.columns.get(key) for prompt in prompts]
                   for key in dict.fromkeys(key for prompt in prompts for key in prompt.columns)}
        shown = [[{"role": "assistant", "content": text}] if prompt.conversational else text
                 for prompt, text in zip(prompts, texts)]

        def score():
            if parallel_state.rank != source:
                return torch.zeros(len(texts), len(self.reward_functions))
            return rewards.score(self.reward_functions, [prompt.prompt for prompt in prompts], shown, completions,
                                 columns)
        group = parallel_state.model_parallel_group
        scores = failures.run_on_every_rank(score, "score the completions").to(collectives.reduction_device([group]))
        collectives.broadcast(scores, source, group)
        return scores.cpu()

    def _score(self, config: Config, parallel_state, chunks: list, batches: list[dict], num_microbatches: int,
               key: str, *, adapters_off: bool) -> None:
        """Adds ``key``: the per-token log-probabilities of ``chunks`` (last stage) to each micro-batch."""
        log_probs = forward_only_outputs(self.run_schedule, config, parallel_state, chunks, [batches],
                                         num_microbatches,
                                         functools.partial(log_probs_forward_step, key, self.settings.temperature),
                                         key, adapters_off=adapters_off)
        if parallel_state.is_pipeline_last_stage():
            for batch, values in zip(batches, log_probs):
                batch[key] = values.cpu()

    def _log_completions(self, parallel_state, prompts, texts, completions, scores, reward, advantages) -> None:
        """Every replica's completions, gathered over the sampling ranks' data-parallel group and written by the
        first, one JSON line each."""
        names = [function.name for function in self.reward_functions]
        lines = [json.dumps({"iteration": self.iteration + 1, "prompt": prompt.prompt, "completion": text,
                             "completion_ids": ids, "rewards": dict(zip(names, row)), "reward": total,
                             "advantage": advantage})
                 for prompt, text, ids, row, total, advantage in zip(prompts, texts, completions, scores.tolist(),
                                                                     reward.tolist(), advantages.tolist())]
        every = [lines]
        if parallel_state.data_parallel_world_size > 1:
            every = [None] * parallel_state.data_parallel_world_size
            dist.all_gather_object(every, lines, group=parallel_state.data_parallel_group)
        if self.completions_log is not None:
            self.completions_log.write("".join(line + "\n" for rank_lines in every for line in rank_lines))
            self.completions_log.flush()


def sample_completions(config: Config, parallel_state, chunk, prompts: list, index: int, eod: int) -> list[list[int]]:
    """--grpo-group-size completions of each prompt, sampled from the training weights (one batch per prompt, the
    prompt repeated: no padding, so a completion does not depend on what else a rank samples)."""
    chunk.finish_param_sync()  # the distributed optimizer's last all-gather of the updated weights
    model, grpo = chunk.module, config.grpo
    completions = []
    for place, prompt in prompts:
        generator = torch.Generator().manual_seed(sampling_seed(config.training.seed, index, place))
        completions += generate(model, [list(prompt.ids)] * grpo.grpo_group_size, max_new_tokens=grpo.max_new_tokens,
                                eod=eod, temperature=grpo.temperature, top_p=grpo.top_p, generator=generator,
                                parallel_state=parallel_state)
    chunk.train()  # generation left it in eval mode
    return completions


def sampling_seed(seed: int, batch: int, place: int) -> int:
    """The seed of one prompt's completions: the run's --seed, the batch of completions, the prompt's place."""
    return int(np.random.SeedSequence([seed, batch, place]).generate_state(1)[0])


def group_advantages(reward: torch.Tensor, every_reward: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Each completion's reward against its group's mean, over the group's (or batch's) standard deviation."""
    grouped = reward.view(-1, group)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale == "none":
        return centred
    std = grouped.std(dim=1).repeat_interleave(group) if scale == "group" else every_reward.std()
    return centred / (std + ADVANTAGE_STD_EPSILON)


def micro_batches(prompts: list, completions: list[list[int]], seq_length: int, pad_token: int,
                  micro_batch_size: int, *, reward: torch.Tensor, advantages: torch.Tensor,
                  reward_std: float) -> list[dict]:
    """One sequence per completion, prompt then completion then padding, the loss mask on the completion."""
    samples = []
    for prompt, ids in zip(prompts, completions):
        tokens = np.asarray(list(prompt.ids) + ids, dtype=np.int64)
        mask = np.concatenate([np.zeros(len(prompt.ids), np.uint8), np.ones(len(ids), np.uint8)])
        samples.append(build_sample([(tokens, mask)], seq_length=seq_length, pad_token=pad_token,
                                    pack_sequences=False))
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        batch = torch.utils.data.default_collate(samples[start:start + micro_batch_size])
        window = slice(start, start + micro_batch_size)
        batch.update(rewards=reward[window].clone(), advantages=advantages[window].clone(),
                     reward_std=torch.full((len(batch["tokens"]),), reward_std))
        batches.append(batch)
    return batches


def _check_lengths(config: Config, longest_prompt: int) -> None:
    """A prompt and its longest completion fit a sequence (the last completion token is a label only)."""
    if longest_prompt + config.grpo.max_new_tokens > config.model.seq_length + 1:
        needed = longest_prompt + config.grpo.max_new_tokens - 1
        raise ConfigError(f"--grpo: the longest prompt ({longest_prompt} tokens) and --max-new-tokens "
                          f"{config.grpo.max_new_tokens} need --seq-length >= {needed} (got "
                          f"{config.model.seq_length}): raise it, or lower --max-new-tokens.")


def _sampling_source(parallel_state) -> int:
    """The rank of this replica that samples the tokens generation broadcasts: the last stage's first tensor rank."""
    return parallel_state.layout.rank(tensor=0, data=parallel_state.data_parallel_rank,
                                      pipeline=parallel_state.pipeline_model_parallel_world_size - 1)


def _gathered(values: torch.Tensor, group) -> torch.Tensor:
    """Every data-parallel rank's ``values`` (equal sizes), in rank order (on the host)."""
    device = collectives.reduction_device([group])
    every = torch.empty(values.numel() * collectives.world_size(group), dtype=values.dtype, device=device)
    collectives.all_gather_into_tensor(every, values.to(device), group)
    return every.cpu()
