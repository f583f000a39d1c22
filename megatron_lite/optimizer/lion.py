"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; docs/reference.md section 17):
the sign of an interpolated momentum, so every element moves by exactly lr (plus weight decay).

    c <- beta1 m + (1 - beta1) g        --lion-beta1
    w <- w (1 - lr wd) - lr sign(c)
    m <- beta2 m + (1 - beta2) g        --lion-beta2

Element-wise, so it runs on the distributed optimizer's flat shards unchanged. ``--optimizer lion`` uses it for
every parameter, ``--muon-scalar-optimizer lion`` for those Muon leaves out.
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float, betas: tuple, weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    def initial_state(self, main: torch.Tensor) -> dict:
        return {"exp_avg": torch.zeros_like(main)}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                momentum = self.state[param]["exp_avg"]
                direction = momentum.lerp(param.grad, 1.0 - beta1).sign_()
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
                param.add_(direction, alpha=-group["lr"])
                momentum.lerp_(param.grad, 1.0 - beta2)
