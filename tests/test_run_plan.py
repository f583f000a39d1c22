"""The facts of a run are found once at start-up (training/run_plan.py), on the trainer's own path.

Counted through ``pretrain_gpt.main``, as a user launches it: the micro-batch calculator, the answer to
"which checkpoint do we load", and the model built on the meta device (for the parameter counts) beside
the real build, for a fresh start and for a resume.
"""
import collections
import sys

from megatron_lite.checkpointing import loading
from megatron_lite.model.gpt_model import GPTModel
from megatron_lite.pretrain_gpt import main
from megatron_lite.training.num_microbatches_calculator import NumMicroBatchesCalculator

FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--vocab-size", "64", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--eval-iters", "1", "--log-interval", "1", "--peft", "lora", "--peft-without-base-checkpoint"]


def _count_start_up_facts(monkeypatch) -> collections.Counter:
    counts = collections.Counter()
    calculator_init = NumMicroBatchesCalculator.__init__

    def counted_calculator(self, *args, **kwargs):
        counts["calculator"] += 1
        calculator_init(self, *args, **kwargs)

    monkeypatch.setattr(NumMicroBatchesCalculator, "__init__", counted_calculator)
    lookup = loading.checkpoint_to_load

    def counted_lookup(checkpoint):
        counts["checkpoint lookup"] += 1
        return lookup(checkpoint)

    for module in list(sys.modules.values()):  # every module that imported it by name
        if getattr(module, "checkpoint_to_load", None) is lookup:
            monkeypatch.setattr(module, "checkpoint_to_load", counted_lookup)
    model_init = GPTModel.__init__

    def counted_model(self, *args, **kwargs):
        model_init(self, *args, **kwargs)
        counts["meta build" if next(self.parameters()).is_meta else "real build"] += 1

    monkeypatch.setattr(GPTModel, "__init__", counted_model)
    return counts


def test_calculator_checkpoint_and_meta_model_are_each_computed_once(tmp_path, monkeypatch):
    checkpoints = ["--save", str(tmp_path), "--load", str(tmp_path)]
    counts = _count_start_up_facts(monkeypatch)
    assert main(FLAGS + checkpoints + ["--train-iters", "1"]) == 0  # a fresh start: --load holds nothing yet
    assert counts == {"calculator": 1, "checkpoint lookup": 1, "meta build": 1, "real build": 1}, counts
    counts.clear()
    assert main(FLAGS + checkpoints + ["--train-iters", "2", "--override-opt_param-scheduler"]) == 0  # a resume
    assert counts == {"calculator": 1, "checkpoint lookup": 1, "meta build": 1, "real build": 1}, counts
