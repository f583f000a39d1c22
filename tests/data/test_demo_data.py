import os

from megatron_lite.data import build_train_valid_test_datasets
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.tokenizer import build_tokenizer
from tools.build_demo_data import demo_documents


def test_build_demo_data_is_complete_and_idempotent(tmp_path, load_tool, capsys):
    tool = load_tool("build_demo_data")
    output_dir = str(tmp_path / "demo_data")
    assert tool.main(["--output-dir", output_dir]) == 0
    printed = capsys.readouterr().out
    for flag in ["--data-path", "--vocab-file", "--merge-file", "--tokenizer-type GPT2BPETokenizer"]:
        assert flag in printed
    files = ["tokenizer/vocab.json", "tokenizer/merges.txt", "demo_text_document.bin", "demo_text_document.idx"]
    mtimes = {name: os.path.getmtime(os.path.join(output_dir, name)) for name in files}

    assert tool.main(["--output-dir", output_dir]) == 0  # second run reuses everything
    assert {name: os.path.getmtime(os.path.join(output_dir, name)) for name in files} == mtimes

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(output_dir, "tokenizer/vocab.json"),
                                merge_file=os.path.join(output_dir, "tokenizer/merges.txt"))
    dataset = IndexedDataset(os.path.join(output_dir, "demo_text_document"))
    documents = demo_documents()
    assert tokenizer.vocab_size == 4096 and len(dataset) == len(documents) > 300
    assert tokenizer.detokenize(dataset[10]) == documents[10] + "<|endoftext|>"
    train, valid, _ = build_train_valid_test_datasets(
        data_path=[os.path.join(output_dir, "demo_text_document")], split="969,30,1", seq_length=256, seed=1234,
        train_valid_test_num_samples=(2000, 50, 0))
    assert len(train) >= 2000 and len(valid) >= 50
