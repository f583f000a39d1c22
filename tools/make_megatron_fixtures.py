"""Build the Megatron-LM checkpoint fixtures of tests/fixtures/megatron with Megatron-LM's own code.

Run by hand (not in CI), on CPU with gloo, in a throwaway virtual environment that has
torch (CPU), numpy and safetensors, from a git directory of NVIDIA/Megatron-LM that holds
the refs of FIXTURES (core_v0.17.0 and a commit of main):

    python tools/make_megatron_fixtures.py --megatron-git-dir /path/to/Megatron-LM/.git

    # our export, read back by Megatron-LM: each fixture imported, exported by
    # tools/checkpoint_convert.py (legacy or torch_dist, at another layout), loaded with Megatron's
    # own load_checkpoint (--use-checkpoint-args: the architecture from the args we wrote) and its
    # logits compared with the fixture's (megatron_lite installed in the same environment)
    pip install --no-deps . && pip install regex sentencepiece tiktoken tokenizers
    python tools/make_megatron_fixtures.py --megatron-git-dir /path/to/Megatron-LM/.git --check-exports

What it does: ``git archive`` each ref into a throwaway directory, ``pip install --target``
the few packages it imports (MEGATRON_DEPS) beside it, and run each fixture in a
fresh interpreter whose ``PYTHONPATH`` is that snapshot, so nothing of Megatron enters
this repository. Each fixture is Megatron's ``gpt_builder`` model (Megatron-Core's GPTModel,
or with ``--use-legacy-models`` the legacy one), built from Megatron's own argument parser,
its weights moved off their initial values (so that biases and norms are not 0 and 1, which
would hide a mapping mistake), saved with Megatron's ``save_checkpoint``, and Megatron's
logits for a fixed batch, written as ``logits.safetensors`` beside the checkpoint.

This file holds the tables (the fixtures, the export checks, the batch) and the driver; the code that
runs inside Megatron-LM's environment is ``megatron_fixture_worker.py``, with the CPU stand-ins of
``megatron_cpu_stand_ins.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Megatron-LM's refs the fixtures come from: core_v0.17.0 (common.pt beside the .distcp files) and the newest
# snapshot of main, whose megatron/core/package_info.py says 0.20.0 (the common state inside the .distcp files,
# as from core 0.19).
CORE_017 = "core_v0.17.0"
# The last release with the legacy GroupedMLP (--moe-grouped-gemm without Transformer Engine): core 0.17 builds
# SequentialMLP for local layers whatever the flag says.
CORE_016 = "core_v0.16.0"
CORE_020 = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


NEEDS_TRITON_STAND_IN = (CORE_016, CORE_020)


@dataclasses.dataclass(frozen=True)
class Fixture:
    model: tuple  # the model's flags
    tp: int
    pp: int
    extra: tuple  # format, precision, model implementation
    ref: str = CORE_017
    ep: int = 1  # expert-parallel size: the world is tp x pp x ep (data-parallel size ep)


# Tiny on purpose: the fixtures are committed. Each rank file carries Megatron's whole args (~30 KB of the
# pickle), so the fixtures keep few rank files, not just small tensors.
GPT2 = ("--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
        "--max-position-embeddings", "8", "--position-embedding-type", "learned_absolute")
LLAMA = ("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--ffn-hidden-size", "24",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "10000",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--max-position-embeddings", "8")
MOE = (*LLAMA, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "12",
       "--moe-token-dispatcher-type", "allgather")
LLAMA_VARIANTS = (*LLAMA, "--qk-layernorm", "--add-qkv-bias", "--window-size", "3,0", "--window-attn-skip-freq", "2",
                  "--use-rope-scaling", "--rotary-base", "1000000")
TIED_LLAMA = tuple(flag for flag in LLAMA if flag != "--untie-embeddings-and-output-weights")
# Weights of std 0.2 make the logits, and so the losses, far from uniform.
MTP = ("--mtp-loss-scaling-factor", "0.3", "--init-method-std", "0.2")
# The clamp small enough to bite at these activations; the window shorter than the sequence; YaRN's defaults
# (original context 4096, beta 32 and 1) interpolate some of the 4 rotary frequencies of an 8-channel head.
GPT_OSS = ("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--group-query-attention",
           "--num-query-groups", "2", "--kv-channels", "8", "--ffn-hidden-size", "24", "--quick-geglu",
           "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "0.3", "--no-bias-gelu-fusion",
           "--normalization", "RMSNorm", "--softmax-type", "learnable", "--window-size", "3,0",
           "--window-attn-skip-freq", "2", "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
           "--untie-embeddings-and-output-weights", "--max-position-embeddings", "8", "--num-experts", "4",
           "--moe-layer-freq", "[0,1]", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "12",
           "--moe-token-dispatcher-type", "allgather", "--init-method-std", "0.2")
QWEN_ATTENTION = (*LLAMA, "--qk-layernorm", "--attention-output-gate", "--add-qkv-bias", "--init-method-std", "0.2")
TORCH, TORCH_DIST = ("--ckpt-format", "torch"), ("--ckpt-format", "torch_dist")
LEGACY_MODEL = ("--use-legacy-models",)  # the nested language_model.encoder... layout
# Every layout the tests need once: tp1pp1 and tp2pp2 of both model implementations (the tp2pp2 GPT-2 one has
# the last stage's copy of the tied embeddings), both families, bf16, torch_dist of core 0.17 and of main.
FIXTURES = {
    "gpt2_tp2pp2_torch": Fixture(GPT2, 2, 2, TORCH),
    "llama_tp1pp1_torch_bf16": Fixture(LLAMA, 1, 1, (*TORCH, "--bf16")),
    "gpt2_tp1pp1_legacy_model": Fixture(GPT2, 1, 1, (*TORCH, *LEGACY_MODEL)),
    "llama_tp2pp2_legacy_model": Fixture(LLAMA, 2, 2, (*TORCH, *LEGACY_MODEL)),
    "gpt2_tp2pp1_torch_dist": Fixture(GPT2, 2, 1, TORCH_DIST),
    "llama_tp2pp1_torch_dist_core020": Fixture(LLAMA, 2, 1, TORCH_DIST, ref=CORE_020),
    # Without the bias-GeLU fusion, Megatron's MLP computes F.gelu: the exact (erf) GeLU, not the tanh one.
    "gpt2_tp2pp1_exact_gelu": Fixture(GPT2, 2, 1, (*TORCH, "--no-bias-gelu-fusion")),
    # Megatron-Core's mixture of experts (SequentialMLP: one MLP per expert), 4 experts top-2, in one file and
    # split over 2 expert-parallel ranks x 2 tensor-parallel ones. The allgather token dispatcher: alltoall
    # creates a CUDA stream.
    "moe_tp1pp1_torch": Fixture(MOE, 1, 1, TORCH),
    "moe_tp2pp1ep2_torch": Fixture(MOE, 2, 1, TORCH, ep=2),
    "moe_tp2pp1ep2_torch_dist": Fixture(MOE, 2, 1, TORCH_DIST, ep=2),
    # The experts whole on each rank (expert-tensor size 1) under tensor size 2: torch_dist's tensors are global.
    "moe_tp2pp1etp1ep2_torch_dist": Fixture(MOE, 2, 1, (*TORCH_DIST, "--expert-tensor-parallel-size", "1"), ep=2),
    # The router's expert bias (a buffer, moved off its zeros like the weights), which needs sigmoid scores.
    "moe_expert_bias_tp1pp1_torch": Fixture((*MOE, "--moe-router-score-function", "sigmoid",
                                             "--moe-router-enable-expert-bias"), 1, 1, TORCH),
    # The legacy GroupedMLP (weight1/weight2: each rank's experts as one grouped GEMM's matrices), bf16 only.
    "moe_grouped_gemm_tp2pp1ep2_torch_bf16": Fixture((*MOE, "--moe-grouped-gemm"), 2, 1, (*TORCH, "--bf16"),
                                                     ref=CORE_016, ep=2),
    # Llama's variants of Qwen, Mistral and Llama 3.1: query/key norms, biases on the QKV projection alone, a
    # sliding window of 3 on every other layer, and Llama 3's RoPE scaling (a base of 1e6, so that the scaling
    # moves a frequency of these 4-channel heads), in both formats.
    "llama_variants_tp2pp1_torch": Fixture(LLAMA_VARIANTS, 2, 1, TORCH),
    "llama_variants_tp2pp1_torch_dist": Fixture(LLAMA_VARIANTS, 2, 1, TORCH_DIST),
    # GLM-4.5's mixture of experts over 2 expert ranks: sigmoid scores with the expert bias, chosen within the
    # best of 2 groups, scaled by 2.5; a gated shared expert; query/key norms, QKV biases, RoPE on half of each head.
    "moe_glm_tp2pp1ep2_torch_dist": Fixture(
        (*MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups",
         "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
         "--moe-shared-expert-intermediate-size", "8", "--moe-shared-expert-gate", "--qk-layernorm", "--add-qkv-bias",
         "--rotary-percent", "0.5"), 2, 1, TORCH_DIST, ep=2),
    # Multi-token prediction (rope only, in Megatron-LM): two depths after a Llama style decoder with tied
    # embeddings (the last stage holds a copy of the embedding for the MTP layers and the output layer), and one
    # depth with experts (DeepSeek-V3's: the MTP layer is of the decoder's last layer's kind) in torch_dist.
    "mtp_tp2pp2_torch": Fixture((*TIED_LLAMA, *MTP, "--mtp-num-layers", "2"), 2, 2, TORCH),
    # (Megatron's training forward, which records the MTP losses, refuses experts under tensor parallelism
    # without sequence parallelism: tensor size 1.)
    "mtp_moe_tp1pp1ep2_torch_dist": Fixture((*MOE, *MTP, "--mtp-num-layers", "1"), 1, 1, TORCH_DIST, ep=2),
    # gpt-oss's features, in main (the first with YaRN for attention other than multi-latent): learnable sinks,
    # quick GeGLU with its linear offset and clamp, biases everywhere (experts' and router's too), a sliding
    # window on every other layer, YaRN; a dense first layer beside the mixture of experts, whose biases
    # Megatron-LM takes at expert-tensor size 1 only.
    "gpt_oss_tp2pp1etp1ep2_torch_dist_core020": Fixture(GPT_OSS, 2, 1, (*TORCH_DIST, "--expert-tensor-parallel-size",
                                                                       "1"), ref=CORE_020, ep=2),
    # Qwen's attention: query/key layer norms, gated attention (--attention-output-gate), biases on the QKV
    # projection alone.
    "qwen_attention_tp2pp1_torch": Fixture(QWEN_ATTENTION, 2, 1, TORCH),
}
# NullTokenizer's vocabulary is --vocab-size + 1 (EOD): 28 tokens, padded to 32 at tensor sizes 1, 2 and 4 alike,
# so an export at another tensor size pads as Megatron-LM does, and 4 padding rows are still there to get right.
COMMON = ("--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--tokenizer-type",
          "NullTokenizer", "--vocab-size", "27", "--make-vocab-size-divisible-by", "8", "--transformer-impl", "local",
          "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
          "--no-rope-fusion", "--no-persist-layer-norm", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--use-cpu-initialization", "--no-save-optim", "--no-save-rng", "--train-iters", "10", "--save-interval",
          "10", "--lr", "1e-4", "--seed", "1234", "--attention-backend", "unfused")


@dataclasses.dataclass(frozen=True)
class ExportCheck:
    fixture: str
    ckpt_format: str  # what our export writes: torch or torch_dist
    tp: int
    pp: int
    ref: str = CORE_017  # the Megatron-LM that loads it
    extra: tuple = ()  # more flags of tools/checkpoint_convert.py
    ep: int = 1  # the export's expert-parallel size


# --check-exports: each fixture imported, exported by tools/checkpoint_convert.py, loaded by Megatron-LM.
EXPORT_CHECKS = (
    ExportCheck("gpt2_tp2pp2_torch", "torch", 1, 1), ExportCheck("llama_tp2pp2_legacy_model", "torch", 2, 1),
    ExportCheck("gpt2_tp1pp1_legacy_model", "torch", 2, 2),
    ExportCheck("gpt2_tp2pp2_torch", "torch_dist", 2, 2), ExportCheck("llama_tp2pp2_legacy_model", "torch_dist", 1, 2),
    ExportCheck("llama_tp1pp1_torch_bf16", "torch_dist", 2, 2),
    ExportCheck("gpt2_tp2pp2_torch", "torch_dist", 2, 1, ref=CORE_020),
    ExportCheck("llama_tp2pp2_legacy_model", "torch_dist", 2, 2, ref=CORE_020,
                extra=("--megatron-common-state", "distcp")),
    ExportCheck("moe_tp2pp1ep2_torch", "torch", 1, 1), ExportCheck("moe_tp1pp1_torch", "torch", 2, 1, ep=2),
    ExportCheck("moe_tp2pp1ep2_torch_dist", "torch_dist", 1, 1),
    ExportCheck("moe_tp1pp1_torch", "torch_dist", 2, 1, ep=2),
    ExportCheck("moe_expert_bias_tp1pp1_torch", "torch", 2, 1, ep=2),
    ExportCheck("moe_expert_bias_tp1pp1_torch", "torch_dist", 1, 1),
    ExportCheck("moe_grouped_gemm_tp2pp1ep2_torch_bf16", "torch", 1, 1),
    ExportCheck("llama_variants_tp2pp1_torch", "torch", 1, 1),
    ExportCheck("llama_variants_tp2pp1_torch_dist", "torch_dist", 1, 1),
    ExportCheck("moe_glm_tp2pp1ep2_torch_dist", "torch", 1, 1, ep=2),
    # The last stage's copy of the embedding and its output layer weight that Megatron never reads (legacy:
    # Megatron-Core has no torch_dist layout for tied embeddings with MTP over pipeline stages).
    ExportCheck("mtp_tp2pp2_torch", "torch", 1, 2), ExportCheck("mtp_tp2pp2_torch", "torch_dist", 2, 1),
    ExportCheck("mtp_tp2pp2_torch", "torch_dist", 1, 1, ref=CORE_020, extra=("--megatron-common-state", "distcp")),
    ExportCheck("mtp_moe_tp1pp1ep2_torch_dist", "torch", 1, 1, ep=2),
    ExportCheck("mtp_moe_tp1pp1ep2_torch_dist", "torch_dist", 1, 1),
    ExportCheck("mtp_moe_tp1pp1ep2_torch_dist", "torch_dist", 1, 2),  # untied: the embedding's copy over stages
    # Biased experts whole on each rank under tp2 (torch_dist only), or in the legacy format at tp1.
    ExportCheck("gpt_oss_tp2pp1etp1ep2_torch_dist_core020", "torch_dist", 2, 1, ref=CORE_020, ep=2,
                extra=("--megatron-common-state", "distcp")),
    ExportCheck("gpt_oss_tp2pp1etp1ep2_torch_dist_core020", "torch", 1, 2, ref=CORE_020),
    ExportCheck("qwen_attention_tp2pp1_torch", "torch", 1, 2),
    ExportCheck("qwen_attention_tp2pp1_torch", "torch_dist", 2, 1),
)
EXPORT_ATOL = {"fp32": 1e-5, "bf16": 2e-2}  # bf16: Megatron's forward in bf16 at another layout
# The fixed batch whose logits are saved: [batch, sequence], tokens below the 28 of the vocabulary.
TOKENS = [[3, 17, 22, 8, 0, 25, 11, 27], [5, 5, 20, 1, 14, 19, 2, 7]]
# Their labels, for the losses of multi-token prediction fixtures: the next tokens, then one more.
LABELS = [[17, 22, 8, 0, 25, 11, 27, 4], [5, 20, 1, 14, 19, 2, 7, 9]]
ITERATION = 10
# What Megatron-LM imports on this path beyond torch, numpy and safetensors (CPU-only packages).
MEGATRON_DEPS = ("einops", "pyyaml", "psutil")


# ---------------------------------------------------------------------------------------------
# The driver: a snapshot of Megatron-LM in a throwaway directory, one interpreter per fixture


class Snapshots:
    """One ``git archive`` of each Megatron-LM ref asked for, with its pure-Python dependencies beside it."""

    def __init__(self, git_dir: str, workdir: str):
        self.git_dir, self.workdir, self.paths = git_dir, workdir, {}

    def pythonpath(self, ref: str) -> str:
        if ref not in self.paths:
            source = os.path.join(self.workdir, f"megatron-lm-{ref[:12]}")
            os.makedirs(source)
            archive = subprocess.run(["git", "--git-dir", self.git_dir, "archive", ref, "megatron",
                                      "gpt_builders.py", "model_provider.py"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "x", "-C", source], input=archive, check=True)
            deps = os.path.join(self.workdir, "deps")
            if not os.path.isdir(deps):
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", deps, *MEGATRON_DEPS],
                               check=True)
            self.paths[ref] = os.pathsep.join([source, deps])
        return self.paths[ref]


def run_worker(pythonpath: str, job: dict, cwd: str) -> None:
    """One fixture in a fresh interpreter. It runs in the output directory and saves to a relative
    path, because the saved ``args`` record ``--save``: no machine path enters the fixtures."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TORCHDYNAMO_DISABLE": "1"}  # Megatron's jit_fuser would compile C++ kernels on CPU
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "megatron_fixture_worker.py"), json.dumps(job)],
                   check=True, env=env, cwd=cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-git-dir", help="a git directory of NVIDIA/Megatron-LM")
    parser.add_argument("--output-dir", default=os.path.join("tests", "fixtures", "megatron"))
    parser.add_argument("--only", nargs="*", help="fixture names to build or check (default: all)")
    parser.add_argument("--check-exports", action="store_true",
                        help="build nothing: load our exports of the fixtures with Megatron-LM (EXPORT_CHECKS)")
    args = parser.parse_args()
    if not args.megatron_git_dir:
        parser.error("--megatron-git-dir is required: a git directory of NVIDIA/Megatron-LM")
    workdir = tempfile.mkdtemp(prefix="megatron-fixtures-")
    try:
        snapshots = Snapshots(args.megatron_git_dir, workdir)
        if args.check_exports:
            check_exports(snapshots, workdir, args.output_dir, args.only)
            return
        os.makedirs(args.output_dir, exist_ok=True)
        failed = []
        for name in args.only or FIXTURES:
            shutil.rmtree(os.path.join(args.output_dir, name), ignore_errors=True)
            try:
                ref = FIXTURES[name].ref
                run_worker(snapshots.pythonpath(ref), {"name": name, "save": name, "workdir": workdir, "ref": ref},
                           cwd=args.output_dir)
            except subprocess.CalledProcessError:
                failed.append(name)
        if failed:
            raise SystemExit(f"Megatron-LM failed to build: {', '.join(failed)} (its traceback is above)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def check_exports(snapshots: Snapshots, workdir: str, fixtures_dir: str, only=None) -> None:
    """Each EXPORT_CHECKS fixture through our import and export (this interpreter's megatron_lite), then
    loaded by Megatron-LM at the export's layout; fails unless Megatron's logits are the fixture's."""
    convert = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_convert.py")]
    results = []
    for number, check in enumerate(c for c in EXPORT_CHECKS if not only or c.fixture in only):
        ours, exported = os.path.join(workdir, f"ours-{number}"), os.path.join(workdir, f"export-{number}")
        subprocess.run([*convert, "--source-format", "megatron", "--load-dir",
                        os.path.join(fixtures_dir, check.fixture), "--save-dir", ours], check=True)
        subprocess.run([*convert, "--target-format", "megatron", "--megatron-ckpt-format", check.ckpt_format,
                        "--load-dir", ours, "--save-dir", exported, "--target-tensor-parallel-size", str(check.tp),
                        "--target-pipeline-parallel-size", str(check.pp), "--target-expert-parallel-size",
                        str(check.ep), *check.extra], check=True)
        result = os.path.join(workdir, f"result-{number}.json")
        run_worker(snapshots.pythonpath(check.ref), {
            "name": check.fixture, "load": exported, "ckpt_format": check.ckpt_format, "tp": check.tp,
            "pp": check.pp, "ep": check.ep, "workdir": workdir, "result": result, "ref": check.ref,
            "reference": os.path.abspath(os.path.join(fixtures_dir, check.fixture, "logits.safetensors"))},
            cwd=workdir)
        with open(result) as f:
            results.append((check, json.load(f)))
    bad = []
    for check, r in results:
        precision = "bf16" if "--bf16" in FIXTURES[check.fixture].extra else "fp32"
        print(f"{check.fixture} exported as {' '.join((check.ckpt_format, *check.extra))} at tp{check.tp}pp{check.pp}"
              f"{f'ep{check.ep}' if check.ep > 1 else ''}, "
              f"loaded by Megatron-LM {check.ref[:12]}: max |logits (MTP: and losses) - fixture's| = "
              f"{r['max_abs_diff']:.3g} "
              f"({precision})")
        if not r["max_abs_diff"] <= EXPORT_ATOL[precision]:
            bad.append(check.fixture)
    if bad:
        raise SystemExit(f"Megatron-LM's logits of our exports differ from the fixtures' by more than "
                         f"{EXPORT_ATOL}: {', '.join(bad)}")


if __name__ == "__main__":
    main()
