"""What the log line reports: throughput, MFU, memory, in Megatron-LM's format.

The FLOPs behind throughput and MFU are ``model.flops``' count, which the planner shares.

Users' log parsers read Megatron's line, so its fields, order and number formats are
kept exactly; tokens/s, MFU and peak memory go on a second line after it.
"""
from __future__ import annotations

import math
import os
import resource
import sys
import warnings

import torch

from megatron_lite.config import DataConfig, LoggingConfig
from megatron_lite.planner.cluster import BF16_PEAK_TFLOPS


def device_peak_tflops(peak_tflops: float | None) -> float | None:
    """--peak-tflops wins; else the planner's bf16 peak for a known GPU; None on CPU or an unknown device."""
    if peak_tflops is not None:
        return peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


def model_flops_utilization(tflops_per_gpu: float, peak: float | None) -> float | None:
    if peak is None:
        return None
    mfu = tflops_per_gpu / peak
    if mfu > 1.0:
        warnings.warn(f"MFU {100 * mfu:.1f}% is above 100%: the peak of {peak} TFLOP/s is wrong for this "
                      "device; pass the right --peak-tflops.", stacklevel=2)
    return mfu


def peak_memory_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2 ** 20 if sys.platform == "darwin" else 2 ** 10)


def loss_name(data: DataConfig) -> str:
    """The name a run logs its trained loss under: ``dpo loss`` (--dpo), ``grpo loss`` (--grpo) or ``lm loss``."""
    return "dpo loss" if data.dpo else "grpo loss" if data.grpo else "lm loss"


def format_iteration_log(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                         tflops_per_gpu: float | None, learning_rate: float, global_batch_size: int,
                         lm_loss: float | None, loss_scale: float, grad_norm: float | None, skipped_iterations: int,
                         nan_iterations: int, routing: dict | None = None, loss_name: str = "lm loss",
                         statistics: dict | None = None) -> str:
    """Megatron's line; the throughput field only with --log-throughput (``tflops_per_gpu`` not None), the loss
    only when an iteration of the interval updated (``lm_loss`` not None: Megatron-LM leaves it out too).
    ``routing``: a mixture of experts' auxiliary losses and expert load, after the loss as Megatron-LM's;
    ``loss_name``: the loss trained (``dpo loss`` under --dpo), ``statistics`` the other logged means after it."""
    line = (f" iteration {iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {elapsed_ms:.1f} |")
    if tflops_per_gpu is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {_tflops_text(tflops_per_gpu)} |"
    line += (f" learning rate: {learning_rate:.6E} |"
            f" global batch size: {global_batch_size:5d} |")
    if lm_loss is not None:
        line += f" {loss_name}: {_loss_text(lm_loss)} |"
    for name, value in (statistics or {}).items():
        line += f" {name}: {_loss_text(value)} |"
    for name, value in (routing or {}).items():
        line += f" {name}: {value:.2f} |" if name == "expert load max/min" else f" {name}: {_loss_text(value)} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    return line + (f" number of skipped iterations: {skipped_iterations:3d} |"
                   f" number of nan iterations: {nan_iterations:3d} |")


def _loss_text(loss: float) -> str:
    """Megatron's %E, and ``nan`` for an interval without a finite loss (%E would print NAN)."""
    return f"{loss:.6E}" if math.isfinite(loss) else str(loss)


def _tflops_text(tflops: float) -> str:
    """Megatron's one decimal on GPUs; three significant digits below 10 so a CPU run does not print 0.0."""
    return _significant(tflops)


def _significant(value: float) -> str:
    """One decimal from 10 up, three significant digits below."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_throughput_log(*, tokens_per_second: float, consumed_tokens: int, mfu: float | None,
                          peak_memory: float) -> str:
    """Tokens are those trained on: every position of a pretraining sample, an --sft sample's without padding."""
    mfu_text = "n/a (pass --peak-tflops)" if mfu is None else f"{100 * mfu:.1f}%"
    return (f" tokens per second: {tokens_per_second:.1f} | consumed tokens: {consumed_tokens} | MFU: {mfu_text} |"
            f" peak memory (MB): {peak_memory:.1f} |")


