"""What transformers and torch compute too, checked against them rather than against our own 1-process run
(docs/testing.md lists each): the learning-rate schedules against transformers' schedulers, the weight-decay
groups against HF Trainer's, the dynamic loss scale against torch's GradScaler kernel.

Each goes through the trainer's own constructors (``get_optimizer_param_scheduler``, ``setup_model_and_optimizer``,
the fp16 optimizer's scaler) and steps them as ``training.loop`` does.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import optimization  # noqa: E402

from megatron_lite.interop.hf import weights as hf_weights  # noqa: E402
from megatron_lite.config import Config, ModelConfig, OptimizerConfig, TrainingConfig  # noqa: E402
from megatron_lite.optimizer.optimizer_param_scheduler import get_optimizer_param_scheduler  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_lite.training.loop import setup_model_and_optimizer  # noqa: E402

ITERS, WARMUP, BATCH, LR, MIN_LR = 40, 6, 4, 3e-3, 3e-4
MODEL = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16, vocab_size=64)


def _ours(**optimizer) -> list:
    """The learning rate of each of ITERS iterations as the trainer sets it: the schedule of a Config with
    ``optimizer``'s flags, counted in samples of BATCH per iteration, stepped after each (training.loop)."""
    config = Config(model=ModelConfig(**MODEL),
                    training=TrainingConfig(micro_batch_size=1, global_batch_size=BATCH, train_iters=ITERS),
                    optimizer=OptimizerConfig(lr=LR, lr_warmup_iters=WARMUP, **optimizer))
    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = get_optimizer_param_scheduler(holder, config, BATCH)
    lrs = []
    for _ in range(ITERS):
        lrs.append(holder.param_groups[0]["lr"])
        scheduler.step(increment=BATCH)
    return lrs


def _transformers(make, **kwargs) -> list:
    """The learning rate of each of ITERS optimizer steps under transformers' scheduler ``make``."""
    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = make(holder, **kwargs)
    lrs = []
    for _ in range(ITERS):
        lrs.append(holder.param_groups[0]["lr"])
        holder.step()
        scheduler.step()
    return lrs


# Each of our --lr-decay-style (with --min-lr where transformers has one) beside the transformers scheduler that
# computes the same curve. WSD: warmup from --lr-warmup-init = --min-lr, as transformers' warmup starts at its
# min_lr_ratio; --lr-wsd-decay-style minus_sqrt is its 1-sqrt.
SCHEDULES = {
    "linear": (dict(lr_decay_style="linear"),
               lambda: _transformers(optimization.get_linear_schedule_with_warmup, num_warmup_steps=WARMUP,
                                     num_training_steps=ITERS)),
    "cosine": (dict(lr_decay_style="cosine"),
               lambda: _transformers(optimization.get_cosine_schedule_with_warmup, num_warmup_steps=WARMUP,
                                     num_training_steps=ITERS)),
    "cosine-min-lr": (dict(lr_decay_style="cosine", min_lr=MIN_LR),
                      lambda: _transformers(optimization.get_cosine_with_min_lr_schedule_with_warmup,
                                            num_warmup_steps=WARMUP, num_training_steps=ITERS, min_lr=MIN_LR)),
    "constant": (dict(lr_decay_style="constant"),
                 lambda: _transformers(optimization.get_constant_schedule_with_warmup, num_warmup_steps=WARMUP)),
    "inverse-square-root": (dict(lr_decay_style="inverse-square-root"),
                            lambda: _transformers(optimization.get_inverse_sqrt_schedule, num_warmup_steps=WARMUP)),
    **{f"WSD-{ours}": (dict(lr_decay_style="WSD", lr_wsd_decay_style=ours, lr_wsd_decay_iters=14, min_lr=MIN_LR,
                            lr_warmup_init=MIN_LR),
                       lambda theirs=theirs: _transformers(
                           optimization.get_wsd_schedule, num_warmup_steps=WARMUP, num_stable_steps=ITERS - WARMUP - 14,
                           num_decay_steps=14, decay_type=theirs, min_lr_ratio=MIN_LR / LR))
       for ours, theirs in (("linear", "linear"), ("cosine", "cosine"), ("minus_sqrt", "1-sqrt"))},
}


@pytest.mark.parametrize("style", sorted(SCHEDULES))
def test_lr_schedule_equals_transformers(style):
    flags, reference = SCHEDULES[style]
    theirs = reference()
    assert max(theirs) == pytest.approx(LR) and theirs[0] < theirs[WARMUP]  # warms up, reaches the peak
    assert _ours(**flags) == pytest.approx(theirs, rel=1e-12, abs=1e-15)


