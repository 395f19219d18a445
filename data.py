"""Which tokens each rank reads, step after step. The whole contract:

  1. Global batch `step` is the global samples [step * G, (step + 1) * G), where
     G = batch_size * gradient_accumulation_steps, whatever the world size.
  2. Rank r's micro-step m reads B = batch_size of them, starting at
     ((step * M + m) * W + r) * B, with W ranks of M micro-steps each (M * W fixed).
  3. Sample i reads the window that starts at token offset sample_offsets(i): a pure function
     of (seed, i). 'epoch' mode reads every block of the split once per epoch, in an order
     and at a phase drawn from (seed, epoch); 'random' draws offsets uniformly, as nanoGPT.
  4. The window at offset o gives x = tokens[o : o + T] and y = tokens[o + 1 : o + T + 1].

So no rank builds anything whose size depends on the data (start-up and memory do not grow
with it), the ranks read disjoint slices of one global batch, any world size reads the same
global batches, and resuming needs one integer: the number of samples consumed. The token
files themselves are tokenfile.py's.
"""
import functools
import hashlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import numpy as np
import torch

import tokenfile
from errors import UserError

SAMPLING_MODES = ("epoch", "random")


# ---- 1 and 2: global sample indices ----

def rank_sample_indices(step, micro_step, rank, world_size, batch_size, micro_steps):
    """Global sample indices of one rank's micro-batch (contract, point 2)."""
    first = ((step * micro_steps + micro_step) * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


# ---- 3: sample index -> window offset, vectorised, O(1) memory ----

# numpy scalars, not python ints: numpy converts a python operand on every operation, which
# doubles the cost of a hash on the dozen indices of a micro-batch
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix(z):
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
        h = mix(h ^ mix(np.array([int(p) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)))
    return int(h[0])


def feistel(x, high_bits, low_bits, round_keys):
    """A bijection of [0, 2**(high_bits + low_bits)): each round XORs one half with a keyed hash
    of the other, which can be undone, so any split of the bits works."""
    shift = np.uint64(low_bits)
    high_mask, low_mask = np.uint64((1 << high_bits) - 1), np.uint64((1 << low_bits) - 1)
    high, low = x >> shift, x & low_mask
    for r, k in enumerate(round_keys):
        if r % 2:
            low ^= mix(high ^ k) & low_mask
        else:
            high ^= mix(low ^ k) & high_mask
    return (high << shift) | low


def permute(i, n, key):
    """A keyed bijection of [0, n): a Feistel network on the smallest power of two >= n,
    cycle-walked back into range (fewer than 2 rounds on average). Nothing of size n is built."""
    bits = max(2, (n - 1).bit_length())
    low_bits = bits // 2
    round_keys = [np.uint64(hash_key(key, r)) for r in range(6)]
    out = feistel(np.asarray(i, dtype=np.uint64), bits - low_bits, low_bits, round_keys)
    outside = out >= n
    while outside.any():
        out[outside] = feistel(out[outside], bits - low_bits, low_bits, round_keys)
        outside = out >= n
    return out


def blocks_per_epoch(n_tokens, block_size):
    """Non-overlapping blocks read in one epoch. One block is left as slack where the split is
    long enough, so that each epoch can shift block boundaries by any phase in [0, block_size)."""
    whole = (n_tokens - 1) // block_size
    return whole - 1 if whole >= 2 else whole


def sample_offsets(sample_indices, n_tokens, block_size, seed, mode):
    """The start offset of the window each global sample index reads (contract, point 3)."""
    indices = np.asarray(sample_indices, dtype=np.int64)
    if mode == "random":
        return (mix(indices.astype(np.uint64) ^ hash_key(seed, 1)) % (n_tokens - block_size)
                ).astype(np.int64)
    if mode != "epoch":
        raise ValueError(f"sampling mode {mode!r} is not one of {SAMPLING_MODES}")
    n_blocks = blocks_per_epoch(n_tokens, block_size)
    max_phase = min(n_tokens - 1 - n_blocks * block_size, block_size - 1)
    out = np.empty(indices.shape, dtype=np.int64)
    epochs = indices // n_blocks
    for epoch in np.unique(epochs):
        here = epochs == epoch
        block = permute(indices[here] % n_blocks, n_blocks, hash_key(seed, 2, epoch))
        phase = hash_key(seed, 3, epoch) % (max_phase + 1)
        out[here] = phase + block.astype(np.int64) * block_size
    return out


def samples_fingerprint(sample_indices, n_tokens, block_size, seed, mode):
    """A short hash of which windows a set of global samples reads, in any order: a loader
    that reports the indices it read (examples/lightning_datamodule.py) hashes them here."""
    offsets = np.sort(sample_offsets(sample_indices, n_tokens, block_size, seed, mode))
    return hashlib.blake2b(offsets.tobytes(), digest_size=8).hexdigest()


def global_batch_fingerprint(step, global_batch, n_tokens, block_size, seed, mode):
    """A short hash of which windows global batch `step` reads, independent of how it is split
    across ranks and micro-steps: two runs that read the same data print the same value."""
    indices = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return samples_fingerprint(indices, n_tokens, block_size, seed, mode)


def eval_offsets(n_tokens, block_size, n_windows):
    """A fixed set of windows spread evenly over a split, the same for every run and world
    size, so that evaluation losses are comparable."""
    last = n_tokens - block_size - 1
    return np.linspace(0, last, num=n_windows).round().astype(np.int64)


# ---- 4: windows -> (x, y) ----

def read_xy(token_file, offsets, block_size, vocab_size=None):
    """(x, y) int64 tensors of shape (len(offsets), block_size); y is x shifted by one.
    With vocab_size, ids the model cannot embed are a UserError here rather than a CUDA
    device-side assert later."""
    offsets = np.asarray(offsets, dtype=np.int64)
    windows = tokenfile.read(token_file, offsets, block_size + 1).astype(np.int64)
    if vocab_size is not None and windows.max() >= vocab_size:
        row = int(np.argmax(windows.max(axis=1) >= vocab_size))
        raise UserError(
            f"{token_file.path} holds token id {int(windows[row].max())} in the window at token "
            f"offset {int(offsets[row])}, but the model's vocab_size is {vocab_size}: the file "
            f"was made with another tokenizer, or it is corrupt. Prepare the data with the "
            f"model's tokenizer, or set vocab_size above the largest id.")
    t = torch.from_numpy(windows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def rank_batches(token_file, *, block_size, batch_size, micro_steps, rank, world_size, seed,
                 mode, start_step, device, vocab_size, prefetch=2):
    """This rank's micro-batches, step after step from start_step: yields (x, y) on device.
    The next `prefetch` batches are read in a background thread while the current step runs;
    prefetch=0 reads each batch when it is asked for."""
    pin = torch.device(device).type == "cuda"

    def load(step, micro_step):
        indices = rank_sample_indices(step, micro_step, rank, world_size, batch_size,
                                      micro_steps)
        offsets = sample_offsets(indices, token_file.n_tokens, block_size, seed, mode)
        x, y = read_xy(token_file, offsets, block_size, vocab_size)
        return (x.pin_memory(), y.pin_memory()) if pin else (x, y)

    def on_device(batch):
        x, y = batch
        return x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)

    order = ((s, m) for s in count(start_step) for m in range(micro_steps))
    if not prefetch:
        for s, m in order:
            yield on_device(load(s, m))
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches") as pool:
        pending = deque(pool.submit(load, *next(order)) for _ in range(prefetch))
        while True:
            batch = pending.popleft().result()
            pending.append(pool.submit(load, *next(order)))
            yield on_device(batch)


# ---- the same contract for people with their own loop (or Lightning) ----

class BlockDataset(torch.utils.data.Dataset):
    """Map-style dataset over global sample indices: item i is the window sample_offsets()
    assigns to i. Its length is one epoch of blocks, but any index >= 0 is valid."""

    def __init__(self, token_file, block_size, seed=0, mode="epoch"):
        self.token_file, self.block_size, self.seed, self.mode = \
            token_file, block_size, seed, mode

    def __len__(self):
        return blocks_per_epoch(self.token_file.n_tokens, self.block_size)

    def __getitem__(self, i):
        offsets = sample_offsets([i], self.token_file.n_tokens, self.block_size, self.seed,
                                 self.mode)
        x, y = read_xy(self.token_file, offsets, self.block_size)
        return x[0], y[0]


class RankSampler(torch.utils.data.Sampler):
    """This rank's global sample indices in order, `batch_size` per micro-batch: use it with
    DataLoader(BlockDataset(...), batch_size=batch_size, sampler=RankSampler(...)). Generated
    lazily; unlike DistributedSampler it never builds a list the size of the dataset."""

    def __init__(self, batch_size, rank=0, world_size=1, micro_steps=1, start_step=0,
                 num_steps=None):
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.micro_steps, self.start_step, self.num_steps = micro_steps, start_step, num_steps

    def __len__(self):
        if self.num_steps is None:
            raise TypeError("RankSampler(num_steps=None) is endless and has no length")
        return self.num_steps * self.micro_steps * self.batch_size

    def __iter__(self):
        steps = count(self.start_step) if self.num_steps is None else range(
            self.start_step, self.start_step + self.num_steps)
        for s in steps:
            for m in range(self.micro_steps):
                yield from rank_sample_indices(s, m, self.rank, self.world_size,
                                               self.batch_size, self.micro_steps).tolist()
