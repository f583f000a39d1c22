"""Direct preference optimisation (Rafailov et al. 2023) on the training loop's schedules and layouts.

Each pair (prompt x, chosen y_w, rejected y_l) is two sequences of one micro-batch
(``data/sft/preference.py``). A sequence's log-probability log pi(y | x) is the sum of its answer tokens'
log-probabilities, which the model's per-token loss already is (negated); with h = beta (log-ratio of
y_w - log-ratio of y_l), log-ratio = log pi(y | x) - log pi_ref(y | x), the per-pair losses are

    sigmoid   -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)          (eps: --dpo-label-smoothing, cDPO)
    hinge     max(0, 1 - h)                                              (SLiC)
    ipo       (lw / |y_w| - ll / |y_l| - 1 / (2 beta))^2                 (IPO, log-ratios per answer token)

and, without a reference, on the average log-probability per answer token a = log pi(y | x) / |y|:

    simpo     the sigmoid loss of h = beta (a_w - a_l) - gamma           (SimPO; gamma: --dpo-simpo-gamma)
              + alpha NLL(y_w)                                           (alpha: --dpo-cpo-alpha, CPO-SimPO)
    orpo      -beta log sigmoid(log odds(a_w) - log odds(a_l)) + NLL(x + y_w),  odds(a) = e^a / (1 - e^a)
                                                                         (ORPO; beta is its lambda)

averaged over the global batch's pairs (the per-token loss path, counting pairs instead of tokens); NLL is
the per-token cross entropy of the chosen sides averaged over the global batch's tokens (CPO's over the
answers, ORPO's over prompt and answer, as TRL's CPOTrainer and ORPOTrainer): each micro-batch adds its sum
times (pairs / tokens of the global batch), counted before the pass. The logged rewards are beta x the
log-ratio of each side (beta x a without a reference), their accuracy the share of pairs whose chosen reward
is the higher, their margin the mean difference: the numbers and definitions of TRL's trainers.

The reference pi_ref is frozen (``reference_model``): a second copy of --pretrained-checkpoint at the same
layout, or under --peft lora the policy itself with its adapters off (the frozen base). Every iteration its
log-probabilities are computed once, in a forward-only pass of the same schedule over the same
micro-batches, before the policy's forward and backward; the last pipeline stage keeps them with the
micro-batches it computes the loss of. Under context parallelism each rank sums its own positions and the
sums are all-reduced (the gradient flows back to every rank's positions unchanged).

With --dpo-precompute-ref-log-probs that pass runs once, before training, over every micro-batch the run
will read (``precompute_reference``): the same micro-batches in the same schedule calls, so the same numbers
bit for bit, kept on the last stage's host and handed to each micro-batch as it is read; then the
reference's copy is freed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch
import torch.nn.functional as F

from megatron_lite.config import Config
from megatron_lite.model.document_rows import attention_input
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron_lite.training.logger import print_rank_last
from megatron_lite.training.reference_model import build_reference, forward_only_outputs, to_device

LOGGED = ("dpo loss", "rewards chosen", "rewards rejected", "reward accuracy", "reward margin")
REFERENCE_KEY = "reference_log_probs"  # what the reference pass adds to a micro-batch on the last stage


@dataclasses.dataclass(frozen=True)
class LossSettings:
    loss_type: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    nll_weight: float  # of the chosen sides' NLL: --dpo-cpo-alpha (simpo), 1 (orpo), else 0
    uses_reference: bool
    seq_length: int
    cp_group: object
    reports: bool  # context-parallel rank 0: the one whose loss dict and pair count are summed

    @classmethod
    def of(cls, config: Config, parallel_state) -> "LossSettings":
        training = config.training
        nll_weight = {"simpo": training.dpo_cpo_alpha, "orpo": 1.0}.get(training.dpo_loss_type, 0.0)
        return cls(loss_type=training.dpo_loss_type, beta=training.dpo_beta,
                   label_smoothing=training.dpo_label_smoothing, simpo_gamma=training.dpo_simpo_gamma,
                   nll_weight=nll_weight, uses_reference=training.dpo_uses_reference,
                   seq_length=config.model.seq_length, cp_group=parallel_state.context_parallel_group,
                   reports=parallel_state.context_parallel_rank == 0)


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor, settings: LossSettings) -> tuple[torch.Tensor, ...]:
    """(per-pair losses, chosen rewards, rejected rewards) of the module docstring. ``chosen``, ``rejected``: each
    side's log-ratio to the reference, or without one its log-probability, summed over its answer tokens."""
    beta = settings.beta
    if not settings.uses_reference:  # per answer token
        chosen, rejected = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    rewards = (beta * chosen.detach(), beta * rejected.detach())
    if settings.loss_type == "ipo":
        difference = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        return (difference - 1 / (2 * beta)) ** 2, *rewards
    if settings.loss_type == "orpo":
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        return -beta * F.logsigmoid(log_odds), *rewards
    h = beta * (chosen - rejected) - (settings.simpo_gamma if settings.loss_type == "simpo" else 0.0)
    if settings.loss_type == "hinge":
        return torch.relu(1 - h), *rewards
    smoothing = settings.label_smoothing
    return -(1 - smoothing) * F.logsigmoid(h) - smoothing * F.logsigmoid(-h), *rewards


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate near 0 (expm1) and far below it (log1p), split at -ln 2."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def per_document(values: torch.Tensor, segment_ids: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[b, seq_length] sums of ``values`` [b, s] over each sequence's documents (column j: document j; padding's
    column, ``seq_length``, is cut off)."""
    sums = torch.zeros((values.shape[0], seq_length + 1), device=values.device, dtype=values.dtype)
    return sums.scatter_add(1, segment_ids.to(values.device), values)[:, :seq_length]


def sequence_log_probs(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, segment_ids: torch.Tensor,
                       seq_length: int, cp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """([b, seq_length] log-probability sums, [b, seq_length] answer-token counts) of each sequence's
    documents, summed over the context-parallel ranks."""
    mask = loss_mask.float()
    log_probs = per_document(-per_token_loss.float() * mask, segment_ids, seq_length)
    counts = per_document(mask, segment_ids, seq_length)
    if collectives.world_size(cp_group) > 1:
        log_probs = reduce_from_tensor_model_parallel_region(log_probs, cp_group)
        collectives.all_reduce(counts, cp_group)
    return log_probs, counts


def nll_mask(settings: LossSettings, batch: dict) -> torch.Tensor:
    """[b/2, s] the chosen sides' positions whose cross entropy the NLL term averages: the answer's (simpo, as
    TRL's CPOTrainer) or every position of a document, prompt included (orpo, as TRL's ORPOTrainer)."""
    if settings.loss_type == "orpo":
        return (batch["segment_ids"][0::2] < settings.seq_length).float()
    return batch["loss_mask"][0::2].float()


def nll_scale(settings: LossSettings, parallel_state, micro_batches: list[dict]) -> torch.Tensor:
    """The global batch's pairs over its NLL positions (this rank's ``micro_batches`` and every data- and
    context-parallel rank's): a micro-batch's NLL sum times this, divided by the pairs as the loop divides the
    loss, is its share of the NLL's per-token mean."""
    device = collectives.reduction_device([parallel_state.data_parallel_group_with_context])
    counts = torch.cat([per_document(batch["loss_mask"].float(), batch["segment_ids"], settings.seq_length)
                        for batch in micro_batches]).to(device)
    collectives.all_reduce(counts, settings.cp_group)  # a document's answer tokens may lie on other ranks
    pairs = (counts[0::2] > 0).sum() if settings.reports else torch.zeros((), device=device)
    positions = sum(nll_mask(settings, batch).sum() for batch in micro_batches).to(device)
    totals = torch.stack([pairs.float(), positions])
    collectives.all_reduce(totals, parallel_state.data_parallel_group_with_context)
    return totals[0] / totals[1].clamp(min=1)


