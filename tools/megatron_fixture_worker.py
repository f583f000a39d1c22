"""The worker of ``make_megatron_fixtures.py``: one fixture (or one export check) run with Megatron-LM's own
code, in a fresh interpreter whose ``PYTHONPATH`` is a snapshot of Megatron-LM, one process per rank.

    python tools/megatron_fixture_worker.py JOB_JSON    # as make_megatron_fixtures.run_worker starts it

Building a fixture: Megatron's argument parser, ``gpt_builder``, its weights moved off their initial values,
``save_checkpoint`` and the logits of a fixed batch. Checking an export: Megatron's ``load_checkpoint`` of our
export and its logits against the fixture's, written as JSON. Pipeline stages hand activations to each other
with plain ``send``/``recv`` (Megatron's p2p code allocates its buffers on the CUDA device).
"""
from __future__ import annotations

import json
import os
import sys
import zlib

# This file runs as a script from tools/, whose siblings are then importable.
from make_megatron_fixtures import (COMMON, CORE_016, CORE_020, FIXTURES, ITERATION, LABELS, NEEDS_TRITON_STAND_IN,
                                    TOKENS)
from megatron_cpu_stand_ins import cpu_stand_ins, grouped_gemm_stand_in, legacy_model_stand_ins, triton_stand_in


def worker(job: dict) -> None:
    import torch.multiprocessing as mp
    fixture = FIXTURES[job["name"]]
    tp, pp, ep = job.get("tp", fixture.tp), job.get("pp", fixture.pp), job.get("ep", fixture.ep)
    init_file = os.path.join(job["workdir"], f"rendezvous-{job['name']}")
    if os.path.exists(init_file):
        os.remove(init_file)
    mp.spawn(rank_main, args=(tp * pp * ep, init_file, job), nprocs=tp * pp * ep, join=True)



def legacy_model_args(args) -> None:
    """Args the legacy model reads that core 0.17's parser no longer defines, at their old defaults."""
    from megatron.core.enums import ModelType
    for name, value in (("model_type", ModelType.encoder_or_decoder), ("apply_layernorm_1p", False),
                        ("fp8_interval", 1), ("fp8_wgrad", True), ("onnx_safe", None)):
        if not hasattr(args, name):
            setattr(args, name, value)


def megatron_args(job: dict, world_size: int):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    fixture = FIXTURES[job["name"]]
    flags, tp, pp, ep, extra = fixture.model, fixture.tp, fixture.pp, fixture.ep, fixture.extra
    if "load" in job:  # the architecture is the args our export wrote, but for what Megatron does not restore;
        # our exports are Megatron-Core models in the format asked for, in the fixture's precision
        flags, tp, pp, ep = not_restored_by_checkpoint_args((*flags, *extra)), job["tp"], job["pp"], job["ep"]
        extra = ["--ckpt-format", job["ckpt_format"], *(["--bf16"] if "--bf16" in extra else []), "--load",
                 job["load"], "--use-checkpoint-args", "--no-load-optim", "--no-load-rng"]
    else:
        extra = [*extra, "--save", job["save"]]
    argv = [*flags, *COMMON, *extra, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
            str(pp), *(["--expert-model-parallel-size", str(ep), "--global-batch-size", str(2 * ep)] if ep > 1 else [])]
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    args.world_size, args.rank = world_size, int(os.environ["RANK"])
    if "load" in job:
        from megatron.training.checkpointing import load_args_from_checkpoint
        load_args_from_checkpoint(args)  # as initialize_megatron does for --use-checkpoint-args
    validate_args(args, {})
    if getattr(args, "use_legacy_models", False):  # the flag is gone from Megatron-LM's main
        legacy_model_args(args)
    set_global_variables(args, build_tokenizer=True)
    return args


