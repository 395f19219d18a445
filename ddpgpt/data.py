"""Which tokens each rank reads, step after step. The whole contract:

  1. Global batch `step` is the global samples [step * G, (step + 1) * G), where
     G = batch_size * gradient_accumulation_steps, whatever the world size.
  2. Rank r's micro-step m reads B = batch_size of them, starting at
     ((step * M + m) * W + r) * B, with W ranks of M micro-steps each (M * W fixed).
  3. Sample i comes from source s(i) of the mixture and is that source's sample j(i); with
     one source (the plain case) s = 0 and j = i. Of every MIX_BLOCK samples, a fixed number
     come from each source, as its weight says, in slots drawn from (seed, block).
  4. A source's sample j reads the window that starts at token offset sample_offsets(j): a
     pure function of (seed, j) and the split's file sizes. 'epoch' mode reads every block of
     the split once per epoch, in an order and at a phase drawn from (seed, epoch); 'random'
     draws windows uniformly, as nanoGPT. A split of many shards is one token space
     (tokenfile.py), and no window crosses from one shard into the next.
  5. The window at offset o gives x = tokens[o : o + T] and y = tokens[o + 1 : o + T + 1].

So no rank builds anything whose size depends on the data (start-up and memory do not grow
with it), the ranks read disjoint slices of one global batch, any world size reads the same
global batches, and resuming needs one integer: the number of samples consumed. The token
files themselves are tokenfile.py's.
"""
import functools
import hashlib
import operator
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from typing import NamedTuple

import numpy as np
import torch

from ddpgpt import tokenfile
from ddpgpt.errors import UserError

SAMPLING_MODES = ("epoch", "random")


# ---- points 1 and 2: global sample indices ----

def rank_sample_indices(step, micro_step, rank, world_size, batch_size, micro_steps):
    """Global sample indices of one rank's micro-batch (contract, point 2)."""
    first = ((step * micro_steps + micro_step) * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


# ---- keyed hashes and permutations, O(1) memory: the tools of points 3 and 4 ----

# numpy scalars, not python ints: numpy converts a python operand on every operation, which
# doubles the cost of a hash on the dozen indices of a micro-batch
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


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


def feistel(x, high_bits, low_bits, round_keys):
    """A bijection of [0, 2**(high_bits + low_bits)): each round XORs one half with a keyed hash
    of the other, which can be undone, so any split of the bits works."""
    shift = np.uint64(low_bits)
    high_mask, low_mask = np.uint64((1 << high_bits) - 1), np.uint64((1 << low_bits) - 1)
    high, low = x >> shift, x & low_mask
    for r, k in enumerate(round_keys):
        if r % 2:
            low ^= hash64(high ^ k) & low_mask
        else:
            high ^= hash64(low ^ k) & high_mask
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


def locate(i, counts):
    """(file, index within that file) of item i of a sequence that is `counts[k]` items of each
    file k in turn: a binary search in the cumulative counts, nothing per item."""
    ends = np.cumsum(counts)
    k = np.searchsorted(ends, i, side="right")
    return k, i - (ends[k] - counts[k])


# ---- point 3: mixtures, the source each global sample comes from ----

MIX_BLOCK = 2**20  # the weights hold exactly over every MIX_BLOCK consecutive samples


class Mixture(NamedTuple):
    """The sources of one split's samples: each source's TokenSplit, how many of every
    MIX_BLOCK consecutive samples come from it, and its name in metrics."""
    splits: tuple
    counts: tuple
    names: tuple

    @property
    def weights(self):
        return [c / MIX_BLOCK for c in self.counts]


def mixture(splits, weights=(1.0,), names=("",)):
    """A Mixture with these weights (shares of the samples), rounded to whole samples per
    MIX_BLOCK by largest remainder; one split alone is the plain case."""
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.max()  # first: the sum of weights near 1e308 would overflow
    exact = shares / shares.sum() * MIX_BLOCK
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[:MIX_BLOCK - counts.sum()]] += 1
    if not counts.all():
        raise UserError(f"a data_mix weight below 1/{MIX_BLOCK:,} of the total gets no samples "
                        f"(weights {', '.join(map(str, weights))}): raise it or leave the "
                        f"source out.")
    return Mixture(tuple(splits), tuple(counts.tolist()), tuple(names))


