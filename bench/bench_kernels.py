"""Times each fused CUDA kernel against the PyTorch reference, eager and torch.compile'd, and apex's.

    python bench/bench_kernels.py [--dtype bf16] [--iters 20] [--no-compile] [--json PATH]

Shapes are a ~1B-parameter GPT's (hidden 2048, 16 heads of 128, sequence 2048,
micro-batch 4, GELU width 8192, SwiGLU width 5632). Each time is the median over
``--iters`` runs, timed with CUDA events, of the forward alone and of forward +
backward. "compiled" is the reference under ``torch.compile``, which is what a
compiled model runs (the dispatch never hands the extension to the compiler); "apex"
is apex's kernel where apex is installed and offers the op.

After the table, one ``dispatch:`` line per op says whether the implementation the
dispatch runs in an eager model (``kernels/dispatch.py``) is the fastest of the eager
ones, forward + backward; where it is not, the line names the entry for
``SLOWER_KERNELS`` that makes it run the faster one, and the command exits 1.
"""
import argparse
import json
import statistics
import sys
import types

import torch

from megatron_lite.kernels import apex_ops, dispatch, fused, reference

SEQ, BATCH, HIDDEN, HEADS, HEAD_DIM = 2048, 4, 2048, 16, 128
GELU_WIDTH, SWIGLU_WIDTH = 4 * HIDDEN, 5632


# The dispatch's name of each case's op, and apex's implementation of it where apex has one.
DISPATCH_OP = {"layer_norm": "layer_norm", "rms_norm": "rms_norm", "bias_gelu": "bias_gelu", "swiglu": "swiglu",
               "bias_dropout_add": "bias_dropout_add", "rotary": "apply_rotary_pos_emb",
               "causal_softmax": "scaled_upper_triang_masked_softmax", "masked_softmax": "scaled_masked_softmax"}
APEX_OP = {"layer_norm": apex_ops.layer_norm_op, "rms_norm": apex_ops.rms_norm_op, "rotary": apex_ops.rotary_op}


def _cases(dtype):
    """(name, shape text, inputs builder, op(fn_module) -> callable)."""

    def rand(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, device="cuda", dtype=dt).requires_grad_(grad)

    def freqs():
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM))
        angles = torch.outer(torch.arange(SEQ, device="cuda", dtype=torch.float32), inv)
        return torch.cat((angles, angles), -1)[:, None, None, :]

    causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").triu(1)
    causal_4d = causal.expand(BATCH, 1, SEQ, SEQ).contiguous()
    tokens = (SEQ, BATCH, HIDDEN)
    return [
        ("layer_norm", f"[{SEQ}, {BATCH}, {HIDDEN}]", lambda: (rand(*tokens), rand(HIDDEN), rand(HIDDEN)),
         lambda m: lambda x, w, b: m.layer_norm(x, w, b, 1e-5)),
        ("rms_norm", f"[{SEQ}, {BATCH}, {HIDDEN}]", lambda: (rand(*tokens), rand(HIDDEN)),
         lambda m: lambda x, w: m.rms_norm(x, w, 1e-6)),
        ("bias_gelu", f"[{SEQ}, {BATCH}, {GELU_WIDTH}]", lambda: (rand(SEQ, BATCH, GELU_WIDTH), rand(GELU_WIDTH)),
         lambda m: m.bias_gelu),
        ("swiglu", f"[{SEQ}, {BATCH}, 2x{SWIGLU_WIDTH}]", lambda: (rand(SEQ, BATCH, 2 * SWIGLU_WIDTH),),
         lambda m: m.swiglu),
        ("bias_dropout_add", f"[{SEQ}, {BATCH}, {HIDDEN}] p=0.1",
         lambda: (rand(*tokens), rand(HIDDEN), rand(*tokens)),
         lambda m: lambda x, b, r: m.bias_dropout_add(x, b, r, 0.1, True)),
        ("rotary", f"[{SEQ}, {BATCH}, {HEADS}, {HEAD_DIM}]", lambda: (rand(SEQ, BATCH, HEADS, HEAD_DIM), freqs()),
         lambda m: m.apply_rotary_pos_emb),
        ("causal_softmax", f"[{BATCH * HEADS}, {SEQ}, {SEQ}]", lambda: (rand(BATCH * HEADS, SEQ, SEQ),),
         lambda m: lambda x: m.scaled_upper_triang_masked_softmax(x, 0.088)),
        ("masked_softmax", f"[{BATCH}, {HEADS}, {SEQ}, {SEQ}]", lambda: (rand(BATCH, HEADS, SEQ, SEQ),),
         lambda m: lambda x: m.scaled_masked_softmax(x, causal_4d, 0.088)),
    ]


