"""One forward pass through every pipeline stage, for the commands that run a checkpoint's model.

Each stage runs its layers on what the previous stage sends (the first embeds the tokens) and sends its
hidden states [s, b, h] on; the last stage's output (logits, or per-token losses given labels) is the
pass's, and the other stages return None. Every stage must be handed the same batch, for its shape.
"""
from __future__ import annotations

from megatron_lite.pipeline_parallel import p2p


def forward_through_stages(model, parallel_state, tokens, *args, **kwargs):
    """``model(tokens, *args, **kwargs)`` for this rank's stage: the last stage's output, None elsewhere."""
    if parallel_state is None or parallel_state.pipeline_model_parallel_world_size == 1:
        return model(tokens, *args, **kwargs)
    parameter = next(model.parameters())
    exchange = dict(shape=(tokens.shape[1], tokens.shape[0], model.config.hidden_size), dtype=parameter.dtype,
                    device=parameter.device, group=parallel_state.pipeline_model_parallel_group)
    if not parallel_state.is_pipeline_first_stage():
        (received,) = p2p.exchange(sends=[], receives=[parallel_state.pipeline_prev_rank], **exchange)
        model.set_input_tensor(received)
    output = model(tokens, *args, **kwargs)
    if not parallel_state.is_pipeline_last_stage():
        p2p.exchange(sends=[(output, parallel_state.pipeline_next_rank)], receives=[], **exchange)
        return None
    return output
