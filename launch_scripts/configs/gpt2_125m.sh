# shellcheck shell=bash disable=SC2034
# GPT-2 small / GPT-3 Small (125M parameters): 12 layers, hidden 768, 12 heads, 1,024 tokens.
# Layout on 8-GPU nodes: pure data parallelism (tp=1, pp=1, dp=8 per node). Weights,
# gradients and Adam state are about 2 GB, so splitting the model would only add communication.
MODEL_ARGS=(
    --num-layers 12 --hidden-size 768 --num-attention-heads 12
    --seq-length 1024 --max-position-embeddings 1024
)
VOCAB_SIZE="${VOCAB_SIZE:-50257}" # GPT-2's BPE; padded to 50,304 inside
TENSOR_MODEL_PARALLEL_SIZE="${TENSOR_MODEL_PARALLEL_SIZE:-1}"
PIPELINE_MODEL_PARALLEL_SIZE="${PIPELINE_MODEL_PARALLEL_SIZE:-1}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-8}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-512}" # 0.5M tokens per step, as GPT-2
TRAIN_ITERS="${TRAIN_ITERS:-600000}"           # 300B tokens
LR="${LR:-6e-4}"
MIN_LR="${MIN_LR:-6e-5}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-2000}"
