"""The optimizer step on fp32 main parameters, for any model precision.

The model computes in its precision (fp32, bf16 or fp16); Adam updates fp32
*main* parameters and the result is copied back into the model. One step:

    model grads (DDP's main_grad) -> fp32 main grads
    fp16: unscale, and skip the step on every rank if any rank saw inf/NaN
    global grad norm -> clip -> Adam (or SGD, Lion, Muon) on the main params -> copy main params to the model

Megatron-LM splits this into FP32Optimizer and Float16OptimizerWithFloat16Params;
here an fp32 main parameter simply *aliases* its fp32 model parameter (and an fp32
main grad aliases the fp32 gradient buffer), so one class covers both and the
distributed optimizer only changes which slice of each parameter a rank owns.
Main parameters are 1-D slices of the flattened model parameters, which is what
lets the distributed optimizer hand each rank an arbitrary contiguous range.

``--optimizer-cpu-offload`` keeps the main parameters, their gradients and the
Adam state in host memory and runs the step there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives
from megatron_lite.config import ConfigError, OptimizerConfig
from megatron_lite.distributed.param_and_grad_buffer import ParamSlice
from megatron_lite.optimizer.emerging_optimizers import ChainedOptimizer, muon_optimizer, scalar_optimizer
from megatron_lite.optimizer.muon import uses_muon
from megatron_lite.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32, get_grads_for_norm

# Attributes the gradient norm and finalisation read; main params carry them too.
_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                        "shared_embedding", "expert_parallel")


@dataclass(eq=False)
class ParamRange:
    """The elements of the model parameter named ``name`` that this rank updates: a ``ParamSlice``
    of its data-parallel wrapper, which says where their weights and averaged gradients live."""

    name: str
    slice: ParamSlice

    @property
    def param(self) -> torch.nn.Parameter:
        return self.slice.param

    @property
    def shape(self) -> torch.Size:
        return self.slice.shape

    @property
    def start(self) -> int:
        return self.slice.start

    @property
    def end(self) -> int:
        return self.slice.end

    def model_data(self) -> torch.Tensor:
        return self.slice.data

    def model_grad(self) -> torch.Tensor:
        return self.slice.grad


class MegatronOptimizer:
    """Adam (or SGD, Lion, Muon: ``emerging_optimizers.py``) over fp32 main parameters covering whole model
    parameters, the same on every data-parallel rank (the distributed optimizer narrows them to this rank's shard).

    Args:
        config: --lr, --weight-decay, --adam-*, --clip-grad, --optimizer-cpu-offload.
        model_chunks: DistributedDataParallel-wrapped chunks (their params have ``main_grad``).
        parallel_state: this rank's groups (the norm and the overflow check reduce over them).
        grad_scaler: a loss scaler for fp16 (None for fp32/bf16).
    """

    def __init__(self, config: OptimizerConfig, model_chunks: list, *, parallel_state, grad_scaler=None) -> None:
        self.config = config
        self.model_chunks = model_chunks
        self.parallel_state = parallel_state
        self.grad_scaler = grad_scaler
        self.offload = config.optimizer_cpu_offload
        self._grads_on_host = any(chunk.config.grad_cpu_offload for chunk in model_chunks)
        self.num_skipped_iterations = 0
        self.param_ranges = self._param_ranges(_named_parameters(model_chunks))
        self.main_params = [self._make_main_param(r) for r in self.param_ranges]
        groups = get_param_groups(config, self.param_ranges, self.main_params)
        self.optimizer = self._torch_optimizer(groups)
        self._allocate_state()

    def _torch_optimizer(self, groups: list):
        config = self.config
        if config.optimizer == "muon":
            return muon_optimizer(config, groups, self.param_ranges, self.main_params,
                                  model_chunks=self.model_chunks, parallel_state=self.parallel_state)
        if config.optimizer in ("adam", "lion"):
            # Adam fused: one pass over each parameter's weights, gradient and moments (Megatron's FusedAdam),
            # on a CPU as on a GPU; the per-tensor loop makes about ten (its step took 3.7x as long on CPU).
            return scalar_optimizer(config.optimizer, groups, config)
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)

    def _allocate_state(self) -> None:
        """Create the state now, as torch's first step would (zeros, step 0), so the memory report at
        start-up measures it. SGD's momentum starting at zero gives its first step's exact value too."""
        for main in self.main_params:
            optimizer = self.optimizer.owner(main) if isinstance(self.optimizer, ChainedOptimizer) else self.optimizer
            if isinstance(optimizer, torch.optim.AdamW):
                # The fused step wants its count on the parameters' device.
                self.optimizer.state[main] = {"step": torch.zeros((), device=main.device),
                                              "exp_avg": torch.zeros_like(main),
                                              "exp_avg_sq": torch.zeros_like(main)}
            elif isinstance(optimizer, torch.optim.SGD):
                if self.config.sgd_momentum > 0:
                    self.optimizer.state[main] = {"momentum_buffer": torch.zeros_like(main)}
            else:
                self.optimizer.state[main] = optimizer.initial_state(main)

    # What a subclass changes: over which group gradients differ, and what happens after the step.
    def _param_ranges(self, named_params: list) -> list[ParamRange]:
        """The elements this rank updates: all of each parameter, or its shards under a sharding
        strategy (the data-parallel wrapper knows which)."""
        names = {param: name for name, param in named_params}
        return [ParamRange(names[s.param], s) for chunk in self.model_chunks for s in chunk.param_slices()]

    def _data_parallel_group_for_grads(self):
        """The group over which ranks hold *different* gradients (None: they are replicated)."""
        return None

    def _expert_data_parallel_group_for_grads(self):
        """The same for expert weights, replicated over the expert-data-parallel group."""
        return None

    def _grad_families(self) -> list[tuple[list, int, list]]:
        """(main params, the rank that counts their replicated gradients, the groups their gradients are
        distinct over) for the dense weights and, where experts have groups of their own, the experts:
        their replicas differ from the dense weights' (``ParallelState.splits_experts``)."""
        ps = self.parallel_state
        dense_groups = [ps.model_parallel_group, self._data_parallel_group_for_grads()]
        if not ps.splits_experts:
            return [(self.main_params, ps.tensor_model_parallel_rank, dense_groups)]
        experts = [m for m in self.main_params if getattr(m, "expert_parallel", False)]
        dense = [m for m in self.main_params if not getattr(m, "expert_parallel", False)]
        return [(dense, ps.tensor_model_parallel_rank, dense_groups),
                (experts, ps.expert_tensor_parallel_rank,
                 [ps.expert_tensor_model_pipeline_group, self._expert_data_parallel_group_for_grads()])]

    def _after_main_params_copied(self) -> None:
        """Hook for the distributed optimizer's all-gather."""

    def _main_aliases_model(self, r: ParamRange) -> bool:
        return r.model_data().dtype == torch.float32 and not self.offload

    def _make_main_param(self, r: ParamRange) -> torch.nn.Parameter:
        if self._main_aliases_model(r):
            main = torch.nn.Parameter(r.model_data())  # shares storage: updating it updates the model
        else:
            device = torch.device("cpu") if self.offload else r.model_data().device
            main = torch.nn.Parameter(r.model_data().to(device=device, dtype=torch.float32, copy=True))
        for attribute in _PARALLEL_ATTRIBUTES:
            if hasattr(r.param, attribute):
                setattr(main, attribute, getattr(r.param, attribute))
        # The fp32 gradient buffer itself can serve as main grad, except under offload: the step then reads
        # its gradients from host memory, like its parameters (where --grad-cpu-offload already keeps them).
        if r.model_grad().dtype == torch.float32 and (not self.offload or self._grads_on_host):
            main.grad_copy = None
        else:
            main.grad_copy = torch.empty_like(main)  # persistent fp32 copy, filled every step
        return main

    # The step.
    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale.to(loss.device)

    def get_loss_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.scale)

    def zero_grad(self) -> None:
        """Drop gradients held outside the DDP buffers (zero those with ``zero_grad_buffer``)."""
        for r, main in zip(self.param_ranges, self.main_params):
            r.param.grad = None
            main.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for r, main in zip(self.param_ranges, self.main_params):
            if main.grad_copy is None:
                main.grad = r.model_grad()
            else:
                main.grad_copy.copy_(r.model_grad())
                main.grad = main.grad_copy

    def _unscale_and_check_for_inf(self) -> bool:
        """Unscale the main grads; True if any rank found inf/NaN, so all ranks skip together."""
        inv_scale = self.grad_scaler.inv_scale
        flags = []
        for main in self.main_params:
            main.grad.mul_(inv_scale.to(main.grad.device))
            flags.append((~torch.isfinite(main.grad)).any())
        groups = [group for _, _, family_groups in self._grad_families() for group in family_groups]
        found_inf = torch.stack(flags).any().float() if flags else torch.zeros(())
        found_inf = found_inf.to(collectives.reduction_device(groups))
        for group in groups:
            collectives.all_reduce(found_inf, group, op=dist.ReduceOp.MAX)
        return bool(found_inf.item())

    def _clip_grads(self) -> Optional[float]:
        if self.config.clip_grad <= 0:
            return None
        first_stage = self.parallel_state.is_pipeline_first_stage()
        # Each family's norm over the ranks holding distinct pieces of it; the model's norm joins them.
        norms = [get_grad_norm_fp32(get_grads_for_norm(params, tensor_model_parallel_rank=rank,
                                                       is_pipeline_first_stage=first_stage),
                                    model_parallel_group=groups[0], data_parallel_group=groups[1])
                 for params, rank, groups in self._grad_families()]
        grad_norm = norms[0] if len(norms) == 1 else math.sqrt(sum(norm ** 2 for norm in norms))
        clip_grad_by_total_norm_fp32([m.grad for m in self.main_params], self.config.clip_grad, grad_norm)
        return grad_norm

    @torch.no_grad()
    def step(self) -> tuple:
        """One update with the learning rate already in ``param_groups``.

        Returns:
            (update_successful, grad_norm, num_zeros_in_grad): update_successful is False when
            an fp16 overflow skipped the step (on every rank); grad_norm is None when
            --clip-grad is 0 or the step was skipped; num_zeros_in_grad is not computed (None).
        """
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_inf()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.num_skipped_iterations += 1
                self.zero_grad()
                return False, None, None
        grad_norm = self._clip_grads()
        self.optimizer.step()
        for r, main in zip(self.param_ranges, self.main_params):
            if not self._main_aliases_model(r):
                r.model_data().copy_(main.detach())
        self._after_main_params_copied()
        self.zero_grad()
        return True, grad_norm, None

    # Accounting and checkpoints.
    def memory_report(self) -> dict:
        """Bytes this rank holds, measured from the live tensors, each storage counted once, in the
        first of these that holds it:

        - parameters: the model's parameter storage (flat buffers under optim and optim_grads, the
          shards under optim_grads_params, plus whatever of them is gathered right now);
        - gradients: the data-parallel gradient buffers (full, or shards and staging buffers);
        - optimizer state: main parameters and main grads that are copies (an alias of an fp32 model
          parameter or gradient buffer was counted above), Adam's moments and step, SGD's momentum.

        ``peak_parameter_bytes`` adds the most whole parameters ZeRO-3 held at once since the
        chunks' ``reset_peak_memory()`` (measured at every gather): the most of any one chunk, since a
        rank runs its chunks one at a time and each releases what it gathered before it returns (its
        forward) or once its gradients are in (its backward). On CUDA, ``allocated_bytes`` and
        ``peak_allocated_bytes`` are the caching allocator's own counts (everything, activations too).
        """
        counted: set = set()
        parameter_bytes = storage_bytes([t for c in self.model_chunks for t in c.parameter_tensors()], counted)
        gradient_bytes = storage_bytes([t for c in self.model_chunks for t in c.gradient_tensors()], counted)
        state = [t for main in self.main_params for t in (main, main.grad_copy) if t is not None]
        # Adam's 0-d step counters are left out: per-parameter bytes follow docs/reference.md section 6's accounting.
        state += [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        gathered = max((c.peak_gathered_bytes for c in self.model_chunks), default=0)
        report = {"parameter_bytes": parameter_bytes, "gradient_bytes": gradient_bytes,
                  "optimizer_state_bytes": storage_bytes(state, counted),
                  "peak_parameter_bytes": parameter_bytes + gathered,
                  "optimizer_state_on_host": self.offload}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            report["allocated_bytes"] = torch.cuda.memory_allocated()
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        return report

    def state_dict(self, *, copy: bool = True) -> dict:
        """This rank's optimizer state, keyed by parameter name (the format is documented in
        ``megatron_lite/optimizer/__init__.py``).

        ``copy=False`` hands out the live tensors (detached), which the next step changes: for a caller that
        copies what it keeps at once (a checkpoint's snapshot copies to host memory; cloning here first would
        hold a second copy of the whole state on the device)."""
        own = (lambda t: t.detach().clone()) if copy else torch.Tensor.detach
        params = {}
        for r, main in zip(self.param_ranges, self.main_params):
            state = self.optimizer.state.get(main, {})
            params[r.name] = {"shape": tuple(r.shape), "range": (r.start, r.end), "main_param": own(main),
                              "state": {k: own(v) for k, v in state.items()}}
        dp = self._data_parallel_group_for_grads()
        return {"params": params,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
                "num_skipped_iterations": self.num_skipped_iterations,
                "data_parallel": {"sharded": dp is not None, "size": collectives.world_size(dp),
                                  "rank": collectives.rank(dp)}}

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model's weights into the main parameters (Megatron's name), e.g. after weights were
        loaded without optimizer state; an fp32 main parameter that aliases its weights has them already."""
        for r, main in zip(self.param_ranges, self.main_params):
            if not self._main_aliases_model(r):
                main.copy_(r.model_data())

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by any data-parallel layout whose entries cover this rank's ranges
        (the same layout, or shards merged with ``merge_optimizer_state_dicts``)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ConfigError(f"optimizer checkpoint has {len(saved_groups)} param groups, this optimizer "
                              f"{len(self.optimizer.param_groups)}: it was saved with a different --decoupled-lr "
                              f"setting (it adds two groups) or by a different optimizer.")
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            # The run's own learning-rate end points stay: the scheduler's checkpoint check then names a
            # changed --decoupled-lr instead of the checkpoint's values silently replacing it.
            # How the step is computed (fused, foreach) is this code's choice, not the checkpoint's.
            group.update({k: v for k, v in saved.items() if k not in ("max_lr", "min_lr", "fused", "foreach")})
        for r, main in zip(self.param_ranges, self.main_params):
            entry = state_dict["params"].get(r.name)
            if entry is None and state_dict["data_parallel"]["sharded"]:
                raise ValueError(f"this rank's optimizer checkpoint shard holds nothing of {r.name!r}: merge the "
                                 f"data-parallel shards with merge_optimizer_state_dicts before loading under a "
                                 f"new layout.")
            if entry is None:
                raise KeyError(f"optimizer checkpoint has no state for parameter {r.name!r}: it was saved "
                               f"from a different model or pipeline layout.")
            start, end = entry["range"]
            if tuple(entry["shape"]) != tuple(r.shape) or not start <= r.start <= r.end <= end:
                raise ValueError(
                    f"optimizer checkpoint holds elements {start}:{end} of {r.name!r} (shape {tuple(entry['shape'])}), "
                    f"this rank needs {r.start}:{r.end} (shape {tuple(r.shape)}): merge the data-parallel "
                    f"shards with merge_optimizer_state_dicts before loading under a new layout.")
            window = slice(r.start - start, r.end - start)
            main.copy_(entry["main_param"][window])
            self.optimizer.state[main] = {k: (v[window] if v.dim() == 1 else v).to(main.device, copy=True)
                                          for k, v in entry["state"].items()}
        if self.grad_scaler is not None and state_dict["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self.num_skipped_iterations = state_dict["num_skipped_iterations"]


def get_param_groups(config: OptimizerConfig, param_ranges: list, main_params: list) -> list[dict]:
    """The main parameters in Megatron's groups: biases and norm weights (1-D) are not decayed, and
    with --decoupled-lr the word embedding and output layer get their own learning-rate end points;
    --optimizer muon puts the weight matrices it orthogonalises in a last group of their own.

    Always [decayed, not decayed], then [decoupled decayed, decoupled not decayed] with --decoupled-lr,
    then [Muon's] with --optimizer muon, so every rank of every layout has the same groups (a
    checkpoint's groups line up)."""
    kinds = [(False, False), (False, True)]
    if config.decoupled_lr is not None:
        kinds += [(True, False), (True, True)]
    groups = {kind: _param_group(config, *kind) for kind in kinds}
    muon = _param_group(config, False, False) if config.optimizer == "muon" else None
    for r, main in zip(param_ranges, main_params):
        if muon is not None and uses_muon(r.param, r.shape):
            muon["params"].append(main)
            continue
        decoupled = config.decoupled_lr is not None and getattr(r.param, "is_embedding_or_output_parameter", False)
        groups[(decoupled, len(r.shape) == 1)]["params"].append(main)
    return list(groups.values()) + ([muon] if muon is not None else [])


def _param_group(config: OptimizerConfig, decoupled: bool, no_weight_decay: bool) -> dict:
    group = {"params": [], "weight_decay": 0.0 if no_weight_decay else config.weight_decay,
             "wd_mult": 0.0 if no_weight_decay else 1.0, "lr_mult": 1.0, "is_decoupled_lr": decoupled}
    if decoupled:
        group["max_lr"] = config.decoupled_lr
        group["min_lr"] = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
    return group


def merge_optimizer_state_dicts(state_dicts: list) -> dict:
    """Join the data-parallel ranks' state dicts into one holding whole parameters.

    Each parameter's pieces are concatenated in range order; the result loads into
    any data-parallel size, sharded or not.
    """
    merged = dict(state_dicts[0])
    merged["data_parallel"] = {"sharded": False, "size": 1, "rank": 0}
    names = {name for sd in state_dicts for name in sd["params"]}
    merged["params"] = {}
    for name in names:
        pieces = sorted((sd["params"][name] for sd in state_dicts if name in sd["params"]),
                        key=lambda e: e["range"][0])
        numel = math.prod(pieces[0]["shape"])
        covered = [e["range"] for e in pieces]
        if covered[0][0] != 0 or covered[-1][1] != numel or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise ValueError(f"the shards of {name!r} cover {covered}, not 0:{numel} exactly once: "
                             f"pass the state dicts of every data-parallel rank.")
        keys = pieces[0]["state"].keys()
        merged["params"][name] = {
            "shape": pieces[0]["shape"], "range": (0, numel),
            "main_param": torch.cat([e["main_param"] for e in pieces]),
            "state": {k: (torch.cat([e["state"][k] for e in pieces]) if pieces[0]["state"][k].dim() == 1
                          else pieces[0]["state"][k]) for k in keys}}
    return merged


def storage_bytes(tensors: list, counted: set) -> int:
    """Bytes of the storages under ``tensors`` that are not in ``counted`` (they join it): a view, or
    a tensor aliasing another's storage, costs nothing more."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if storage.nbytes() > 0 and key not in counted:
            counted.add(key)
            total += storage.nbytes()
    return total


def _named_parameters(model_chunks: list) -> list:
    """(name, param) of every trainable parameter, names unique across chunks."""
    named, seen = [], set()
    for chunk in model_chunks:
        for name, param in chunk.module.named_parameters():
            if not param.requires_grad:
                continue
            if name in seen:
                raise ValueError(f"parameter name {name!r} appears in two model chunks; names must be "
                                 f"layout independent (global layer numbers) and unique.")
            seen.add(name)
            named.append((name, param))
    return named