# Families whose parameter names differ in what is not decayed: GPT-2's LayerNorm modules (ln_1, ln_f) and
# biases, Qwen2's attention biases, Gemma 2's four norms per layer, Qwen3's q_norm/k_norm, DeepSeek's
# latent-attention norms.
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32)
DECAY_FAMILIES = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=8, tie_word_embeddings=False),
    "gemma2": lambda: transformers.Gemma2Config(**TINY, head_dim=8, query_pre_attn_scalar=8),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **dict(TINY, num_key_value_heads=2), kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=4, first_k_dense_replace=1, tie_word_embeddings=False),
}


def _our_decayed(hf_config: dict) -> dict:
    """Our optimizer's groups, for the model of ``hf_config`` at 1 process: each parameter's tensor in Hugging
    Face's names (weights_to_hf), ones where it is in a decayed group (weight_decay > 0), zeros where not."""
    config = Config(model=hf_weights.model_config_from_hf(hf_config),
                    training=TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=1))
    parallel_state = initialize_model_parallel(1, 1)
    try:
        _, optimizer, _ = setup_model_and_optimizer(config, parallel_state)
        decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
        marks = {r.name: torch.full(r.shape, float(id(main) in decayed))
                 for r, main in zip(optimizer.param_ranges, optimizer.main_params)}
    finally:
        destroy_model_parallel(parallel_state)
    return hf_weights.weights_to_hf(lambda name: marks[name], config.model)


@pytest.mark.parametrize("family", sorted(DECAY_FAMILIES))
def test_weight_decay_groups_equal_hf_trainers(family):
    """The parameters we decay are those HF Trainer decays (its get_decay_parameter_names: not biases, not
    norms), tensor by tensor in Hugging Face's names; a fused tensor (qkv) must be all one or the other."""
    hf_config = DECAY_FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = set(transformers.Trainer.get_decay_parameter_names(None, model))
    ours = _our_decayed(hf_config.to_dict())
    names = {name for name, _ in model.named_parameters()} & set(ours)
    assert len(names) >= len(list(model.parameters())) - 1, (sorted(ours), sorted(names))  # all but a tied head
    assert all(bool(ours[n].all()) or not bool(ours[n].any()) for n in names)
    assert {n for n in names if bool(ours[n].all())} == theirs & names
    assert theirs & names and names - theirs  # both groups hold something


def _torch_scales(initial: float, window: int, overflows: list) -> list:
    """The scale after each step under torch's GradScaler update (the kernel torch.amp.GradScaler runs):
    x0.5 on an overflow, x2 after ``window`` clean steps."""
    scale, tracker, scales = torch.tensor([initial]), torch.zeros(1, dtype=torch.int32), []
    for overflow in overflows:
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(overflow)]), 2.0, 0.5, window)
        scales.append(scale.item())
    return scales


def test_dynamic_loss_scale_equals_torch_grad_scaler():
    """--hysteresis 1 (every overflow backs off): the scale our fp16 optimizer's scaler keeps step by step is
    torch's; the default hysteresis 2 is Megatron-LM's own rule, tested in test_grad_scaler.py."""
    optimizer_config = OptimizerConfig(initial_loss_scale=2.0 ** 16, loss_scale_window=3, hysteresis=1)
    overflows = [True, True, False, False, False, False, True, False, False, False, False, False, False, True]
    config = Config(model=ModelConfig(**MODEL), optimizer=optimizer_config,
                    training=TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=1, fp16=True))
    parallel_state = initialize_model_parallel(1, 1)
    try:
        _, optimizer, _ = setup_model_and_optimizer(config, parallel_state)
        scaler = optimizer.grad_scaler
        ours = []
        for overflow in overflows:
            scaler.update(overflow)
            ours.append(float(scaler.scale))
    finally:
        destroy_model_parallel(parallel_state)
    assert ours == _torch_scales(2.0 ** 16, 3, overflows)
    steps = list(zip(ours, ours[1:]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps)  # it backed off and grew


def test_router_z_loss_equals_transformers():
    """--moe-z-loss-coeff: the z-loss our router logs and the gradient it gives the router weight are those of
    transformers' router_z_loss_func (Switch Transformers, ST-MoE's loss) over the same logits."""
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    from tests.model.test_moe import E, H, layout, router

    coefficient, sequences, length = 0.01, 3, 8
    r = router(moe_z_loss_coeff=coefficient).train()
    x = torch.randn(sequences * length, H)
    probs, _ = r(x, layout(sequences * length, sequences))
    (probs * 0).sum().backward()  # only the attached loss reaches the weight
    weight = r.weight.detach().clone().requires_grad_()
    theirs = router_z_loss_func((x @ weight.t()).view(sequences, length, E))
    (coefficient * theirs).backward()
    torch.testing.assert_close(r.loss_sums["z_loss"], theirs.detach())
    torch.testing.assert_close(r.weight.grad, weight.grad)
    assert weight.grad.abs().max() > 0
