"""The optimizers beyond Adam and SGD (Megatron-LM's emerging-optimizers flags): ``--optimizer lion`` and
``--optimizer muon``, Muon for the weight matrices chained with ``--muon-scalar-optimizer`` (Adam or Lion)
for everything else.

``MegatronOptimizer`` builds them from its param groups and main parameters; both keep their state per main
parameter, 1-D like the parameter, so checkpoints, data-parallel merging and resharding treat them as Adam's.
"""
from __future__ import annotations

import itertools
from collections.abc import MutableMapping

import torch

from megatron_lite.optimizer.lion import Lion
from megatron_lite.optimizer.muon import Muon, MuonMatrix, fused_parts, uses_muon


class ChainedOptimizer:
    """Several torch optimizers over disjoint parameters, stepped as one (Megatron-LM's name): their groups
    in order, and one ``state`` mapping that reads and writes each parameter's own optimizer's."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers
        self.state = _RoutedState({p: o for o in optimizers for g in o.param_groups for p in g["params"]})

    @property
    def param_groups(self) -> list:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def owner(self, param):
        return self.state.owners[param]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


class _RoutedState(MutableMapping):
    def __init__(self, owners: dict) -> None:
        self.owners = owners

    def __getitem__(self, param):
        if param not in self.owners or param not in self.owners[param].state:
            raise KeyError(param)
        return self.owners[param].state[param]

    def __setitem__(self, param, value) -> None:
        self.owners[param].state[param] = value

    def __delitem__(self, param) -> None:
        del self.owners[param].state[param]

    def __iter__(self):
        return itertools.chain.from_iterable(o.state for o in dict.fromkeys(self.owners.values()))

    def __len__(self) -> int:
        return sum(len(o.state) for o in dict.fromkeys(self.owners.values()))


def scalar_optimizer(name: str, groups: list, config):
    """AdamW (fused, as ``--optimizer adam``) or Lion over ``groups``."""
    if name == "lion":
        return Lion(groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2),
                    weight_decay=config.weight_decay)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, weight_decay=config.weight_decay, fused=True)


def muon_optimizer(config, groups: list, param_ranges: list, main_params: list, *, model_chunks: list,
                   parallel_state) -> ChainedOptimizer:
    """Muon over the last group (``get_param_groups`` puts the matrices there), the scalar optimizer over the rest."""
    matrices = muon_matrices(model_chunks, parallel_state, split=config.muon_split_qkv)
    by_name = {m.name: m for m in matrices}
    slices = {main: (by_name[r.name], r.start, r.end) for r, main in zip(param_ranges, main_params)
              if r.name in by_name}
    muon = Muon(groups[-1], slices=slices, matrices=matrices, config=config)
    return ChainedOptimizer([scalar_optimizer(config.muon_scalar_optimizer, groups[:-1], config), muon])


def muon_matrices(model_chunks: list, parallel_state, split: bool) -> list[MuonMatrix]:
    """Every matrix Muon updates in ``model_chunks``, sorted by name: the order every rank walks them in."""
    names = {param: name for chunk in model_chunks for name, param in chunk.module.named_parameters()}
    fused = fused_parts(model_chunks, split)
    matrices = []
    for chunk in model_chunks:
        for buffer in chunk.grad_buffers:
            sharded = buffer.sharding.num_shards > 1
            for param, bucket in buffer.param_to_bucket.items():
                shape = bucket.layout[param][1]  # the parameter itself is empty between uses under ZeRO-3
                if not uses_muon(param, shape):
                    continue
                blocks, parts = fused[param](shape[0]) if param in fused else (1, (shape[0],))
                expert = getattr(param, "expert_parallel", False)
                matrices.append(MuonMatrix(
                    name=names[param], shape=shape, blocks=blocks, parts=parts,
                    partition_dim=param.partition_dim if getattr(param, "tensor_model_parallel", False) else None,
                    tp_group=(parallel_state.expert_tensor_parallel_group if expert
                              else parallel_state.tensor_model_parallel_group),
                    data_parallel_group=buffer.data_parallel_group if sharded else None))
    return sorted(matrices, key=lambda m: m.name)
