"""Hugging Face models and PEFT adapters <-> megatron_lite checkpoints.

``families`` is each family's ``config.json`` (what it reads, what it refuses, which family an export is);
``weights`` maps each family's tensor names and layouts to ours (with ``latent_attention`` for DeepSeek's);
``checkpoint`` reads and writes model directories and converts whole checkpoints; ``tokenizer`` and
``pad_token`` carry the tokenizer's files and ids; ``peft`` converts LoRA adapters. See
docs/model_families.md.
"""
