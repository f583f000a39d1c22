"""Preprocessing: ``tools/preprocess_data.py`` as a whole command against a plain Hugging Face ``tokenizers``
loop, and our engine's throughput by tokenizer and worker count.

    python bench/bench_preprocess.py [--repeat 8] [--workers 1 2] [--rounds 3] [--engine]

The corpus is the bundled demo text (Python's documentation topics) repeated ``--repeat`` times; a
GPT-2 byte-level BPE of 4,096 entries is trained on it first. The whole command (interpreter start,
imports, reading JSON, tokenizing, writing ``.bin``/``.idx``) runs as a fresh process against a fresh
process of the plain loop a user would write with ``tokenizers`` on the same vocab.json and merges.txt
(JSON lines in batches of 1,000 through ``encode_batch``, which tokenizes on every core, ids written
to a ``.bin``), alternating round by round; the two ``.bin`` files must hold the same token ids. The
ratio is the loop's time over ours (> 1 = we are faster), min / median / max over the rounds; "scaling"
is the command's time with one worker over its time with the most.

``--engine`` adds the engine's table, in this process: tokens/s of ``preprocess_jsonl`` for GPT-2 BPE
and SentencePiece at each worker count (the fastest of the rounds), and the tokenizer alone per
CPU-second, which does not depend on machine load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

# tools/ is not installed with the package: run as a script, the repo root is not on the path.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from bench.side_by_side import Ratio, Seconds, load_average, markdown_table  # noqa: E402
from tools.build_demo_data import demo_documents  # noqa: E402

# The plain loop: ids of every document (EOD appended) into one .bin of uint16, as a user would write it.
TOKENIZERS_LOOP = """
import json, sys
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

corpus, vocab_file, merge_file, output = sys.argv[1:]
tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
eod = tokenizer.token_to_id("<|endoftext|>")

def write(texts, out):
    for encoding in tokenizer.encode_batch(texts):
        np.asarray(encoding.ids + [eod], dtype=np.uint16).tofile(out)

with open(corpus, encoding="utf-8") as lines, open(output, "wb") as out:
    batch = []
    for line in lines:
        batch.append(json.loads(line)["text"])
        if len(batch) == 1000:
            write(batch, out)
            batch = []
    write(batch, out)