def format_memory_report(report: dict, iteration: int | None = None) -> str:
    """One rank's memory, measured (``MegatronOptimizer.memory_report``): at start-up, or during
    ``iteration`` (parameters at their peak, which ZeRO-3's gathers raise above the shard; the
    caching allocator's peak on CUDA, activations included)."""
    # Three significant digits below 10 MB, so a PEFT run's few adapter bytes do not print as 0.0.
    mb = {k: _significant(v / 2 ** 20) for k, v in report.items() if k.endswith("_bytes")}
    where = " (host)" if report.get("optimizer_state_on_host") else ""
    if iteration is None:
        line = f" memory per rank (MB) | parameters: {mb['parameter_bytes']}"
    else:
        line = f" memory per rank in iteration {iteration} (MB) | parameters (peak): {mb['peak_parameter_bytes']}"
    line += f" | gradients: {mb['gradient_bytes']} | optimizer state{where}: {mb['optimizer_state_bytes']} |"
    if "allocated_bytes" in mb:
        allocated = mb["allocated_bytes"] if iteration is None else mb["peak_allocated_bytes"]
        line += f" {'allocated' if iteration is None else 'peak allocated'} (CUDA): {allocated} |"
    return line


def format_training_summary(*, iterations: int, first_iteration: int, tokens: int, losses: list,
                            seconds: float, loss_name: str = "lm loss") -> str:
    """The closing line of a run, printed whatever --log-interval (a run shorter than the interval prints no
    iteration line): its iterations, tokens, last and mean loss (of the finite ones), wall time."""
    finite = [loss for loss in losses if math.isfinite(loss)]
    loss_text = (f"{loss_name} last: {losses[-1]:.6E}, mean: {sum(finite) / len(finite):.6E} over "
                 f"{len(finite)} iterations" if finite else f"{loss_name}: none finite")
    return (f" training finished: {iterations} iterations ({first_iteration}-{first_iteration + iterations - 1}) |"
            f" tokens: {tokens:,} | {loss_text} | time: {seconds:.1f} s |")


def format_validation_log(*, iteration: int, lm_loss: float, on: str | None = None,
                          loss_name: str = "lm loss") -> str:
    """Megatron's validation line; ``on="test set"`` names the data, as its end-of-training test line does.
    A preference loss (``loss_name`` "dpo loss") has no perplexity."""
    where = f" on {on}" if on else ""
    line = f" validation loss at iteration {iteration}{where} | {loss_name} value: {lm_loss:.6E} |"
    if loss_name != "lm loss":
        return line
    ppl = math.exp(min(20.0, lm_loss))  # as Megatron: cap the exponent so a diverged run prints
    return line + f" lm loss PPL: {ppl:.6E} |"


def tensorboard_writer(log_dir: str | None):
    """A SummaryWriter when --tensorboard-dir is given and tensorboard is installed, else None."""
    if log_dir is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn("--tensorboard-dir is set but tensorboard is not installed (pip install tensorboard); "
                      "logging to stdout only.", stacklevel=2)
        return None
    return SummaryWriter(log_dir=log_dir)


def wandb_run(logging: LoggingConfig, save: str | None, run_config: dict):
    """A Weights & Biases run when --wandb-project is given and wandb is installed, else None.

    As Megatron-LM: files go to --wandb-save-dir, else --save/wandb; the run records the whole config.
    WANDB_MODE=offline (wandb's own switch) writes the run locally, for ``wandb sync`` later.
    """
    if not logging.wandb_project:
        return None
    try:
        import wandb
    except ImportError:
        warnings.warn("--wandb-project is set but wandb is not installed (pip install wandb); logging to stdout "
                      "only.", stacklevel=2)
        return None
    save_dir = logging.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name or None,
                      entity=logging.wandb_entity or None, dir=save_dir, config=run_config)
