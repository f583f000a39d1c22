# shellcheck shell=bash
# Shared by the launch scripts (sourced, not run): argument parsing, the model
# config, the training flags, environment knobs, the dry run. Every knob is an
# environment variable with a default; launch_scripts/README.md lists them.

ml_log() {
    printf '[megatron_lite] %s\n' "$*"
}

ml_warn() {
    printf '[megatron_lite] WARNING: %s\n' "$*" >&2
}

ml_die() {
    printf '[megatron_lite] error: %s\n' "$*" >&2
    exit 2
}

# A command as one line that can be pasted back into a shell: words with
# special characters in single quotes, the rest bare.
ml_quote() {
    local word words=() IFS=" "
    for word in "$@"; do
        if [[ "$word" =~ ^[[:alnum:]_./=:,+@%-]+$ ]]; then
            words+=("$word")
        else
            words+=("'${word//\'/\'\\\'\'}'")
        fi
    done
    printf '%s\n' "${words[*]}"
}

# --dry-run and --help are the scripts' own; everything else goes to the training.
ml_parse_args() {
    EXTRA_ARGS=()
    while (($#)); do
        case "$1" in
            --dry-run) DRY_RUN=1 ;;
            -h | --help)
                # The usage is the script's header comment.
                sed -n '2,/^$/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$ML_SCRIPT"
                exit 0
                ;;
            --)
                shift
                EXTRA_ARGS+=("$@")
                break
                ;;
            *) EXTRA_ARGS+=("$1") ;;
        esac
        shift
    done
    DRY_RUN="${DRY_RUN:-0}"
}

# GPUs this process may use: CUDA_VISIBLE_DEVICES if set (empty hides them all), else nvidia-smi.
ml_count_gpus() {
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        local devices
        IFS=',' read -r -a devices <<<"$CUDA_VISIBLE_DEVICES"
        printf '%s\n' "${#devices[@]}"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        printf '0\n'
    fi
}