def source_indices(sample_indices, mix, seed):
    """(source, index among that source's samples) of each global sample. In block b of
    MIX_BLOCK samples, source s takes counts[s] slots, drawn from (seed, b), and its samples
    b * counts[s] onwards: so each source reads its own samples in order, every block of it
    once per its own epoch, and a source sampled less reaches its epoch boundary later."""
    indices = np.asarray(sample_indices, dtype=np.int64)
    if len(mix.counts) == 1:
        return np.zeros_like(indices), indices
    blocks, slots = indices // MIX_BLOCK, np.empty_like(indices)
    for block in np.unique(blocks):
        here = blocks == block
        slots[here] = permute(indices[here] % MIX_BLOCK, MIX_BLOCK, hash_key(seed, 4, block))
    counts = np.asarray(mix.counts, dtype=np.int64)
    source, rank = locate(slots, counts)
    return source, blocks * counts[source] + rank


def sample_windows(sample_indices, mix, block_size, seed, mode):
    """(source, window offset in that source's split) of each global sample (points 3, 4)."""
    source, local = source_indices(sample_indices, mix, seed)
    offsets = np.empty_like(local)
    for s in np.unique(source).tolist():
        here = source == s
        offsets[here] = sample_offsets(local[here], mix.splits[s].starts, block_size, seed,
                                       mode)
    return source, offsets


def samples_fingerprint(sample_indices, mix, block_size, seed, mode):
    """A short hash of which windows a set of global samples reads, in any order: a loader
    that reports the indices it read (examples/lightning_datamodule.py) hashes them here."""
    source, offsets = sample_windows(sample_indices, mix, block_size, seed, mode)
    return hashlib.blake2b(np.sort(offsets + (source << 48)).tobytes(),
                           digest_size=8).hexdigest()


def global_batch_fingerprint(step, global_batch, mix, block_size, seed, mode):
    """samples_fingerprint of global batch `step`, independent of how it is split across
    ranks and micro-steps: two runs that read the same data print the same value."""
    indices = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return samples_fingerprint(indices, mix, block_size, seed, mode)


# ---- point 4: a source's sample -> its window offset ----

