"""Direct preference optimisation (Rafailov et al. 2023) on the training loop's schedules and layouts.

Each pair (prompt x, chosen y_w, rejected y_l) is two sequences of one micro-batch
(``data/sft/preference.py``). A sequence's log-probability log pi(y | x) is the sum of its answer tokens'
log-probabilities, which the model's per-token loss already is (negated); with h = beta (log-ratio of
y_w - log-ratio of y_l), log-ratio = log pi(y | x) - log pi_ref(y | x), the per-pair losses are

    sigmoid   -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)          (eps: --dpo-label-smoothing, cDPO)
    hinge     max(0, 1 - h)                                              (SLiC)
    ipo       (lw / |y_w| - ll / |y_l| - 1 / (2 beta))^2                 (IPO, log-ratios per answer token)

averaged over the global batch's pairs (the per-token loss path, counting pairs instead of tokens). The
logged rewards are beta x log-ratio of each side, their accuracy the share of pairs whose chosen reward is
the higher, their margin the mean difference: the numbers and definitions of TRL's DPOTrainer.

The reference pi_ref is frozen (``reference_model``): a second copy of --pretrained-checkpoint at the same
layout, or under --peft lora the policy itself with its adapters off (the frozen base). Every iteration its
log-probabilities are computed once, in a forward-only pass of the same schedule over the same
micro-batches, before the policy's forward and backward; the last pipeline stage keeps them with the
micro-batches it computes the loss of. Under context parallelism each rank sums its own positions and the
sums are all-reduced (the gradient flows back to every rank's positions unchanged).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megatron_lite.config import Config
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron_lite.training.reference_model import build_reference, forward_only_outputs, to_device

LOGGED = ("dpo loss", "rewards chosen", "rewards rejected", "reward accuracy", "reward margin")
REFERENCE_KEY = "reference_log_probs"  # what the reference pass adds to a micro-batch on the last stage


def pair_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
                reference_rejected: torch.Tensor, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *,
                loss_type: str, beta: float, label_smoothing: float) -> torch.Tensor:
    """The per-pair losses of the module docstring, from sequence log-probabilities and answer lengths."""
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    if loss_type == "ipo":
        difference = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        return (difference - 1 / (2 * beta)) ** 2
    h = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "hinge":
        return torch.relu(1 - h)
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def sequence_log_probs(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, segment_ids: torch.Tensor,
                       seq_length: int, cp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """([b, seq_length] log-probability sums, [b, seq_length] answer-token counts) of each sequence's
    documents (column j: document j; padding's column is cut off), summed over the context-parallel ranks."""
    mask = loss_mask.float()
    shape = (per_token_loss.shape[0], seq_length + 1)
    log_probs = torch.zeros(shape, device=per_token_loss.device).scatter_add(1, segment_ids,
                                                                            -per_token_loss.float() * mask)
    counts = torch.zeros(shape, device=mask.device).scatter_add(1, segment_ids, mask)
    if collectives.world_size(cp_group) > 1:
        log_probs = reduce_from_tensor_model_parallel_region(log_probs, cp_group)
        collectives.all_reduce(counts, cp_group)
    return log_probs[:, :seq_length], counts[:, :seq_length]


@dataclasses.dataclass(frozen=True)
class LossSettings:
    loss_type: str
    beta: float
    label_smoothing: float
    seq_length: int
    cp_group: object
    reports: bool  # context-parallel rank 0: the one whose loss dict and pair count are summed

    @classmethod
    def of(cls, config: Config, parallel_state) -> "LossSettings":
        training = config.training
        return cls(loss_type=training.dpo_loss_type, beta=training.dpo_beta,
                   label_smoothing=training.dpo_label_smoothing, seq_length=config.model.seq_length,
                   cp_group=parallel_state.context_parallel_group,
                   reports=parallel_state.context_parallel_rank == 0)


def dpo_loss_func(settings: LossSettings, batch: dict, output_tensor: torch.Tensor):
    """(sum of the micro-batch's pair losses, its pair count, the logged sums and counts), the per-token
    loss contract of ``loop.loss_func`` with pairs for tokens. Every context-parallel rank backpropagates
    the whole pair loss through its own positions; only rank 0 counts the pairs and reports."""
    log_probs, counts = sequence_log_probs(output_tensor, batch["loss_mask"], batch["segment_ids"],
                                           settings.seq_length, settings.cp_group)
    reference = batch[REFERENCE_KEY]
    pairs = counts[0::2] > 0  # documents of the chosen rows; the rejected row holds the same pairs
    chosen, rejected = log_probs[0::2][pairs], log_probs[1::2][pairs]
    reference_chosen, reference_rejected = reference[0::2][pairs], reference[1::2][pairs]
    losses = pair_losses(chosen, rejected, reference_chosen, reference_rejected, counts[0::2][pairs],
                         counts[1::2][pairs], loss_type=settings.loss_type, beta=settings.beta,
                         label_smoothing=settings.label_smoothing)
    rewards_chosen = settings.beta * (chosen - reference_chosen).detach()
    rewards_rejected = settings.beta * (rejected - reference_rejected).detach()
    loss_sum = losses.sum()
    count = torch.tensor(float(pairs.sum()) if settings.reports else 0.0, device=loss_sum.device)
    sums = (loss_sum.detach(), rewards_chosen.sum(), rewards_rejected.sum(),
            (rewards_chosen > rewards_rejected).float().sum(), (rewards_chosen - rewards_rejected).sum())
    reported = {name: torch.stack([value if settings.reports else torch.zeros_like(value), count])
                for name, value in zip(LOGGED, sums)}
    return loss_sum, count.long(), reported


def dpo_forward_step(settings: LossSettings, data_iterator, model):
    """The policy's forward of one micro-batch (``loop.forward_step``'s contract) and its DPO loss."""
    batch = to_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, functools.partial(dpo_loss_func, settings, batch)


def reference_forward_step(settings: LossSettings, data_iterator, model):
    """The reference's forward of one micro-batch; its 'loss' dict carries the sequences' log-probabilities."""
    batch = to_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])

    def keep_log_probs(output_tensor):
        log_probs, _ = sequence_log_probs(output_tensor, batch["loss_mask"], batch["segment_ids"],
                                          settings.seq_length, settings.cp_group)
        zero = torch.zeros((), device=log_probs.device)
        return zero, zero.long(), {REFERENCE_KEY: log_probs}
    return output, keep_log_probs


