"""Other projects' checkpoint formats <-> ours: Hugging Face models and PEFT adapters (``interop.hf``), and
Megatron-LM's legacy and torch_dist checkpoints (``interop.megatron``).

Each converts through global tensors and our own format (``checkpointing``), which stays the only format the
training loop reads and writes.
"""
