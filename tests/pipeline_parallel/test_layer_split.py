import pytest

from megatron_lite.config import ConfigError
from megatron_lite.pipeline_parallel.layer_split import get_layer_numbers


def split(num_layers, p, v=None, first=None, last=None):
    """{(pipeline rank, chunk): list of layers}."""
    return {(r, c): list(get_layer_numbers(num_layers, pipeline_model_parallel_size=p, pipeline_rank=r,
                                           virtual_pipeline_model_parallel_size=v, virtual_pipeline_rank=c,
                                           decoder_first_pipeline_num_layers=first,
                                           decoder_last_pipeline_num_layers=last))
            for r in range(p) for c in range(v or 1)}


def model_order(chunks, p):
    """Layers in the order activations visit them: chunk c of rank r is model slice c * p + r."""
    return [n for (r, c) in sorted(chunks, key=lambda rc: rc[1] * p + rc[0]) for n in chunks[(r, c)]]


def test_even_split_is_contiguous():
    assert split(8, 4) == {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4, 5], (3, 0): [6, 7]}
    assert split(5, 1) == {(0, 0): [0, 1, 2, 3, 4]}


def test_interleaved_chunk_c_of_rank_r_is_model_slice_c_times_p_plus_r():
    assert split(8, 2, v=2) == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    assert split(12, 3, v=2)[(1, 1)] == [8, 9]


def test_uneven_first_and_last_stages():
    assert split(10, 4, first=1, last=1) == {(0, 0): [0], (1, 0): [1, 2, 3, 4], (2, 0): [5, 6, 7, 8], (3, 0): [9]}
    assert split(7, 3, first=1) == {(0, 0): [0], (1, 0): [1, 2, 3], (2, 0): [4, 5, 6]}
    assert split(6, 2, last=2) == {(0, 0): [0, 1, 2, 3], (1, 0): [4, 5]}
    # Interleaved: every stage's layers spread evenly over its chunks, trips round the ring in order.
    assert split(10, 3, v=2, first=2, last=2) == {(0, 0): [0], (1, 0): [1, 2, 3], (2, 0): [4],
                                                  (0, 1): [5], (1, 1): [6, 7, 8], (2, 1): [9]}


@pytest.mark.parametrize("num_layers,p,v,first,last", [
    (24, 4, None, None, None), (24, 4, 3, None, None), (24, 2, 6, None, None), (14, 4, None, 2, 2),
    (16, 4, 2, 2, 2), (9, 2, None, 4, None), (14, 3, 2, None, 2), (4, 2, None, 0, None)])
def test_chunks_partition_the_layers_in_model_order(num_layers, p, v, first, last):
    assert model_order(split(num_layers, p, v, first, last), p) == list(range(num_layers))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=7, p=2), "--num-layers \\(7\\).*--pipeline-model-parallel-size \\(2\\)"),
    (dict(num_layers=8, p=2, v=3), "--virtual-pipeline-model-parallel-size 3"),
    (dict(num_layers=9, p=4, first=3, last=3), "3 layers after the first/last stage layers over 2 stages"),
    (dict(num_layers=8, p=2, first=3, last=3), "--decoder-first-pipeline-num-layers"),
    (dict(num_layers=8, p=1, first=3), "--pipeline-model-parallel-size > 1"),
    (dict(num_layers=8, p=2, first=-1), "must be >= 0"),
])
def test_bad_splits_name_the_flags(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        split(kwargs.pop("num_layers"), kwargs.pop("p"), **kwargs)
