"""Generating text from a trained model (``python -m megatron_lite.generate`` is the command)."""
