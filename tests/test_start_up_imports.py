"""A command starts in about the time of ``import torch``: heavy modules are imported where they are used.

Every launch pays its imports on every rank, and so does every test that runs a command as a subprocess:
``torch.distributed.checkpoint`` alone (DTensor, sympy) added about half of ``import torch`` again to each
start-up until it moved into the one function that reads Megatron-LM's torch_dist files.
"""
import subprocess
import sys

COMMANDS = ("megatron_lite.pretrain_gpt", "megatron_lite.generate", "megatron_lite.evaluate", "megatron_lite.plan")
# Imported only by the code that needs them: a Megatron-LM torch_dist read, HF conversion, a logger, a plot,
# fine-tuning data in Parquet/Arrow, and torch.optim's first step (torch._dynamo).
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "transformers", "peft",
         "torch.utils.tensorboard", "tensorboard", "wandb", "matplotlib", "datasets", "pyarrow", "torch._dynamo")


def test_the_commands_import_nothing_heavy_before_they_need_it():
    probe = (f"import sys\nimport {', '.join(COMMANDS)}\n"
             f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"imported at start-up: {result.stdout}"
