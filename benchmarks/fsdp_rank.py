"""One rank of the fsdp and muon benchmarks' measurements; benchmarks/fsdp.py and benchmarks/muon.py
launch it under torchrun (one rank as a plain process, `python -m benchmarks.fsdp_rank ...`):

  torchrun --standalone --nproc_per_node=N -m benchmarks.fsdp_rank OUT [train.py's --key=value ...]

Builds the model of those settings and shares it out as train.py does (parallel.wrap, with the
run's parallel key), makes its optimizer (optim.make: AdamW, or Muon and AdamW), and takes
max_iters optimizer steps as train.py takes them on random tokens, one micro-step per rank (so
that the gradients are reduced in its backward): forward and backward, the gradient norm
clipped over the ranks (parallel.clip_grad_norm), the optimizer's step. After the first it
counts the bytes of the tensors this rank holds: its weights, its gradients (counted before
they are freed), its optimizer state, and the largest of them it holds whole rather than a
shard of; and at the end its peak RSS. Each step and its optimizer step are timed (a CPU's
clock: the part runs on CPUs). Writes OUT.rank<r>.json.
"""
import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ddpgpt import arch, configurator, launch, optim, parallel, runtime
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig


def held(t):
    """(bytes this rank holds of t, whether it holds all of t)."""
    if isinstance(t, DTensor):
        local = t.to_local()
        whole = all(isinstance(p, Replicate) for p in t.placements)
    else:
        local, whole = t, True
    return local.numel() * local.element_size(), whole


def count(tensors):
    """(bytes held, the largest tensor held whole, in bytes)."""
    total = largest = 0
    for t in tensors:
        n, whole = held(t)
        total += n
        largest = max(largest, n if whole else 0)
    return total, largest


def build(argv):
    """train.py's model for its settings argv, shared out as train.py does, and its optimizer:
    (cfg, ranks, device, precision, model, the model to call, optimizer)."""
    cfg = configurator.parse(TrainConfig, argv, "train.py")
    ranks = runtime.ranks()
    device = runtime.pick_device(cfg.device, ranks)
    launch.init_distributed(device, ranks.world_size, cfg.backend, cfg.dist_timeout_s)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**arch.model_args(cfg, None)))
    precision = runtime.precision(cfg.dtype, device)
    model, _, train_model = parallel.wrap(model, cfg, ranks, device, precision)
    optimizer = optim.make(cfg, model, runtime.device_type(device))
    return cfg, ranks, device, precision, model, train_model, optimizer


def state_tensors(optimizer):
    """The tensors of optimizer's state: AdamW's, or Muon's and AdamW's (optim.MuonAdamW)."""
    parts = optimizer.parts.values() if isinstance(optimizer, optim.MuonAdamW) else [optimizer]
    return [v for part in parts for s in part.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]


def main(out, argv):
    cfg, ranks, device, precision, model, train_model, optimizer = build(argv)
    params = list(model.parameters())
    step_ms, optimizer_ms = [], []
    for _ in range(cfg.max_iters):
        t0 = time.perf_counter()
        x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size), device=device)
        parallel.sync_gradients(train_model, True)
        with precision.autocast:
            _, loss = train_model(x, torch.roll(x, -1, 1))
        loss.backward()
        parallel.clip_grad_norm(model, cfg.grad_clip)  # its all-reduce lines the ranks up
        if not step_ms:  # the first step's, before they are freed
            grads = count(p.grad for p in params)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer_ms.append((time.perf_counter() - t1) * 1000)
        step_ms.append((time.perf_counter() - t0) * 1000)
        if len(step_ms) == 1:
            state, weights_ = count(state_tensors(optimizer)), count(params)
        optimizer.zero_grad(set_to_none=True)
    result = {"rank": ranks.rank, "params": sum(p.numel() for p in params),
              "weights": weights_[0], "grads": grads[0], "optimizer": state[0],
              "largest_whole": max(weights_[1], grads[1], state[1]),
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "step_ms": step_ms, "optimizer_ms": optimizer_ms}
    with open(f"{out}.rank{ranks.rank}.json", "w") as f:
        json.dump(result, f)
    if ranks.world_size > 1:
        dist.barrier()
    launch.finish(ranks.world_size)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
