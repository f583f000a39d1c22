"""The GPT model: a plain decoder-only transformer built from tensor-parallel layers."""
from megatron_lite.model.gpt_model import GPTModel
from megatron_lite.model.weight_init import initialize_weights

__all__ = ["GPTModel", "initialize_weights"]
