# shellcheck shell=bash disable=SC2034
# GPT-2 medium / GPT-3 Medium (350M parameters): 24 layers, hidden 1024, 16 heads, 1,024 tokens.
# Layout on 8-GPU nodes: pure data parallelism (tp=1, pp=1, dp=8 per node); about 6 GB of
# weights and optimizer state per GPU leaves the rest for activations.
MODEL_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
)
VOCAB_SIZE="${VOCAB_SIZE:-50257}"
TENSOR_MODEL_PARALLEL_SIZE="${TENSOR_MODEL_PARALLEL_SIZE:-1}"
PIPELINE_MODEL_PARALLEL_SIZE="${PIPELINE_MODEL_PARALLEL_SIZE:-1}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-8}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-512}"
TRAIN_ITERS="${TRAIN_ITERS:-600000}"
LR="${LR:-3e-4}"
MIN_LR="${MIN_LR:-3e-5}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-2000}"
