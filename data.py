"""Token files on disk and how training reads them.

On-disk format (the only description of it; prepare.py writes it, everything else reads it):
  <data_dir>/train.bin, <data_dir>/val.bin
      Raw little-endian token ids, no header: uint16 when the vocabulary fits in 65,536 ids,
      else uint32. Every document is followed by the tokenizer's end-of-text id. Files made by
      nanoGPT's prepare.py are the same format (uint16).
  <data_dir>/meta.json, written last
      {"format_version": 1, "dtype": "uint16", "vocab_size": 50257, "tokenizer": "gpt2",
       "eot_token": 50256,
       "splits": {"train": {"tokens": N, "documents": D, "max_token_id": M,
                            "fingerprint": "..."}, "val": {...}}}
      "fingerprint" is sampled_fingerprint() of the file: its size and 64 evenly spaced 4 KiB
      chunks, so checking it costs the same for 16 MiB as for 16 GiB.
  A folder with .bin files and no meta.json is read as nanoGPT's raw uint16.

Why the reading side looks the way it does: which window a sample reads is a pure function of
(seed, global sample index). No rank ever builds a list, a permutation or an RNG state whose size
depends on the data, so start-up time and memory do not grow with the file; the ranks' batches
are disjoint slices of one global batch; the global batches are the same for any world size and
gradient-accumulation split; and resuming needs one integer, the number of samples consumed.
The file is opened for each batch, in the process that reads it, and each window is read with
one os.pread: no open file or memmap is ever pickled into a worker, the pages read never pile up
in the resident memory of a long run, and a random window costs one small read. (A memmap would
fault in the disk's whole read-ahead around each window, often 8 MiB for a 2 KiB window: 15 GiB
read for 1,000 cold batches of a 16 GiB file, against a few MiB; see docs/benchmarks.md.)
"""
import functools
import hashlib
import json
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import numpy as np
import torch

FORMAT_VERSION = 1
META_NAME = "meta.json"
SPLITS = ("train", "val")
SAMPLING_MODES = ("epoch", "random")
_FINGERPRINT_CHUNKS, _FINGERPRINT_CHUNK_BYTES = 64, 4096
PREPARE_HINT = "python prepare.py --out_dir={}"


class DataError(Exception):
    """Bad data on disk; the message says which file, what is wrong and how to fix it."""


def token_dtype(vocab_size):
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sampled_fingerprint(path):
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    chunk = min(_FINGERPRINT_CHUNK_BYTES, size)
    with open(path, "rb") as f:
        for i in range(_FINGERPRINT_CHUNKS):
            f.seek((size - chunk) * i // (_FINGERPRINT_CHUNKS - 1))
            h.update(f.read(chunk))
    return h.hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp_path, final_path):
    """Make a completely written file visible under its final name, durably."""
    with open(tmp_path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, final_path)
    fsync_dir(os.path.dirname(os.path.abspath(final_path)))