def dpo_loss_func(settings: LossSettings, batch: dict, scale: torch.Tensor | None, output_tensor: torch.Tensor):
    """(sum of the micro-batch's pair losses, its pair count, the logged sums and counts), the per-token
    loss contract of ``loop.loss_func`` with pairs for tokens. Every context-parallel rank backpropagates
    the whole pair loss through its own positions; only rank 0 counts the pairs and reports. ``scale``:
    ``nll_scale``'s, with an NLL term."""
    log_probs, counts = sequence_log_probs(output_tensor, batch["loss_mask"], batch["segment_ids"],
                                           settings.seq_length, settings.cp_group)
    pairs = counts[0::2] > 0  # documents of the chosen rows; the rejected row holds the same pairs
    chosen, rejected = log_probs[0::2][pairs], log_probs[1::2][pairs]
    if settings.uses_reference:
        reference = batch[REFERENCE_KEY]
        chosen, rejected = chosen - reference[0::2][pairs], rejected - reference[1::2][pairs]
    losses, rewards_chosen, rewards_rejected = pair_losses(chosen, rejected, counts[0::2][pairs],
                                                           counts[1::2][pairs], settings)
    loss_sum = losses.sum()
    logged_loss = loss_sum.detach()
    count = torch.tensor(float(pairs.sum()) if settings.reports else 0.0, device=loss_sum.device)
    per_position = {}
    if settings.nll_weight:
        mask = nll_mask(settings, batch)
        nll = (output_tensor[0::2].float() * mask).sum()  # this rank's positions
        loss_sum = loss_sum + settings.nll_weight * scale * nll
        whole = nll.detach().clone()
        collectives.all_reduce(whole, settings.cp_group)
        logged_loss = logged_loss + settings.nll_weight * scale * whole
        per_position["nll loss"] = torch.stack([nll.detach(), mask.sum()])  # summed over every rank's positions
    sums = (logged_loss, rewards_chosen.sum(), rewards_rejected.sum(),
            (rewards_chosen > rewards_rejected).float().sum(), (rewards_chosen - rewards_rejected).sum())
    reported = {name: torch.stack([value if settings.reports else torch.zeros_like(value), count])
                for name, value in zip(LOGGED, sums)}
    return loss_sum, count.long(), reported | per_position


