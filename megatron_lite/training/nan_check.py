"""Stop a run whose loss or gradient norm is no longer a number (Megatron-LM's
--check-for-nan-in-loss-and-grad, on by default), as --rerun-mode disabled does it: at once, without a re-run
(rerun_state_machine.py re-runs the iteration first).

Once the loss is NaN or infinite every later update is too: without the check a diverged run trains on
to the end, exits 0 and saves NaN weights as its newest checkpoint, which a restart then resumes. The
check comes after the forward-backward, before the optimizer step and the iteration's save, so the last
checkpoint is the last good one. Each rank checks its own loss (last pipeline stage) and gradients;
the ranks agree on the verdict (one all-reduce), so all of them stop, and the rank that saw it reports.
Under fp16 the loss scaler handles NaN and Inf (it skips the step, which then changes nothing).
"""
from __future__ import annotations

import math

from megatron_lite.config import UserError
from megatron_lite.process_groups import failures


class NonFiniteLossError(UserError, RuntimeError):
    """The loss or the gradient norm of an iteration is NaN or infinite: the run diverged."""


def check_for_nan_in_loss_and_grad(loss: float | None, grad_norm: float | None, iteration: int) -> None:
    """Raise NonFiniteLossError on every rank when this rank's ``loss`` (last stage only; None elsewhere)
    or ``grad_norm`` (None when not computed) is not finite."""
    failures.run_on_every_rank(lambda: _check_local(loss, grad_norm, iteration),
                               f"keep a finite loss and grad norm at iteration {iteration}")


def _check_local(loss: float | None, grad_norm: float | None, iteration: int) -> None:
    bad = {name: value for name, value in (("loss", loss), ("grad norm", grad_norm))
           if value is not None and not math.isfinite(value)}
    if bad:
        found = " and ".join(f"the {name} is {value}" for name, value in bad.items())
        raise NonFiniteLossError(
            f"iteration {iteration}: {found} on rank {failures.global_rank()}: training diverged, so the run stops "
            f"before saving this iteration (the last checkpoint is the last good one). Lower --lr, add warm-up "
            f"(--lr-warmup-iters) or --clip-grad, or check the data; --no-check-for-nan-in-loss-and-grad trains "
            f"on regardless.")
