"""Random-number states for tensor parallelism, and activation checkpointing that replays them.

Dropout on a replicated activation (the residual stream) must draw the same mask
on every tensor-parallel rank, while dropout on a sharded activation (attention
probabilities of this rank's heads) must draw a different mask per rank, or the
shards would be correlated. So there are two states: the default generator,
seeded with ``seed`` on every rank, and a named tensor-parallel state seeded with
``seed + 2718 + tp_rank`` (docs/reference.md section 4), entered with
``get_rng_tracker().fork()``.

The tracker is module-level on purpose: it mirrors torch's own default
generators, which are process-global too.

A "state" here is the CPU generator's state plus, when CUDA is available, the
current CUDA device's: dropout draws from whichever generator its tensor lives on.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
TENSOR_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_generator_states() -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_generator_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _seed_generators(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that can be entered (``fork``) without disturbing the default one."""

    def __init__(self):
        self.states: dict[str, dict] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``; the current state is left as it was."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() before reseeding.")
        saved = _get_generator_states()
        _seed_generators(seed)
        self.states[name] = _get_generator_states()
        _set_generator_states(saved)

    def get_states(self) -> dict:
        """A copy of every named state (for checkpoints and recomputation)."""
        return {name: dict(states) for name, states in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {name: dict(s) for name, s in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Draw random numbers from state ``name`` inside the block, then switch back.

        The named state advances, so successive forks give fresh masks.
        """
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never seeded; call model_parallel_seed(seed, tp_rank) "
                           f"before the first forward pass.")
        saved = _get_generator_states()
        _set_generator_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_generator_states()
            _set_generator_states(saved)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _RNG_TRACKER


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed the default state with ``seed`` and the tensor-parallel state with ``seed + 2718 + tp_rank``."""
    _seed_generators(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + TENSOR_MODEL_PARALLEL_SEED_OFFSET + tp_rank)


class _CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping activations; rerun it in backward with the same RNG states."""

    @staticmethod
    def forward(ctx, function, graph_anchor, *args):
        ctx.function = function
        ctx.generator_states = _get_generator_states()
        ctx.tracker_states = _RNG_TRACKER.get_states()
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.non_tensor_args)
        for i, tensor in zip(ctx.tensor_indices, ctx.saved_tensors):
            args[i] = tensor.detach().requires_grad_(tensor.requires_grad)

        # Replay the forward pass from the states it started with, so dropout draws the
        # same masks; then put back the states the rest of the backward pass expects.
        current_generator_states, current_tracker_states = _get_generator_states(), _RNG_TRACKER.get_states()
        _set_generator_states(ctx.generator_states)
        _RNG_TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _set_generator_states(current_generator_states)
            _RNG_TRACKER.set_states(current_tracker_states)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(args[i].grad if i in ctx.tensor_indices else None for i in range(len(args)))


def checkpoint(function, *args):
    """Activation checkpointing: ``function(*args)`` keeps only its inputs and recomputes in backward.

    ``function`` returns a tensor or a tuple of tensors. The CPU/CUDA generator
    states and the tracker's named states are saved and replayed, so dropout masks
    in the recomputation match the original forward pass.
    """
    # apply() connects the outputs to the graph only if some input requires grad; the
    # parameters inside ``function`` are not inputs, and its real inputs may not require
    # grad (frozen embeddings under LoRA), so always pass an anchor that does.
    graph_anchor = torch.empty(0, requires_grad=True)
    return _CheckpointFunction.apply(function, graph_anchor, *args)


def set_random_seeds(seed: int, parallel_state) -> None:
    """Pipeline stages get different default streams (Megatron's seed + 100 x stage); dropout
    inside tensor-parallel regions uses the tracker's per-tensor-rank stream."""
    stage_seed = seed + 100 * parallel_state.pipeline_model_parallel_rank
    # Python's and NumPy's global generators too, as Megatron: checkpoints save their states, and two
    # identical fresh runs must save the same ones.
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    model_parallel_seed(seed, parallel_state.tensor_model_parallel_rank)
