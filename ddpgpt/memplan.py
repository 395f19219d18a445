"""The memory plan: what one rank of a run holds at its peak, found before the run by taking its
first two optimizer steps on fake tensors (torch's FakeTensorMode: shapes, no memory) and
counting with torch's own tracker (torch.distributed._tools.mem_tracker.MemTracker, and its
FSDPMemTracker for fully_shard), not with a formula of ours.

The steps are train.py's: the model shared out by parallel.wrap and the optimizer of
optim.make (the code a run uses, so whatever it applies the plan sees), in the run's precision.
Two steps, so the second's backward meets the optimizer state the first made; two micro-steps
at most, the second meeting the gradients the first accumulated (more add nothing). Every block
runs (the peak is not affine in n_layer). What the tracker cannot see, and so the plan leaves
out, is in docs/fsdp.md ("What it leaves out").
"""
import contextlib
import dataclasses
import logging
import math
import shlex
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from ddpgpt import configurator, optim, parallel, runtime
from ddpgpt.errors import UserError
from ddpgpt.model import GPT, GPTConfig

log = logging.getLogger(__name__)

# the share of a GPU's memory a plan may fill: the CUDA context, NCCL's buffers, kernels'
# workspaces and the caching allocator's fragmentation take the rest
GPU_HEADROOM = 0.9
# the tracker's categories (MemTracker's and FSDPMemTracker's names) as the plan reports them;
# what none names (activations, the backward's temporaries, the inputs) is "activations"
WEIGHTS = {"Parameter", "Buffer", "Sharded Param", "Unsharded Param", "All Gather"}
GRADIENTS = {"Gradient", "Sharded Grad", "Unsharded Grad", "Reduce Scatter"}
OPTIMIZER = {"Optstate", "OptState"}
STEPS, MICRO_STEPS = 2, 2
# largest_batch's plans at most, and the largest micro-batch it plans: 2**20 sequences are
# more than any GPU holds, and a batch unbounded overflowed torch.randint's size (1e290GiB)
PLANS, MAX_BATCH = 8, 2**20
# settings that take less memory at the same batch, planned when a run does not fit (fixes)
SHARDING = ({"parallel": "fsdp"}, {"parallel": "fsdp", "reduce_every_micro_step": True})
RECOMPUTING = ({"activation_checkpointing": "selective"}, {"activation_checkpointing": "full"},
               {"activation_checkpointing": "full", "loss_chunks": 8})
PROGRESS_S = 10  # after which a plan (a deep model's) says when each micro-step ended


