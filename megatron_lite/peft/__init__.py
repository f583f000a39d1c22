"""Parameter-efficient fine-tuning under tensor, pipeline and data parallelism.

``apply_peft`` (``apply.py``) freezes a built model chunk and attaches one method's
weights by module name: ``lora.py`` (low-rank updates of the column- and
row-parallel linears), ``adapter.py`` (bottleneck adapters after attention and the
MLP), ``prefix_tuning.py`` (learned key/value prefixes per layer).
"""
from megatron_lite.peft.apply import apply_peft

__all__ = ["apply_peft"]
