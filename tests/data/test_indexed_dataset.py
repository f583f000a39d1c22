import os
import pickle
import struct

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                                                best_fitting_dtype)

SEQUENCES = [[1, 2, 3], [], [65535, 0], [7] * 10, [4, 5]]


def write(prefix, sequences=SEQUENCES, dtype=np.uint16, documents_of=None):
    """Writes sequences; ``documents_of`` lists how many sequences each document has (default one each)."""
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype) as builder:
        sizes = documents_of or [1] * len(sequences)
        it = iter(sequences)
        for size in sizes:
            for _ in range(size):
                builder.add_item(next(it))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_index_layout_field_by_field(tmp_path):
    prefix = write(tmp_path / "d", documents_of=[2, 1, 2])
    raw = open(f"{prefix}.idx", "rb").read()
    n, d = len(SEQUENCES), 4
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)  # version
    assert raw[17] == 8  # uint16
    assert struct.unpack("<Q", raw[18:26]) == (n,)
    assert struct.unpack("<Q", raw[26:34]) == (d,)
    assert struct.unpack(f"<{n}i", raw[34:34 + 4 * n]) == (3, 0, 2, 10, 2)
    assert struct.unpack(f"<{n}q", raw[34 + 4 * n:34 + 12 * n]) == (0, 6, 6, 10, 30)  # bytes, 2 per token
    assert struct.unpack(f"<{d}q", raw[34 + 12 * n:]) == (0, 2, 3, 5)
    assert len(raw) == 34 + 12 * n + 8 * d
    assert open(f"{prefix}.bin", "rb").read() == np.array(sum(SEQUENCES, []), dtype="<u2").tobytes()


def test_reads_a_pair_written_by_hand_from_the_spec(tmp_path):
    """Stands in for a file written by Megatron-LM: bytes packed from the format, not by our writer."""
    tokens = [[100000, 5], [7, 8, 9]]
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 2, 3)
    index = header + struct.pack("<2i", 2, 3) + struct.pack("<2q", 0, 8) + struct.pack("<3q", 0, 1, 2)
    (tmp_path / "m.idx").write_bytes(index)
    (tmp_path / "m.bin").write_bytes(struct.pack("<5i", 100000, 5, 7, 8, 9))
    dataset = IndexedDataset(str(tmp_path / "m"))
    assert dataset.dtype == np.int32 and len(dataset) == 2
    assert [dataset[i].tolist() for i in range(2)] == tokens
    assert dataset.get(1, offset=1, length=2).tolist() == [8, 9]
    assert dataset.document_indices.tolist() == [0, 1, 2]


def test_round_trip_and_partial_reads(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "d"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == SEQUENCES
    assert dataset.get(3, offset=8).tolist() == [7, 7]
    assert dataset.get(0, offset=1, length=1).tolist() == [2]
    with pytest.raises(IndexError):
        dataset[5]


def test_file_reads_equal_the_memory_map(tmp_path):
    """--no-mmap-bin-files: the same tokens from one file read per call, and loader workers keep the mode."""
    prefix = write(tmp_path / "d")
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    assert not isinstance(read[3], np.memmap) and read._tokens.size == 0
    for i in range(len(SEQUENCES)):
        for offset, length in [(0, None), (1, 1), (0, 2), (2, None)]:
            offset = min(offset, len(SEQUENCES[i]))
            assert read.get(i, offset, length).tolist() == mapped.get(i, offset, length).tolist(), (i, offset)
    assert read.get(4, offset=1, length=5).tolist() == mapped.get(4, offset=1, length=5).tolist() == [5]
    assert pickle.loads(pickle.dumps(read)).mmap is False


def test_pickles_as_its_path(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "d"))
    payload = pickle.dumps(dataset)
    assert len(payload) < 200 and pickle.loads(payload)[3].tolist() == SEQUENCES[3]


def test_dtype_choice_and_overflow(tmp_path):
    assert best_fitting_dtype(50257) == np.uint16 and best_fitting_dtype(65500) == np.int32
    with pytest.raises(ValueError, match="wider dtype"), IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16) as b:
        b.add_item([70000])
    assert os.listdir(tmp_path) == []  # the failed builder left nothing behind


def test_merge_keeps_documents(tmp_path, load_tool):
    a = write(tmp_path / "a", documents_of=[2, 3])
    b = write(tmp_path / "b", [[9, 9], [8]])
    assert load_tool("merge_datasets").main(["--input", a, b, "--output-prefix", str(tmp_path / "ab")]) == 0
    merged = IndexedDataset(str(tmp_path / "ab"))
    assert [merged[i].tolist() for i in range(len(merged))] == SEQUENCES + [[9, 9], [8]]
    assert merged.document_indices.tolist() == [0, 2, 5, 6, 7]
    c = write(tmp_path / "c", [[1]], dtype=np.int32)
    assert load_tool("merge_datasets").main(["--input", a, c, "--output-prefix", str(tmp_path / "ac")]) == 2
    assert not os.path.exists(tmp_path / "ac.idx") and not os.path.exists(tmp_path / "ac.bin")


def test_builder_writes_temporaries_then_renames(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16) as builder:
        builder.add_document([1, 2])
        assert not os.path.exists(tmp_path / "o.bin")  # only the temporary exists while writing
        builder.finalize(str(tmp_path / "o.idx"))
    assert sorted(os.listdir(tmp_path)) == ["o.bin", "o.idx"]
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16) as builder:
        builder.add_document([3, 4, 5])
        raise RuntimeError("interrupted")
    assert sorted(os.listdir(tmp_path)) == ["o.bin", "o.idx"]
    assert IndexedDataset(str(tmp_path / "o"))[0].tolist() == [1, 2]  # the old pair is untouched


@pytest.mark.parametrize("damage, message", [
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-5]), "truncated or corrupt"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "truncated"),
    (lambda idx, bin_: idx.write_bytes(b""), "truncated"),
    (lambda idx, bin_: idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:]), "not a Megatron indexed-dataset"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]),
     "version 2"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x09" + idx.read_bytes()[18:]), "dtype code 9"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "truncated or the pair does not belong"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes() + b"xx"), "does not belong together"),
    # Second pointer (offset 34 + 4 * 5 + 8) off by two bytes.
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:62] + struct.pack("<q", 8) + idx.read_bytes()[70:]),
     "pointers that do not follow the lengths"),
    (lambda idx, bin_: idx.unlink(), "does not exist. --data-path takes the prefix"),
])
def test_damaged_files_are_rejected_clearly(tmp_path, damage, message):
    prefix = write(tmp_path / "d")
    damage(tmp_path / "d.idx", tmp_path / "d.bin")
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(prefix)
