"""Loading checks every model setting that changes what the weights compute, and lists all mismatches at once."""
import dataclasses

import pytest
import torch

from megatron_lite.checkpointing import load_checkpoint
from megatron_lite.checkpointing.architecture import ROLES, Role, check_architecture
from megatron_lite.config import CheckpointConfig, ConfigError, ModelConfig
from megatron_lite.cli.arguments import parse_args
from megatron_lite.model.builder import build_model
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.training.loop import pretrain
from tests.checkpointing.common import GPT2, LLAMA, MOE, tiny_config

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--vocab-size", "64", "--mock-data"]


def test_every_model_field_is_classified():
    """A new ModelConfig field is checked on load until someone decides otherwise; this test makes them decide."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(ROLES) == fields, f"classify in checkpointing/architecture.py ROLES: {sorted(fields - set(ROLES))}"


def test_every_mismatch_is_listed_in_one_error():
    saved = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64,
                        normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope",
                        rotary_base=500000.0, swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                        attention_dropout=0.0, init_method_std=0.01, make_vocab_size_divisible_by=32)
    run = parse_args(BASE + ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                             "--seq-length", "8", "--max-position-embeddings", "8"]).model
    with pytest.raises(ConfigError) as error:
        check_architecture(dataclasses.asdict(saved), run, "ckpt/iter_0000010")
    lines = str(error.value).splitlines()
    assert lines[0].startswith("this run's model differs from the checkpoint's (ckpt/iter_0000010) in 3 setting(s)")
    assert lines[1:4] == ["  --norm-epsilon: checkpoint 1e-06, this run 1e-05",
                          "  --rotary-base: checkpoint 500000.0, this run 10000.0",
                          "  --disable-bias-linear: checkpoint on, this run off"]
    assert "--use-checkpoint-args" in lines[4]
    # Dropouts, init, sequence length, vocabulary padding and (with rope) the position bound differ too,
    # but none of them changes what the weights compute.


def test_position_table_size_is_checked_only_for_learned_positions():
    saved = dataclasses.asdict(parse_args(BASE + ["--max-position-embeddings", "32"]).model)
    check_architecture(saved, parse_args(BASE + ["--max-position-embeddings", "32"]).model, "ckpt")
    with pytest.raises(ConfigError, match="--max-position-embeddings: checkpoint 32, this run 16"):
        check_architecture(saved, parse_args(BASE).model, "ckpt")
    rope = ["--position-embedding-type", "rope"]  # no position weights: the maximum may change
    check_architecture(dataclasses.asdict(parse_args(BASE + rope + ["--max-position-embeddings", "32"]).model),
                       parse_args(BASE + rope).model, "ckpt")


def test_a_checkpoint_predating_a_field_has_its_default():
    saved = dataclasses.asdict(parse_args(BASE).model)
    del saved["rotary_base"]
    check_architecture(saved, parse_args(BASE).model, "ckpt")
    saved["a_future_model_setting"] = True
    with pytest.raises(ConfigError, match=r"settings this megatron_lite does not know \(a_future_model_setting\)"):
        check_architecture(saved, parse_args(BASE).model, "ckpt")


def _logits(config, input_ids):
    parallel_state = initialize_model_parallel(1, 1)
    try:
        (model,) = build_model(config, parallel_state)
        load_checkpoint(config, parallel_state, [model], None, None)
        with torch.no_grad():
            return model.eval()(input_ids)
    finally:
        destroy_model_parallel(parallel_state)


@pytest.mark.parametrize("arch", [LLAMA, GPT2, MOE], ids=["rope", "learned", "experts"])
def test_settings_not_checked_do_not_change_the_function(tmp_path, arch):
    """The other side of the classification: a checkpoint loaded with every unchecked setting changed
    computes the same logits, so not checking them is safe."""
    root = str(tmp_path)
    pretrain(tiny_config(iters=1, arch=arch, save=root))
    saved = tiny_config(arch=arch, load=root)
    unchecked = dict(seq_length=8, hidden_dropout=0.3, attention_dropout=0.2, init_method_std=0.5,
                     make_vocab_size_divisible_by=16, use_fused_kernels=False, hf_model_type="phi3",
                     pad_token_id=5, freeze_padding_embedding=True,  # a frozen row still computes the same
                     mtp_loss_scaling_factor=0.7)
    if arch is GPT2:
        unchecked.update(rotary_base=123.0, rotary_percent=0.5)  # no rotary embedding with learned positions
    else:
        unchecked["max_position_embeddings"] = 64  # no position table with rope
    machine = {"attention_backend", "moe_grouped_gemm"}  # the same function, rounded differently: below
    moe_only = {name for name in ROLES if name.startswith("moe_")}
    if arch is MOE:  # how the router trains: its losses and the expert bias's step
        unchecked.update(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5,
                         moe_z_loss_coeff=0.1, moe_router_bias_update_rate=0.5)
    needed = {name for name, r in ROLES.items() if r is not Role.ARCHITECTURE} - machine
    assert needed - (set() if arch is MOE else moe_only) <= set(unchecked)
    changed = dataclasses.replace(saved, model=dataclasses.replace(saved.model, **unchecked),
                                  checkpoint=CheckpointConfig(load=root))
    input_ids = torch.randint(0, 60, (2, 8))
    torch.testing.assert_close(_logits(changed, input_ids), _logits(saved, input_ids), rtol=0, atol=0)
    # The unfused attention path computes the same function, in another rounding order.
    machine_changed = dict(attention_backend="unfused", moe_grouped_gemm=arch is MOE)
    unfused = dataclasses.replace(changed, model=dataclasses.replace(changed.model, **machine_changed))
    torch.testing.assert_close(_logits(unfused, input_ids), _logits(saved, input_ids), rtol=0, atol=1e-5)


def test_megatron_script_model_fields_are_checked():
    rope = BASE + ["--position-embedding-type", "rope"]
    saved = dataclasses.asdict(parse_args(rope + ["--kv-channels", "16", "--attention-backend", "unfused"]).model)
    check_architecture(saved, parse_args(rope).model, "ckpt")  # 16 = hidden / heads, the default head width
    with pytest.raises(ConfigError) as error:
        check_architecture(saved, parse_args(rope + ["--kv-channels", "8", "--apply-layernorm-1p",
                                                     "--rotary-percent", "0.5"]).model, "ckpt")
    assert str(error.value).splitlines()[1:4] == ["  --kv-channels: checkpoint 16, this run 8",
                                                  "  --apply-layernorm-1p: checkpoint off, this run on",
                                                  "  --rotary-percent: checkpoint 1.0, this run 0.5"]