def write_meta(data_dir, meta):
    path = os.path.join(data_dir, META_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    publish(path + ".tmp", path)


def read_meta(data_dir):
    """meta.json as a dict, or None for a nanoGPT-style folder that has none."""
    path = os.path.join(data_dir, META_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
        meta["dtype"], meta["splits"], meta["vocab_size"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DataError(
            f"{path} is not a valid ddpgpt meta.json ({type(e).__name__}: {e}). It is written "
            f"last by prepare.py, so a damaged one means the folder is incomplete: run "
            f"`{PREPARE_HINT.format(data_dir)}` again.") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version {meta.get('format_version')!r}, this code reads "
            f"{FORMAT_VERSION}: run `{PREPARE_HINT.format(data_dir)}` again.")
    return meta


class TokenFile:
    """One split's token file: its path, dtype and length. It holds no open file, so it pickles
    in a few hundred bytes and works in any process, forked or spawned."""

    def __init__(self, path, dtype, n_tokens, max_token_id=None):
        self.path, self.dtype, self.n_tokens = path, np.dtype(dtype), n_tokens
        self.max_token_id = max_token_id  # from meta.json; None when unknown

    def windows(self, offsets, length):
        """The tokens [o, o + length) for each offset o, as a (len(offsets), length) array."""
        n_bytes = length * self.dtype.itemsize
        fix = f"Restore it, or run `{PREPARE_HINT.format(os.path.dirname(self.path))}` and resume."
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                raw = b"".join([os.pread(fd, n_bytes, o * self.dtype.itemsize)
                                for o in offsets.tolist()])
            finally:
                os.close(fd)
        except OSError as e:
            raise DataError(f"{self.path} could not be read during the run ({e.strerror}). "
                            f"{fix}") from None
        if len(raw) != n_bytes * len(offsets):
            raise DataError(f"{self.path} is shorter than the {self.n_tokens} tokens it held at "
                            f"start-up: it was truncated or replaced during the run. {fix}")
        return np.frombuffer(raw, dtype=self.dtype).reshape(len(offsets), length)


def open_split(data_dir, split, block_size, vocab_size=None, log=print):
    """Check one split on disk and return its TokenFile; every problem is a DataError."""
    meta = read_meta(data_dir)
    path = os.path.join(data_dir, f"{split}.bin")
    hint = PREPARE_HINT.format(data_dir)
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist: make the token files with `{hint}` "
                        f"or set data_dir to a folder that holds train.bin and val.bin.")
    if meta is None:
        log(f"data: {data_dir} has no {META_NAME}; reading {split}.bin as raw uint16 tokens "
            "(nanoGPT's format)")
        dtype, info = np.dtype(np.uint16), {}
    else:
        dtype, info = np.dtype(meta["dtype"]), meta["splits"].get(split, {})
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise DataError(
            f"{path} is {size} bytes, which is not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each): the file is truncated or is not a token file. "
            f"Run `{hint}` again.")
    n_tokens = size // dtype.itemsize
    if "tokens" in info and info["tokens"] != n_tokens:
        raise DataError(
            f"{path} holds {n_tokens} tokens but {META_NAME} says {info['tokens']}: the file "
            f"was truncated, extended or replaced after prepare.py wrote it. Run `{hint}` again.")
    if "fingerprint" in info and info["fingerprint"] != sampled_fingerprint(path):
        raise DataError(
            f"{path} does not match the fingerprint in {META_NAME}: its content changed after "
            f"prepare.py wrote it (a different file of the same size?). Run `{hint}` again.")
    if n_tokens < block_size + 1:
        raise DataError(
            f"{path} holds {n_tokens} tokens, fewer than one block of block_size={block_size} "
            f"plus the shifted target: set block_size to at most {max(n_tokens - 1, 0)} or "
            f"prepare more data for the {split} split.")
    if vocab_size is not None and meta is not None and meta["vocab_size"] > vocab_size:
        raise DataError(
            f"{data_dir} was tokenized with {meta.get('tokenizer')!r}, whose {meta['vocab_size']} "
            f"ids do not fit the model's vocab_size={vocab_size}: use a model with vocab_size "
            f">= {meta['vocab_size']} or data prepared with a smaller vocabulary.")
    return TokenFile(path, dtype, n_tokens, info.get("max_token_id"))


# ---- sampling: pure functions of (seed, global sample index), vectorised, O(1) memory ----

_MASK64 = 0xFFFFFFFFFFFFFFFF
# numpy scalars, not python ints: numpy converts a python operand on every operation, which
# doubles the cost of a hash on the dozen indices of a micro-batch
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(z):
    """splitmix64's finaliser: a well-mixed 64-bit hash of each element of a uint64 array
    (multiplication wraps, as it should)."""
    z = (z ^ (z >> _S1)) * _M1
    z = (z ^ (z >> _S2)) * _M2
    return z ^ (z >> _S3)


@functools.lru_cache(maxsize=1024)
def _key(*parts):
    """A 64-bit key (a python int) from a few integers."""
    h = np.zeros(1, dtype=np.uint64)
    for p in parts:
        h = _mix(h ^ _mix(np.array([int(p) & _MASK64], dtype=np.uint64)))
    return int(h[0])


def _feistel(x, high_bits, low_bits, round_keys):
    """A bijection of [0, 2**(high_bits + low_bits)): each round XORs one half with a keyed hash
    of the other, which can be undone, so any split of the bits works."""
    shift = np.uint64(low_bits)
    high_mask, low_mask = np.uint64((1 << high_bits) - 1), np.uint64((1 << low_bits) - 1)
    high, low = x >> shift, x & low_mask
    for r, k in enumerate(round_keys):
        if r % 2:
            low ^= _mix(high ^ k) & low_mask
        else:
            high ^= _mix(low ^ k) & high_mask
    return (high << shift) | low


def permute(i, n, key):
    """A keyed bijection of [0, n): a Feistel network on the smallest power of two >= n,
    cycle-walked back into range (fewer than 2 rounds on average). Nothing of size n is built."""
    bits = max(2, (n - 1).bit_length())
    low_bits = bits // 2
    round_keys = [np.uint64(_key(key, r)) for r in range(6)]
    out = _feistel(np.asarray(i, dtype=np.uint64), bits - low_bits, low_bits, round_keys)
    outside = out >= n
    while outside.any():
        out[outside] = _feistel(out[outside], bits - low_bits, low_bits, round_keys)
        outside = out >= n
    return out


def blocks_per_epoch(n_tokens, block_size):
    """Non-overlapping blocks read in one epoch. One block is left as slack where the file is
    long enough, so that each epoch can shift block boundaries by any phase in [0, block_size)."""
    whole = (n_tokens - 1) // block_size
    return whole - 1 if whole >= 2 else whole


def sample_offsets(sample_index, n_tokens, block_size, seed, mode):
    """Start offset of the window read for each global sample index.

    'random': uniform offsets with replacement, as nanoGPT samples.
    'epoch': epoch e = index // blocks_per_epoch reads every block once, in an order and with a
    phase shift both drawn from (seed, e)."""
    g = np.asarray(sample_index, dtype=np.int64)
    if mode == "random":
        return (_mix(g.astype(np.uint64) ^ _key(seed, 1)) % (n_tokens - block_size)
                ).astype(np.int64)
    if mode != "epoch":
        raise ValueError(f"sampling mode {mode!r} is not one of {SAMPLING_MODES}")
    n_blocks = blocks_per_epoch(n_tokens, block_size)
    max_phase = min(n_tokens - 1 - n_blocks * block_size, block_size - 1)
    out = np.empty(g.shape, dtype=np.int64)
    epochs = g // n_blocks
    for e in np.unique(epochs):
        here = epochs == e
        block = permute(g[here] % n_blocks, n_blocks, _key(seed, 2, e))
        phase = _key(seed, 3, e) % (max_phase + 1)
        out[here] = phase + block.astype(np.int64) * block_size
    return out


def rank_sample_indices(step, micro_step, rank, world_size, batch_size, micro_steps):
    """Global sample indices of one rank's micro-batch. Global batch `step` is the samples
    [step * G, (step + 1) * G), G = batch_size * world_size * micro_steps, whatever the split."""
    first = (step * micro_steps * world_size + micro_step * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


def global_batch_fingerprint(step, global_batch, n_tokens, block_size, seed, mode):
    """A short hash of which windows global batch `step` reads, independent of how it is split
    across ranks and micro-steps: two runs that read the same data print the same value."""
    g = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    offsets = np.sort(sample_offsets(g, n_tokens, block_size, seed, mode))
    return hashlib.blake2b(offsets.tobytes(), digest_size=8).hexdigest()


def eval_offsets(n_tokens, block_size, count_):
    """A fixed set of windows spread evenly over a split, the same for every run and world
    size, so that evaluation losses are comparable."""
    last = n_tokens - block_size - 1
    return np.linspace(0, last, num=count_).round().astype(np.int64)


def read_windows(tokens, offsets, block_size, vocab_size=None):
    """(x, y) int64 tensors of shape (len(offsets), block_size); y is x shifted by one.
    With vocab_size, ids the model cannot embed are a DataError here rather than a CUDA
    device-side assert later."""
    buf = tokens.windows(np.asarray(offsets, dtype=np.int64), block_size + 1).astype(np.int64)
    if vocab_size is not None and buf.max() >= vocab_size:
        row = int(np.argmax(buf.max(axis=1) >= vocab_size))
        raise DataError(
            f"{tokens.path} holds token id {int(buf[row].max())} in the window at token offset "
            f"{int(offsets[row])}, but the model's vocab_size is {vocab_size}: the file was "
            f"made with another tokenizer, or it is corrupt. Prepare the data with the model's "
            f"tokenizer, or set vocab_size above the largest id.")
    t = torch.from_numpy(buf)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def rank_batches(tokens, *, block_size, batch_size, micro_steps, rank, world_size, seed, mode,
                 start_step, device, vocab_size, prefetch=2):
    """This rank's micro-batches, step after step from start_step: yields (x, y) on device.
    The next `prefetch` batches are read in a background thread while the current step runs;
    prefetch=0 reads each batch when it is asked for."""
    pin = torch.device(device).type == "cuda"

    def load(step, micro):
        g = rank_sample_indices(step, micro, rank, world_size, batch_size, micro_steps)
        offsets = sample_offsets(g, tokens.n_tokens, block_size, seed, mode)
        x, y = read_windows(tokens, offsets, block_size, vocab_size)
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


# ---- the same sampling for people with their own loop (or Lightning) ----

class BlockDataset(torch.utils.data.Dataset):
    """Map-style dataset over global sample indices: item g is the window sample_offsets()
    assigns to g. Its length is one epoch of blocks, but any index >= 0 is valid."""

    def __init__(self, tokens, block_size, seed=0, mode="epoch"):
        self.tokens, self.block_size, self.seed, self.mode = tokens, block_size, seed, mode

    def __len__(self):
        return blocks_per_epoch(self.tokens.n_tokens, self.block_size)

    def __getitem__(self, g):
        offsets = sample_offsets([g], self.tokens.n_tokens, self.block_size, self.seed, self.mode)
        x, y = read_windows(self.tokens, offsets, self.block_size)
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
