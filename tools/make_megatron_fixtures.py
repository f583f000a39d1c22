"""Build the Megatron-LM checkpoint fixtures of tests/fixtures/megatron with Megatron-LM's own code.

Run by hand (not in CI), on CPU with gloo, from a git directory of NVIDIA/Megatron-LM:

    python tools/make_megatron_fixtures.py --megatron-git-dir /path/to/Megatron-LM/.git \\
        --megatron-ref core_v0.17.0 --output-dir tests/fixtures/megatron

    # our export, read back by Megatron-LM: each fixture imported, exported at another layout by
    # tools/checkpoint_convert.py, loaded with Megatron's own load_checkpoint (--use-checkpoint-args:
    # the architecture from the args we wrote) and its logits compared with the fixture's
    PYTHONPATH=$PWD python tools/make_megatron_fixtures.py --megatron-git-dir /path/to/Megatron-LM/.git \\
        --check-exports

What it does: ``git archive`` the ref into a throwaway directory, ``pip install --target``
its one missing pure-Python dependency (einops) beside it, and run each fixture in a
fresh interpreter whose ``PYTHONPATH`` is that snapshot, so nothing of Megatron enters
this repository or this environment. Each fixture is Megatron's ``gpt_builder`` model,
built from Megatron's own argument parser, its weights moved off their initial values
(so that biases and norms are not 0 and 1, which would hide a mapping mistake), saved
with Megatron's ``save_checkpoint``, and Megatron's logits for a fixed batch, written as
``logits.safetensors`` beside the checkpoint.

CPU stand-ins, in this script only: CUDA's RNG-state calls and ``synchronize`` become
the CPU ones / no-ops, and pipeline stages hand activations to each other with plain
``send``/``recv`` (Megatron's p2p code allocates its buffers on the CUDA device).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zlib

# name -> (model flags, tensor size, pipeline size, extra flags). Tiny on purpose: the fixtures are committed.
GPT2 = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--ffn-hidden-size", "32",
        "--max-position-embeddings", "16", "--position-embedding-type", "learned_absolute"]
LLAMA = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--ffn-hidden-size", "24",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "10000",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--max-position-embeddings", "16"]
FIXTURES = {
    "gpt2_tp1pp1_torch": (GPT2, 1, 1, ["--ckpt-format", "torch"]),
    "gpt2_tp2pp2_torch": (GPT2, 2, 2, ["--ckpt-format", "torch"]),
    "llama_tp1pp1_torch": (LLAMA, 1, 1, ["--ckpt-format", "torch"]),
    "llama_tp2pp2_torch": (LLAMA, 2, 2, ["--ckpt-format", "torch"]),
    "llama_tp2pp2_torch_bf16": (LLAMA, 2, 2, ["--ckpt-format", "torch", "--bf16"]),
    "gpt2_tp2pp1_torch_dist": (GPT2, 2, 1, ["--ckpt-format", "torch_dist"]),
    "llama_tp2pp1_torch_dist": (LLAMA, 2, 1, ["--ckpt-format", "torch_dist"]),
}
# No --use-legacy-models fixture: in core 0.17 the legacy model reads args its parser no longer defines
# (model_type, apply_layernorm_1p) and its LayerNorm needs apex's CUDA extension (fused_layer_norm_cuda).
COMMON = ["--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--tokenizer-type",
          "NullTokenizer", "--vocab-size", "50", "--make-vocab-size-divisible-by", "8", "--transformer-impl", "local",
          "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
          "--no-rope-fusion", "--no-persist-layer-norm", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--use-cpu-initialization", "--no-save-optim", "--no-save-rng", "--train-iters", "10", "--save-interval",
          "10", "--lr", "1e-4", "--seed", "1234", "--attention-backend", "unfused"]
# --check-exports: (fixture, tensor size, pipeline size of the export). Megatron recomputes the padded
# vocabulary from its tokenizer (50 tokens + EOD here), so each export's layout pads it as the source did.
EXPORT_CHECKS = (("gpt2_tp1pp1_torch", 2, 2), ("llama_tp1pp1_torch", 2, 2), ("gpt2_tp2pp2_torch", 2, 1),
                 ("llama_tp2pp2_torch", 2, 1))
EXPORT_ATOL = 1e-5
# The fixed batch whose logits are saved: [batch, sequence].
TOKENS = [[3, 17, 42, 8, 0, 25, 11, 49], [5, 5, 30, 1, 44, 19, 2, 7]]
ITERATION = 10


# ---------------------------------------------------------------------------------------------
# The driver: a snapshot of Megatron-LM in a throwaway directory, one interpreter per fixture


def snapshot(git_dir: str, ref: str, workdir: str) -> str:
    source = os.path.join(workdir, "megatron-lm")
    os.makedirs(source, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", ref, "megatron", "gpt_builders.py",
                              "model_provider.py"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", source], input=archive, check=True)
    deps = os.path.join(workdir, "deps")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", deps, "einops"], check=True)
    return os.pathsep.join([source, deps])


def run_worker(pythonpath: str, job: dict, cwd: str) -> None:
    """One fixture in a fresh interpreter. It runs in the output directory and saves to a relative
    path, because the saved ``args`` record ``--save``: no machine path enters the fixtures."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TORCHDYNAMO_DISABLE": "1"}  # Megatron's jit_fuser would compile C++ kernels on CPU
    subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)], check=True, env=env,
                   cwd=cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-git-dir")
    parser.add_argument("--megatron-ref", default="core_v0.17.0")
    parser.add_argument("--output-dir", default=os.path.join("tests", "fixtures", "megatron"))
    parser.add_argument("--only", nargs="*", help="fixture names to build or check (default: all)")
    parser.add_argument("--check-exports", action="store_true",
                        help="build nothing: load our exports of the fixtures with Megatron-LM (EXPORT_CHECKS)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    workdir = tempfile.mkdtemp(prefix="megatron-fixtures-")
    try:
        pythonpath = snapshot(args.megatron_git_dir, args.megatron_ref, workdir)
        if args.check_exports:
            check_exports(pythonpath, workdir, args.output_dir, args.megatron_ref, args.only)
            return
        os.makedirs(args.output_dir, exist_ok=True)
        failed = []
        for name in args.only or FIXTURES:
            shutil.rmtree(os.path.join(args.output_dir, name), ignore_errors=True)
            try:
                run_worker(pythonpath, {"name": name, "save": name, "workdir": workdir, "ref": args.megatron_ref},
                           cwd=args.output_dir)
            except subprocess.CalledProcessError:
                failed.append(name)
        if failed:
            raise SystemExit(f"Megatron-LM failed to build: {', '.join(failed)} (its traceback is above)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def check_exports(pythonpath: str, workdir: str, fixtures_dir: str, ref: str, only=None) -> None:
    """Each EXPORT_CHECKS fixture through our import and export (this interpreter's megatron_lite), then
    loaded by Megatron-LM at the export's layout; fails unless Megatron's logits are the fixture's."""
    convert = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_convert.py")]
    results = []
    for name, tp, pp in [check for check in EXPORT_CHECKS if not only or check[0] in only]:
        ours, exported = os.path.join(workdir, f"ours-{name}"), os.path.join(workdir, f"export-{name}-tp{tp}pp{pp}")
        subprocess.run([*convert, "--source-format", "megatron", "--load-dir", os.path.join(fixtures_dir, name),
                        "--save-dir", ours], check=True)
        subprocess.run([*convert, "--target-format", "megatron", "--megatron-ckpt-format", "torch", "--load-dir",
                        ours, "--save-dir", exported, "--target-tensor-parallel-size", str(tp),
                        "--target-pipeline-parallel-size", str(pp)], check=True)
        result = os.path.join(workdir, f"result-{name}.json")
        run_worker(pythonpath, {"name": name, "load": exported, "tp": tp, "pp": pp, "workdir": workdir, "ref": ref,
                                "reference": os.path.abspath(os.path.join(fixtures_dir, name, "logits.safetensors")),
                                "result": result}, cwd=workdir)
        with open(result) as f:
            results.append(json.load(f))
    for r in results:
        print(f"{r['fixture']} exported at tp{r['tp']}pp{r['pp']}, loaded by Megatron-LM {ref}: "
              f"max |logits - fixture's| = {r['max_abs_diff']:.3g}")
    bad = [r["fixture"] for r in results if not r["max_abs_diff"] <= EXPORT_ATOL]
    if bad:
        raise SystemExit(f"Megatron-LM's logits of our exports differ from the fixtures' by more than "
                         f"{EXPORT_ATOL}: {', '.join(bad)}")


# ---------------------------------------------------------------------------------------------
# The worker: Megatron's code, one process per rank


def worker(job: dict) -> None:
    import torch.multiprocessing as mp
    flags, tp, pp, extra = FIXTURES[job["name"]]
    tp, pp = job.get("tp", tp), job.get("pp", pp)
    init_file = os.path.join(job["workdir"], f"rendezvous-{job['name']}")
    if os.path.exists(init_file):
        os.remove(init_file)
    mp.spawn(rank_main, args=(tp * pp, init_file, job), nprocs=tp * pp, join=True)


def cpu_stand_ins() -> None:
    """What Megatron asks of CUDA that a CPU run answers: RNG states, synchronisation, the device."""
    import torch
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embeddings' first all-reduce moves them there
    torch.cuda.current_device = lambda: "cpu"  # where Megatron's global memory buffer allocates
    # validate_args asks for the GPU generation to decide whether to require CUDA_DEVICE_MAX_CONNECTIONS.
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="cpu")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    # load_checkpoint all-reduces the tracker file's iteration in a tensor it creates on device "cuda".
    cpu_tensor = torch.tensor
    torch.tensor = lambda *a, device=None, **k: cpu_tensor(*a, device=None if str(device).startswith("cuda")
                                                            else device, **k)


def megatron_args(job: dict, world_size: int):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    flags, tp, pp, extra = FIXTURES[job["name"]]
    if "load" in job:  # the architecture is the args our export wrote, but for what Megatron does not restore
        flags, tp, pp = not_restored_by_checkpoint_args(flags), job["tp"], job["pp"]
        extra = [*extra, "--load", job["load"], "--use-checkpoint-args", "--no-load-optim", "--no-load-rng"]
    else:
        extra = [*extra, "--save", job["save"]]
    argv = [*flags, *COMMON, *extra, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
            str(pp)]
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    args.world_size, args.rank = world_size, int(os.environ["RANK"])
    if "load" in job:
        from megatron.training.checkpointing import load_args_from_checkpoint
        load_args_from_checkpoint(args)  # as initialize_megatron does for --use-checkpoint-args
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    return args


def not_restored_by_checkpoint_args(flags: list) -> list:
    """The model flags Megatron-LM's ``--use-checkpoint-args`` does not take from the saved args (its
    load_args_from_checkpoint leaves the norm epsilon at the default): given on the command line."""
    return [item for i, flag in enumerate(flags) if flag == "--norm-epsilon" for item in flags[i:i + 2]]


def rank_main(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    cpu_stand_ins()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    args = megatron_args(job, world_size)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
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
    logits = forward(model, args)
    if logits is not None and mpu.get_tensor_model_parallel_rank() == 0:
        if "load" in job:
            write_comparison(job, logits)
        else:
            write_logits(os.path.join(job["save"], "logits.safetensors"), logits, job)
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
            key = "embedding.word_embeddings.weight" if tied and name.endswith("output_layer.weight") else name
            if getattr(param, "tensor_model_parallel", False):
                key += f"@tp{mpu.get_tensor_model_parallel_rank()}"
            if "layers." in name:  # the same layer on any stage: global layer numbers
                key += f"@stage{mpu.get_pipeline_model_parallel_rank()}"
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            param.add_(0.05 * torch.randn(param.shape, generator=generator).to(param.dtype))


def forward(model, args):
    """Megatron's logits [batch, sequence, padded vocab] on the last stage (None elsewhere); the stages
    pass activations [sequence, batch, hidden] with send/recv."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    tokens = torch.tensor(TOKENS)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if not mpu.is_pipeline_first_stage():
        received = torch.empty(tokens.shape[1], tokens.shape[0], args.hidden_size, dtype=dtype)
        dist.recv(received, src=mpu.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    with torch.no_grad():
        output = model(tokens, position_ids, mask)
    if not mpu.is_pipeline_last_stage():
        dist.send(output.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
        return None
    # GPTModel returns vocabulary-parallel logits [batch, sequence, vocab / tp].
    return tensor_parallel.gather_from_tensor_model_parallel_region(output).float()


def write_logits(path: str, logits, job: dict) -> None:
    import safetensors.torch
    import torch
    safetensors.torch.save_file({"tokens": torch.tensor(TOKENS), "logits": logits.contiguous()}, path,
                                metadata={"megatron_ref": job["ref"], "fixture": job["name"]})


def write_comparison(job: dict, logits) -> None:
    """Megatron's logits of our export against the fixture's, as JSON. An export at a larger tensor size
    pads the vocabulary further with zero rows: their logits are the extra columns, compared to 0."""
    import safetensors.torch
    reference = safetensors.torch.load_file(job["reference"])["logits"]
    width = reference.shape[-1]
    difference = max((logits[..., :width] - reference).abs().max().item(), logits[..., width:].abs().max().item()
                     if logits.shape[-1] > width else 0.0)
    with open(job["result"], "w") as f:
        json.dump({"fixture": job["name"], "tp": job["tp"], "pp": job["pp"], "max_abs_diff": difference,
                   "shape": list(logits.shape), "reference_shape": list(reference.shape)}, f)


if __name__ == "__main__":
    main()
