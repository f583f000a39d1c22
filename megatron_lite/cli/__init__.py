"""The command line: Megatron-LM's flags -> a validated ``Config``.

This package sits above everything it reads (checkpoints for ``--use-checkpoint-args``, the tokenizer
for the vocabulary size, the launch environment for rank-0 notices); ``megatron_lite/config/`` below it
holds only the dataclasses and their validation, so a ``Config`` built in code is checked exactly as
one built from flags.

    parser.py           ArgumentParser: argparse whose mistakes raise one ConfigError (every tool uses it)
    arguments.py        build_parser / parse_args: one flag per config field
    checkpoint_args.py  --use-checkpoint-args, a resumed run's tokenizer, a Megatron-LM checkpoint's import
    deepspeed_config.py --deepspeed-config ds.json translated into our flags
    megatron_compat.py  Megatron-LM flags with no field of ours: accepted as no-ops or refused by name

Adding a flag is one field and its help, nothing in this package:

1. a field in the section dataclass (``megatron_lite/config/``: one module per section, ``model.py``,
   ``parallel.py``, ``training.py`` ...; ``micro_batch_size`` becomes ``--micro-batch-size``; its default is
   the flag's). A bool that defaults to True is switched off by Megatron's negative spelling: add it to
   ``NEGATIVE_FLAGS`` (``fields.py``). A field that takes one of a few names says so once,
   ``field(default=..., metadata={"choices": (...)})``: the parser offers them and the
   section refuses any other value, from flags or from code. A list field's ``nargs``/``metavar`` go in
   the metadata too;
2. its line of ``--help`` in ``megatron_lite/config/help_text.py`` (a test fails without one);
3. any other check in the section's ``__post_init__``, raising ConfigError that names the flag.
"""
