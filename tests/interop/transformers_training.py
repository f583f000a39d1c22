"""The reference a fine-tune of an imported model is checked against: the same model trained by transformers,
stepped by ``torch.optim.AdamW`` after ``clip_grad_norm_``, on --mock-data's batches; and the comparison.

Gradients large enough to clip on every step (widened weights, ``common.widen_and_save``) make the clipping,
the grad norm that decides it, and anything that changes the gradient's size (the pad row, an auxiliary loss)
show in the weights; a loss-only comparison cannot see them (the pad row moved the loss 5e-6 while the grad
norm went from 4.83 to 5.50).
"""
import copy

import torch

from megatron_lite.interop.hf import checkpoint as hf_checkpoint
from megatron_lite.data import MockGPTDataset
from tests.interop.hf_family_ranks import FAIR_BATCH, FAIR_OPTIMIZER, FAIR_STEPS, train_logged
from tests.distributed import run_distributed

WEIGHT_RTOL = 1e-4  # of the distance the reference moved the weights
# The logged grad norm against transformers': the log's rounding (3 decimals) plus NORM_RTOL of the norm. Measured
# with the log printing 9 decimals, every family, step and layout of the four fair fights (float32): within 2.5e-7
# of transformers' for most, 7.9e-7 for Gemma 3, 1.7e-6 for Qwen3.5 and 2.2e-5 for Qwen3-Next (their DeltaNet; its
# own tolerance, test_hf_families.HYBRID_TOLERANCES). Comparing the rounded strings instead failed whenever the two
# norms straddled a rounding boundary, however close, and at a norm of 80 asked for 1e-5, more than float32 holds.
LOGGED_NORM_ATOL = 5e-4
NORM_RTOL = 1e-5
# bf16 weights against the fp32 reference: the rounding of 3 steps.
BF16_TOLERANCES = dict(loss_rtol=2e-2, norm_rtol=2e-2, weight_rtol=0.5)


def mock_batches(vocab: int) -> list:
    """--mock-data's training samples (--seed 1234) of each step, [FAIR_BATCH, 17] token ids, in order."""
    data = MockGPTDataset(vocab_size=vocab, seq_length=16, seed=1234, num_samples=FAIR_BATCH * FAIR_STEPS)
    return [torch.stack([torch.from_numpy(data[step * FAIR_BATCH + i]["tokens"]) for i in range(FAIR_BATCH)])
            for step in range(FAIR_STEPS)]


def transformers_training(hf_model, vocab: int, *, padding_idx: int | None):
    """(the (cross-entropy loss, grad norm before clipping) of each step, the final weights) of ``hf_model``
    trained as ``FAIR_OPTIMIZER`` says, on micro-batches of one sequence as ``fair_config``'s: AdamW with decay
    on the matrices only, not biases (Megatron's groups), gradients clipped to norm 1. ``padding_idx``: the input
    embedding's (the row that gets no gradient), or None (every row trains, as megatron_lite's default). A
    mixture of experts trains on the cross entropy plus router_aux_loss_coef x its load-balancing loss, as
    transformers' own loss (of each micro-batch: the statistics of a micro-batch's tokens, as ours)."""
    model = copy.deepcopy(hf_model).train()
    model.get_input_embeddings().padding_idx = padding_idx
    # Megatron's groups: biases and norms undecayed, by name too where a family stacks its experts' biases (gpt-oss).
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decayed = {name: p.dim() > 1 and not name.endswith("bias") for name, p in named}
    groups = [{"params": [p for name, p in named if decayed[name]], "weight_decay": FAIR_OPTIMIZER.weight_decay},
              {"params": [p for name, p in named if not decayed[name]], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=FAIR_OPTIMIZER.lr, betas=(FAIR_OPTIMIZER.adam_beta1,
                                                                        FAIR_OPTIMIZER.adam_beta2),
                                  eps=FAIR_OPTIMIZER.adam_eps)
    logged = []
    for tokens in mock_batches(vocab):
        optimizer.zero_grad()
        cross_entropy = 0.0
        for sequence in tokens.split(1):  # micro-batches of 1, accumulated as transformers' Trainer does
            output = model(sequence[:, :-1])
            micro_cross_entropy = torch.nn.functional.cross_entropy(output.logits.reshape(-1, vocab),
                                                                    sequence[:, 1:].reshape(-1))
            aux_loss = getattr(output, "aux_loss", None)
            loss = micro_cross_entropy if aux_loss is None else (micro_cross_entropy
                                                                 + model.config.router_aux_loss_coef * aux_loss)
            (loss / len(tokens)).backward()
            cross_entropy += micro_cross_entropy.item() / len(tokens)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), FAIR_OPTIMIZER.clip_grad)
        optimizer.step()
        logged.append((cross_entropy, norm.item()))
    return logged, {name: p.detach().clone() for name, p in model.state_dict().items()}


