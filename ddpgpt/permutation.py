"""A keyed permutation of [0, n) that builds nothing of size n: which sample reads which window
(data.py) and which document goes to which split (prepare.py) are drawn with it, as pure
functions of a seed and an index. Numpy only, so that prepare.py does not import torch."""
import functools

import numpy as np

# numpy scalars, not python ints: numpy converts a python operand on every operation, which
# doubles the cost of a hash on the dozen indices of a micro-batch
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)
ROUNDS = 6


def hash64(z):
    """splitmix64's finaliser: a well-mixed 64-bit hash of each element of a uint64 array
    (multiplication wraps, as it should)."""
    z = (z ^ (z >> _S1)) * _M1
    z = (z ^ (z >> _S2)) * _M2
    return z ^ (z >> _S3)


@functools.lru_cache(maxsize=1024)
def hash_key(*parts):
    """A 64-bit key (a python int) from a few integers, e.g. (seed, epoch)."""
    h = np.zeros(1, dtype=np.uint64)
    for p in parts:
        h = hash64(h ^ hash64(np.array([int(p) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)))
    return int(h[0])


@functools.lru_cache(maxsize=1024)
def round_keys(key):
    """The Feistel network's round keys for one permutation key."""
    return tuple(np.uint64(hash_key(key, r)) for r in range(ROUNDS))


def feistel_shape(n):
    """(shift, high mask, low mask) of the bijection of the smallest power of two >= n (at
    least 4) whose bits a Feistel network splits in two halves."""
    bits = max(2, (int(n) - 1).bit_length())
    low_bits = bits // 2
    return (np.uint64(low_bits), np.uint64((1 << (bits - low_bits)) - 1),
            np.uint64((1 << low_bits) - 1))


def feistel(x, shape, keys):
    """A bijection of [0, 2**bits): each round XORs one half with a keyed hash of the other,
    which can be undone, so any split of the bits works. shape and keys may be one for all
    elements, or arrays of each one's own."""
    shift, high_mask, low_mask = shape
    high, low = x >> shift, x & low_mask
    for r, k in enumerate(keys):
        if r % 2:
            low ^= hash64(high ^ k) & low_mask
        else:
            high ^= hash64(low ^ k) & high_mask
    return (high << shift) | low


def walk(x, n, shape, keys):
    """feistel, cycle-walked back into [0, n): fewer than 2 rounds on average. Each element may
    have its own n, shape and keys (arrays), as the samples of several sources do."""
    out = feistel(x, shape, keys)
    # each pass hashes only the elements still outside: the batch waits for its slowest
    # element, several passes where n is just above a power of two
    outside = np.flatnonzero(out >= n)
    while len(outside):
        again = feistel(out[outside], *(tuple(_at(v, outside) for v in part)
                                         for part in (shape, keys)))
        out[outside] = again
        outside = outside[again >= _at(n, outside)]
    return out


def _at(value, where):
    """value's elements at `where`, or value itself if it is one for all elements."""
    return value[where] if np.ndim(value) else value


def permute(i, n, key):
    """A keyed bijection of [0, n): a Feistel network on the smallest power of two >= n,
    cycle-walked back into range. Nothing of size n is built."""
    return walk(np.asarray(i, dtype=np.uint64), np.uint64(n), feistel_shape(n), round_keys(key))
