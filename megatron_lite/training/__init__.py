"""The training loop and what it carries.

``loop`` (pretrain, train_step, evaluate) is the loop itself; ``data_iterators`` the micro-batch iterators
positioned for a resume; ``logger`` Megatron's log lines; ``metrics`` FLOPs, MFU and
memory; ``signal_handler`` saving on SIGTERM; ``loss_parity`` the user-facing ladder
that runs the same flags under several layouts.

The loop's progress (``TrainingState``) lives in ``checkpointing.training_state`` and the
seeding in ``tensor_parallel.random``: checkpointing needs both, and must not import the
loop that calls it.
"""
