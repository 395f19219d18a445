"""Data parallel training: the model as the training steps call it. One rank calls the model
itself; several call it through DistributedDataParallel, whose backward all-reduces the
gradients, so that every rank applies the same update to the same weights.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(forward, ranks, device, batch_shape, autocast):
    """What the steps call: forward (the model, or its compiled form) itself on one rank; on
    several, DDP around it, its gradient buckets settled with a backward of batch_shape whose
    gradients the caller must zero."""
    if ranks.world_size == 1:
        return forward
    trained = DDP(forward, device_ids=[torch.device(device).index]
                  if torch.device(device).type == "cuda" else None)
    settle_gradient_buckets(trained, batch_shape, device, autocast)
    return trained


def settle_gradient_buckets(model, batch_shape, device, autocast):
    """One backward whose gradients are thrown away. DDP's first backward all-reduces every
    gradient as one bucket, and later ones in buckets rebuilt in the order the gradients came;
    with more than two ranks a sum's rounding depends on that layout. So every counted step,
    in a fresh run or after a resume, uses the rebuilt buckets, and a resumed run repeats the
    uninterrupted one bit for bit. (Two tensors, not x twice: torch.compile would guard on
    their being one and compile the graph again at the first real step.)"""
    x = torch.zeros(batch_shape, dtype=torch.long, device=device)
    model.require_backward_grad_sync = True
    with autocast:
        _, loss = model(x, torch.zeros_like(x))
    loss.backward()
