"""Tiny training configurations and rank bodies shared by the checkpoint tests."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lite.config import (CheckpointConfig, Config, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)

# Vocabulary 60 pads to 64 rows at tensor-parallel sizes 1 and 2 and to 128 at 4 (multiples of
# 32 x tp): loading across those layouts resizes the padding.
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, num_query_groups=4)
GPT2 = dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
            add_bias_linear=True, untie_embeddings_and_output_weights=False)
# Llama with a mixture of 4 experts in every layer: a Mixtral (softmax over the top 2).
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2)


def tiny_config(tp: int = 1, pp: int = 1, *, ep: int = 1, arch: dict = LLAMA, vpp=None, dist_opt: bool = False,
                strategy: str | None = None, sequence_parallel: bool = False, iters: int = 4, global_batch: int = 8,
                dropout: float = 0.0, save=None, load=None, save_interval=None, exit_interval=None,
                **checkpoint_flags) -> Config:
    return Config(
        model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=8, ffn_hidden_size=64, seq_length=16,
                          vocab_size=60, make_vocab_size_divisible_by=32, hidden_dropout=dropout,
                          attention_dropout=dropout, **arch),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                expert_model_parallel_size=ep,
                                virtual_pipeline_model_parallel_size=vpp, use_distributed_optimizer=dist_opt,
                                data_parallel_sharding_strategy=strategy,
                                sequence_parallel=sequence_parallel),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=global_batch, train_iters=iters,
                                exit_interval=exit_interval),
        optimizer=OptimizerConfig(lr=1e-2, lr_warmup_iters=1, lr_decay_iters=10),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval, **checkpoint_flags),
        logging=LoggingConfig(log_interval=1000, log_memory=False))


def widen_and_save(hf_model, directory) -> None:
    """Draw a transformers model's weights wider than its init (norm scales around 1, biases not zero), so that a
    dropped bias, swapped norm or misplaced weight changes its output, and save it to ``directory``."""
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            parameter.normal_(1.0 if "norm" in name or ".ln_" in name else 0.0, 0.2)  # GPT-2's ln_1, ln_f
    hf_model.eval().save_pretrained(directory)


@dataclasses.dataclass
class Imported:
    """A Hugging Face family's tiny random model, saved and imported (``import_hf_model``)."""

    name: str
    hf_model: object
    hf_dir: str
    root: str  # our checkpoint, written at tp2 x pp2
    input_ids: torch.Tensor
    logits: torch.Tensor  # transformers'


def import_hf_model(name: str, hf_config, directory, *, vocab: int, input_seed: int | None = None,
                    prepare=None) -> Imported:
    """``hf_config``'s model (seed 0) with widened weights (and ``prepare(model)`` first: a buffer to set), saved
    under ``directory`` and imported at tp2 x pp2; transformers' logits of [2, 16] token ids (drawn after, or
    from a generator of ``input_seed``)."""
    import transformers

    from tools.checkpoint_convert import main as convert

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    if prepare is not None:
        prepare(hf_model)
    widen_and_save(hf_model, directory / "hf")
    root = str(directory / "ckpt")
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", str(directory / "hf"),
                    "--save-dir", root, "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2"]) == 0
    generator = None if input_seed is None else torch.Generator().manual_seed(input_seed)
    input_ids = torch.randint(2, vocab, (2, 16), generator=generator)
    with torch.no_grad():
        logits = hf_model(input_ids).logits
    return Imported(name, hf_model, str(directory / "hf"), root, input_ids, logits)


def train(rank, world_size, kwargs):
    """Rank body: train as configured; the losses (last pipeline stage) or None."""
    from megatron_lite.training.loop import pretrain

    state, _, _ = pretrain(tiny_config(**kwargs))
    return state.losses or None


def losses_of(results: list) -> list:
    """The losses reported by the last pipeline stage (every data-parallel replica reports the same)."""
    reported = [r for r in results if r is not None]
    assert reported and all(r == reported[0] for r in reported), reported
    return reported[0]


def assert_continues(resumed: list, reference: list, rtol: float = 1e-5) -> None:
    """A run resumed at iteration 2 of 4: the saved history as saved, then the reference's losses."""
    assert len(resumed) == 4
    assert resumed[:2] == reference[:2]
    assert resumed[2:] == pytest.approx(reference[2:], rel=rtol)
