"""Philox4x32-10 in NumPy, written from Salmon et al. (SC 2011).

The oracle for the CUDA dropout's keep mask: element i of a tensor uses output word
i % 4 of Philox(counter = (i // 4, 0, 0) as 64-bit low/high words, key = seed).
"""
import numpy as np

_MUL = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_WEYL = (0x9E3779B9, 0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key):
    """counter: uint32 array [..., 4]; key: two uint32. Returns uint32 [..., 4]."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = int(key[0]), int(key[1])
    for _ in range(10):
        p0 = _MUL[0] * c[0]
        p1 = _MUL[1] * c[2]
        c = [
            (p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0),
            p1 & _LOW,
            (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
            p0 & _LOW,
        ]
        k0, k1 = (k0 + _WEYL[0]) & 0xFFFFFFFF, (k1 + _WEYL[1]) & 0xFFFFFFFF
    return np.stack(c, axis=-1).astype(np.uint32)


def dropout_uniforms(seed, n):
    """The uniform in [0, 1) that the CUDA dropout kernel draws for elements 0..n-1."""
    groups = np.arange((n + 3) // 4, dtype=np.uint64)
    counter = np.zeros((len(groups), 4), dtype=np.uint32)
    counter[:, 0] = (groups & _LOW).astype(np.uint32)
    counter[:, 1] = (groups >> np.uint64(32)).astype(np.uint32)
    seed = int(seed)
    bits = philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)[:n]
    return (bits >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
