"""Processes and their groups: ``initialize`` starts torch.distributed from torchrun's or
SLURM's variables, ``parallel_state`` cuts the world into tensor x data x pipeline groups,
and ``collectives`` is the one place every collective goes through (counted, checked)."""
