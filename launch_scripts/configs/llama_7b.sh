# shellcheck shell=bash disable=SC2034
# Llama-style 7B (the Llama 2 7B shape): 32 layers, hidden 4096, 32 heads, SwiGLU MLP of 11008,
# RMSNorm, RoPE, no biases, untied output layer, 4,096 tokens.
# Layout on 8-GPU nodes: tp=2 (inside NVLink) with sequence parallelism, pp=1, dp=4 per node,
# distributed optimizer: 3.5B parameters per GPU x (6 + 12/4) bytes = 32 GB of weights and
# optimizer state, the rest of an 80 GB GPU for activations. On 40 GB GPUs use tp=4.
# Across nodes only data parallelism grows; add PIPELINE_MODEL_PARALLEL_SIZE=2 only if a
# node's interconnect cannot carry the data-parallel gradient traffic.
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
    --seq-length 4096 --max-position-embeddings 4096
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02
    --sequence-parallel --use-distributed-optimizer
)
VOCAB_SIZE="${VOCAB_SIZE:-32000}"
TENSOR_MODEL_PARALLEL_SIZE="${TENSOR_MODEL_PARALLEL_SIZE:-2}"
PIPELINE_MODEL_PARALLEL_SIZE="${PIPELINE_MODEL_PARALLEL_SIZE:-1}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-1}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-1024}" # 4M tokens per step, as Llama 2
TRAIN_ITERS="${TRAIN_ITERS:-500000}"           # 2T tokens
LR="${LR:-3e-4}"
MIN_LR="${MIN_LR:-3e-5}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-2000}"
