# shellcheck shell=bash disable=SC2034
# GPT-3 XL shape on the GPT-2 architecture (1.3B parameters): 24 layers, hidden 2048, 16 heads.
# Layout on 8-GPU nodes: tp=1, pp=1, dp=8 per node with the distributed optimizer: unsharded,
# bf16 weights with fp32 gradients and Adam take 18 bytes/parameter (23 GB); sharded over 8
# data-parallel ranks, 6 + 12/8 bytes (10 GB), which leaves room for micro-batches of 4.
MODEL_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --use-distributed-optimizer
)
VOCAB_SIZE="${VOCAB_SIZE:-50257}"
TENSOR_MODEL_PARALLEL_SIZE="${TENSOR_MODEL_PARALLEL_SIZE:-1}"
PIPELINE_MODEL_PARALLEL_SIZE="${PIPELINE_MODEL_PARALLEL_SIZE:-1}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-4}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-512}" # 1M tokens per step, as GPT-3 XL
TRAIN_ITERS="${TRAIN_ITERS:-300000}"
LR="${LR:-2e-4}"
MIN_LR="${MIN_LR:-2e-5}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-2000}"
