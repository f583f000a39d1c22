"""The NumPy Philox that tests/gpu uses as the dropout oracle, against known answers."""
import numpy as np

from tests.kernels.philox import dropout_uniforms, philox4x32_10


def test_philox_known_answers():
    # Known-answer vectors of Philox4x32-10 published with Random123.
    cases = [
        ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (
            [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
            (0xA4093822, 0x299F31D0),
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        ),
    ]
    for counter, key, expected in cases:
        out = philox4x32_10(np.array([counter], dtype=np.uint32), key)[0]
        assert out.tolist() == expected


def test_dropout_uniforms_cover_unit_interval_evenly():
    u = dropout_uniforms(seed=12345, n=100_003)
    assert u.shape == (100_003,) and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005
    # Group g's four words come from one Philox call with counter g.
    first = philox4x32_10(np.array([[1, 0, 0, 0]], dtype=np.uint32), (12345, 0))[0]
    assert np.array_equal(u[4:8], (first >> 8).astype(np.float32) / 16777216.0)
