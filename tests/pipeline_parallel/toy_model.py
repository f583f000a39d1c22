"""A toy model for schedule tests: residual tanh-linear layers, split like a GPT.

Layer n is initialised from a generator seeded with n, so every layout builds the
same weights. The forward step records what runs (forward when called, backward
from a hook on the chunk's output) so tests can compare the executed order with
the schedule table, and checks that activations already sent were freed.
"""
import torch
from torch import nn

from megatron_lite.pipeline_parallel.schedule_table import OpKind

SEQ, BATCH, HIDDEN, NUM_LAYERS = 4, 2, 8, 8


class ToyChunk(nn.Module):
    def __init__(self, layer_numbers, *, is_first: bool, is_last: bool, chunk_id: int = 0):
        super().__init__()
        self.layers = nn.ModuleDict()
        for n in layer_numbers:
            generator = torch.Generator().manual_seed(n)
            layer = nn.Linear(HIDDEN, HIDDEN)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5)
                layer.bias.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
            self.layers[str(n)] = layer
        self.is_first, self.is_last, self.chunk_id = is_first, is_last, chunk_id
        self.input_tensor = None
        self.trace = []  # (kind, micro-batch, chunk), in execution order; shared by a rank's chunks
        self.sent_outputs = []  # outputs of a non-last chunk; each must be freed once sent

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.is_first else self.input_tensor
        for layer in self.layers.values():
            h = h + torch.tanh(layer(h))  # ends in an add, which saves nothing for backward
        return h


def make_batches(num_microbatches: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"index": i, "x": torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
             "target": torch.randn(SEQ, BATCH, HIDDEN, generator=generator)} for i in range(num_microbatches)]


def mse_loss_func(target, output):
    loss = ((output - target) ** 2).mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, chunk: ToyChunk):
    batch = next(data_iterator)
    index = batch["index"]
    still_full = [o for o in chunk.sent_outputs if o.numel() != 1]
    assert not still_full, f"{len(still_full)} sent activations were not freed before forward {index}"
    chunk.trace.append((OpKind.FORWARD, index, chunk.chunk_id))
    output = chunk(batch["x"])
    if output.requires_grad:  # not under forward_only
        output.register_hook(lambda grad: chunk.trace.append((OpKind.BACKWARD, index, chunk.chunk_id)))
        if not chunk.is_last:
            chunk.sent_outputs.append(output)
    return output, lambda out: mse_loss_func(batch["target"], out)


def reference(batches: list[dict], grad_scale: float = 1.0):
    """Single-process losses and gradients: plain gradient accumulation, no schedule code."""
    model = ToyChunk(range(NUM_LAYERS), is_first=True, is_last=True)
    losses = []
    for batch in batches:
        loss, _ = mse_loss_func(batch["target"], model(batch["x"]))
        (loss * grad_scale / len(batches)).backward()
        losses.append(loss.item())
    return losses, {name: p.grad for name, p in model.named_parameters()}
