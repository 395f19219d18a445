"""Run under torchrun by test_data.py: read a few steps of this rank's batches through
loader.rank_batches, as train.py does, and write what was read and the memory it took."""
import json
import os
import sys

import psutil
import torch.distributed as dist

from ddpgpt import data, loader, sources


def main(data_dir, out, block_size, batch_size, micro_steps, start_step, steps, mode):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    train = data.mixture([sources.open_split(data_dir, "train", block_size, mode=mode)])
    batches = loader.rank_batches(train, block_size=block_size, batch_size=batch_size,
                                  micro_steps=micro_steps, rank=rank, world_size=world, seed=7,
                                  mode=mode, start_step=start_step, device="cpu", vocab_size=2**32)
    read, rss_first = [], None
    for step in range(start_step, start_step + steps):
        for micro in range(micro_steps):
            x, y = next(batches)
            if rss_first is None:
                rss_first = psutil.Process().memory_info().rss
            # for a file of tokens 0, 1, 2, ... a window's first token is its offset
            # y is x shifted by one, but for the -1s past a file's end ('documents' mode)
            read.append({"step": step, "micro": micro, "first_tokens": x[:, 0].tolist(),
                         "shift_ok": bool(((x[:, 1:] == y[:, :-1]) | (y[:, :-1] == -1)).all()),
                         "targets": (y != -1).sum(dim=1).tolist()})
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world": world, "rss_first_batch": rss_first, "reads": read}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8]), sys.argv[8])