class DirectPreferenceOptimization:
    """The --dpo forward and backward: the reference's pass, then the policy's, over the same micro-batches.

    ``forward_backward`` has ``loop._forward_backward``'s signature (``run_schedule``, which it calls), so
    ``train_step_with_losses`` and ``evaluate`` take it in that one's place; its ``forward_step_func`` is
    not used (the two passes have their own forward steps). Under the interleaved schedule each model chunk
    reads its own iterator of the same micro-batches, as in training."""

    def __init__(self, config: Config, parallel_state, model_chunks: list, *, run_schedule):
        self.settings = LossSettings.of(config, parallel_state)
        self.run_schedule = run_schedule
        self.adapters_off = config.peft.peft == "lora"
        self.reference_chunks = model_chunks if self.adapters_off else build_reference(config, parallel_state)

    def forward_backward(self, config: Config, parallel_state, model_chunks, data_iterator, num_microbatches, *,
                         forward_only: bool, grad_scale_func=None, forward_step_func=None):
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        micro_batches = [[next(iterator) for _ in range(num_microbatches)] for iterator in iterators]
        reference = self._reference_log_probs(config, parallel_state, micro_batches, num_microbatches)
        if parallel_state.is_pipeline_last_stage():
            for batch, log_probs in zip(micro_batches[-1], reference):
                batch[REFERENCE_KEY] = log_probs
        policy_iterators = [iter(batches) for batches in micro_batches]
        return self.run_schedule(config, parallel_state, model_chunks,
                                 policy_iterators if isinstance(data_iterator, list) else policy_iterators[0],
                                 num_microbatches, forward_only=forward_only, grad_scale_func=grad_scale_func,
                                 forward_step_func=functools.partial(dpo_forward_step, self.settings))

    def _reference_log_probs(self, config: Config, parallel_state, micro_batches: list,
                             num_microbatches: int) -> list[torch.Tensor]:
        """The reference's [b, seq_length] sequence log-probabilities of each micro-batch (last stage)."""
        return forward_only_outputs(self.run_schedule, config, parallel_state, self.reference_chunks, micro_batches,
                                    num_microbatches, functools.partial(reference_forward_step, self.settings),
                                    REFERENCE_KEY, adapters_off=self.adapters_off)