def assert_trains_as_transformers(name: str, logged: list, reference: tuple, initial: dict, exported_dir: str, *,
                                  loss_rtol: float = 1e-6, weight_rtol: float = WEIGHT_RTOL,
                                  norm_rtol: float = NORM_RTOL) -> None:
    """Our (lm loss, grad norm) log of each iteration and the weights exported from our last checkpoint
    against ``transformers_training``'s: the losses to ``loss_rtol`` (the log's 7 digits), the grad norm to
    ``norm_rtol`` beyond the log's rounding and above the clip (or the comparison is not the
    fair fight it claims), and the weights' difference from the reference's at most ``weight_rtol`` of the
    distance the reference moved them
    (all tensors together: a tensor whose exact gradient is zero moves by Adam's rounding noise alone)."""
    expected, final = reference
    assert len(logged) == len(expected) == FAIR_STEPS, (name, logged)
    for step, ((loss, norm), (their_loss, their_norm)) in enumerate(zip(logged, expected)):
        assert abs(loss - their_loss) <= loss_rtol * their_loss, (name, step, loss, their_loss)
        same = abs(norm - their_norm) <= LOGGED_NORM_ATOL + norm_rtol * their_norm
        assert same and their_norm > FAIR_OPTIMIZER.clip_grad, (name, step, norm, their_norm)
    import transformers

    # Read back by transformers, which names the weights as the reference's state (experts fused or not).
    exported = transformers.AutoModelForCausalLM.from_pretrained(exported_dir)
    heads = exported.config.num_attention_heads
    ours = {key: _without_key_bias(key, value, heads) for key, value in exported.state_dict().items()}
    final, initial = ({key: _without_key_bias(key, t[key], heads) for key in ours} for t in (final, initial))
    difference, moved = _distance(ours, final), _distance(final, initial)
    worst = max(ours, key=lambda key: float((ours[key] - final[key]).norm()))
    assert difference <= weight_rtol * moved, (name, difference, moved, worst)


def fair_fight(imports: dict, layouts: dict, tmp_path, export_flags: dict, *, vocab: int, pad: int,
               tolerances: dict | None = None) -> None:
    """Each family of ``layouts`` (``imports``' ``common.Imported``) fine-tuned with ``pad`` as its pad token, a
    token the mock batches hold (the eos, as many released configs), and
    --freeze-padding-embedding at 1 process and at its layout of 4 ranks (one start-up for all), against
    ``transformers_training`` with that padding_idx; the first two families also without the flag, against
    transformers without padding_idx. ``export_flags``: the --hf-model-type of a family that needs one;
    ``tolerances``: a family's own ``assert_trains_as_transformers`` tolerances, where its float32 rounding
    differs from transformers' more than the defaults allow (each with its measurement where it is given)."""
    assert any((batch == pad).any() for batch in mock_batches(vocab))
    names = list(layouts)
    # (family, freeze the pad row?, parallel: at its layout, else 1 process)
    runs = [(n, True, False) for n in names] + [(n, False, False) for n in names[:2]] + [(n, True, True)
                                                                                          for n in names]
    save = {run: str(tmp_path / "_".join(map(str, run))) for run in runs}
    arguments = {run: (imports[run[0]].root, save[run], pad if run[1] else None,
                       dict(layouts[run[0]]) if run[2] else {})
                 for run in runs}
    single, parallel = [r for r in runs if not r[2]], [r for r in runs if r[2]]
    logged = dict(zip(single, train_logged(0, 1, [arguments[r] for r in single])))
    per_rank = run_distributed(train_logged, 4, args=([arguments[r] for r in parallel],), timeout=600)
    for index, run in enumerate(parallel):
        (logged[run],) = [rank[index] for rank in per_rank if rank[index] is not None]
    references = {}
    for run in runs:
        name, freeze, at_layout = run
        exported = save[run] + "_hf"
        hf_checkpoint.export_hf_checkpoint(save[run], exported, hf_model_type=export_flags.get(name))
        if (name, freeze) not in references:  # the same for the 1-process run and the layout's
            references[name, freeze] = transformers_training(imports[name].hf_model, vocab,
                                                             padding_idx=pad if freeze else None)
        reference = references[name, freeze]
        bf16 = at_layout and layouts[name].get("bf16", False)
        assert_trains_as_transformers(f"{run}", logged[run], reference, imports[name].hf_model.state_dict(),
                                      exported, **(BF16_TOLERANCES if bf16 else (tolerances or {}).get(name, {})))
    for name in names[:2]:  # the pad row is a difference the weight comparison sees, 10 x over its tolerance
        (_, frozen), (_, trained) = references[name, True], references[name, False]
        initial = imports[name].hf_model.state_dict()
        assert _distance(frozen, trained) > 10 * WEIGHT_RTOL * _distance(frozen, initial), name


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[key] - b[key]).double().square().sum()) for key in a) ** 0.5


def _without_key_bias(name: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """A weight without its key bias, whose gradient is zero in exact arithmetic (softmax ignores a shift of a
    query's scores): Adam turns its rounding noise into lr-sized, run-dependent steps (GPT-2: 3e-3 of the distance
    moved, where every other weight agrees to 1e-5). GPT-2's c_attn bias is query, key, value; GPT-NeoX's
    query_key_value bias the query, key and value of each of the ``heads`` in turn."""
    if name.endswith("k_proj.bias"):
        return tensor[:0]
    if name.endswith("attn.c_attn.bias"):
        query, _, value = tensor.chunk(3)
        return torch.cat([query, value])
    if name.endswith("attention.query_key_value.bias"):
        query, _, value = tensor.view(heads, 3, -1).unbind(1)
        return torch.cat([query.flatten(), value.flatten()])
    return tensor
