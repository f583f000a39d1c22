"""Generating text from a GPT with a key/value cache, under tensor, pipeline, expert, data and context parallelism.

    new_tokens = generate(model, [prompt_ids, ...], max_new_tokens=64, eod=tokenizer.eod, greedy=True)

The first forward pass runs the whole prompts and fills every layer's key/value cache
(``StaticInferenceContext``); each step after it runs only the newest token, whose keys
and values join the cache. The model computes logits for the last position only.

A batch of prompts of different lengths is left-padded to the longest, so every
sequence's newest token is in the same column. Padding is masked out of attention, and
each prompt's positions count from 0 at its first real token, so a prompt gives the same
tokens in a batch as alone. A sequence that has produced EOD is finished: its later
tokens are dropped, and the batch stops when all are finished.

Every rank of a tensor x pipeline layout runs this same loop. Tensor-parallel ranks
attend with, and cache, their own heads. Pipeline stages pass the hidden states of each
forward pass on with point-to-point sends. The last stage gathers the logits and samples;
one broadcast over the model-parallel group gives every rank the tokens (the first stage
embeds them next, and all ranks must agree when to stop). The sampling generator is
seeded alike on every rank, so the tokens do not depend on the layout.

Under context parallelism the prompts' prefill is split over the context-parallel ranks: the prompts are
left-padded to a multiple of 2 x cp positions, each rank runs its two chunks of them, and every layer gathers
the whole prompts' keys and values into each rank's cache (``inference_context.py``). Decoding then runs
whole on every context-parallel rank (a step is one token per sequence, nothing to split), each on its full
cache: the simplest exact design, which costs each rank the whole cache. The last position's logits are
context-parallel rank 0's (it holds the last chunk, last), and its tokens are broadcast to the others.

Data-parallel ranks generate batches of their own. Under expert parallelism they still share
every mixture-of-experts layer (its tokens are dispatched over them), so they run the same
number of steps: a batch stops when every data-parallel rank's batch is finished.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.config import ConfigError
from megatron_lite.context_parallel import ContextParallelConfig, get_batch_on_this_cp_rank
from megatron_lite.inference.forward import forward_through_stages
from megatron_lite.inference.inference_context import StaticInferenceContext
from megatron_lite.process_groups import collectives


@torch.inference_mode()
def generate(model, prompts: list[list[int]], *, max_new_tokens: int, eod: int | None = None, greedy: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0, generator: torch.Generator | None = None,
             parallel_state=None) -> list[list[int]]:
    """The new tokens of each prompt: ``max_new_tokens`` of them, or fewer ending with ``eod``.

    Args:
        model: this rank's GPTModel (its stage, its tensor-parallel shard).
        prompts: token ids, one non-empty list per sequence of the batch.
        greedy: take the most likely token (so does ``temperature`` 0); else sample from the
            softmax of logits / ``temperature``, restricted to the ``top_k`` most likely tokens
            (0: all) and to the smallest set whose probability reaches ``top_p`` (0: all).
        generator: the random source of sampling; seed it alike on every rank.
        parallel_state: the layout the model is cut by; None for one process.
    """
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    greedy = greedy or temperature == 0
    model.eval()
    device = next(model.parameters()).device
    cp = ContextParallelConfig.of_layout(parallel_state)
    tokens, padding = _left_padded(prompts, device, multiple=1 if cp is None else 2 * cp.size)
    _check_length(model.config, int((~padding).sum(dim=1).max()), max_new_tokens)  # the padding takes no position
    context = StaticInferenceContext(tokens.shape[1] + max_new_tokens, context_parallel=cp)
    position_ids = ((~padding).cumsum(dim=1) - 1).clamp(min=0)
    attention_mask = _prompt_mask(padding) if padding.any() else None
    new_tokens = []
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logits = _forward(model, *_this_ranks_positions(tokens, position_ids, attention_mask, context), context,
                          parallel_state)
        context.increment_sequence_len_offset(tokens.shape[1])
        next_tokens = torch.empty(len(prompts), dtype=torch.long, device=device)
        if logits is not None:
            next_tokens.copy_(sample(logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                                     generator=generator))
        _broadcast_from_last_stage(next_tokens, parallel_state)
        _broadcast_from_context_rank_0(next_tokens, parallel_state)
        new_tokens.append(next_tokens)
        if eod is not None:
            finished |= next_tokens == eod
        if _all_finished(finished, parallel_state):
            break
        tokens, position_ids = next_tokens[:, None], position_ids[:, -1:] + 1
        if attention_mask is not None:  # the new token sees every real token before it
            padding = torch.nn.functional.pad(padding, (0, 1), value=False)
            attention_mask = padding[:, None, None, :]
    return [_until_eod(row, eod) for row in torch.stack(new_tokens, dim=1).tolist()]


def check_sampling(*, temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0 is --greedy), got {temperature}.")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 keeps every token), got {top_k}.")
    if not 0.0 <= top_p <= 1.0:
        raise ConfigError(f"--top-p must be in [0, 1] (0 keeps every token), got {top_p}.")


def sample(logits: torch.Tensor, *, greedy: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [b, V]: the argmax, or a draw after temperature, top-k and top-p."""
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the tokens more likely than it hold less than top_p: the most likely always stays.
        outside = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    # Drawn on the CPU: a CPU generator gives the same numbers whatever the device.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)


