"""The reference a fine-tune of an imported model is checked against: the same model trained by transformers,
stepped by ``torch.optim.AdamW`` after ``clip_grad_norm_``, on --mock-data's batches; and the comparison.

Gradients large enough to clip on every step (widened weights, ``common.widen_and_save``) make the clipping,
the grad norm that decides it, and anything that changes the gradient's size (the pad row, an auxiliary loss)
show in the weights; a loss-only comparison cannot see them (the pad row moved the loss 5e-6 while the grad
norm went from 4.83 to 5.50).
"""
import copy

import torch

from megatron_lite.checkpointing import hf_interop
from megatron_lite.data import MockGPTDataset
from tests.checkpointing.hf_family_ranks import FAIR_BATCH, FAIR_OPTIMIZER, FAIR_STEPS


def mock_batches(vocab: int) -> list:
    """--mock-data's training samples (--seed 1234) of each step, [FAIR_BATCH, 17] token ids, in order."""
    data = MockGPTDataset(vocab_size=vocab, seq_length=16, seed=1234, num_samples=FAIR_BATCH * FAIR_STEPS)
    return [torch.stack([torch.from_numpy(data[step * FAIR_BATCH + i]["tokens"]) for i in range(FAIR_BATCH)])
            for step in range(FAIR_STEPS)]


def transformers_training(hf_model, vocab: int, *, padding_idx: int | None):
    """(the (cross-entropy loss, grad norm before clipping) of each step, the final weights) of ``hf_model``
    trained as ``FAIR_OPTIMIZER`` says: AdamW with decay on the matrices only (Megatron's groups), gradients
    clipped to norm 1. ``padding_idx``: the input embedding's (the row that gets no gradient), or None (every
    row trains, as megatron_lite's default). A mixture of experts trains on the cross entropy plus
    router_aux_loss_coef x its load-balancing loss, as transformers' own loss."""
    model = copy.deepcopy(hf_model).train()
    model.get_input_embeddings().padding_idx = padding_idx
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in parameters if p.dim() > 1], "weight_decay": FAIR_OPTIMIZER.weight_decay},
              {"params": [p for p in parameters if p.dim() <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=FAIR_OPTIMIZER.lr, betas=(FAIR_OPTIMIZER.adam_beta1,
                                                                        FAIR_OPTIMIZER.adam_beta2),
                                  eps=FAIR_OPTIMIZER.adam_eps)
    logged = []
    for tokens in mock_batches(vocab):
        output = model(tokens[:, :-1])
        cross_entropy = torch.nn.functional.cross_entropy(output.logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        aux_loss = getattr(output, "aux_loss", None)
        loss = cross_entropy if aux_loss is None else cross_entropy + model.config.router_aux_loss_coef * aux_loss
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), FAIR_OPTIMIZER.clip_grad)
        optimizer.step()
        logged.append((cross_entropy.item(), norm.item()))
    return logged, {name: p.detach().clone() for name, p in model.state_dict().items()}


def assert_trains_as_transformers(name: str, logged: list, reference: tuple, initial: dict, exported_dir: str, *,
                                  loss_rtol: float = 1e-6, weight_rtol: float = 1e-4, norm_rtol: float = 0.0) -> None:
    """Our (lm loss, grad norm) log of each iteration and the weights exported from our last checkpoint
    against ``transformers_training``'s: the losses to ``loss_rtol`` (the log's 7 digits), the grad norm as the
    log prints it (3 decimals; else to ``norm_rtol``, for bf16) and above the clip (or the comparison is not the fair fight it claims), and the
    weights' difference from the reference's at most ``weight_rtol`` of the distance the reference moved them
    (all tensors together: a tensor whose exact gradient is zero moves by Adam's rounding noise alone)."""
    expected, final = reference
    assert len(logged) == len(expected) == FAIR_STEPS, (name, logged)
    for step, ((loss, norm), (their_loss, their_norm)) in enumerate(zip(logged, expected)):
        assert abs(loss - their_loss) <= loss_rtol * their_loss, (name, step, loss, their_loss)
        same = abs(norm - their_norm) <= norm_rtol * their_norm if norm_rtol else f"{norm:.3f}" == f"{their_norm:.3f}"
        assert same and their_norm > FAIR_OPTIMIZER.clip_grad, (name, step, norm, their_norm)
    _, ours = hf_interop.read_hf_directory(exported_dir)
    difference = sum(float((ours[key] - final[key]).double().square().sum()) for key in ours) ** 0.5
    moved = sum(float((final[key] - initial[key]).double().square().sum()) for key in ours) ** 0.5
    assert difference <= weight_rtol * moved, (name, difference, moved)
