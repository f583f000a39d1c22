#!/usr/bin/env bash
# Pretrain GPT on one machine (or on each of several, with NODE_RANK) with torchrun.
#
# Usage: [VAR=value ...] launch_scripts/pretrain_gpt_torchrun.sh [--dry-run] [-- extra training flags]
#
# One process per GPU with NCCL, or NPROC_PER_NODE processes on CPU with gloo
# (megatron_lite picks the backend). Flags after the options go to
# `python -m megatron_lite.pretrain_gpt` last, so they override the defaults.
# --dry-run (or DRY_RUN=1) prints the command and the rank map and starts nothing.
#
# Examples:
#   CONFIG=gpt2_350m SAVE=/ckpt/gpt2_350m launch_scripts/pretrain_gpt_torchrun.sh
#   CONFIG=tiny NPROC_PER_NODE=4 TENSOR_MODEL_PARALLEL_SIZE=2 launch_scripts/pretrain_gpt_torchrun.sh --dry-run
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch_scripts/pretrain_gpt_torchrun.sh   # on the second node

set -euo pipefail

ML_SCRIPT="${BASH_SOURCE[0]}"
MEGATRON_LITE_DIR="${MEGATRON_LITE_DIR:-$(cd "$(dirname "$ML_SCRIPT")/.." && pwd)}"
# shellcheck source=launch_scripts/common.sh
source "$MEGATRON_LITE_DIR/launch_scripts/common.sh"

ml_parse_args "$@"
PYTHON="${PYTHON:-python3}"
NUM_GPUS="$(ml_count_gpus)"
NPROC_PER_NODE="${NPROC_PER_NODE:-$((NUM_GPUS > 0 ? NUM_GPUS : 1))}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
ml_load_config "$NUM_GPUS"
ml_training_args "$NUM_GPUS"
ml_export_env "$NUM_GPUS" "$NPROC_PER_NODE"

LAUNCHER=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE")
HOSTNAMES=()
if ((NNODES == 1)) && [[ -z "${MASTER_PORT:-}" ]]; then
    # One machine: torchrun picks a free port itself, so two runs on one box do not collide.
    LAUNCHER+=(--standalone)
    HOSTNAMES=("$(hostname)")
else
    [[ -n "${MASTER_ADDR:-}" || "$NNODES" == 1 ]] ||
        ml_die "NNODES=$NNODES needs MASTER_ADDR, the host of NODE_RANK=0, set the same on every node."
    LAUNCHER+=(--nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
fi
if [[ -n "${TORCHRUN_ARGS:-}" ]]; then
    read -r -a torchrun_args <<<"$TORCHRUN_ARGS"
    LAUNCHER+=("${torchrun_args[@]}")
fi
COMMAND=("${LAUNCHER[@]}" -m megatron_lite.pretrain_gpt "${TRAINING_ARGS[@]}")

ml_log "$NNODES node(s) x $NPROC_PER_NODE processes, $NUM_GPUS GPU(s) visible, OMP_NUM_THREADS=$OMP_NUM_THREADS"
ml_log "command: $(ml_quote "${COMMAND[@]}")"
if ((DRY_RUN)); then
    ml_print_rank_map "$NNODES" "$NPROC_PER_NODE" "${HOSTNAMES[@]}"
    exit 0
fi
exec "${COMMAND[@]}"
