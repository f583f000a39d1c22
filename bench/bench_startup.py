"""Start-up: from a fresh interpreter to the end of the first training iteration, and the imports alone,
of ``python -m megatron_lite.pretrain_gpt`` against the script a transformers user would write.

    python bench/bench_startup.py [--rounds 3] [--threads 2]

Both train the same small GPT-2 (2 layers x 128, seq 128, micro-batch 4, vocab 8192, fp32, mock
data) for one iteration: ours through the command line (argument checks, the run plan, the model,
the optimizer, the data, one step, its log line), theirs as ``GPT2LMHeadModel`` with
``torch.optim.AdamW`` and one step on random tokens. The clock stops when the first iteration's line
is printed. "Import" is ``import megatron_lite.pretrain_gpt`` against ``from transformers import
GPT2LMHeadModel``. Fresh processes alternate round by round; the ratio is theirs over ours (> 1 =
we are faster), min / median / max.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from bench.side_by_side import Ratio, Seconds, load_average, markdown_table  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH, VOCAB = 2, 128, 4, 128, 4, 8192

OUR_FLAGS = ["--mock-data", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads",
             str(HEADS), "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
             "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(MICRO_BATCH), "--train-iters", "1",
             "--lr", "1e-4", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--eval-iters", "0"]

PEER_SCRIPT = f"""
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.set_num_threads(int(sys.argv[1]))
model = GPT2LMHeadModel(GPT2Config(vocab_size={VOCAB}, n_positions={SEQ}, n_embd={HIDDEN}, n_layer={LAYERS},
                                   n_head={HEADS}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
ids = torch.randint(0, {VOCAB}, ({MICRO_BATCH}, {SEQ} + 1))
logits = model(ids[:, :-1]).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, {VOCAB}), ids[:, 1:].reshape(-1))
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
print(f" iteration        1/       1 | lm loss: {{loss.item():.6E}}", flush=True)
"""


def until_first_iteration(command: list, threads: int) -> Seconds:
    """Wall-clock seconds from starting ``command`` to its first iteration's log line (CPU time unknown: 0)."""
    environment = dict(os.environ, OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT,
                          env=environment) as process:
        for line in process.stdout:
            if line.startswith(" iteration        1/"):
                elapsed = time.perf_counter() - start
                break
        else:
            raise SystemExit(f"{' '.join(command[:3])} printed no first iteration (exit code {process.wait()})")
        process.stdout.read()
    return Seconds(elapsed, 0.0)


def imported(statement: str) -> Seconds:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, cwd=REPO_ROOT)
    return Seconds(time.perf_counter() - start, 0.0)


def compare(rounds: int, threads: int) -> list:
    """Rows (what, ratio, our median seconds, their median seconds) of the two measurements."""
    runs = {
        "start to first iteration": (
            lambda: until_first_iteration([sys.executable, "-m", "megatron_lite.pretrain_gpt", *OUR_FLAGS], threads),
            lambda: until_first_iteration([sys.executable, "-c", PEER_SCRIPT, str(threads)], threads)),
        "import": (lambda: imported("import megatron_lite.pretrain_gpt"),
                   lambda: imported("from transformers import GPT2LMHeadModel")),
    }
    rows = []
    for what, (ours, peer) in runs.items():
        ours(), peer()  # warm the page cache
        times = {"ours": [], "peer": []}
        for _ in range(rounds):
            times["ours"].append(ours())
            times["peer"].append(peer())
        median = {name: sorted(t.wall for t in values)[len(values) // 2] for name, values in times.items()}
        rows.append((what, Ratio.of(times["ours"], times["peer"]), median["ours"], median["peer"]))
    return rows


def table(rows: list) -> str:
    columns = ["from a fresh process", "ours vs transformers, min / median / max", "seconds, ours / theirs"]
    return markdown_table(columns, [[what, ratio, f"{ours:.2f} / {peer:.2f}"] for what, ratio, ours, peer in rows])


def header(rounds: int, threads: int) -> str:
    return (f"Start-up: GPT-2 {LAYERS} layers x {HIDDEN}, seq {SEQ}, micro-batch {MICRO_BATCH}, vocab {VOCAB}, "
            f"fp32, {threads} threads, one iteration; {rounds} alternating rounds of fresh processes")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(header(args.rounds, args.threads), flush=True)
    print(table(compare(args.rounds, args.threads)))
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
