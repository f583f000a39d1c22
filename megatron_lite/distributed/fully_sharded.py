"""ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params): gather a unit's parameters just
before it runs and release them after, in forward and again in backward.

A *unit* is an outermost submodule whose class is in ``fsdp_unit_modules`` (Megatron-FSDP's
name; training passes the embedding and the transformer layer); every unit's parameters get
buckets of their own. Parameters outside all units (a GPT's final norm and output layer) form the
*root* unit. Each rank stores only its shard of every bucket; the gradient side is ZeRO-2's.

    forward of unit u     pre-hook:  wait for u's all-gather (issue it if not prefetched); with
                                     --overlap-param-gather start gathering the next unit now
                          post-hook: release u; hook u's outputs so their gradient regathers u
    backward of unit u    output's gradient arrives: gather u (prefetch the unit before it)
                          u's last parameter gradient arrives (DDP's hook): reduce-scatter, release u
    root unit             gathered by the first module that uses a root parameter, its own or one
                          handed to it as an argument (the output layer borrows the tied word
                          embedding); released when the model's forward returns, regathered when
                          the gradient of its output arrives

So in each micro-batch every unit is all-gathered twice and reduce-scattered once, and at most
two units are whole at a time (the running one and the prefetched one), with two exceptions:
a tied embedding on a one-stage model stays whole through the backward (its gradient is complete
only once the embedding's backward has run), and recomputation keeps the units of one recomputed
group whole until their backward, which follows at once (--recompute-num-layers units).

Pipelining keeps nothing whole across micro-batches: 1F1B interleaves forwards and backwards of
different micro-batches, and each one gathers what it runs (memory: the shard plus two units;
communication: m x 3 parameter volumes per step for m micro-batches, against ZeRO-1/2's one).
"""
from __future__ import annotations

import torch
from torch import nn


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a forward then is activation recomputation."""
    return torch._C._current_graph_task_id() != -1


def _tensors(output) -> list:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


class FullyShardedUnits:
    """The gather and release schedule of one model chunk's units (see the module docstring).

    Args:
        module: the model chunk.
        units: parameter -> its unit (``units_of``).
        param_to_bucket: parameter -> its bucket (parameters without one are not sharded: frozen).
        prefetch: gather the next unit asynchronously while the current one computes.
    """

    def __init__(self, module: nn.Module, units: dict, param_to_bucket: dict, *, prefetch: bool) -> None:
        self.module = module
        self.param_to_bucket = param_to_bucket
        self.prefetch = prefetch
        self.buckets_of: dict = {}  # unit -> its buckets
        for param, unit in units.items():
            bucket = param_to_bucket.get(param)
            buckets = self.buckets_of.setdefault(unit, [])
            if bucket is not None and bucket not in buckets:
                buckets.append(bucket)
        # Forward order: units as registered, the root last (its final norm and output layer run last).
        self.order = [u for u in self.buckets_of if u is not module] + [module] * (module in self.buckets_of)
        self.root_gathered: list = []  # buckets root-level modules gathered in the running forward
        self.peak_gathered_bytes = 0  # the most whole-parameter bytes alive at once, measured
        for unit in self.order:
            if unit is module:
                continue
            unit.register_forward_pre_hook(self._unit_pre_forward)
            unit.register_forward_hook(self._unit_post_forward)
        for submodule in self._root_level_modules(module, set(self.order)):
            submodule.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)

    @staticmethod
    def units_of(module: nn.Module, unit_classes: tuple) -> dict:
        """parameter -> the outermost submodule of a class in ``unit_classes`` holding it, else ``module``."""
        units: dict = {}

        def visit(submodule: nn.Module, unit: nn.Module) -> None:
            for param in submodule.parameters(recurse=False):
                units.setdefault(param, unit)
            for child in submodule.children():
                inner = child if unit is module and isinstance(child, tuple(unit_classes)) else unit
                visit(child, inner)

        visit(module, module)
        return units

    @staticmethod
    def _root_level_modules(module: nn.Module, units: set) -> list:
        """The modules outside every unit (the root itself included)."""
        found = [module]
        for child in module.children():
            if child not in units:
                found += FullyShardedUnits._root_level_modules(child, units)
        return found

    def forward(self, *args, **kwargs):
        """The chunk's forward; afterwards the root unit is released until its output's gradient arrives."""
        output = self.module(*args, **kwargs)
        gathered, self.root_gathered = self.root_gathered, []
        for bucket in gathered:
            bucket.release_params()
        self._regather_on_gradient(output, gathered, self.module)
        return output

    def _gather(self, buckets: list) -> None:
        for bucket in buckets:
            bucket.gather_params(async_op=False)
        for bucket in buckets:
            bucket.wait_params()
        self._measure()

    def _measure(self) -> None:
        """Add up the whole-parameter buffers alive now (gathered or being gathered)."""
        live = sum(b.gathered.numel() * b.gathered.element_size()
                   for buckets in self.buckets_of.values() for b in buckets if b.gathered is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def _prefetch(self, unit, step: int) -> None:
        """Start gathering the unit ``step`` places from ``unit`` in forward order (-1 in backward)."""
        if not self.prefetch:
            return
        position = self.order.index(unit) if unit in self.order else len(self.order)
        if 0 <= position + step < len(self.order):
            for bucket in self.buckets_of[self.order[position + step]]:
                bucket.gather_params(async_op=True)
            self._measure()

    def _unit_pre_forward(self, unit: nn.Module, args) -> None:
        self._gather(self.buckets_of[unit])
        self._prefetch(unit, -1 if _in_backward() else 1)

    def _unit_post_forward(self, unit: nn.Module, args, output) -> None:
        # A forward inside backward is recomputation: the unit's backward follows at once.
        if not _in_backward():
            for bucket in self.buckets_of[unit]:
                bucket.release_params()
        self._regather_on_gradient(output, self.buckets_of[unit], unit)

    def _root_pre_forward(self, submodule: nn.Module, args, kwargs) -> None:
        used = [*submodule.parameters(recurse=False),
                *(a for a in (*args, *kwargs.values()) if isinstance(a, nn.Parameter))]
        buckets = []
        for param in used:
            bucket = self.param_to_bucket.get(param)
            if bucket is not None and bucket not in buckets:
                buckets.append(bucket)
        self.root_gathered += [b for b in buckets if b not in self.root_gathered]
        self._gather(buckets)

    def _regather_on_gradient(self, output, buckets: list, unit) -> None:
        """Gather ``buckets`` when the gradient of ``output`` arrives: ``unit``'s backward is next."""
        if not torch.is_grad_enabled():
            return

        def hook(grad):
            self._gather(buckets)
            self._prefetch(unit, -1)

        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(hook)
