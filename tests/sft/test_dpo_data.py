"""--dpo's data: TRL's preference records in every file format, the chat template applied, the loss mask on the
answer only, pairs kept whole by padding, packing and truncation; and the errors a bad run gets."""
import json
import re

import numpy as np
import pytest

from megatron_lite.data.sft.preference import PreferenceDataset, load_preference_pairs
from megatron_lite.pretrain_gpt import main as pretrain_main
from megatron_lite.tokenizer import build_tokenizer

pyarrow = pytest.importorskip("pyarrow")
parquet = pytest.importorskip("pyarrow.parquet")

NULL = build_tokenizer("NullTokenizer", vocab_size=63)  # ids 0-62, EOD 63
RECORDS = [{"prompt": "1 2 3", "chosen": " 4 5", "rejected": " 6"},
           {"prompt": "7", "chosen": " 8", "rejected": " 9 10 11"},
           {"prompt": "12 13", "chosen": " 14 15 16", "rejected": " 17 18"}]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def _sides(pairs) -> list:
    return [[(ids.tolist(), mask.tolist()) for ids, mask in pairs.get(i)] for i in range(len(pairs))]


def test_string_pairs_in_jsonl_json_and_parquet_read_alike_and_mask_only_the_answers(tmp_path):
    (tmp_path / "pairs.json").write_text(json.dumps(RECORDS, indent=1))
    parquet.write_table(pyarrow.Table.from_pylist(RECORDS), str(tmp_path / "pairs.parquet"))
    read = [_sides(load_preference_pairs([path], NULL, "plain"))
            for path in (_jsonl(tmp_path / "pairs.jsonl", RECORDS), str(tmp_path / "pairs.json"),
                         str(tmp_path / "pairs.parquet"))]
    assert read[0] == read[1] == read[2]
    assert read[0][0] == [([1, 2, 3, 4, 5, 63], [0, 0, 0, 1, 1, 1]), ([1, 2, 3, 6, 63], [0, 0, 0, 1, 1])]


def test_conversational_pairs_explicit_or_implicit_prompt_and_chatml(tmp_path, chat_tokenizer_dir):
    """TRL's two conversational forms give the same ids; an earlier assistant turn of the prompt is no answer."""
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir)
    prompt = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "how are you"},
              {"role": "user", "content": "be brief"}]
    chosen, rejected = [{"role": "assistant", "content": "the answer is 4"}], [{"role": "assistant", "content": "2"}]
    explicit = _jsonl(tmp_path / "explicit.jsonl", [{"prompt": prompt, "chosen": chosen, "rejected": rejected}])
    implicit = _jsonl(tmp_path / "implicit.jsonl", [{"chosen": prompt + chosen, "rejected": prompt + rejected}])
    pairs = [load_preference_pairs([path], tokenizer, "chatml") for path in (explicit, implicit)]
    assert _sides(pairs[0]) == _sides(pairs[1])
    for (ids, mask), answer in zip(pairs[0].get(0), (chosen, rejected)):
        assert tokenizer.detokenize(ids[mask == 1][:-1].tolist()) == answer[0]["content"] + "<|im_end|>"
        assert "<|im_start|>assistant\nhow are you" in tokenizer.detokenize(ids.tolist())


@pytest.mark.parametrize("pack", [False, True])
def test_a_pair_is_never_split_padded_packed_or_truncated(tmp_path, pack):
    records = RECORDS + [{"prompt": "20 21 22 23 24 25 26", "chosen": " 27 28 29 30", "rejected": " 31"},
                         {"prompt": " ".join(["40"] * 12), "chosen": " 41", "rejected": " 42"}]  # prompt fills it
    pairs = load_preference_pairs([_jsonl(tmp_path / "pairs.jsonl", records)], NULL, "plain")
    dataset = PreferenceDataset(pairs, seq_length=10, num_samples=8, seed=1, pad_token=63, pack_sequences=pack)
    assert "2 pairs with a side longer than --seq-length + 1 = 11 tokens truncated, 1 dropped" in dataset.describe()
    seen = set()
    for index in range(0, len(dataset), 2):
        chosen, rejected = dataset[index], dataset[index + 1]
        documents = [np.unique(s["segment_ids"][s["loss_mask"] > 0]).tolist() for s in (chosen, rejected)]
        assert documents[0] == documents[1] and len(documents[0]) >= 1  # the same pairs, each with answer tokens
        seen.update(tuple(chosen["tokens"][chosen["segment_ids"] == d][:1]) for d in documents[0])
        assert pack or len(documents[0]) == 1
    assert (40,) not in seen  # the pair whose prompt fills the sequence is dropped


