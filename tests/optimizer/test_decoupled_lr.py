"""--decoupled-lr / --decoupled-min-lr: the word embedding and output layer on their own learning rate.

As Megatron-LM: they go into param groups of their own whose schedule has the same warmup and
decay shape but ends at --decoupled-lr / --decoupled-min-lr; a checkpoint resumes the schedule
and refuses a run that changed them.
"""
import math

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--eval-interval", "1000", "--eval-iters", "1", "--no-log-memory", "--log-interval", "1000",
        "--untie-embeddings-and-output-weights", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
        "--lr-decay-iters", "10", "--train-iters", "4", "--lr-decay-style", "cosine"]
DECOUPLED = ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"]


def megatron_cosine(step, max_lr, min_lr, warmup=8, decay=40):
    if step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _build(flags):
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.training.loop import build_optimizer_and_scheduler, get_model

    config = parse_args(flags)
    parallel_state = initialize_model_parallel(1, 1)
    model_chunks = get_model(config, parallel_state)
    optimizer, scheduler = build_optimizer_and_scheduler(config, parallel_state, model_chunks)
    names = {id(main): r.name for r, main in zip(optimizer.param_ranges, optimizer.main_params)}
    groups = [{names[id(p)] for p in group["params"]} for group in optimizer.param_groups]
    return optimizer, scheduler, groups


def test_embedding_and_output_layer_get_their_own_groups():
    optimizer, _, groups = _build(BASE + DECOUPLED)
    assert groups[2] == {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert groups[3] == set()  # no 1-D embedding or output parameter here; the group keeps layouts aligned
    assert "embedding.position_embeddings.weight" in groups[0] and "final_layernorm.weight" in groups[1]
    assert [g["is_decoupled_lr"] for g in optimizer.param_groups] == [False, False, True, True]
    assert optimizer.param_groups[2]["weight_decay"] == 0.01 and optimizer.param_groups[3]["weight_decay"] == 0.0
    _, _, plain = _build(BASE)
    assert len(plain) == 2 and "embedding.word_embeddings.weight" in plain[0]


def test_decoupled_min_lr_defaults_to_min_lr():
    optimizer, _, _ = _build(BASE + ["--decoupled-lr", "5e-3"])
    assert (optimizer.param_groups[2]["max_lr"], optimizer.param_groups[2]["min_lr"]) == (5e-3, 1e-4)


def test_same_shape_own_end_points():
    """The schedule in samples (4 per iteration): warmup 8, decay 40; each group's LR is Megatron's cosine
    between its own end points."""
    optimizer, scheduler, _ = _build(BASE + DECOUPLED)
    for samples in [0, 4, 8, 12, 20, 32, 40, 44]:
        scheduler.num_steps = samples
        scheduler.step(increment=0)
        lrs = [group["lr"] for group in optimizer.param_groups]
        assert lrs[0] == lrs[1] == pytest.approx(megatron_cosine(samples, 1e-3, 1e-4), abs=1e-15)
        assert lrs[2] == lrs[3] == pytest.approx(megatron_cosine(samples, 5e-3, 5e-4), abs=1e-15)


def test_decoupled_lr_trains_and_resumes(tmp_path):
    """Trained 4 iterations with a save at 2; the resumed run continues with the same learning rates and
    losses. A resume with another --decoupled-lr, or without it, is refused by name."""
    from megatron_lite.training.loop import pretrain

    flags = BASE + DECOUPLED + ["--save", str(tmp_path), "--save-interval", "2"]
    uninterrupted, _, _ = pretrain(parse_args(flags))
    storage.write_latest_iteration(str(tmp_path), 2)
    resumed, chunks, _ = pretrain(parse_args(flags + ["--load", str(tmp_path)]))
    assert resumed.losses == uninterrupted.losses
    with pytest.raises(ConfigError, match="--decoupled-lr/--decoupled-min-lr"):
        pretrain(parse_args(BASE + ["--decoupled-lr", "1e-2", "--load", str(tmp_path)]))
    with pytest.raises(ConfigError, match="different --decoupled-lr setting"):
        pretrain(parse_args(BASE + ["--load", str(tmp_path)]))


def test_scheduler_state_round_trips():
    optimizer, scheduler, _ = _build(BASE + DECOUPLED)
    scheduler.step(increment=12)
    state = scheduler.state_dict()
    assert state["num_steps"] == 12 and state["group_lrs"] == [[1e-3, 1e-4]] * 2 + [[5e-3, 5e-4]] * 2
    _, fresh, _ = _build(BASE + DECOUPLED)
    fresh.load_state_dict(state)
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    _, other, _ = _build(BASE + ["--decoupled-lr", "5e-3"])  # decoupled min lr 1e-4 instead of 5e-4
    with pytest.raises(ConfigError, match=r"--decoupled-lr/--decoupled-min-lr \(checkpoint \[\[0.001"):
        other.load_state_dict(state)
    other.load_state_dict(state, override=True)  # --override-opt_param-scheduler: this run's end points
    assert other.optimizer.param_groups[2]["min_lr"] == 1e-4
    other.load_state_dict(state, use_checkpoint=True)  # --use-checkpoint-opt_param-scheduler: the checkpoint's
    assert other.optimizer.param_groups[2]["min_lr"] == 5e-4
    assert [g["lr"] for g in other.optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]


def test_decoupled_min_lr_needs_decoupled_lr():
    with pytest.raises(ConfigError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse_args(BASE + ["--decoupled-min-lr", "1e-5"])
