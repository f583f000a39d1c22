"""Megatron-LM checkpoints in and out: legacy ``--ckpt-format torch`` and ``torch_dist``, any TP/PP.

``safe_unpickle`` reads Megatron's pickles without running them, ``args_mapping`` turns their
saved ``args`` into our ModelConfig, ``layout`` knows how Megatron names and splits tensors,
``legacy`` and ``torch_dist`` read (and write) the two on-disk formats. See
docs/megatron_checkpoints.md.
"""