def blocks_per_epoch(n_tokens, block_size):
    """Non-overlapping blocks read in one epoch of a file of n_tokens (an int or an array of
    them). One block is left as slack where the file is long enough, so that each epoch can
    shift block boundaries by any phase in [0, block_size)."""
    whole = np.maximum((np.asarray(n_tokens) - 1) // block_size, 0)
    return np.where(whole >= 2, whole - 1, whole)


def check_mode(mode):
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode {mode!r} is not one of {SAMPLING_MODES}")


def sample_offsets(sample_indices, starts, block_size, seed, mode):
    """The start offset of the window each sample index of a split reads (contract, point 4).
    starts: where each file of the split begins in its token space, and its end (TokenSplit)."""
    check_mode(mode)
    indices = np.asarray(sample_indices, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    sizes = np.diff(starts)
    if mode == "random":  # any window inside a file, each as likely
        windows = np.maximum(sizes - block_size, 0)
        k, local = locate(hash64(indices.astype(np.uint64) ^ hash_key(seed, 1))
                          % np.uint64(windows.sum()), windows)
        return starts[k] + local.astype(np.int64)
    blocks = blocks_per_epoch(sizes, block_size)
    n_blocks = int(blocks.sum())
    slack = np.clip(sizes - 1 - blocks * block_size, 0, block_size - 1)  # 0 for a file too short
    max_phase = slack.astype(np.uint64)
    out = np.empty(indices.shape, dtype=np.int64)
    epochs = indices // n_blocks
    for epoch in np.unique(epochs):
        here = epochs == epoch
        k, block = locate(permute(indices[here] % n_blocks, n_blocks, hash_key(seed, 2, epoch)),
                          blocks)
        phase = np.uint64(hash_key(seed, 3, epoch)) % (max_phase[k] + np.uint64(1))
        out[here] = starts[k] + phase.astype(np.int64) + block.astype(np.int64) * block_size
    return out


def eval_offsets(starts, block_size, n_windows):
    """A fixed set of windows spread evenly over a split, the same for every run and world
    size, so that evaluation losses are comparable."""
    starts = np.asarray(starts, dtype=np.int64)
    windows = np.maximum(np.diff(starts) - block_size, 0)
    spread = np.linspace(0, windows.sum() - 1, num=n_windows).round().astype(np.int64)
    k, local = locate(spread, windows)
    return starts[k] + local


# ---- point 5: windows -> (x, y) ----

def read_xy(token_split, offsets, block_size, vocab_size=None):
    """(x, y) int64 tensors of shape (len(offsets), block_size); y is x shifted by one.
    With vocab_size, ids the model cannot embed are a UserError here rather than a CUDA
    device-side assert later."""
    offsets = np.asarray(offsets, dtype=np.int64)
    windows = tokenfile.read(token_split, offsets, block_size + 1).astype(np.int64)
    if vocab_size is not None and windows.max() >= vocab_size:
        row = int(np.argmax(windows.max(axis=1) >= vocab_size))
        k = int(np.searchsorted(token_split.starts, offsets[row], side="right")) - 1
        raise UserError(
            f"{token_split.paths[k]} holds token id {int(windows[row].max())} in the window at "
            f"token offset {int(offsets[row] - token_split.starts[k])}, but the model's "
            f"vocab_size is {vocab_size}: the file was made with another tokenizer, or it is "
            f"corrupt. Prepare the data with the model's tokenizer, or set vocab_size above "
            f"the largest id.")
    t = torch.from_numpy(windows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def read_mixture_xy(mix, source, offsets, block_size, vocab_size=None):
    """read_xy for windows of several sources, in the order given."""
    if len(mix.splits) == 1:
        return read_xy(mix.splits[0], offsets, block_size, vocab_size)
    x = torch.empty((len(offsets), block_size), dtype=torch.long)
    y = torch.empty_like(x)
    for s in np.unique(source).tolist():
        here = torch.from_numpy(np.flatnonzero(source == s))
        xs, ys = read_xy(mix.splits[s], offsets[source == s], block_size, vocab_size)
        # index_copy_, not x[here] = xs: with several threads, that indexing costs 100x more
        x.index_copy_(0, here, xs)
        y.index_copy_(0, here, ys)
    return x, y


def rank_batches(mix, *, block_size, batch_size, micro_steps, rank, world_size, seed,
                 mode, start_step, device, vocab_size, prefetch=2):
    """This rank's micro-batches, step after step from start_step: yields (x, y) on device.
    The next `prefetch` batches are read in a background thread while the current step runs;
    prefetch=0 reads each batch when it is asked for."""
    pin = torch.device(device).type == "cuda"

    def load(step, micro_step):
        indices = rank_sample_indices(step, micro_step, rank, world_size, batch_size,
                                      micro_steps)
        source, offsets = sample_windows(indices, mix, block_size, seed, mode)
        x, y = read_mixture_xy(mix, source, offsets, block_size, vocab_size)
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

MAX_INDEX = 2**63 - 1  # sample indices are int64


def check_int(name, value, minimum=None, maximum=None):
    """value as an int: TypeError if it is no integer (a float is not silently truncated),
    ValueError outside [minimum, maximum]. Every argument is checked when the object is made,
    because a bad one loops forever (batch_size=0) or reads the wrong data without a word."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}") from None
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value} must be {bounds}")
    return value


class BlockDataset(torch.utils.data.Dataset):
    """Map-style dataset over global sample indices: item i is the window sample_offsets()
    assigns to i. Its length is one epoch of blocks; every index from 0 to MAX_INDEX is valid,
    later epochs beyond len(). A negative index is an IndexError, not counted from the end:
    there is no end, and wrapping into epoch 0 would hide an off-by-one."""

    def __init__(self, token_split, block_size, seed=0, mode="epoch"):
        if not isinstance(token_split, tokenfile.TokenSplit):
            raise TypeError(f"BlockDataset takes a tokenfile.TokenSplit, such as "
                            f"tokenfile.open_split(data_dir, 'train', block_size), not a "
                            f"{type(token_split).__name__}")
        self.token_split = token_split
        self.block_size = check_int("block_size", block_size, 1)
        self.seed = check_int("seed", seed)
        check_mode(mode)
        self.mode = mode
        tokenfile.check_block_size(token_split, self.block_size)

    def __len__(self):
        return int(blocks_per_epoch(np.diff(self.token_split.starts), self.block_size).sum())

    def __getitem__(self, i):
        i = operator.index(i)  # TypeError for a float or a str, as a list's indexing
        if not 0 <= i <= MAX_INDEX:
            raise IndexError(f"BlockDataset index {i} is out of range: indices are global sample "
                             f"numbers from 0 to 2**63 - 1 (len() is one epoch, later indices "
                             f"are later epochs); negative ones do not count from the end")
        offsets = sample_offsets([i], self.token_split.starts, self.block_size, self.seed,
                                 self.mode)
        x, y = read_xy(self.token_split, offsets, self.block_size)
        return x[0], y[0]


class RankSampler(torch.utils.data.Sampler):
    """This rank's global sample indices in order, `batch_size` per micro-batch: use it with
    DataLoader(BlockDataset(...), batch_size=batch_size, sampler=RankSampler(...)). Generated
    lazily; unlike DistributedSampler it never builds a list the size of the dataset."""

    def __init__(self, batch_size, rank=0, world_size=1, micro_steps=1, start_step=0,
                 num_steps=None):
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0, self.world_size - 1)
        self.micro_steps = check_int("micro_steps", micro_steps, 1)
        self.start_step = check_int("start_step", start_step, 0)
        self.num_steps = None if num_steps is None else check_int("num_steps", num_steps, 0)

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
