"""Newton-Schulz orthogonalisation of a matrix, whole or split over tensor-parallel ranks (docs/reference.md
section 17).

Muon replaces a weight matrix's momentum M = U S V^T by (nearly) U V^T. The odd polynomial

    X <- a X + b (X X^T) X + c (X X^T)^2 X

applied a few times to X = M / ||M||_F pushes every singular value towards 1 without an SVD. The
coefficients (a, b, c) are ``--muon-coefficient-type``'s: ``simple`` repeats torch.optim.Muon's one triple,
``quintic`` cycles five triples tuned per step (Megatron-LM's default).

The iteration works on the shorter side: X X^T is then the smaller Gram matrix. A matrix whose rows (or
columns) are split over tensor-parallel ranks can be orthogonalised without gathering it
(``--muon-tp-mode distributed``): orient it so the split runs along X's columns, and X X^T is the sum of the
ranks' own Gram matrices, one all-reduce per step; the polynomial's other products stay local.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives

COEFFICIENT_SETS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
}
# Keeps an all-zero momentum (a matrix that got no gradient yet) from dividing by zero.
NORM_EPS = 1e-7


def newton_schulz(x: torch.Tensor, *, steps: int, coefficient_type: str, bf16: bool,
                  tp_group=None, transpose: bool | None = None) -> torch.Tensor:
    """The orthogonalised ``x`` (fp32, same shape).

    Args:
        x: fp32 [rows, cols]; with ``tp_group``, this rank's piece of a matrix split along the dimension
            that ``transpose`` turns into X's columns.
        steps: iterations (--muon-num-ns-steps).
        coefficient_type: a key of ``COEFFICIENT_SETS``.
        bf16: iterate in bf16 (--muon-fp32-matmul-prec medium or low, as torch.optim.Muon always does).
        tp_group: sum the Gram matrix (and the norm) over this group.
        transpose: iterate on ``x.T``; default: when ``x`` has more rows than columns.
    """
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    X = x.T if transpose else x
    squared = (X * X).sum()
    collectives.all_reduce(squared, tp_group)
    X = X / squared.sqrt().clamp(min=NORM_EPS)
    if bf16:
        X = X.bfloat16()
    for a, b, c in itertools.islice(itertools.cycle(COEFFICIENT_SETS[coefficient_type]), steps):
        gram = X @ X.T
        if tp_group is not None:
            # gloo sums no bf16: the partial Gram matrices travel in fp32.
            gram = gram.float()
            collectives.all_reduce(gram, tp_group, op=dist.ReduceOp.SUM)
            gram = gram.to(X.dtype)
        X = torch.addmm(X, torch.addmm(gram, gram, gram, beta=b, alpha=c), X, beta=a)
    X = X.float()
    return X.T if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """--muon-scale-mode's multiplier of the orthogonalised update of a [rows, cols] (output x input) matrix.

    shape_scaling: sqrt(max(1, rows / cols)), Keller Jordan's Muon (torch.optim.Muon's ``adjust_lr_fn="original"``);
    spectral: sqrt(max(rows, cols)), Moonlight's (with --muon-extra-scale-factor 0.2 it is torch's
    ``"match_rms_adamw"``: the update's RMS matches AdamW's); unit_rms_norm: sqrt(rows / cols), Scion's.
    """
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    return math.sqrt(rows / cols)