"""


def write_corpus(work: str, repeat: int) -> tuple[str, str, str, list]:
    """(corpus.jsonl, vocab.json, merges.txt, the documents) of the demo text and a BPE trained on it."""
    from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe

    documents = demo_documents()
    vocab_file, merge_file = save_gpt2_bpe_files(*train_byte_level_bpe(documents, 4096), work)
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(repeat):
            f.writelines(json.dumps({"text": d}) + "\n" for d in documents if d)
    return corpus, vocab_file, merge_file, documents


def _run(command: list, env: dict | None = None) -> Seconds:
    """The wall-clock time of ``command`` and the CPU time of its processes (workers included)."""
    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    start, cpu = time.perf_counter(), children_cpu()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:2])} failed:\n{result.stderr[-2000:]}")
    return Seconds(time.perf_counter() - start, children_cpu() - cpu)


def compare_commands(work: str, corpus: str, vocab_file: str, merge_file: str, workers: list,
                     rounds: int) -> dict:
    """{"ours_<w>": [Seconds per round], "peer": [...], "same_tokens": bool} of the two commands, alternating."""
    ours = {w: [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                "--output-prefix", os.path.join(work, f"ours{w}"), "--tokenizer-type", "GPT2BPETokenizer",
                "--vocab-file", vocab_file, "--merge-file", merge_file, "--append-eod", "--workers", str(w)]
            for w in workers}
    peer = [sys.executable, "-c", TOKENIZERS_LOOP, corpus, vocab_file, merge_file, os.path.join(work, "peer.bin")]
    # A script's own folder (tools/) heads sys.path, not the checkout: without this the command would import
    # whichever megatron_lite is installed, not the one being measured.
    ours_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    seconds = {f"ours_{w}": [] for w in workers} | {"peer": []}
    for round_number in range(rounds + 1):  # the first round warms the page cache and is not counted
        for name, command in [*((f"ours_{w}", c) for w, c in ours.items()), ("peer", peer)]:
            elapsed = _run(command, ours_env if name != "peer" else None)
            if round_number:
                seconds[name].append(elapsed)
    with open(os.path.join(work, f"ours{workers[0]}_text_document.bin"), "rb") as a, \
            open(os.path.join(work, "peer.bin"), "rb") as b:
        seconds["same_tokens"] = a.read() == b.read()
    return seconds


def command_table(seconds: dict, workers: list, megabytes: float) -> str:
    most, peer = max(workers), seconds["peer"]

    def rate(times: list) -> str:
        return f"{megabytes / statistics.median(s.wall for s in times):.2f}"

    rows = [[f"tools/preprocess_data.py --workers {w}", rate(seconds[f"ours_{w}"]),
             Ratio.of(seconds[f"ours_{w}"], peer), Ratio.of(seconds[f"ours_{w}"], peer, clock="cpu")] for w in workers]
    rows.append(["tokenizers encode_batch loop (all cores)", rate(peer), 1, 1])
    scaling = Ratio.of(seconds[f"ours_{most}"], seconds[f"ours_{min(workers)}"])
    same = "identical" if seconds["same_tokens"] else "DIFFERENT"
    return (markdown_table(["command", "MB/s (median)", "vs the tokenizers loop, min / median / max", "by CPU time"],
                           rows)
            + f"\nscaling, {min(workers)} -> {most} workers: {scaling} (min / median / max); token ids {same}")


def engine_table(work: str, corpus: str, vocab_file: str, merge_file: str, documents: list, workers: list,
                 rounds: int) -> str:
    """Tokens/s of ``preprocess_jsonl`` per tokenizer and worker count, and the tokenizer alone per CPU-second."""
    from megatron_lite.data.preprocess import preprocess_jsonl
    from megatron_lite.tokenizer import build_tokenizer
    from megatron_lite.tokenizer.sentencepiece_tokenizer import train_sentencepiece

    megabytes = os.path.getsize(corpus) / 1e6
    tokenizers = {
        "GPT2BPETokenizer": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file),
        "SentencePieceTokenizer": dict(tokenizer_type="SentencePieceTokenizer",
                                       tokenizer_model=train_sentencepiece(documents, os.path.join(work, "sp"),
                                                                           4096)),
    }
    rows = []
    with open(os.devnull, "w") as quiet:
        for name, kwargs in tokenizers.items():
            tokenizer = build_tokenizer(**kwargs)
            start = time.process_time()
            alone = sum(len(tokenizer.tokenize(d)) for d in documents * 2) / (time.process_time() - start)
            for w in workers:
                stats = min((preprocess_jsonl([corpus], output_prefix=os.path.join(work, f"{name}_{w}"),
                                              tokenizer_kwargs=kwargs, append_eod=True, workers=w, log=quiet)
                             for _ in range(rounds)), key=lambda s: s.seconds)
                rows.append([name, w, stats.tokens, f"{stats.seconds:.2f}", f"{stats.tokens / stats.seconds:,.0f}",
                             f"{megabytes / stats.seconds:.2f}", f"{alone:,.0f}"])
    columns = ["tokenizer", "workers", "tokens", "seconds", "tokens/s", "MB/s", "alone, tokens/CPU-s"]
    return markdown_table(columns, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=8, help="copies of the ~460 KB demo corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", action="store_true", help="also the engine's tokens/s per tokenizer")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        corpus, vocab_file, merge_file, documents = write_corpus(work, args.repeat)
        megabytes = os.path.getsize(corpus) / 1e6
        print(f"Preprocessing: {megabytes:.1f} MB of JSONL ({args.repeat} copies of the demo corpus), GPT-2 BPE of "
              f"4,096 entries, whole commands in fresh processes, {args.rounds} alternating rounds", flush=True)
        seconds = compare_commands(work, corpus, vocab_file, merge_file, sorted(args.workers), args.rounds)
        print(command_table(seconds, sorted(args.workers), megabytes))
        if args.engine:
            print(engine_table(work, corpus, vocab_file, merge_file, documents, args.workers, args.rounds))
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
