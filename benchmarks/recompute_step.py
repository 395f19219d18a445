"""One process of the activation checkpointing benchmark, run once per mode by
benchmarks/recompute.py:

  python -m benchmarks.recompute_step OUT STEPS [train.py's --key=value ...]

Builds the model of those settings and wraps it as train.py does (parallel.wrap, which applies
activation_checkpointing), makes its optimizer (optim.make), and takes optimizer steps as
train.py takes them on random tokens. The second step (the first makes AdamW's state) runs
under torch's MemTracker (torch.distributed._tools.mem_tracker), which sorts every tensor alive
into weights, gradients, optimizer state, activations (what the forward keeps for the
backward, and what a recompute makes again) and temporaries (the backward's own): the bytes of
each at the step's peak; the most activations alive at once, over its snapshots at every
module's boundaries; and from those at the first block's start and the last block's end, the
activations that the blocks' forwards added. The next STEPS are timed without the tracker,
whose bookkeeping on every operation would be timed with them: in seconds, and in the
process's CPU seconds, which other work on a shared machine changes less. Writes OUT (JSON).
"""
import json
import sys
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

from ddpgpt import arch, configurator, optim, parallel, runtime
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig

CPU = torch.device("cpu")


def step(model, optimizer, x):
    loss = model(x, torch.roll(x, -1, 1))[1]  # the logits dropped at once, as train.py does
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tracked_step(model, optimizer, x):
    """One optimizer step under the tracker: {kind of tensor: bytes} at the step's peak (of
    all tensors together), and the most bytes of activations alive at once, and of those the
    blocks' forwards left for the backward."""
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step(model, optimizer, x)
    peak = tracker.get_tracker_snapshot("peak")[CPU]
    by_kind = {getattr(kind, "value", kind): n for kind, n in peak.items()}  # and "Total"
    blocks = model.transformer.h
    before, after = (tracker.memory_tracking[block].snapshots[state][0][CPU][_MemRefType.ACT]
                     for block, state in ((blocks[0], _ModState.PRE_FW),
                                          (blocks[-1], _ModState.POST_FW)))
    return by_kind, most_activations(tracker), after - before


def most_activations(tracker):
    """The most bytes of activations in any of the tracker's snapshots: at each module's
    start and end of forward and backward, and at its peaks."""
    return max(snap[CPU][_MemRefType.ACT] for stats in tracker.memory_tracking.values()
               for snaps in stats.snapshots.values() for snap in snaps if CPU in snap)


def main(out, n_steps, argv):
    cfg = configurator.parse(TrainConfig, argv, "train.py")
    ranks = runtime.ranks()
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**arch.model_args(cfg, None)))
    precision = runtime.precision(cfg.dtype, "cpu")
    model, _, train_model = parallel.wrap(model, cfg, ranks, "cpu", precision)
    optimizer = optim.make(cfg, model, "cpu")
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size))
    step(train_model, optimizer, x)  # AdamW's state made, so the step tracked is any later one
    peak, most, blocks = tracked_step(train_model, optimizer, x)
    wall, cpu = [], []
    for _ in range(n_steps):
        t, c = time.perf_counter(), time.process_time()
        step(train_model, optimizer, x)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    with open(out, "w") as f:
        json.dump({"peak": peak, "activations": most, "blocks": blocks, "step_s": wall,
                   "step_cpu_s": cpu}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