# The model flags Megatron-LM's --use-checkpoint-args does not take from the saved args (its
# load_args_from_checkpoint restores a fixed list), with the number of values each takes.
NOT_RESTORED = {"--norm-epsilon": 1, "--mtp-loss-scaling-factor": 1, "--softmax-type": 1, "--quick-geglu": 0,
                "--glu-linear-offset": 1, "--activation-func-clamp-value": 1, "--no-bias-gelu-fusion": 0,
                "--window-size": 1, "--window-attn-skip-freq": 1, "--rotary-scaling-factor": 1, "--qk-layernorm": 0,
                "--attention-output-gate": 0, "--expert-tensor-parallel-size": 1, "--use-rope-scaling": 0,
                "--rope-scaling-factor": 1, "--moe-router-num-groups": 1, "--moe-router-group-topk": 1,
                "--moe-shared-expert-gate": 0}


def not_restored_by_checkpoint_args(flags: tuple) -> list:
    """The fixture's model flags that loading our export must give on the command line (NOT_RESTORED)."""
    return [item for i, flag in enumerate(flags) if flag in NOT_RESTORED
            for item in flags[i:i + 1 + NOT_RESTORED[flag]]]


def rank_main(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    cpu_stand_ins()
    if "load" not in job and "--use-legacy-models" in FIXTURES[job["name"]].extra:
        legacy_model_stand_ins()  # before gpt_builders imports megatron.legacy.model
    if job["ref"] in NEEDS_TRITON_STAND_IN:
        triton_stand_in()
    if "load" not in job and "--moe-grouped-gemm" in FIXTURES[job["name"]].model:
        grouped_gemm_stand_in()  # before megatron.core imports grouped_gemm_util
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    args = megatron_args(job, world_size)
    if job["ref"] == CORE_016:  # its router's linear asks for te_general_gemm, defined only when TE imports
        from megatron.core.transformer.moe import moe_utils
        moe_utils.te_general_gemm = None
    if job["ref"] == CORE_020:  # its MTP layer asks whether eh_proj is an inference-optimised Transformer Engine
        # linear, with an isinstance of classes that are not types without Transformer Engine: none is
        from megatron.core.transformer import multi_token_prediction
        multi_token_prediction.is_inference_column_parallel_linear = lambda module: False
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                  expert_model_parallel_size=args.expert_model_parallel_size,
                                  expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True)
    from gpt_builders import gpt_builder
    model = gpt_builder(args, pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    if args.bf16:
        model = model.to(torch.bfloat16)
    model.eval()
    if "load" in job:
        from megatron.training.checkpointing import load_checkpoint
        load_checkpoint([model], None, None, strict=True)
    else:
        move_off_initial_values(model, args)
        from megatron.training.checkpointing import save_checkpoint
        save_checkpoint(ITERATION, [model], None, None, 0)
    outputs = megatron_outputs(model, args)
    if outputs is not None and mpu.get_tensor_model_parallel_rank() == 0:
        if "load" in job:
            write_comparison(job, outputs)
        else:
            write_outputs(os.path.join(job["save"], "logits.safetensors"), outputs, job)
    dist.barrier()
    dist.destroy_process_group()


def move_off_initial_values(model, args) -> None:
    """Add a fixed perturbation to every weight: the same on every rank holding a replicated
    tensor (and on both copies of tied embeddings), per rank for a tensor-parallel shard."""
    import torch
    from megatron.core import parallel_state as mpu
    tied = not args.untie_embeddings_and_output_weights
    with torch.no_grad():
        for name, param in model.named_parameters():
            # the last stage's copy: output_layer.weight (Megatron-Core), word_embeddings.weight (legacy model)
            copy = name.endswith("word_embeddings.weight") or name == "output_layer.weight"
            key = "tied embeddings" if tied and copy else name
            if getattr(param, "tensor_model_parallel", False):
                key += f"@tp{mpu.get_tensor_model_parallel_rank()}"
            if "layers." in name:  # the same layer on any stage: global layer numbers
                key += f"@stage{mpu.get_pipeline_model_parallel_rank()}"
            if ".experts." in name:  # each expert-parallel rank holds other experts under the same local names
                key += f"@ep{mpu.get_expert_model_parallel_rank()}"
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            param.add_(0.05 * torch.randn(param.shape, generator=generator).to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("router.expert_bias"):  # the same on every rank, as the router's weight; large
                # enough to change which experts some tokens go to
                key = f"{name}@stage{mpu.get_pipeline_model_parallel_rank()}"
                generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                buffer.add_(0.5 * torch.randn(buffer.shape, generator=generator))


def megatron_outputs(model, args):
    """On the last stage, {"logits": Megatron's logits [batch, sequence, padded vocab]} and with multi-token
    prediction its losses for LABELS: "lm_loss" per token [batch, sequence] and "mtp_losses", L_k of each depth
    [depths], which its training forward records in MTPLossLoggingHelper's tracker (dropout is 0, so training
    and evaluation compute alike); None on the other stages."""
    import torch
    from megatron.core import tensor_parallel
    output = forward(model, args)
    outputs = None if output is None else {
        "logits": tensor_parallel.gather_from_tensor_model_parallel_region(output).float()}  # vocab-parallel
    if args.mtp_num_layers:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        labels = torch.tensor(LABELS)
        model.train()
        lm_loss = forward(model, args, labels=labels, loss_mask=torch.ones(labels.shape))
        model.eval()
        if outputs is not None:
            tracker = MTPLossLoggingHelper.tracker  # "values" up to core 0.19, "loss_values" in main
            outputs.update(labels=labels, lm_loss=lm_loss.float(),
                           mtp_losses=tracker.get("loss_values", tracker.get("values")).float().clone())
    return outputs


def forward(model, args, **kwargs):
    """Megatron's output on the last stage (None elsewhere): vocabulary-parallel logits [batch, sequence,
    vocab / tp], or given labels the loss per token; the stages pass activations [sequence, batch, hidden]
    with send/recv."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    tokens = torch.tensor(TOKENS)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if not mpu.is_pipeline_first_stage():
        received = torch.empty(tokens.shape[1], tokens.shape[0], args.hidden_size, dtype=dtype)
        dist.recv(received, src=mpu.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    with torch.no_grad():
        output = model(tokens, position_ids, mask, **kwargs)
    if not mpu.is_pipeline_last_stage():
        dist.send(output.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
        return None
    return output


def write_outputs(path: str, outputs: dict, job: dict) -> None:
    import safetensors.torch
    import torch
    safetensors.torch.save_file({"tokens": torch.tensor(TOKENS), **{k: v.contiguous() for k, v in outputs.items()}},
                                path, metadata={"megatron_ref": job["ref"], "fixture": job["name"]})


def write_comparison(job: dict, outputs: dict) -> None:
    """Megatron's logits (and multi-token prediction's losses) of our export against the fixture's, as JSON. An
    export at a larger tensor size pads the vocabulary further with zero rows: their logits are the extra
    columns, compared to 0 (the fixtures' vocabulary pads alike at tensor sizes 1 to 4, so the losses, whose
    softmax takes every column, compare too)."""
    import safetensors.torch
    reference = safetensors.torch.load_file(job["reference"])
    logits, width = outputs["logits"], reference["logits"].shape[-1]
    difference = max((logits[..., :width] - reference["logits"]).abs().max().item(),
                     logits[..., width:].abs().max().item() if logits.shape[-1] > width else 0.0)
    for name in ("lm_loss", "mtp_losses"):
        if name in reference:
            difference = max(difference, (outputs[name] - reference[name]).abs().max().item())
    with open(job["result"], "w") as f:
        json.dump({"fixture": job["name"], "tp": job["tp"], "pp": job["pp"], "max_abs_diff": difference,
                   "shape": list(logits.shape), "reference_shape": list(reference["logits"].shape)}, f)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
