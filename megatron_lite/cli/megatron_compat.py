"""Megatron-LM flags with no field of our own: accepted as no-ops, or refused by name with the reason.

A launch script written for Megatron-LM should either run or stop at once with a message
that says which flag to remove and why, never with argparse's bare "unrecognized
arguments". Each flag is one row of data here; ``arguments.py`` registers them and
``check_megatron_only_flags`` turns the parsed values into notices or a ConfigError.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_lite.config import ConfigError

# Flags that switch off one of Megatron-LM's fused kernels. Ours are switched together by
# --no-fused-kernels, and every fused op equals its PyTorch reference (tests/kernels), so
# leaving one on changes no result.
_FUSION_NOOP = "accepted, no effect: megatron_lite's fused ops are switched together by --no-fused-kernels"

# store_true flags accepted with no effect, with what each means here (shown in --help).
ACCEPTED_FLAGS = {
    "--use-mcore-models": "accepted, no effect: megatron_lite has one model implementation (Megatron-Core's design)",
    "--cross-entropy-loss-fusion": "accepted, no effect: the loss is always the vocab-parallel cross entropy "
                                   "on each rank's logit shard, which never gathers the logits",
    "--no-create-attention-mask-in-dataloader": "accepted, no effect: pretraining's data loader builds no attention "
                                                "masks (attention is causal inside the kernel); --sft's packed "
                                                "sequences carry their examples' ids, not a mask",
    "--use-flash-attn": "accepted, no effect: attention runs torch's scaled_dot_product_attention, which uses a "
                        "flash kernel where the device has one (see --attention-backend)",
    "--no-masked-softmax-fusion": _FUSION_NOOP,
    "--no-bias-swiglu-fusion": _FUSION_NOOP,
    "--no-bias-dropout-fusion": _FUSION_NOOP,
    "--no-rope-fusion": _FUSION_NOOP,
    "--no-persist-layer-norm": _FUSION_NOOP,
    "--check-for-nan-in-loss-and-grad": "accepted: the default (a non-finite loss or grad norm re-runs its iteration "
                                        "and stops the run if it reproduces; --no-check-for-nan-in-loss-and-grad "
                                        "turns the check off)",
    "--cache-mla-latents": "accepted, no effect: multi-latent attention's generation always caches its latents",
    "--mla-down-proj-fusion": _FUSION_NOOP,
    "--yarn-correction-range-round-to-int": "accepted: the default (YaRN's blended channel range is rounded out; "
                                            "--no-yarn-correction-range-round-to-int keeps it unrounded)",
    "--no-gradient-accumulation-fusion": "accepted, no effect: gradients always accumulate in the data-parallel "
                                         "gradient buffer",
    "--moe-permute-fusion": "accepted, no effect: tokens are permuted to their experts by PyTorch ops",
    "--moe-router-fusion": "accepted, no effect: the router's top-k and losses are PyTorch ops",
}

# Megatron-LM's --no-bias-gelu-fusion is more than a kernel switch: its fused kernel is the tanh GeLU, and
# without it the MLP computes F.gelu, the exact one. So it sets --gelu-exact (with --swiglu it changes nothing
# there either: SwiGLU has no GeLU).
EXACT_GELU_FLAG = "--no-bias-gelu-fusion"
_EXACT_GELU_HELP = ("Megatron-LM's MLP without its fused tanh-GeLU kernel computes the exact (erf) GeLU: sets "
                    "--gelu-exact (no effect with --swiglu)")

# Flags with a value, accepted with no effect: each row is the spellings of one flag and what it means here.
# DeepSpeed's launcher passes --local_rank=N, torch.distributed.launch --local-rank N, Megatron-LM takes both;
# the same rank is in the environment as LOCAL_RANK, which every launcher sets and we read.
ACCEPTED_VALUE_FLAGS = {
    ("--local-rank", "--local_rank"): "accepted, no effect: the local rank is read from the launcher's LOCAL_RANK "
                                      "(or SLURM_LOCALID) environment variable",
}

_NO_FP8 = "megatron_lite has no FP8 path (needs Transformer Engine on Hopper)"
_NO_FP4 = "megatron_lite has no FP4 path (needs Transformer Engine on Blackwell)"
_NO_MOE = ("megatron_lite's mixture of experts takes the --moe-* flags listed in --help "
           "(docs/moe.md), not this one")
_NO_TE = ("megatron_lite's layers are its own PyTorch modules (Megatron's 'local' implementation), "
          "not Transformer Engine")
_NO_CUDA_GRAPHS = "megatron_lite does not capture CUDA graphs"


@dataclass(frozen=True)
class Refusal:
    """A Megatron-LM flag we cannot honour; ``harmless`` lists the values that ask for nothing we lack."""

    reason: str
    takes_value: bool = True
    harmless: tuple[str, ...] = ()
    notice: str = ""  # printed when the flag is given with a harmless value


REFUSED_FLAGS = {
    # FP8 / FP4 (Llama 3 8B example: --fp8-format hybrid --fp8-amax-history-len 1024 ...).
    "--fp8-format": Refusal(_NO_FP8),
    "--fp8-recipe": Refusal(_NO_FP8),
    "--fp8-margin": Refusal(_NO_FP8),
    "--fp8-interval": Refusal(_NO_FP8),
    "--fp8-amax-history-len": Refusal(_NO_FP8),
    "--fp8-amax-compute-algo": Refusal(_NO_FP8),
    "--fp8-param-gather": Refusal(_NO_FP8, takes_value=False),
    "--fp8-output-proj": Refusal(_NO_FP8, takes_value=False),
    "--no-fp8-wgrad": Refusal(_NO_FP8, takes_value=False),
    "--fp4-format": Refusal(_NO_FP4),
    "--fp4-recipe": Refusal(_NO_FP4),
    "--fp4-param-gather": Refusal(_NO_FP4, takes_value=False),
    # Mixture of experts: one dispatcher (all-to-all) and one router precision (fp32).
    "--moe-token-dispatcher-type": Refusal(
        "megatron_lite dispatches tokens with all-to-all only", harmless=("alltoall", "allgather"),
        notice="--moe-token-dispatcher-type: tokens are dispatched with all-to-all (allgather computes the same)."),
    "--moe-router-dtype": Refusal("megatron_lite's router always computes in fp32", harmless=("fp32",)),
    # Transformer Engine.
    "--transformer-impl": Refusal(_NO_TE, harmless=("local",)),
    "--tp-comm-overlap": Refusal(_NO_TE + " (its userbuffers overlap tensor-parallel communication with GEMMs)",
                                 takes_value=False),
    "--te-rng-tracker": Refusal(_NO_TE, takes_value=False),
    "--cross-entropy-fusion-impl": Refusal(_NO_TE + " (te is its cross entropy; ours is the native one)",
                                           harmless=("native",)),
    # CUDA graphs.
    "--enable-cuda-graph": Refusal(_NO_CUDA_GRAPHS, takes_value=False),
    "--external-cuda-graph": Refusal(_NO_CUDA_GRAPHS, takes_value=False),
    "--cuda-graph-impl": Refusal(_NO_CUDA_GRAPHS, harmless=("none",)),
    # Checkpoint formats: ours is one format, reshardable like torch_dist.
    "--ckpt-format": Refusal("megatron_lite writes one checkpoint format, reshardable like torch_dist",
                             harmless=("torch_dist",),
                             notice="--ckpt-format torch_dist: saving megatron_lite's own reshardable format "
                                    "(loads at any parallel layout; not Megatron-LM's torch_dist files)."),
}

# Whole families of flags, refused by prefix so each of their many options is named too.
REFUSED_PREFIXES = {
    "--moe-": _NO_MOE,
    "--fp8-": _NO_FP8,
    "--fp4-": _NO_FP4,
    "--cuda-graph-": _NO_CUDA_GRAPHS,
    "--tp-comm-": _NO_TE,
    "--te-": _NO_TE,
}


def add_megatron_only_flags(parser) -> None:
    """Registers every table flag, so a refused one reaches ``check_megatron_only_flags`` instead of argparse's
    "unrecognized arguments"."""
    group = parser.add_argument_group("Megatron-LM flags without a megatron_lite setting")
    for flag, meaning in {**ACCEPTED_FLAGS, EXACT_GELU_FLAG: _EXACT_GELU_HELP}.items():
        group.add_argument(flag, dest=dest(flag), action="store_true", default=argparse.SUPPRESS, help=meaning)
    for spellings, meaning in ACCEPTED_VALUE_FLAGS.items():
        group.add_argument(*spellings, dest=dest(spellings[0]), metavar="VALUE", default=argparse.SUPPRESS,
                           help=meaning)
    for flag, refusal in REFUSED_FLAGS.items():
        accepted = f"accepted only as {flag} {' or '.join(refusal.harmless)}; " if refusal.harmless else ""
        kind = dict(metavar="VALUE") if refusal.takes_value else dict(action="store_true")
        group.add_argument(flag, dest=dest(flag), default=argparse.SUPPRESS,
                           help=f"{accepted}refused otherwise: {refusal.reason}", **kind)


def check_megatron_only_flags(values: dict) -> list[str]:
    """Removes the table flags from the parsed ``values``; returns notices to print, or raises ConfigError."""
    notices = []
    for flag, refusal in REFUSED_FLAGS.items():
        if dest(flag) not in values:
            continue
        value = values.pop(dest(flag))
        if refusal.takes_value and value in refusal.harmless:
            notices += [refusal.notice] if refusal.notice else []
            continue
        given = f"{flag} {value}" if refusal.harmless else flag  # the value matters only where some are fine
        fix = f"remove it or give {flag} {refusal.harmless[0]}" if refusal.harmless else "remove it"
        raise ConfigError(f"{given} is not supported: {refusal.reason}; {fix}.")
    for flag in [*ACCEPTED_FLAGS, *(spellings[0] for spellings in ACCEPTED_VALUE_FLAGS)]:
        values.pop(dest(flag), None)
    if values.pop(dest(EXACT_GELU_FLAG), False) and not values.get("swiglu"):
        values["gelu_exact"] = True
    return notices


def check_unknown_flags(unknown: list[str]) -> None:
    """An unknown flag of a refused family (``--moe-router-topk``) is refused by name; raises ConfigError."""
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        reason = next((r for prefix, r in REFUSED_PREFIXES.items() if flag.startswith(prefix)), None)
        if reason is not None:
            raise ConfigError(f"{flag} is not supported: {reason}; remove it.")


def dest(flag: str) -> str:
    """The argparse destination of a table flag, kept apart from the config's field names."""
    return "megatron_only_" + flag.lstrip("-").replace("-", "_")