def dpo_forward_step(settings: LossSettings, scale: torch.Tensor | None, data_iterator, model):
    """The policy's forward of one micro-batch (``loop.forward_step``'s contract) and its DPO loss."""
    batch = to_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], attention_input(batch), labels=batch["labels"])
    return output, functools.partial(dpo_loss_func, settings, batch, scale)


def reference_forward_step(settings: LossSettings, data_iterator, model):
    """The reference's forward of one micro-batch; its 'loss' dict carries the sequences' log-probabilities."""
    batch = to_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], attention_input(batch), labels=batch["labels"])

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
        self.reference_chunks = None  # none for a reference-free loss, or once precomputed
        if self.settings.uses_reference:
            self.reference_chunks = model_chunks if self.adapters_off else build_reference(config, parallel_state)

    def forward_backward(self, config: Config, parallel_state, model_chunks, data_iterator, num_microbatches, *,
                         forward_only: bool, grad_scale_func=None, forward_step_func=None):
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        micro_batches = [[next(iterator) for _ in range(num_microbatches)] for iterator in iterators]
        last_stage = parallel_state.is_pipeline_last_stage()
        if self.reference_chunks is not None:  # else the loss needs none, or each micro-batch carries it already
            reference = self._reference_log_probs(config, parallel_state, micro_batches, num_microbatches)
            if last_stage:
                for batch, log_probs in zip(micro_batches[-1], reference):
                    batch[REFERENCE_KEY] = log_probs
        scale = nll_scale(self.settings, parallel_state, micro_batches[-1]) if self.settings.nll_weight and \
            last_stage else None
        policy_iterators = [iter(batches) for batches in micro_batches]
        return self.run_schedule(config, parallel_state, model_chunks,
                                 policy_iterators if isinstance(data_iterator, list) else policy_iterators[0],
                                 num_microbatches, forward_only=forward_only, grad_scale_func=grad_scale_func,
                                 forward_step_func=functools.partial(dpo_forward_step, self.settings, scale))

    def _reference_log_probs(self, config: Config, parallel_state, micro_batches: list,
                             num_microbatches: int) -> list[torch.Tensor]:
        """The reference's [b, seq_length] sequence log-probabilities of each micro-batch (last stage)."""
        return forward_only_outputs(self.run_schedule, config, parallel_state, self.reference_chunks, micro_batches,
                                    num_microbatches, functools.partial(reference_forward_step, self.settings),
                                    REFERENCE_KEY, adapters_off=self.adapters_off)

    def precompute_reference(self, config: Config, parallel_state, iterators: tuple, passes: tuple,
                             reads: tuple) -> tuple:
        """--dpo-precompute-ref-log-probs: ``iterators`` (train, valid, test; None where absent) wrapped so that
        each micro-batch carries the reference's log-probabilities, computed now from ``passes``, a second set of
        the same iterators, for the ``reads`` micro-batches the run will read from each; then the reference's
        copy is freed (``reference_bytes`` of this rank)."""
        start = time.perf_counter()
        num_microbatches = config.training.num_microbatches(parallel_state.data_parallel_world_size)
        scored = [self._score_ahead(config, parallel_state, source, count, num_microbatches) if source else []
                  for source, count in zip(passes, reads)]
        freed = 0 if self.adapters_off else reference_bytes(self.reference_chunks)
        self.reference_chunks = None
        counts = ", ".join(f"{len(values)} {split}" for values, split in zip(scored, ("train", "validation", "test")))
        freed_text = (f"its frozen copy, {freed / 2 ** 20:.1f} MiB on this rank, is freed" if freed else
                      "it is the base with the adapters off (no copy to free)")
        print_rank_last(f" --dpo-precompute-ref-log-probs: the reference scored the micro-batches ahead ({counts}) "
                        f"in {time.perf_counter() - start:.1f} s; {freed_text}")
        if not parallel_state.is_pipeline_last_stage():
            return iterators
        seq_length = config.model.seq_length
        return tuple(None if iterator is None else
                     [with_reference(i, values, seq_length) for i in iterator] if isinstance(iterator, list)
                     else with_reference(iterator, values, seq_length) for iterator, values in zip(iterators, scored))

    def _score_ahead(self, config: Config, parallel_state, source, count: int, num_microbatches: int) -> list:
        """The reference's log-probabilities of the next ``count`` micro-batches of ``source`` (last stage; their
        trailing all-zero columns, where no document lies, dropped), read as ``forward_backward`` reads them."""
        iterators = source if isinstance(source, list) else [source]
        values = []
        for _ in range(count // num_microbatches):
            micro_batches = [[next(iterator) for _ in range(num_microbatches)] for iterator in iterators]
            values += [trimmed(log_probs).to("cpu", copy=True)
                       for log_probs in self._reference_log_probs(config, parallel_state, micro_batches,
                                                                  num_microbatches)]
        return values


def reference_bytes(chunks: list) -> int:
    """Bytes of the reference's weights and buffers on this rank."""
    return sum(t.numel() * t.element_size() for chunk in chunks for t in (*chunk.parameters(), *chunk.buffers()))


def trimmed(log_probs: torch.Tensor) -> torch.Tensor:
    """[b, k]: ``log_probs`` [b, seq_length] without its trailing columns that are 0 in every row (no document)."""
    used = torch.nonzero(log_probs.ne(0).any(dim=0))
    return log_probs[:, :int(used.max()) + 1 if len(used) else 0]


def with_reference(iterator, values: list, seq_length: int):
    """The micro-batches of ``iterator``, each with its precomputed reference log-probabilities [b, seq_length]."""
    for log_probs in values:
        batch = dict(next(iterator))
        batch[REFERENCE_KEY] = torch.zeros(log_probs.shape[0], seq_length).index_copy_(
            1, torch.arange(log_probs.shape[1]), log_probs)
        yield batch
    raise RuntimeError("--dpo-precompute-ref-log-probs: the run read more micro-batches than were scored ahead")
