#!/bin/bash
# Pretrain GPT on a SLURM cluster: submit with sbatch, from the repository root.
#
# Usage: [VAR=value ...] sbatch [--nodes=N ...] launch_scripts/pretrain_gpt_slurm.sh [--dry-run] [-- training flags]
#
# LAUNCH_MODE=srun (default): srun starts one task per GPU and megatron_lite reads
#   its rank from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS.
# LAUNCH_MODE=torchrun: srun starts one torchrun per node; they rendezvous on the
#   first node of the allocation (MASTER_ADDR) and each starts a process per GPU.
# Without GPUs the processes train on CPU over gloo.
#
# Before the time limit SLURM sends SIGTERM to this script (--signal=B:TERM@120);
# the script passes it to the training, which saves a checkpoint at the end of the
# current iteration and exits, and then requeues the job (REQUEUE=1), which
# resumes from SAVE. --dry-run (or DRY_RUN=1) prints the srun command and the
# rank map without starting anything; it also works outside an allocation.
#
# Example: CONFIG=llama_7b SAVE=/ckpt/llama_7b DATA_PATH=/data/corpus_text_document \
#          TOKENIZER_TYPE=HuggingFaceTokenizer TOKENIZER_MODEL=/models/llama2 \
#          sbatch --nodes=4 launch_scripts/pretrain_gpt_slurm.sh

#SBATCH --job-name=megatron_lite
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:TERM@120
#SBATCH --requeue

set -euo pipefail

# sbatch runs a copy of this file from the node's spool directory, so the
# repository is found from the submit directory rather than from the script's path.
ML_SCRIPT="${BASH_SOURCE[0]}"
if [[ -z "${MEGATRON_LITE_DIR:-}" ]]; then
    for candidate in "$(dirname "$ML_SCRIPT")/.." "${SLURM_SUBMIT_DIR:-.}" "${SLURM_SUBMIT_DIR:-.}/.."; do
        if [[ -f "$candidate/launch_scripts/common.sh" ]]; then
            MEGATRON_LITE_DIR="$(cd "$candidate" && pwd)"
            break
        fi
    done
fi
[[ -n "${MEGATRON_LITE_DIR:-}" ]] || {
    echo "[megatron_lite] error: cannot find the repository; submit from its root or set MEGATRON_LITE_DIR." >&2
    exit 2
}
# shellcheck source=launch_scripts/common.sh
source "$MEGATRON_LITE_DIR/launch_scripts/common.sh"

ml_parse_args "$@"
PYTHON="${PYTHON:-python3}"
LAUNCH_MODE="${LAUNCH_MODE:-srun}"
[[ "$LAUNCH_MODE" == srun || "$LAUNCH_MODE" == torchrun ]] ||
    ml_die "LAUNCH_MODE=$LAUNCH_MODE: use srun (one task per GPU) or torchrun (one torchrun per node)."
if [[ -z "${SLURM_JOB_ID:-}" ]] && ((!DRY_RUN)); then
    ml_die "not inside a SLURM job: submit with sbatch (or run inside salloc), or add --dry-run."
fi

NUM_GPUS="$(ml_count_gpus)" # on this node; the allocation's nodes are assumed alike
NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${NNODES:-1}}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_NTASKS_PER_NODE:-$((NUM_GPUS > 0 ? NUM_GPUS : 1))}}"
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))
ml_load_config "$NUM_GPUS"
ml_training_args "$NUM_GPUS"
ml_export_env "$NUM_GPUS" "$NPROC_PER_NODE"

HOSTNAMES=()
if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
    mapfile -t HOSTNAMES <<<"$hosts"
fi
# Rank 0 (the first node) hosts the rendezvous; the port is derived from the job
# id, as megatron_lite.process_groups.initialize does, so jobs sharing a node do not collide.
export MASTER_ADDR="${MASTER_ADDR:-${HOSTNAMES[0]:-localhost}}"
export MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 10000))}"

SRUN=(srun --nodes="$NNODES" --kill-on-bad-exit=1)
if [[ -n "${SRUN_ARGS:-}" ]]; then
    read -r -a srun_args <<<"$SRUN_ARGS" # site flags: --cpu-bind, --container-image, ...
    SRUN+=("${srun_args[@]}")
fi
if [[ "$LAUNCH_MODE" == srun ]]; then
    COMMAND=("${SRUN[@]}" --ntasks-per-node="$NPROC_PER_NODE" --ntasks="$WORLD_SIZE"
        "$PYTHON" -m megatron_lite.pretrain_gpt "${TRAINING_ARGS[@]}")
else
    TORCHRUN=(--nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
        --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
    if [[ -n "${TORCHRUN_ARGS:-}" ]]; then
        read -r -a torchrun_args <<<"$TORCHRUN_ARGS"
        TORCHRUN+=("${torchrun_args[@]}")
    fi
    # Each node's rank is SLURM_NODEID, known only inside the task, hence the
    # small bash -c: static rendezvous with explicit node ranks keeps the rank
    # map below true (dynamic rendezvous numbers nodes in arrival order).
    # shellcheck disable=SC2016
    COMMAND=("${SRUN[@]}" --ntasks-per-node=1 --ntasks="$NNODES"
        bash -c 'exec "$1" -m torch.distributed.run --node-rank="$SLURM_NODEID" "${@:2}"' torchrun
        "$PYTHON" "${TORCHRUN[@]}" -m megatron_lite.pretrain_gpt "${TRAINING_ARGS[@]}")
fi

ml_log "job ${SLURM_JOB_ID:-(none)} restart ${SLURM_RESTART_COUNT:-0}: $LAUNCH_MODE mode, $NNODES node(s) x" \
    "$NPROC_PER_NODE processes, $NUM_GPUS GPU(s) per node, rendezvous $MASTER_ADDR:$MASTER_PORT," \
    "OMP_NUM_THREADS=$OMP_NUM_THREADS"
ml_log "command: $(ml_quote "${COMMAND[@]}")"
if ((DRY_RUN)); then
    ml_print_rank_map "$NNODES" "$NPROC_PER_NODE" "${HOSTNAMES[@]}"
    exit 0
fi

# SIGTERM must not reach srun itself: srun answers its own SIGTERM by killing the
# tasks (SIGKILL), before any checkpoint. scancel --signal delivers it to every
# process of the job's steps instead, torchrun's workers included, and leaves this
# shell out.
STOP_REQUESTED=0
# shellcheck disable=SC2317,SC2329  # called by the trap
on_sigterm() {
    STOP_REQUESTED=1
    ml_log "SIGTERM: asking every rank to checkpoint and exit"
    scancel --signal=TERM "$SLURM_JOB_ID" || ml_log "scancel failed; the time limit will end the job"
}
trap on_sigterm TERM

"${COMMAND[@]}" &
launch_pid=$!
# The trap interrupts wait; keep waiting until the training has really finished.
while kill -0 "$launch_pid" 2>/dev/null; do
    wait "$launch_pid" || true
done
status=0
wait "$launch_pid" || status=$?
ml_log "training exited with status $status"

if ((STOP_REQUESTED)) && [[ "${REQUEUE:-1}" == 1 ]]; then
    ml_log "requeueing job $SLURM_JOB_ID; it will resume from ${SAVE:-(no SAVE set: from scratch)}"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
