"""The training loop and what it carries.

``loop`` (pretrain, train_step, evaluate) is the loop itself; ``data_iterators`` the micro-batch iterators
positioned for a resume; ``logger`` Megatron's log lines; ``metrics`` throughput, MFU and
memory (the FLOPs are ``model.flops``', which the planner shares); ``signal_handler`` saving
on SIGTERM. The parity ladder that runs the same flags under several layouts is a tool
(``tools/loss_parity.py``): it drives the entry point in subprocesses.

The loop's progress (``TrainingState``) lives in ``checkpointing.training_state`` and the
seeding in ``tensor_parallel.random``: checkpointing needs both, and must not import the
loop that calls it.
"""