def test_preprocessed_pairs_read_as_the_jsonl_and_each_kind_refuses_the_other(tmp_path, capsys):
    """tools/preprocess_data.py --dpo writes a pair per document (chosen, rejected); read back, the pairs and the
    padded and packed (truncating) samples equal the JSONL's, a bad line is named and skipped, and --sft data is
    not taken for pairs nor pairs for --sft data."""
    from megatron_lite.data.sft import load_sft_examples
    from tools.preprocess_data import main as preprocess_data

    records = RECORDS + [{"prompt": "20 21 22 23 24 25 26", "chosen": " 27 28 29 30", "rejected": " 31"}]
    data = _jsonl(tmp_path / "pairs.jsonl", records[:2] + [{"prompt": "1", "chosen": " 2"}] + records[2:])
    common = ["--input", data, "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]
    assert preprocess_data(["--dpo", *common, "--output-prefix", str(tmp_path / "pairs")]) == 0
    assert "pairs.jsonl:3: a preference record needs" in capsys.readouterr().err
    direct = load_preference_pairs([_jsonl(tmp_path / "good.jsonl", records)], NULL, "plain")
    preprocessed = load_preference_pairs([str(tmp_path / "pairs")], NULL, "plain")
    assert _sides(preprocessed) == _sides(direct) and len(direct) == 4
    for pack in (False, True):
        samples = [PreferenceDataset(pairs, seq_length=10, num_samples=8, seed=1, pad_token=63, pack_sequences=pack)
                   for pairs in (direct, preprocessed)]
        assert samples[0].num_truncated == 1
        for index in range(8):
            assert all(np.array_equal(samples[0][index][key], samples[1][index][key]) for key in samples[0][index])
    losses = []  # trained from either source (ORPO: no reference checkpoint needed), the same loss
    for source in (str(tmp_path / "good.jsonl"), str(tmp_path / "pairs")):
        assert pretrain_main(["--dpo", "--dpo-loss-type", "orpo", "--train-data-path", source, "--tokenizer-type",
                              "NullTokenizer", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
                              "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
                              "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1"]) == 0
        losses.append(re.findall(r"dpo loss: (\S+)", capsys.readouterr().out))
    assert losses[0] == losses[1] and len(losses[0]) == 2
    with pytest.raises(ValueError, match="holds preference pairs, but this run reads fine-tuning examples"):
        load_sft_examples([str(tmp_path / "pairs")], NULL, "plain")
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1 2", "response": " 3"}])
    assert preprocess_data(["--sft", *common[:1], sft, *common[2:], "--output-prefix", str(tmp_path / "sft")]) == 0
    with pytest.raises(ValueError, match="holds fine-tuning examples, but this run reads preference pairs: "
                                         "preprocess its records with tools/preprocess_data.py --dpo"):
        load_preference_pairs([str(tmp_path / "sft")], NULL, "plain")


def test_a_record_missing_chosen_or_rejected_names_the_file_and_line(tmp_path, capsys):
    data = _jsonl(tmp_path / "pairs.jsonl", RECORDS[:1] + [{"prompt": "1", "chosen": " 2"}])
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: a preference record needs \"chosen\" and \"rejected\""
                                         r".*lacks 'rejected'"):
        load_preference_pairs([data], NULL, "plain")


