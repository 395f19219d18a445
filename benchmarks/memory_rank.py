"""One rank of a measured run for the memory plan's check; tests/test_memplan.py and
benchmarks/memplan.py launch it under torchrun, as train.py is launched (one rank as a plain
process, `python -m benchmarks.memory_rank ...`):

  torchrun --standalone --nproc_per_node=N -m benchmarks.memory_rank OUT [--key=value ...]

It builds and wraps the model of those settings (train.py's) as train.py does, on real
CPU tensors in the real process group, and counts its first two steps with torch's tracker
exactly as the plan does (memplan.tracked_steps). Writes OUT.rank<r>.json: the Plan's fields.
"""
import json
import sys

import torch

from ddpgpt import arch, configurator, launch, memplan, parallel, runtime
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig


def main(out, argv):
    cfg = configurator.parse(TrainConfig, argv, "train.py")
    ranks = runtime.ranks()
    launch.init_distributed("cpu", ranks.world_size, "gloo", cfg.dist_timeout_s)
    torch.manual_seed(cfg.seed)
    args = arch.model_args(cfg, None)
    model = GPT(GPTConfig(**args))
    model, _, train_model = parallel.wrap(model, cfg, ranks, "cpu",
                                          runtime.precision(cfg.dtype, "cpu"))
    measured = memplan.tracked_steps(cfg, model, train_model, ranks, "cpu", args["vocab_size"])
    with open(f"{out}.rank{ranks.rank}.json", "w") as f:
        json.dump(measured._asdict(), f)
    launch.finish(ranks.world_size)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
