"""Run under torchrun by test_reliability.py: joins the process group as every script does
(launch.init_distributed), imports torch._dynamo afterwards as an optimizer's constructor does,
runs a collective, leaves the group (destroy_process_group, as launch.finish does before it
exits), then writes the names of the threads this process still has to <out>.rank<RANK>.json.
The process group's threads must be gone: one that outlives the group can abort the
interpreter's exit."""
import glob
import json
import sys

import torch

from ddpgpt import launch, runtime

ranks = runtime.ranks()
launch.init_distributed("cpu", ranks.world_size)
import torch._dynamo  # noqa: E402,F401  (what torch.optim's constructors import)

total = torch.ones(3)
torch.distributed.all_reduce(total)
torch.distributed.destroy_process_group()
threads = sorted(open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm"))
with open(f"{sys.argv[1]}.rank{ranks.rank}.json", "w") as f:
    json.dump({"sum": total.tolist(), "threads": threads}, f)