def test_dpo_without_a_reference_is_refused_by_name(tmp_path, capsys):
    data = _jsonl(tmp_path / "pairs.jsonl", RECORDS)
    code = pretrain_main(["--dpo", "--train-data-path", data, "--tokenizer-type", "NullTokenizer", "--vocab-size",
                          "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                          "--seq-length", "16", "--micro-batch-size", "2"])
    assert code != 0
    assert "error: --dpo needs a reference model: give --pretrained-checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--dpo-precompute-ref-log-probs"], "--dpo-precompute-ref-log-probs needs --dpo"),
    (["--dpo", "--dpo-loss-type", "orpo", "--dpo-precompute-ref-log-probs"],
     "--dpo-loss-type orpo has no reference model to precompute"),
    (["--dpo", "--dpo-cpo-alpha", "1", "--pretrained-checkpoint", "base"], "are SimPO's: add --dpo-loss-type simpo"),
    (["--dpo", "--dpo-loss-type", "orpo", "--dpo-label-smoothing", "0.1"], "smooths the sigmoid and simpo losses")])
def test_the_new_preference_flags_are_refused_where_they_mean_nothing(tmp_path, capsys, flags, message):
    data = _jsonl(tmp_path / "pairs.jsonl", RECORDS)
    code = pretrain_main(flags + ["--train-data-path", data, "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                  "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                                  "--seq-length", "16", "--micro-batch-size", "2"] + ([] if "--dpo" in flags else
                                                                                      ["--sft"]))
    assert code != 0 and message in capsys.readouterr().err


def test_the_planner_counts_the_reference_whole_on_every_data_parallel_rank_and_none_under_lora():
    from megatron_lite.config import (CheckpointConfig, Config, DataConfig, ModelConfig, ParallelConfig, PeftConfig,
                                      TrainingConfig)
    from megatron_lite.model.builder import count_parameters
    from megatron_lite.planner.static_memory import static_memory

    def memory(peft=None, strategy=None, **training):
        config = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                          vocab_size=64),
                        parallel=ParallelConfig(data_parallel_sharding_strategy=strategy),
                        data=DataConfig(dpo=True, train_data_path=["pairs.jsonl"], tokenizer_type="NullTokenizer"),
                        training=TrainingConfig(micro_batch_size=2, **training), peft=PeftConfig(peft=peft),
                        checkpoint=CheckpointConfig(pretrained_checkpoint="base"))
        return config, static_memory(config, pipeline_rank=0, data_parallel_size=2)
    config, replicated = memory()
    _, zero3 = memory(strategy="optim_grads_params")
    assert replicated.reference_bytes == zero3.reference_bytes == 4 * count_parameters(config).total
    assert zero3.parameter_bytes < zero3.reference_bytes  # the policy is sharded, the reference is not
    assert memory(peft="lora")[1].reference_bytes == 0
    assert memory(dpo_loss_type="simpo")[1].reference_bytes == 0  # a loss without a reference builds none
    # Precomputed: held only for the pass before training, so out of the static bytes, in the peak beside the pass's
    _, precomputed = memory(dpo_precompute_ref_log_probs=True)
    assert (precomputed.reference_bytes, precomputed.reference_pass_bytes) == (0, replicated.reference_bytes)
    assert precomputed.device_bytes == replicated.device_bytes - replicated.reference_bytes


def test_the_planner_command_plans_a_dpo_run_and_shows_the_reference(capsys):
    """``python -m megatron_lite.plan`` takes --dpo with its --train-data-path (never read): the reference is a line of
    the memory account, held through training or, precomputed, only before it."""
    from megatron_lite.plan import main as plan_main

    flags = ["--cluster", "h100-80g", "--num-gpus", "4", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "256", "--global-batch-size", "8",
             "--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--dpo", "--train-data-path",
             "pairs.jsonl", "--pretrained-checkpoint", "base", "--tokenizer-type", "NullTokenizer"]
    assert plan_main(flags) == 0
    assert "reference model (frozen)" in capsys.readouterr().out
    assert plan_main(flags + ["--dpo-precompute-ref-log-probs"]) == 0
    assert "reference model, before training" in capsys.readouterr().out
