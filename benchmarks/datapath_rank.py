"""One rank of the data-path benchmark; benchmarks/datapath.py launches it under torchrun:

  torchrun --standalone --nproc_per_node=N -m benchmarks.datapath_rank LOADER DATA_DIR OUT BATCHES

Measures the time from this process's start to its first batch of 12 x 1024 tokens and its
memory then, reads BATCHES batches in all, timing each, measures its memory again and writes
OUT.rank<r>.json. LOADER is what reads the batches: 'ddpgpt' is loader.rank_batches, as train.py
uses it, on DATA_DIR's train split (train.bin, or the shards its meta.json lists), or on a
mixture when DATA_DIR is written as train.py's data_mix ('folder=0.3,folder=0.2,...');
'documents' is the same in sampling='documents' mode, with the split's document index;
'nanogpt' and 'seed' are references written for this comparison (see below), which read
train.bin.
Each loader is (its batches, the number of files it reads), so the result says what was read.
"""
import json
import os
import sys
import time

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddpgpt import loader, sources

BATCH, BLOCK, VOCAB, SEED = 12, 1024, 50304, 1337


def data_sources(data_dir):
    """One folder, or a data_mix string of several, as train.py reads it."""
    return sources.parse_mix(data_dir) if "=" in data_dir else \
        [sources.Source(data_dir, 1.0, "")]


def ddpgpt(data_dir, rank, world, mode="epoch"):
    """train.py's loader without its background thread (prefetch=0), so that a next() times
    making one batch, as it does for (a). With the thread, as in training, a loop that does
    nothing between batches would time two threads passing the interpreter lock back and
    forth; the training part measures what the thread is for, a step's wait for data. The
    data is opened as train.py opens it: a Mixture of each source's train split."""
    train = sources.open_splits(data_sources(data_dir), BLOCK, VOCAB,
                                splits=["train"], mode=mode)["train"]
    return loader.rank_batches(train, block_size=BLOCK, batch_size=BATCH, micro_steps=1,
                               rank=rank, world_size=world, seed=SEED, mode=mode,
                               start_step=0, device="cpu", vocab_size=VOCAB, prefetch=0), \
        sum(len(split.paths) for split in train.splits)


def documents(data_dir, rank, world):
    """ddpgpt's loader in sampling='documents' mode."""
    return ddpgpt(data_dir, rank, world, mode="documents")


def nanogpt(data_dir, rank, world):
    """Reference (a), nanoGPT's way: every batch maps the file afresh (nanoGPT does this so
    that the pages it touched are released) and draws its offsets with torch.randint."""
    return nanogpt_batches(os.path.join(data_dir, "train.bin")), 1


def nanogpt_batches(path):
    while True:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        starts = torch.randint(len(tokens) - BLOCK, (BATCH,)).tolist()
        x = torch.stack([torch.from_numpy(tokens[s:s + BLOCK].astype(np.int64)) for s in starts])
        y = torch.stack([torch.from_numpy(tokens[s + 1:s + 1 + BLOCK].astype(np.int64))
                         for s in starts])
        yield x, y


class EveryOffset(torch.utils.data.Dataset):
    """Reference (b), the seed's dataset: sample i is the window that starts at token i, so
    there are about as many samples as tokens."""

    def __init__(self, path):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")

    def __len__(self):
        return len(self.tokens) - BLOCK

    def __getitem__(self, i):
        window = torch.from_numpy(self.tokens[i:i + BLOCK + 1].astype(np.int64))
        return window[:-1], window[1:]


def seed(data_dir, rank, world):
    """Reference (b) behind a DistributedSampler, whose shuffle builds a permutation of every
    sample index, as a Python list, in every rank, before the first batch."""
    dataset = EveryOffset(os.path.join(data_dir, "train.bin"))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    return iter(DataLoader(dataset, batch_size=BATCH, sampler=sampler)), 1


LOADERS = {"ddpgpt": ddpgpt, "documents": documents, "nanogpt": nanogpt, "seed": seed}


def memory():
    """RSS and its parts, as benchmarks/common.py's tree_memory counts them: private (anonymous)
    memory is this process's own; file pages are the page cache of the mapped token file and
    libraries, which the kernel shares between ranks and can drop."""
    m = psutil.Process().memory_info()
    return {"rss": m.rss, "private": m.rss - m.shared, "file": m.shared}


def main(loader, data_dir, out, n_batches):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # as train.py does, before it opens the data
    t_setup = time.perf_counter()
    batches, files = LOADERS[loader](data_dir, rank, world)
    x, _ = next(batches)
    t_first = time.time()
    setup_s = time.perf_counter() - t_setup
    at_first = memory()
    assert x.shape == (BATCH, BLOCK), x.shape
    latencies = []
    for _ in range(n_batches - 1):
        t = time.perf_counter()
        next(batches)
        latencies.append(time.perf_counter() - t)
    result = {"rank": rank, "files": files, "startup_s": t_first - psutil.Process().create_time(),
              "setup_s": setup_s, "first": at_first, "after": memory(),
              "batches": n_batches, "batches_per_s": len(latencies) / sum(latencies),
              "latency_ms": [t * 1000 for t in latencies]}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
