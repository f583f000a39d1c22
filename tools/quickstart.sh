#!/usr/bin/env bash
# The README's two quick-start commands:
#   bash tools/quickstart.sh train   set up, build the demo corpus + tokenizer, train tp=2 x pp=2 x dp=2 on CPU, sample
#   bash tools/quickstart.sh test    set up, run the test suite
# Both are idempotent and download nothing but Python packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-8}"            # 8 gloo processes: tensor 2 x pipeline 2 x data 2
TRAIN_ITERS="${TRAIN_ITERS:-100}"
DEMO_DIR="${DEMO_DIR:-demo_data}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

setup() {
  "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "megatron_lite needs Python 3.10 or newer")'
  if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    # Pinned: an unpinned torch may resolve to a multi-GB CUDA build on a CPU-only machine.
    "$PYTHON" -m pip install -q "torch==2.13.0"
  fi
  local stamp
  stamp="build/.installed-$(sha256sum setup.py | cut -c1-16)"
  if [ ! -f "$stamp" ] || ! "$PYTHON" -c 'import megatron_lite, pytest, transformers' 2>/dev/null; then
    "$PYTHON" -m pip install -q -e ".[dev]"
    mkdir -p build && touch "$stamp"
  fi
}

train() {
  "$PYTHON" tools/build_demo_data.py --output-dir "$DEMO_DIR"
  rm -rf "$DEMO_DIR/checkpoints"
  local tokenizer=(--tokenizer-type GPT2BPETokenizer --vocab-file "$DEMO_DIR/tokenizer/vocab.json"
                   --merge-file "$DEMO_DIR/tokenizer/merges.txt")
  local command=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" -m megatron_lite.pretrain_gpt
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
    --micro-batch-size 4 --global-batch-size 32 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
    --hidden-dropout 0.0 --attention-dropout 0.0
    --data-path "$DEMO_DIR/demo_text_document" --split "95,5,0" "${tokenizer[@]}"
    --log-interval 10 --eval-interval 50 --eval-iters 2
    --save "$DEMO_DIR/checkpoints" --save-interval "$TRAIN_ITERS")
  echo "+ ${command[*]}"
  OMP_NUM_THREADS=1 "${command[@]}"
  "$PYTHON" -m megatron_lite.generate --load "$DEMO_DIR/checkpoints" "${tokenizer[@]}" \
    --prompt "The for statement" --max-new-tokens 40
}

case "${1:-}" in
  train) setup && train ;;
  # --timeout: a last guard per test; distributed tests have their own, shorter ones.
  # --durations: the 25 slowest tests in every CI log, so a test that outgrows the time budget shows.
  test) setup && "$PYTHON" -m pytest -q -p no:cacheprovider --timeout 900 --durations=25 tests ;;
  *) echo "usage: bash tools/quickstart.sh train|test" >&2; exit 2 ;;
esac