class Plan(NamedTuple):
    """One rank's bytes at the peak of its first steps, by what holds them."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    peak: int  # the tracker's peak: the sum of the four
    ddp_buckets: int  # DDP's copy of the gradients on several ranks, beside the peak

    @property
    def total(self):
        return self.peak + self.ddp_buckets


def plan(cfg, model_args, world_size, dtype):
    """The Plan of one rank of a run with these settings (cfg: a TrainConfig, its dtype
    resolved) on world_size ranks, on fake tensors. Opens and closes the fake process group
    it needs: the process must not be in another."""
    sharded = parallel.sharded(cfg, runtime.Ranks(0, 0, world_size, world_size))
    ranks = runtime.Ranks(0, 0, world_size, world_size) if sharded else runtime.Ranks(0, 0, 1, 1)
    cfg = dataclasses.replace(cfg, compile=False, dtype=dtype)
    log.info(f"planning {model_args['n_layer']} layers, " + keys({key: getattr(cfg, key) for key in
             ("batch_size", "parallel", "reduce_every_micro_step", "activation_checkpointing",
              "loss_chunks")}))
    from torch._subclasses.fake_tensor import FakeTensorMode
    # small real tensors (DDP's bucket settling batch, the mesh's ranks) become fake as used
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # rank 0 of world_size in the fake group, whatever the model's wrapping: what the step
    # itself exchanges (Muon's owned updates and gather under ddp, muon.py) is then counted
    with fake_ranks(world_size) if world_size > 1 else contextlib.nullcontext():
        with fake, torch.device("cpu"):
            model = GPT(GPTConfig(**model_args))
        # outside the fake mode: a device mesh reads its ranks' values; the weights, fake,
        # stay fake in whatever wrap does to them
        model, _, train_model = parallel.wrap(model, cfg, ranks, "cpu",
                                              runtime.precision(dtype, "cpu"))
        with fake:
            peak = tracked_steps(cfg, model, train_model, ranks, "cpu", model_args["vocab_size"])
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak._replace(ddp_buckets=grads if cfg.parallel == "ddp" and world_size > 1 else 0)


@contextlib.contextmanager
def fake_ranks(world_size):
    """This process as rank 0 of world_size in a process group of torch's 'fake' backend,
    whose collectives move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def tracked_steps(cfg, model, train_model, ranks, device, vocab_size):
    """The Plan of the first steps of a wrapped model, as torch's tracker counts them: on real
    tensors when called on real ones (a measurement), on fake ones inside a FakeTensorMode."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    optimizer = optim.make(cfg, model, device)
    parts = [*optimizer.parts.values()] if isinstance(optimizer, optim.MuonAdamW) else [optimizer]
    if parallel.sharded(cfg, ranks):
        # it follows one optimizer's state (the other's counts as activations), and Muon's
        # momentum is the larger under muon
        tracker = FSDPMemTracker(model, parts[0])
    else:
        tracker = MemTracker()
        tracker.track_external(model, *parts)

    def update_peak(_):  # torch's _update_peak_stats but for its visit of every module's stats
        for device, now in tracker._curr_mem_snap.items():  # at every op: n_layer squared
            if now["Total"] > tracker._peak_mem.get(device, 0):
                tracker._peak_mem[device], tracker._peak_mem_snap[device] = now["Total"], dict(now)
    tracker._update_peak_stats = update_peak
    precision = runtime.precision(cfg.dtype, device)
    micro_steps = min(MICRO_STEPS, cfg.micro_steps(ranks.world_size))
    started = time.monotonic()
    with tracker:
        for step in range(STEPS):
            for micro_step in range(micro_steps):
                parallel.sync_gradients(train_model, micro_step == micro_steps - 1 or
                                        cfg.reduce_every_micro_step)
                x = torch.randint(vocab_size, (cfg.batch_size, cfg.block_size), device=device)
                tracker.reset_mod_stats()  # each forward is a new one to the tracker
                with precision.autocast:
                    _, loss = train_model(x, x)
                (loss / micro_steps).backward()
                if (took := time.monotonic() - started) > PROGRESS_S:
                    log.info(f"  step {step + 1}, micro-step {micro_step + 1}: {took:.0f} s")
            parallel.clip_grad_norm(model, cfg.grad_clip or math.inf)
            optimizer.step()
            optim.average(optimizer, cfg, optim.tail_start(cfg) + step)  # ema_tail: the tail
            optimizer.zero_grad(set_to_none=True)
    return by_kind(next(iter(tracker.get_tracker_snapshot("peak").values())))


def by_kind(snapshot):
    """The Plan of one device's peak snapshot of the tracker."""
    named = {str(getattr(kind, "value", kind)): n for kind, n in snapshot.items()}
    total = named.pop("Total")
    weights, grads, state = (sum(n for name, n in named.items() if name in kinds)
                             for kinds in (WEIGHTS, GRADIENTS, OPTIMIZER))
    return Plan(weights, grads, state, total - weights - grads - state, total, 0)


# ---- what fits ----

class Fit(NamedTuple):
    """A plan against a GPU's memory."""
    room: int  # the bytes a rank may fill: GPU_HEADROOM of the GPU's
    fits: bool
    largest_batch: int  # the largest batch_size planned to fit, 0 when one sequence does not
    over_batch: int  # the smallest planned not to: largest_batch + 1 once found; 0: none was
    fixes: list  # --key=value settings that would make a run that does not fit fit, with why


def fit(cfg, model_args, world_size, dtype, gpu_memory, planned):
    """The Fit of planned (the Plan of cfg) on GPUs of gpu_memory bytes each."""
    room = int(gpu_memory * GPU_HEADROOM)
    largest, over = largest_batch(cfg, model_args, world_size, dtype, room)
    fits = planned.total <= room
    return Fit(room, fits, largest, over,
               [] if fits else fixes(cfg, model_args, world_size, dtype, room, largest))


