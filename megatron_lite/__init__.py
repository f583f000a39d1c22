"""megatron_lite: Megatron-style 3D-parallel GPT training that reads in an afternoon."""

__version__ = "0.1.0"