def _left_padded(prompts: list[list[int]], device, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [b, longest rounded up to ``multiple``] with padding on the left, and where the padding is
    (True)."""
    if not prompts or not all(prompts):
        raise ValueError("generate needs at least one prompt, and no prompt may be empty (start one with EOD).")
    longest = -(-max(len(p) for p in prompts) // multiple) * multiple
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
    padding = torch.ones(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt):] = torch.tensor(prompt)
        padding[row, longest - len(prompt):] = False
    return tokens.to(device), padding.to(device)


def _check_length(config, prompt_length: int, max_new_tokens: int) -> None:
    if prompt_length + max_new_tokens > config.max_position_embeddings:
        raise ConfigError(f"a prompt of {prompt_length} tokens and --max-new-tokens {max_new_tokens} exceed the "
                          f"{config.max_position_embeddings} positions the model has (--max-position-embeddings): "
                          f"lower --max-new-tokens or shorten the prompt.")


def _prompt_mask(padding: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s], True where a prompt token may not attend: the future and the padding.

    A padding position still sees itself: a row with nothing to attend to is NaN, and that
    NaN would reach the real tokens through the next layer's keys and values (0 x NaN = NaN).
    """
    length = padding.shape[1]
    future = torch.ones(length, length, dtype=torch.bool, device=padding.device).triu(1)
    itself = torch.eye(length, dtype=torch.bool, device=padding.device)
    return (future | padding[:, None, None, :]) & ~itself


def _this_ranks_positions(tokens, position_ids, attention_mask, context) -> tuple:
    """(tokens, position ids, mask) of this pass on this rank: a context-parallel prefill's chunks of the
    rank (the mask's query rows), else all of them."""
    if not context.splits_sequence:
        return tokens, position_ids, attention_mask
    batch = {"tokens": tokens, "position_ids": position_ids}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    batch = get_batch_on_this_cp_rank(batch, context.context_parallel.rank, context.context_parallel.size)
    return batch["tokens"], batch["position_ids"], batch.get("attention_mask")


def _forward(model, tokens, position_ids, attention_mask, context, parallel_state) -> torch.Tensor | None:
    """One forward pass through every pipeline stage: the last stage's logits [b, V], None elsewhere."""
    output = forward_through_stages(model, parallel_state, tokens, position_ids, attention_mask,
                                    inference_context=context)
    return None if output is None else output[:, -1]


def _broadcast_from_last_stage(next_tokens: torch.Tensor, parallel_state) -> None:
    """Every rank of the model-parallel group takes the tokens of the last stage's tensor-parallel rank 0."""
    if parallel_state is None:
        return
    source = parallel_state.layout.rank(tensor=0, data=parallel_state.data_parallel_rank,
                                        pipeline=parallel_state.pipeline_model_parallel_world_size - 1,
                                        context=parallel_state.context_parallel_rank)
    collectives.broadcast(next_tokens, source, parallel_state.model_parallel_group)


def _broadcast_from_context_rank_0(next_tokens: torch.Tensor, parallel_state) -> None:
    """Every context-parallel rank takes rank 0's tokens: after a split prefill only its last position is the
    prompts' last (the others' are earlier positions), and so every rank decodes the same sequence."""
    if parallel_state is None or parallel_state.context_parallel_world_size == 1:
        return
    source = parallel_state.group_ranks["context"][0]
    collectives.broadcast(next_tokens, source, parallel_state.context_parallel_group)


def _all_finished(finished: torch.Tensor, parallel_state) -> bool:
    """Whether this batch is done; under expert parallelism, whether every data-parallel rank's batch is."""
    done = finished.all()
    if parallel_state is not None and parallel_state.splits_experts:
        done = done.to(torch.int32)
        collectives.all_reduce(done, parallel_state.data_parallel_group_with_context, op=dist.ReduceOp.MIN)
    return bool(done)


def _until_eod(tokens: list[int], eod: int | None) -> list[int]:
    return tokens[:tokens.index(eod) + 1] if eod in tokens else tokens
