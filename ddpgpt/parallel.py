"""Data parallel training: the model as the training steps call it, shared out over the ranks
by DistributedDataParallel (parallel=ddp) or FSDP2 (parallel=fsdp: fully_shard on each block
and on the root); docs/fsdp.md says what each holds and costs. One rank trains the model itself,
either way. What the training step does differently under each is here: which micro-step
reduces the gradients (sync_gradients), the gradient norm over sharded gradients
(clip_grad_norm), and whether the weights are finite (all_finite)."""
import sys
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgpt import recompute, runtime
from ddpgpt.errors import UserError


def sharded(cfg, ranks):
    """Is the model sharded over the ranks? parallel=fsdp on more than one."""
    return cfg.parallel == "fsdp" and ranks.world_size > 1


def check(cfg, dtype):
    """What fsdp cannot train in: float16 (dtype, what cfg.dtype is on this device), asked for
    or what dtype='auto' is on a GPU without bfloat16 (V100, T4). Checked here alone, where
    the device says what 'auto' is."""
    if cfg.parallel == "fsdp" and dtype == "float16":
        what = "dtype='float16'" if cfg.dtype == "float16" else \
            f"dtype={cfg.dtype!r} is float16 on this GPU"
        raise UserError(f"parallel='fsdp' does not train in float16 ({what}): float16 needs a "
                        f"gradient scaler, which the sharded gradients do not have here. Use "
                        f"dtype='bfloat16' on a GPU that has it (A100, H100 and later), "
                        f"dtype='float32', or parallel='ddp'.")


class Wrapped(NamedTuple):
    """One set of weights, three handles: `model` owns them (the optimizer, checkpoints,
    clipping, HellaSwag); `eval_model` is what the losses' evaluation calls; `train_model` is
    what the training steps call. Under fsdp all three are the sharded model itself."""
    model: torch.nn.Module
    eval_model: Callable
    train_model: Callable


def wrap(model, cfg, ranks, device, precision):
    """The model of a run on its device, as the run's parallel key shares it out, compiled with
    compile=True (the whole model under ddp; each block under fsdp, whose gathers run between them),
    each block recomputing in its backward what activation_checkpointing says (recompute.py, before
    fsdp and compile wrap the blocks, as torchtitan orders them). Its gradients are None."""
    recompute.apply(model, cfg.activation_checkpointing, cfg.loss_chunks)
    if sharded(cfg, ranks):
        shard(model, device, precision.dtype, cfg.reshard_after_forward, cfg.compile)
        return Wrapped(model, model, model)
    if next(model.parameters()).device != torch.device(device):
        # (the memory plan's fake weights, made on the device, cannot be moved: torch swaps a
        # FakeTensor parameter for its copy, which the fake mode's weak references forbid)
        model.to(device)
    # under DDP the losses' evaluation calls the compiled model itself, beneath DDP, which
    # averages gradients that evaluation does not make: so ranks may run different numbers of
    # evaluation batches
    eval_model = torch.compile(model) if cfg.compile else model
    train_model = eval_model
    if ranks.world_size > 1:
        train_model = DDP(eval_model, device_ids=[torch.device(device).index]
                          if runtime.device_type(device) == "cuda" else None)
        settle_gradient_buckets(train_model, (cfg.batch_size, cfg.block_size), device,
                                precision.autocast)
        model.zero_grad(set_to_none=True)
    return Wrapped(model, eval_model, train_model)


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


def shard(model, device, dtype, reshard_after_forward, compile):
    """fully_shard each block, then the root (the embeddings, the final LayerNorm and the tied
    output layer), in place: each rank keeps its shard of every weight, on the device. The
    weights keep their names, so checkpoints hold the same keys as under ddp."""
    from torch.distributed.device_mesh import init_device_mesh  # see is_dtensor()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(runtime.device_type(device), (dist.get_world_size(),))
    # bfloat16 gathers and matmuls; float32 gradient sums and master weights. The embeddings'
    # output, gathered in bfloat16, makes the residual stream bfloat16 (float32 under ddp's
    # autocast), as torchtitan has it: half the activations' memory, which is what fsdp is
    # for (docs/fsdp.md). autocast still wraps the forward: LayerNorm, softmax and the loss in
    # float32, as under ddp
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == "bfloat16" else MixedPrecisionPolicy()
    for block in model.transformer.h:
        if compile:
            block.compile()  # in place, so the weights keep their names
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # the root at FSDP2's default (None; a bool reshards it), which keeps its weights gathered
    # from the forward into the backward, which begins with the output layer (and after an
    # evaluation's forward, which has no backward: sync_gradients knows fsdp by the module)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def sync_gradients(train_model, sync):
    """Whether the next backward reduces the gradients over the ranks. nanoGPT's note holds:
    DDP's model.no_sync() is the official way, but it bloats the code."""
    if isinstance(train_model, DDP):
        train_model.require_backward_grad_sync = sync
    elif hasattr(train_model, "set_requires_gradient_sync"):  # an FSDPModule: see shard()
        train_model.set_requires_gradient_sync(sync)


def clip_grad_norm(model, max_norm):
    """Scale the gradients down to a norm of max_norm where it is more (math.inf: never); their
    norm before, a tensor on the device that is the same on every rank. Under fsdp each rank
    holds a shard of each gradient: the norm of the whole takes a small all-reduce, on the
    device, as torchtitan computes it."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    norm = norm.full_tensor() if is_dtensor(norm) else norm
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def all_finite(model):
    """Are all the weights finite? The same answer on every rank: under fsdp each rank holds a
    shard of each weight, and would otherwise answer for its shard alone."""
    params = list(model.parameters())
    finite = torch.stack([local(p).isfinite().all() for p in params]).all().float()
    if is_dtensor(params[0]):
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite)


def local(t):
    """This rank's part of t: its local shard of a DTensor, else t."""
    return t.to_local() if is_dtensor(t) else t


def is_dtensor(t):
    """isinstance(t, DTensor), without importing torch.distributed.tensor: that import (and
    FSDP's and DCP's, which make it) takes 1-2 s, a third of every process's start-up, and a
    DTensor exists only once shard() has imported it."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)
