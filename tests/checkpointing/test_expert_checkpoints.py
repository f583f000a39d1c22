"""Checkpoints of a mixture of experts reshard across expert layouts: experts are named by their global number,
so a rank loads the experts it holds, whichever layout saved them (docs/checkpoints.md)."""
import torch

from megatron_lite.checkpointing import storage
from megatron_lite.interop.hf.checkpoint import export_hf_checkpoint, import_hf_checkpoint, read_hf_directory
from megatron_lite.checkpointing.resharding import CheckpointReader, has_vocab_rows
from tests.checkpointing.common import MOE, assert_continues, losses_of, train
from tests.distributed import run_distributed


def test_saved_at_ep4_resumes_at_ep1_and_at_ep2_tp2_with_the_uninterrupted_losses(tmp_path):
    """Saved under ZeRO-3 (every rank writes the flat slices of its shards: dense weights over 4 data-parallel
    ranks, each expert whole on its own rank), resumed with its optimizer state at one process and at
    tensor 2 (sequence parallel, experts split over the tensor ranks) x expert 2 with the distributed optimizer."""
    root = str(tmp_path)
    uninterrupted = losses_of(run_distributed(train, 4, args=(dict(
        arch=MOE, ep=4, strategy="optim_grads_params", save=root, save_interval=2),)))
    reader = CheckpointReader(storage.checkpoint_dir(root, 4))
    assert {f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"
            for layer in range(4) for e in range(4)} <= set(reader.tensors)
    assert reader.metadata["layout"]["expert_model_parallel_size"] == 4
    # Exported to Hugging Face (Mixtral) and imported back, every weight is the one the experts' ranks saved.
    export_hf_checkpoint(root, str(tmp_path / "hf"))
    assert sum(".experts." in name for name in read_hf_directory(str(tmp_path / "hf"))[1]) == 4 * 4 * 3
    again = CheckpointReader(import_hf_checkpoint(str(tmp_path / "hf"), str(tmp_path / "again")))
    for name in again.tensors:  # the vocabulary's padding rows are each checkpoint's own
        rows = 60 if has_vocab_rows(name) else None
        assert torch.equal(again.read(name)[:rows], reader.read(name)[:rows]), name
    storage.write_latest_iteration(root, 2)
    at_one_process = losses_of(run_distributed(train, 1, args=(dict(arch=MOE, load=root),)))
    at_ep2_tp2 = losses_of(run_distributed(train, 4, args=(dict(arch=MOE, tp=2, ep=2, sequence_parallel=True,
                                                                dist_opt=True, load=root),)))
    assert_continues(at_one_process, uninterrupted)
    assert_continues(at_ep2_tp2, uninterrupted)
