"""The example configs are valid for the training's flag parser, fit 8-GPU nodes and are the sizes they claim."""
import subprocess

import pytest

from megatron_lite.cli.arguments import parse_args
from megatron_lite.process_groups.parallel_state import RankLayout
from tests.launch.helpers import LAUNCH_SCRIPTS

# Name -> parameters the name promises (within 10%).
CONFIGS = {"gpt2_125m": 125e6, "gpt2_350m": 350e6, "gpt2_1.3b": 1.3e9, "llama_1b": 1.24e9, "llama_7b": 6.7e9,
           "tiny": None}


def config_flags(name: str) -> list[str]:
    """Source the config as the scripts do and return the flags it contributes."""
    script = (f'source "{LAUNCH_SCRIPTS}/configs/{name}.sh"; printf "%s\\0" "${{MODEL_ARGS[@]}}" '
              '--vocab-size "$VOCAB_SIZE" --mock-data '
              '--tensor-model-parallel-size "$TENSOR_MODEL_PARALLEL_SIZE" '
              '--pipeline-model-parallel-size "$PIPELINE_MODEL_PARALLEL_SIZE" '
              '--micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" '
              '--train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$LR_WARMUP_ITERS"')
    out = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, check=True, env={}).stdout
    return out.split("\0")[:-1]


def parameter_count(model, padded_vocab: int) -> int:
    """Weights of a GPT: embeddings, per-layer attention and MLP matrices, norms, biases."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    kv = model.num_query_groups * d
    attention = h * (h + 2 * kv) + h * h
    mlp = h * f * (3 if model.swiglu else 2)
    norms = 2 * h * (1 if model.normalization == "RMSNorm" else 2)
    biases = (h + 2 * kv + h + f * (2 if model.swiglu else 1) + h) if model.add_bias_linear else 0
    embeddings = padded_vocab * h * (2 if model.untie_embeddings_and_output_weights else 1)
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    return embeddings + positions + model.num_layers * (attention + mlp + norms + biases) + norms // 2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_is_valid_on_one_8_gpu_node(name):
    config = parse_args(config_flags(name))
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    world = 8 if name != "tiny" else 4
    layout = RankLayout(world, tp, pp)
    assert tp <= 8 and 8 % tp == 0, "tensor-parallel groups must stay inside a node"
    assert config.training.num_microbatches(layout.data_parallel_size) >= 1
    if CONFIGS[name] is not None:
        count = parameter_count(config.model, config.model.padded_vocab_size(1))
        assert abs(count / CONFIGS[name] - 1) < 0.1, f"{name} has {count / 1e6:.0f}M parameters"
