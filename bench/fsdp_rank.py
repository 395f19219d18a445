"""One rank of the fsdp benchmark's memory measurement; bench/fsdp.py launches it under torchrun:

  torchrun --standalone --nproc_per_node=N -m bench.fsdp_rank OUT [train.py's --key=value ...]

Builds the model of those settings and shares it out as train.py does (parallel.wrap, with the
run's parallel key), makes its optimizer (optim.make_optimizer), and takes one optimizer step
as train.py takes it on random tokens, one micro-step per rank (so that the gradients are
reduced in its backward): forward and backward, the gradient norm clipped over the ranks
(parallel.clip_grad_norm), the AdamW step. Then it counts the bytes of the tensors this rank
holds: its weights, its gradients (counted before they are freed), its optimizer state, and
the largest of them it holds whole rather than a shard of; and its peak RSS. Writes
OUT.rank<r>.json.
"""
import json
import resource
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ddpgpt import configurator, optim, parallel, runtime, weights
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


def main(out, argv):
    cfg = configurator.parse(TrainConfig, argv, "train.py")
    ranks = runtime.ranks()
    device = runtime.pick_device(cfg.device, ranks)
    runtime.init_distributed(device, ranks.world_size, cfg.backend, cfg.dist_timeout_s)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**weights.model_args(cfg, None)))
    precision = runtime.precision(cfg.dtype, device)
    model, _, train_model = parallel.wrap(model, cfg, ranks, device, precision)
    optimizer = optim.make_optimizer(model, cfg.weight_decay, cfg.learning_rate,
                                     (cfg.beta1, cfg.beta2), runtime.device_type(device))
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size), device=device)
    parallel.sync_gradients(train_model, True)
    with precision.autocast:
        _, loss = train_model(x, torch.roll(x, -1, 1))
    loss.backward()
    parallel.clip_grad_norm(model, cfg.grad_clip)
    params = list(model.parameters())
    grads = count(p.grad for p in params)
    optimizer.step()
    state = count(v for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))
    weights_ = count(params)
    optimizer.zero_grad(set_to_none=True)
    result = {"rank": ranks.rank, "params": sum(p.numel() for p in params),
              "weights": weights_[0], "grads": grads[0], "optimizer": state[0],
              "largest_whole": max(weights_[1], grads[1], state[1]),
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    with open(f"{out}.rank{ranks.rank}.json", "w") as f:
        json.dump(result, f)
    if ranks.world_size > 1:
        dist.barrier()
    runtime.finish(ranks.world_size)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
