# shellcheck shell=bash disable=SC2034
# Llama-style 1B (the Llama 3.2 1B shape): 16 layers, hidden 2048, 32 query heads sharing
# 8 key/value groups, SwiGLU MLP of 8192, RMSNorm, RoPE (base 500,000), no biases, tied embeddings.
# Layout on 8-GPU nodes: tp=1, pp=1, dp=8 per node. The 128K vocabulary makes the logits
# the largest activation; lower MICRO_BATCH_SIZE before adding tensor parallelism.
MODEL_ARGS=(
    --num-layers 16 --hidden-size 2048 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192
    --seq-length 2048 --max-position-embeddings 2048
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --position-embedding-type rope --rotary-base 500000
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02
    --use-distributed-optimizer
)
VOCAB_SIZE="${VOCAB_SIZE:-128256}"
TENSOR_MODEL_PARALLEL_SIZE="${TENSOR_MODEL_PARALLEL_SIZE:-1}"
PIPELINE_MODEL_PARALLEL_SIZE="${PIPELINE_MODEL_PARALLEL_SIZE:-1}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-4}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-512}" # 1M tokens per step
TRAIN_ITERS="${TRAIN_ITERS:-250000}"
LR="${LR:-3e-4}"
MIN_LR="${MIN_LR:-3e-5}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-2000}"
