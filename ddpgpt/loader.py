"""This rank's batches as tensors, of the windows that data.py's contract says it reads: for
train.py, rank_batches, which reads ahead in a thread of its own and hands each batch to the
device; for a DataLoader (your own loop, or Lightning), BlockDataset over the global sample
indices and RankSampler, which yields this rank's indices of each global batch."""
import operator
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import numpy as np
import torch

from ddpgpt import data, runtime, tokenfile

READER = "batches"  # rank_batches' reader thread's name, by which the hang watchdog finds it


def rank_batches(mix, *, block_size, batch_size, micro_steps, rank, world_size, seed,
                 mode, start_step, device, vocab_size, prefetch=2):
    """This rank's micro-batches, step after step from start_step: yields (x, y) on device.
    The next `prefetch` batches are read in a background thread while the current step runs;
    prefetch=0 reads each batch when it is asked for."""
    mix = data.with_windows(mix, block_size, mode)
    pin = runtime.device_type(device) == "cuda"
    planned = data.rank_windows(mix, block_size, batch_size, micro_steps, rank, world_size,
                                seed, mode, start_step)

    def load():  # in one thread at a time, in order: the reader's, or this one's
        source, offsets = next(planned)
        x, y = map(torch.from_numpy, data.read_mixture_xy(mix, source, offsets, block_size,
                                                          vocab_size))
        return (x.pin_memory(), y.pin_memory()) if pin else (x, y)

    def on_device(batch):  # load() pinned it for a GPU already: to_device only copies
        return tuple(runtime.to_device(t, device) for t in batch)

    if not prefetch:
        while True:
            yield on_device(load())
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=READER,
                            initializer=runtime.on_device(device)) as pool:
        pending = deque(pool.submit(load) for _ in range(prefetch))
        while True:
            batch = pending.popleft().result()
            pending.append(pool.submit(load))
            yield on_device(batch)


# ---- for a DataLoader: your own loop's, or Lightning's ----

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
    """Map-style dataset over global sample indices: item i is the window that sample i reads
    (point 4). Its length is one epoch of blocks ('documents': of starts); every index from 0
    to MAX_INDEX is valid, later epochs beyond len(). A negative index is an IndexError, not
    counted from the end: there is no end, and wrapping into epoch 0 would hide an off-by-one.
    'documents' mode needs the split opened with its index (sources.open_split)."""

    def __init__(self, token_split, block_size, seed=0, mode="epoch"):
        if not isinstance(token_split, tokenfile.TokenSplit):
            raise TypeError(f"BlockDataset takes a tokenfile.TokenSplit, such as "
                            f"tokenfile.open_split(data_dir, 'train', block_size), not a "
                            f"{type(token_split).__name__}")
        self.token_split = token_split
        self.block_size = check_int("block_size", block_size, 1)
        self.seed = check_int("seed", seed)
        data.check_mode(mode)
        if mode == "documents" and token_split.docs is None:
            raise ValueError("BlockDataset(mode='documents') reads the split's document index: "
                             "open the split with sources.open_split(data_dir, 'train', "
                             "block_size, mode='documents')")
        self.mode = mode
        tokenfile.check_block_size(token_split, self.block_size)
        self._windows = None  # made in each process that reads, once (windows())

    def __getstate__(self):  # pickles small: each worker makes the tables again
        return {**self.__dict__, "_windows": None}

    def windows(self):
        if self._windows is None:
            self._windows = data.windows(data.mixture([self.token_split]), self.block_size,
                                         self.mode)
        return self._windows

    def __len__(self):
        if self.mode == "random":  # an epoch of blocks, as many samples as 'epoch' has
            return int(data.blocks_per_epoch(np.diff(self.token_split.starts),
                                             self.block_size).sum())
        return int(self.windows().n[0])

    def __getitem__(self, i):
        i = operator.index(i)  # TypeError for a float or a str, as a list's indexing
        if not 0 <= i <= MAX_INDEX:
            raise IndexError(f"BlockDataset index {i} is out of range: indices are global sample "
                             f"numbers from 0 to 2**63 - 1 (len() is one epoch, later indices "
                             f"are later epochs); negative ones do not count from the end")
        offsets = data.window_offsets([0], [i], self.windows(), self.seed)
        x, y = data.read_xy(self.token_split, offsets, self.block_size)
        return torch.from_numpy(x[0]), torch.from_numpy(y[0])


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
                yield from data.rank_sample_indices(s, m, self.rank, self.world_size,
                                                    self.batch_size, self.micro_steps).tolist()
