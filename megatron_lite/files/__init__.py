"""Files on disk, written so that a crash never leaves half of one (``atomic_write``).

On the ground floor beside ``config/``: the tokenizer, data and tools write through it, and it imports
nothing of ours.
"""
from megatron_lite.files.atomic_write import atomic_write

__all__ = ["atomic_write"]