# CONFIG is a name from launch_scripts/configs/ or a path to a file like them. The default
# fits the machine: GPT-2 125M with GPUs, the toy config without (125M would take hours per
# step on CPU); a chosen config meant for GPUs gets a warning on a machine without any.
ml_load_config() {
    local num_gpus="$1"
    local config="${CONFIG:-}"
    if [[ -z "$config" ]]; then
        config=gpt2_125m
        ((num_gpus > 0)) || config=tiny
        ml_log "CONFIG unset: $config fits this machine ($num_gpus GPU(s) visible); set CONFIG to choose"
    fi
    local file="$config"
    [[ -f "$file" ]] || file="$MEGATRON_LITE_DIR/launch_scripts/configs/$config.sh"
    if [[ ! -f "$file" ]]; then
        local known=() path
        for path in "$MEGATRON_LITE_DIR"/launch_scripts/configs/*.sh; do
            known+=("$(basename "$path" .sh)")
        done
        ml_die "CONFIG=$config is neither a file nor one of: ${known[*]}"
    fi
    # After the name is known to exist: a mistyped one gets its error alone, not also a warning about its size.
    if ((num_gpus == 0)) && [[ "$config" != tiny && "$file" != "$config" ]]; then
        ml_warn "CONFIG=$config is sized for GPUs and none is visible: on CPU it will be very slow or run out of memory (CONFIG=tiny fits a CPU)"
    fi
    # shellcheck source=/dev/null
    source "$file"
    ml_log "config: $file"
}

# The flags for python -m megatron_lite.pretrain_gpt, into TRAINING_ARGS.
ml_training_args() {
    local num_gpus="$1"
    TRAINING_ARGS=("${MODEL_ARGS[@]}"
        --tensor-model-parallel-size "$TENSOR_MODEL_PARALLEL_SIZE"
        --pipeline-model-parallel-size "$PIPELINE_MODEL_PARALLEL_SIZE"
        --micro-batch-size "$MICRO_BATCH_SIZE"
        --global-batch-size "$GLOBAL_BATCH_SIZE"
        --train-iters "$TRAIN_ITERS"
        --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$LR_WARMUP_ITERS" --lr-decay-style cosine
        --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
        --seed "${SEED:-1234}"
        --log-interval "${LOG_INTERVAL:-10}"
        --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
        # Stop on SIGTERM (SLURM's warning before the time limit) at the same iteration on every rank.
        --exit-signal-handler)

    if [[ -n "${DATA_PATH:-}" ]]; then
        local data_path
        read -r -a data_path <<<"$DATA_PATH" # "PREFIX" or "W1 PREFIX1 W2 PREFIX2" for blending
        TRAINING_ARGS+=(--data-path "${data_path[@]}" --split "${SPLIT:-969,30,1}")
        [[ -z "${TOKENIZER_TYPE:-}" ]] || TRAINING_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE")
        [[ -z "${VOCAB_FILE:-}" ]] || TRAINING_ARGS+=(--vocab-file "$VOCAB_FILE")
        [[ -z "${MERGE_FILE:-}" ]] || TRAINING_ARGS+=(--merge-file "$MERGE_FILE")
        [[ -z "${TOKENIZER_MODEL:-}" ]] || TRAINING_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
    else
        ml_warn "DATA_PATH is unset: training on --mock-data (random tokens, the loss stays flat). Set DATA_PATH to a prefix from tools/preprocess_data.py"
        # shellcheck disable=SC2153  # VOCAB_SIZE is the config's (launch_scripts/configs/*.sh), not VOCAB_FILE
        TRAINING_ARGS+=(--mock-data --vocab-size "$VOCAB_SIZE")
    fi

    local precision="${PRECISION:-auto}"
    if [[ "$precision" == auto ]]; then
        precision=fp32
        ((num_gpus == 0)) || precision=bf16
    fi
    case "$precision" in
        bf16) TRAINING_ARGS+=(--bf16) ;;
        fp16) TRAINING_ARGS+=(--fp16) ;;
        fp32) ;;
        *) ml_die "PRECISION=$precision: use auto, bf16, fp16 or fp32." ;;
    esac

    if [[ -n "${SAVE:-}" ]]; then
        TRAINING_ARGS+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-1000}")
        # A requeued job resumes from its own newest checkpoint.
        if [[ -z "${LOAD:-}" && -f "$SAVE/latest_checkpointed_iteration.txt" ]]; then
            LOAD="$SAVE"
            ml_log "resuming from $SAVE (iteration $(<"$SAVE/latest_checkpointed_iteration.txt"))"
        fi
    fi
    [[ -n "${SAVE:-}" ]] || ml_warn "SAVE is unset: no checkpoint will be written and the run cannot be resumed. Set SAVE=DIR"
    [[ -z "${LOAD:-}" ]] || TRAINING_ARGS+=(--load "$LOAD")
    TRAINING_ARGS+=("${EXTRA_ARGS[@]}")
}

# Threads per process and the CUDA knobs; values already set by the user win.
ml_export_env() {
    local num_gpus="$1" procs_per_node="$2" cpus
    cpus="${SLURM_CPUS_ON_NODE:-$(nproc)}"
    # Each rank gets its share of the node's cores; torch would otherwise start one
    # thread per core in every process and oversubscribe the node.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cpus / procs_per_node > 0 ? cpus / procs_per_node : 1))}"
    if ((num_gpus > 0)); then
        # One hardware queue per device keeps kernels in issue order, so a communication
        # kernel issued before a GEMM is scheduled first (Megatron relies on this to
        # overlap tensor-parallel communication with compute).
        export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    fi
}

# The rank -> (node, tp, pp, dp) table, computed by megatron_lite's own RankLayout
# after the training flags are validated as the training would.
ml_print_rank_map() {
    local nnodes="$1" procs_per_node="$2"
    shift 2
    "$PYTHON" "$MEGATRON_LITE_DIR/tools/print_rank_map.py" --nnodes "$nnodes" \
        --nproc-per-node "$procs_per_node" --hostnames "$@" -- "${TRAINING_ARGS[@]}"
}
