# shellcheck shell=bash disable=SC2034
# A toy GPT for smoke tests on a laptop CPU: seconds per run, any layout up to 4 x 2 x 2.
MODEL_ARGS=(
    --num-layers 4 --hidden-size 64 --num-attention-heads 4
    --seq-length 32 --max-position-embeddings 32
    --hidden-dropout 0.0 --attention-dropout 0.0
)
VOCAB_SIZE="${VOCAB_SIZE:-256}"
TENSOR_MODEL_PARALLEL_SIZE="${TENSOR_MODEL_PARALLEL_SIZE:-1}"
PIPELINE_MODEL_PARALLEL_SIZE="${PIPELINE_MODEL_PARALLEL_SIZE:-1}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-2}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-8}"
TRAIN_ITERS="${TRAIN_ITERS:-20}"
LR="${LR:-1e-3}"
MIN_LR="${MIN_LR:-1e-4}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-0}"