def _median_ms(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_op(op, inputs, iters):
    """(forward ms, forward + backward ms) of op on inputs."""
    differentiable = [t for t in inputs if t.requires_grad]
    grad = torch.randn_like(op(*inputs))

    def forward():
        with torch.no_grad():
            op(*inputs)

    def forward_backward():
        torch.autograd.grad(op(*inputs), differentiable, grad)

    return _median_ms(forward, iters), _median_ms(forward_backward, iters)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not fused.available():
        sys.exit("bench_kernels needs a CUDA GPU and the built extension (see docs/kernels.md)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]

    rows = []
    print(f"Device: {torch.cuda.get_device_name()}, {args.dtype}, median of {args.iters} runs")
    print("| op | shape | pytorch eager | pytorch compiled | apex | fused | fused speed-up vs eager / compiled "
          "(fwd+bwd) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, shape, make_inputs, make_op in _cases(dtype):
        inputs = make_inputs()
        row = {"op": name, "shape": shape, "dtype": args.dtype, "dispatch": dispatch_pick(name, inputs[0])}
        row["eager"] = time_op(make_op(reference), inputs, args.iters)
        row["fused"] = time_op(make_op(fused), inputs, args.iters)
        apex = APEX_OP.get(name, lambda: None)()
        row["apex"] = None if apex is None else time_op(
            make_op(types.SimpleNamespace(**{DISPATCH_OP[name]: apex})), inputs, args.iters)
        row["compiled"] = None
        if not args.no_compile:
            row["compiled"] = time_op(torch.compile(make_op(reference), dynamic=False), inputs, args.iters)
        rows.append(row)
        compiled = row["compiled"]
        speedup = f"{row['eager'][1] / row['fused'][1]:.2f}x"
        speedup += f" / {compiled[1] / row['fused'][1]:.2f}x" if compiled else ""
        print(f"| {name} | {shape} | {_pair(row['eager'])} | {_pair(compiled)} | {_pair(row['apex'])} | "
              f"{_pair(row['fused'])} | {speedup} |", flush=True)
        del inputs
        torch.cuda.empty_cache()
    lines = verdicts(rows)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "dispatch": lines}, f, indent=1)
    return 1 if any("SLOWER" in line for line in lines) else 0


def dispatch_pick(name: str, tensor) -> str:
    """What the dispatch runs for this case's op on ``tensor`` in an eager model: fused, apex or pytorch."""
    apex = APEX_OP.get(name)
    impl = dispatch.choose(DISPATCH_OP[name], tensor, "pytorch",
                           None if apex is None else (lambda: "apex" if apex() is not None else None))
    return impl if isinstance(impl, str) else "fused"


def verdicts(rows: list, tolerance: float = 0.05) -> list:
    """One ``dispatch:`` line per row: whether the implementation the dispatch runs is the fastest eager one,
    forward + backward (within ``tolerance``), what to put in ``SLOWER_KERNELS`` if not, and how the fused
    kernel compares with the compiled reference (what a torch.compile'd model runs instead)."""
    lines = []
    for row in rows:
        op = DISPATCH_OP[row["op"]]
        times = {"fused": row["fused"], "apex": row["apex"], "pytorch": row["eager"]}
        times = {name: pair[1] for name, pair in times.items() if pair is not None}
        fastest = min(times, key=times.get)
        picked = row["dispatch"]
        compiled = "" if row["compiled"] is None else f"; fused vs compiled {row['compiled'][1] / times['fused']:.2f}x"
        if times[picked] <= times[fastest] * (1 + tolerance):
            lines.append(f"dispatch: {op} runs {picked}, the fastest in eager mode{compiled}")
        else:
            fix = (f"remove SLOWER_KERNELS[{op!r}]" if fastest == "fused"
                   else f"set SLOWER_KERNELS[{op!r}] = {fastest!r}")
            lines.append(f"dispatch: {op} runs {picked} ({times[picked]:.3f} ms) but {fastest} takes "
                         f"{times[fastest]:.3f} ms: SLOWER; {fix} in kernels/dispatch.py{compiled}")
    return lines


def _pair(times):
    return "n/a" if times is None else f"{times[0]:.3f} / {times[1]:.3f}"


if __name__ == "__main__":
    sys.exit(main())