def largest_batch(cfg, model_args, world_size, dtype, room):
    """(the largest batch_size planned to fit in room bytes, the smallest planned not to),
    each 0 where none was; consecutive once found. The peak grows with the batch as the
    activations do, but not always in proportion from the first sequences on (4 KiB a
    sequence from 1 to 2, then far more, was extrapolated below zero): each next batch is
    where the line through the last two plans reaches room, kept between the two bounds."""
    fits, over, planned, batch = 0, 0, [], 1
    for _ in range(PLANS):
        planned.append((batch, plan(dataclasses.replace(cfg, batch_size=batch), model_args,
                                    world_size, dtype).total))
        fits, over = (batch, over) if planned[-1][1] <= room else (fits, batch)
        top = over - 1 if over else MAX_BATCH
        if fits == top:
            break
        (a, at), (b, bt) = planned[-2:] if len(planned) > 1 else planned * 2
        # where the line through the last two plans reaches room; twice fits without a rising one
        line = b + (room - bt) * (b - a) // (bt - at) if (bt - at) * (b - a) > 0 else 2 * fits
        batch = min(max(fits + 1, line), top)
    return fits, over


def fixes(cfg, model_args, world_size, dtype, room, largest):
    """What would fit, each a (settings, why) pair, of what train.py takes in this dtype: each of
    SHARDING and RECOMPUTING alone at the same batch, or the same global batch in smaller
    micro-batches; else each sharding with each recomputation, then the leanest in smaller ones."""
    def taken(changes):  # not what was planned, nor fsdp on one rank (the same), nor refused
        leaner = dataclasses.replace(cfg, **changes)
        with contextlib.suppress(UserError):  # parallel.check: train.py refuses it (None)
            parallel.check(leaner, dtype)
            return leaner != cfg and not (changes.get("parallel") == "fsdp" and world_size == 1)

    def fitting(group):
        totals = [(changes, plan(dataclasses.replace(cfg, **changes), model_args, world_size,
                                 dtype).total) for changes in group if taken(changes)]
        return [(keys(changes), f"peak {size(total)} per rank") for changes, total in totals
                if total <= room]
    found = fitting(SHARDING + RECOMPUTING) + smaller_batch(cfg, {}, world_size, largest) or \
        fitting([{**s, **r} for s in SHARDING for r in RECOMPUTING if taken(s) and taken(r)])
    leanest = {**SHARDING[-1], **RECOMPUTING[-1]} if taken(SHARDING[-1]) else RECOMPUTING[-1]
    if found or not taken(leanest):
        return found
    lean = dataclasses.replace(cfg, **leanest)
    return smaller_batch(lean, leanest, world_size,
                         largest_batch(lean, model_args, world_size, dtype, room)[0])


def keys(changes):
    return " ".join(f"--{key}={value}" for key, value in changes.items())


def smaller_batch(cfg, changes, world_size, largest):
    """[the fix of cfg (changes made) in the largest micro-batch up to largest, under its own,
    that keeps the global batch whole over the ranks' micro-steps], or [] where none does."""
    for batch in range(min(largest, cfg.batch_size - 1), 0, -1):
        if cfg.global_batch % batch == 0 and (micro := cfg.global_batch // batch) % world_size == 0:
            return [(keys({**changes, "batch_size": batch, "gradient_accumulation_steps": micro}),
                     "the same global batch")]
    return []


def out_of_memory(cfg, world_size, gpu_memory, error):
    """What to say of an out-of-memory error in a run's first steps: that the settings do not
    fit this GPU, and the plan.py command of them (the keys not at their defaults), whose plan
    says what one rank holds and what would fit. The plan is not made here: it takes a
    process group of its own (fake_ranks), and this process is in the run's."""
    first = str(error).strip().splitlines()[0]
    keys = [f"--{f.name}={text(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != f.default]
    command = shlex.join(["python", "plan.py", *keys, f"--world_size={world_size}",
                          f"--gpu_memory={gpu_memory / 2**20:g}MiB"])
    return (f"out of memory in the first steps (torch: {first}): this configuration does not "
            f"fit this GPU (batch_size={cfg.batch_size}, parallel={cfg.parallel}, "
            f"activation_checkpointing={cfg.activation_checkpointing}). Its memory plan says "
            f"what one rank holds at its peak and which settings would fit: {command}")


def text(value):
    """A value as --key=value gives it back (configurator.parse_value): a string that would
    read as a literal is quoted."""
    return repr(value) if isinstance(value, str) and configurator.parse_value(value, str) != \
        value else str(value)


def size(n):
    """Bytes as a reader takes them in: GiB, or MiB below one."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
