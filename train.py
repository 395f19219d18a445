"""Train a GPT with DistributedDataParallel, on one process or many.

  python train.py config/quickstart.py                       # one process, CPU or one GPU
  torchrun --standalone --nproc_per_node=8 train.py config/owt.py --batch_size=16
  srun python train.py config/owt.py                         # one SLURM task per GPU

Every key, its default and its type is in TrainConfig below; config files and --key=value
arguments override them (configurator.py). The data position is a number of global samples
(data.py), so a run resumes exactly, also on another world size with the same global batch.

The file reads top to bottom: the configuration; the learning rate and evaluation; one
optimizer step; what a run reports (metrics.jsonl, wandb, checkpoints); then main(), which
starts the run (startup.py: the device, the checkpoint or weights, the data, all checked on
every rank before any step), and the training loop.
"""
import contextlib
import dataclasses
import json
import math
import os
import resource
import secrets
import statistics
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import configurator
import data
import errors
import fileio
import hellaswag
import hf
import startup
import watchdog
from errors import UserError


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200  # evaluation reads eval_iters * batch_size fixed windows per split
    eval_only: bool = False
    always_save_checkpoint: bool = True  # else only when val loss improves (and at the end)
    # scratch, resume, auto (resume if possible), or GPT-2's weights to start from: gpt2,
    # gpt2-medium, gpt2-large, gpt2-xl or a Hugging Face GPT-2 folder (hf.py)
    init_from: str = "scratch"
    keep_checkpoints: int = 3
    # HellaSwag at the evaluations whose iter is a multiple of this (0: never), on all ranks
    hellaswag_interval: int = 0
    hellaswag_path: str = ""  # its validation file; '' for the cached copy, downloaded once
    # wandb
    wandb_log: bool = False
    wandb_project: str = "ddpgpt"
    wandb_run_name: str = "gpt2"
    # data
    data_dir: str = "data/openwebtext"
    data_mix: str = ""  # 'data/web=0.7,data/code=0.3': sources and their shares of the samples
    allow_data_change: bool = False  # resume on other data than the checkpoint's
    sampling: Literal["epoch", "random"] = "epoch"  # epoch: every block once; random: nanoGPT's
    gradient_accumulation_steps: int = 5 * 8  # global: divided by the world size
    batch_size: int = 12  # per rank and micro-step
    block_size: int = 1024
    # model
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    vocab_size: int = 0  # 0: the data's vocabulary rounded up to a multiple of 64
    # AdamW and its schedule
    learning_rate: float = 6e-4
    max_iters: int = 600000
    weight_decay: float = 1e-1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    decay_lr: bool = True
    lr_schedule: Literal["cosine", "wsd"] = "cosine"  # wsd: warm-up, stable, then a cooldown
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000  # cosine: where it reaches min_lr
    cooldown_frac: float = 0.2  # wsd: the last share of max_iters, decaying as 1 - sqrt
    min_lr: float = 6e-5
    nan_policy: Literal["stop", "skip"] = "stop"  # on a non-finite loss or gradient
    spike_policy: Literal["off", "skip"] = "off"  # skip: a step whose loss or gradient norm
    spike_zscore: float = 6.0  # is this many standard deviations above the last 100 steps
    # system
    backend: Literal["", "nccl", "gloo"] = ""  # '' picks nccl on CUDA, gloo on CPU
    device: str = "auto"  # 'auto' and 'cuda': cuda:<local rank> when CUDA is there, else cpu
    dtype: startup.Dtype = "auto"  # auto: bfloat16 on CUDA that has it, else float16; CPU: float32
    compile: bool = False
    dist_timeout_s: int = 600  # how long a collective may wait before the run fails
    # no step for max(hang_timeout_s, 10 x the median step): each rank's stacks, then exit;
    # startup_timeout_s until the first step completes. 0: off. (watchdog.py)
    hang_timeout_s: int = 300
    startup_timeout_s: int = 1800
    seed: int = 1337


# the ranges the types cannot say (the configurator checks the types and the choices)
AT_LEAST = {**dict.fromkeys(("batch_size", "block_size", "gradient_accumulation_steps",
                             "eval_iters", "eval_interval", "log_interval", "keep_checkpoints",
                             "n_layer", "n_head", "n_embd", "dist_timeout_s"), 1),
            **dict.fromkeys(("learning_rate", "min_lr", "weight_decay", "grad_clip",
                             "max_iters", "warmup_iters", "lr_decay_iters", "vocab_size", "seed",
                             "hang_timeout_s", "startup_timeout_s", "hellaswag_interval"), 0)}
BELOW_ONE = ("dropout", "beta1", "beta2")  # and at least 0
SPIKE_WINDOW, SPIKE_WARMUP = 100, 20  # steps a spike is judged against; fewer: no judging
# Dense bf16 tensor peak of one GPU, for MFU, by a part of its name; the first that matches
# counts, so a variant comes before its family. From NVIDIA's datasheets, which print the
# peak with 2:4 sparsity: half of it is the dense one.
PEAK_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),  # H100 datasheet
              ("H200 NVL", 835e12), ("H200", 989e12),  # H200 datasheet
              ("B200", 2250e12),  # HGX B200 datasheet: 36 PFLOPS sparse for 8 GPUs
              ("A100", 312e12),  # A100 datasheet, SXM and PCIe alike
              ("L40S", 362e12),  # L40S datasheet
              ("A10G", 70e12)]  # AWS's A10G (not NVIDIA's A10, 125e12)


def peak_flops(device):
    """The device's dense bf16 peak in FLOP/s, for MFU; None when unknown (or a CPU)."""
    if torch.device(device).type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name):
    return next((flops for part, flops in PEAK_FLOPS if part in name), None)


def check_config(cfg):
    for key, low in AT_LEAST.items():
        value = getattr(cfg, key)
        if not low <= value < math.inf:  # not nan either
            raise UserError(f"{key}={value!r} must be at least {low}")
    for key in BELOW_ONE:
        if not 0 <= getattr(cfg, key) < 1:
            raise UserError(f"{key}={getattr(cfg, key)!r} must be at least 0 and below 1")
    if not 0 < cfg.cooldown_frac <= 1:
        raise UserError(f"cooldown_frac={cfg.cooldown_frac!r} must be above 0 and at most 1")
    if not 0 < cfg.spike_zscore < math.inf:
        raise UserError(f"spike_zscore={cfg.spike_zscore!r} must be above 0")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")
    hf.check_init_from(cfg.init_from, startup.INIT_FROM)










# ---- evaluation and the learning rate ----

def lr_at(cfg, it):
    """Linear warm-up, then cosine decay to min_lr at lr_decay_iters, then min_lr; or (wsd)
    the learning rate until the last cooldown_frac of max_iters, which decays as 1 - sqrt to
    min_lr at the last step, so a run can be extended by raising max_iters before then."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "wsd":
        cooldown = max(1, round(cfg.max_iters * cfg.cooldown_frac))
        done = min(1.0, max(0, it + 1 - (cfg.max_iters - cooldown)) / cooldown)
        return cfg.min_lr + (1 - math.sqrt(done)) * (cfg.learning_rate - cfg.min_lr)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def evaluate(model, splits, cfg, rank, world_size, autocast, device, vocab_size,
             token_bytes=None):
    """{'train_loss': ..., 'val_loss': ...}: the mean loss over the fixed evaluation windows of
    each split, shared out over the ranks, and with token_bytes the bits per byte ('val_bpb');
    for a mixture, each source's too ('val_loss/web', 'val_bpb/web'), and the split's value is
    their average by weight. cfg: anything with block_size, batch_size and eval_iters."""
    model.eval()
    out = {}
    for split, mix in splits.items():
        results = [split_loss(model, t, cfg, rank, world_size, autocast, device, vocab_size,
                              token_bytes) for t in mix.splits]
        for k, what in enumerate(("loss",) if token_bytes is None else ("loss", "bpb")):
            values = [r[k] for r in results]
            out[f"{split}_{what}"] = sum(w * v for w, v in zip(mix.weights, values))
            if len(values) > 1:
                out.update({f"{split}_{what}/{n}": v for n, v in zip(mix.names, values)})
    model.train()
    return out


def split_loss(model, token_split, cfg, rank, world_size, autocast, device, vocab_size,
               token_bytes=None):
    """(mean loss, bits per byte or None without token_bytes). Bits per byte are the summed
    cross-entropy of every target token scored, in bits, over the bytes of text those same
    tokens stand for (token_bytes[id], tokenizer.byte_lengths): comparable across tokenizers.
    The losses stay on the device until the one transfer at the end."""
    offsets = data.eval_offsets(token_split.starts, cfg.block_size,
                                cfg.eval_iters * cfg.batch_size)[rank::world_size]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_bytes = 0
    for i in range(0, len(offsets), cfg.batch_size):
        chunk = offsets[i:i + cfg.batch_size]
        x, y = data.read_xy(token_split, chunk, cfg.block_size, vocab_size)
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        loss_sum += loss.double() * len(chunk)
        if token_bytes is not None:
            n_bytes += int(token_bytes[y.numpy()].sum())
    total = torch.stack([loss_sum, torch.full_like(loss_sum, len(offsets)),
                         torch.full_like(loss_sum, n_bytes)])
    if world_size > 1:
        dist.all_reduce(total)
    loss_sum, n, n_bytes = total.tolist()
    # every window's loss is the mean over its block_size targets: times block_size, the sum
    bpb = None if token_bytes is None else loss_sum * cfg.block_size / math.log(2) / n_bytes
    return loss_sum / n, bpb


# ---- one optimizer step ----

def settle_gradient_buckets(model, cfg, device, autocast):
    """One backward whose gradients are thrown away. DDP's first backward all-reduces every
    gradient as one bucket, and later ones in buckets rebuilt in the order the gradients came;
    with more than two ranks a sum's rounding depends on that layout. So every counted step,
    in a fresh run or after a resume, uses the rebuilt buckets, and a resumed run repeats the
    uninterrupted one bit for bit. (Two tensors, not x twice: torch.compile would guard on
    their being one and compile the graph again at the first real step.)"""
    x = torch.zeros((cfg.batch_size, cfg.block_size), dtype=torch.long, device=device)
    model.require_backward_grad_sync = True
    with autocast:
        _, loss = model(x, torch.zeros_like(x))
    loss.backward()


def forward_backward(model, batches, micro_steps, autocast, scaler, world_size):
    """This rank's micro-steps of one optimizer step: (the summed loss on the device, seconds
    spent waiting for data, seconds until the last backward, which waits for the other ranks
    in DDP: what this rank alone took). The gradients accumulate in the parameters."""
    loss_sum, data_wait, t_start = 0.0, 0.0, time.perf_counter()
    for micro_step in range(micro_steps):
        if world_size > 1:
            # DDP all-reduces the gradients in the last micro-step's backward only. nanoGPT's
            # note holds: model.no_sync() is the official way, but it bloats the code
            model.require_backward_grad_sync = micro_step == micro_steps - 1
        t = time.perf_counter()
        x, y = next(batches)
        data_wait += time.perf_counter() - t
        with autocast:
            _, loss = model(x, y)
            loss = loss / micro_steps
        alone = time.perf_counter() - t_start
        scaler.scale(loss).backward()
        loss_sum = loss_sum + loss.detach().float()
    return loss_sum, data_wait, alone


def share_step_results(loss_sum, grad_norm, stop_signals, world_size):
    """(global mean loss, gradient norm, whether any rank was signalled to stop) in one small
    all-reduce and one transfer to the host: the step's only host-device synchronisation,
    so the device is never left idle waiting on Python mid-step."""
    shared = torch.stack([loss_sum, grad_norm.float(),
                          torch.full_like(loss_sum, float(bool(stop_signals)))])
    if world_size > 1:
        dist.all_reduce(shared)  # a sum; the gradient norm is the same on every rank
    loss, norm, stops = shared.tolist()
    return loss / world_size, norm / world_size, stops > 0


def step_problem(cfg, loss, grad_norm, history, fp16):
    """Why this step must not be applied, or None. In float16 an overflow is normal, and the
    GradScaler's to skip. A spike is judged against the last SPIKE_WINDOW applied steps
    (llm.c's idea), once there are SPIKE_WARMUP of them."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return None if fp16 else "non-finite"
    if cfg.spike_policy == "off" or len(history) < SPIKE_WARMUP:
        return None
    for name, value, seen in (("loss", loss, [h[0] for h in history]),
                              ("gradient norm", grad_norm, [h[1] for h in history])):
        mean, spread = statistics.fmean(seen), statistics.pstdev(seen)
        if value > mean + cfg.spike_zscore * spread:
            return (f"{name} spike: {value:.4g}, {(value - mean) / spread:.1f} standard "
                    f"deviations above the last {len(seen)} steps' {mean:.4g}")
    return None


def skip_or_stop(cfg, log, problem, iter_num, loss, batch_fp):
    """A step that was not applied: stop (nan_policy's default), or go on with the next one,
    whose data is what it would have been."""
    if problem != "non-finite":
        log(f"warning: {problem} at iter {iter_num} (batch_fp {batch_fp}): step skipped "
            f"(spike_policy='skip')")
        return
    what = f"non-finite loss {loss} or gradient norm at iter {iter_num} (batch_fp {batch_fp})"
    if cfg.nan_policy == "stop":
        raise UserError(f"{what}: training stopped without saving, so the last checkpoint is "
                        f"still good. Try a lower learning_rate, grad_clip=1.0 or "
                        f"dtype=bfloat16, and check the data at that batch; nan_policy='skip' "
                        f"skips such steps.")
    log(f"warning: {what}: step skipped (nan_policy='skip')")


# ---- what a run reports: metrics, the console, checkpoints ----

def rank_telemetry(alone_s, data_wait_s, device, world_size):
    """Each rank's seconds alone in the step (before the gradients' all-reduce), seconds
    waiting for data, and peak memory (CUDA's allocated, else the process's RSS), gathered on
    every rank: one small collective, on log steps only."""
    if torch.device(device).type == "cuda":
        memory = torch.cuda.max_memory_allocated(device)
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    mine = torch.tensor([alone_s * 1000, data_wait_s * 1000, memory / 2**20],
                        dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(every, mine)
    else:
        every = [mine]
    ms, wait, mib = zip(*torch.stack(every).tolist())
    return {"rank_ms": list(ms), "rank_data_wait_ms": list(wait), "rank_mem_mib": list(mib)}


def log_straggler(log, row):
    """Name the slowest rank when it is more than 10% slower than the median."""
    ms = row["rank_ms"]
    median = statistics.median(ms)
    slowest = max(range(len(ms)), key=ms.__getitem__)
    if len(ms) > 1 and ms[slowest] > 1.1 * median:
        log(f"iter {row['iter']}: rank {slowest} is the slowest: {ms[slowest]:.1f} ms alone in "
            f"the step against a median of {median:.1f} ms, {row['rank_data_wait_ms'][slowest]:.1f}"
            f" ms of it waiting for data")


def save_checkpoint(cfg, model, optimizer, scaler, args, meta, iter_num, samples, best_val,
                    identity):
    watchdog.beat(iter_num)  # the save gets a whole limit of its own
    return checkpoint.save(cfg.out_dir, {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "model_args": args, "iter_num": iter_num,
        "samples_consumed": samples, "best_val_loss": best_val,
        "config": dataclasses.asdict(cfg), "data_meta": meta, "data_identity": identity},
        cfg.keep_checkpoints)


def record(metrics, wandb, row):
    """One row of metrics.jsonl (and of wandb); rank 0 alone has them open."""
    if metrics is not None:
        try:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        except OSError as e:
            out_dir = os.path.dirname(metrics.name)
            raise UserError(f"could not write {metrics.name}: "
                            f"{fileio.disk_full(e, out_dir) or e.strerror}. The checkpoints in "
                            f"{out_dir} are intact: free space there, or move out_dir, and "
                            f"resume with --init_from=resume.") from e
    if wandb is not None:
        wandb.log(row, step=row["iter"])


def log_evaluation(log, iter_num, losses):
    sources = ", ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in losses.items()
                        if k.startswith("val_loss/"))
    bpb = f", {losses['val_bpb']:.4f} bits per byte" if "val_bpb" in losses else ""
    swag = "" if "hellaswag_n" not in losses else (
        f", HellaSwag acc_norm {losses['hellaswag_acc_norm']:.4f} (acc "
        f"{losses['hellaswag_acc']:.4f}, {losses['hellaswag_n']} examples)")
    log(f"iter {iter_num}: train loss {losses['train_loss']:.4f}, val loss "
        f"{losses['val_loss']:.4f}{f' ({sources})' if sources else ''}{bpb}{swag}")


def log_step(log, row, peak):
    mfu = f", mfu {row['mfu'] * 100:.1f}%" if peak else ""
    log(f"iter {row['iter']}: loss {row['loss']:.4f}, grad norm {row['grad_norm']:.3g}, lr "
        f"{row['lr']:.2e}, {row['ms']:.1f} ms, {row['tok_per_s']:,.0f} tok/s{mfu}, data wait "
        f"{row['data_wait'] * 100:.1f}%")


def open_metrics(cfg, master):
    """(metrics.jsonl opened for appending, the wandb module once initialised) on rank 0."""
    if not master:
        return None, None
    metrics = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a")
    if not cfg.wandb_log:
        return metrics, None
    import wandb  # slow to import, and only needed here
    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,
               config=dataclasses.asdict(cfg), id=wandb_run_id(cfg.out_dir), resume="allow")
    return metrics, wandb


def wandb_run_id(out_dir):
    """The wandb run of out_dir, made on its first run and kept there: a resumed or requeued
    run goes on with the same curve instead of starting a new run."""
    path = os.path.join(out_dir, "wandb_run_id")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(secrets.token_hex(4) + "\n")
        fileio.publish(path + ".tmp", path)
    with open(path) as f:
        return f.read().strip()


# ---- the run: its parts, then the loop ----

def restore(cfg, model, resume, device_type):
    """(optimizer, scaler, iter_num, samples, best_val) of a fresh run, or as a checkpoint
    left them. iter_num counts optimizer steps (the learning rate follows it); samples counts
    the global samples read (the data position). They part when a run resumes with another
    global batch, which is why the batch index is always samples // global_batch."""
    float16 = startup.pick_dtype(cfg, device_type) == "float16"
    scaler = torch.amp.GradScaler(device_type, enabled=float16)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate,
                                           (cfg.beta1, cfg.beta2), device_type)
    if resume is None:
        return optimizer, scaler, 0, 0, float("inf")
    optimizer.load_state_dict(resume["optimizer"])
    if "scaler" in resume:
        scaler.load_state_dict(resume["scaler"])
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    return (optimizer, scaler, resume["iter_num"], startup.samples_consumed(resume, global_batch),
            resume.get("best_val_loss", float("inf")))


def autocast_for(dtype, device_type):
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type, dtype={"bfloat16": torch.bfloat16,
                                              "float16": torch.float16}[dtype])


@dataclass
class Run:
    """What the training loop works with, made once by prepare_run()."""
    cfg: TrainConfig
    rank: int
    world_size: int
    device: str
    log: Callable
    # One set of weights, three handles: `model` owns them (checkpoints, clipping, the
    # optimizer); `forward` is what evaluation calls, beneath DDP, which averages gradients
    # that evaluation does not make, so ranks may run different numbers of evaluation batches;
    # `trained` is what the steps call, and in DDP it all-reduces the gradients in backward.
    model: torch.nn.Module
    forward: Callable
    trained: Callable
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: Any
    meta: dict  # the data's meta.json, kept in checkpoints
    args: dict  # the model's arguments
    splits: dict  # {split: data.Mixture}
    identity: dict  # what the data is, kept in checkpoints (startup.data_identity)
    scoring: tuple  # (bytes per token id or None, HellaSwag or None)
    batches: Iterator  # this rank's micro-batches, from the data position on
    metrics: Any  # metrics.jsonl, open on rank 0
    wandb: Any  # the wandb module, initialised on rank 0 when wandb_log
    global_batch: int
    micro_steps: int
    flops_per_step: int  # of the model on the global batch, forward and backward
    peak: float  # the device's peak FLOP/s, for MFU; None when unknown


def prepare_run(cfg, rank, world_size, device, log, model, optimizer, scaler, meta, args,
                splits, scoring, samples):
    device_type = torch.device(device).type
    dtype = startup.pick_dtype(cfg, device_type)
    autocast = autocast_for(dtype, device_type)
    forward = torch.compile(model) if cfg.compile else model
    trained = forward
    if world_size > 1:
        trained = DDP(forward, device_ids=[torch.device(device).index]
                      if device_type == "cuda" else None)
        settle_gradient_buckets(trained, cfg, device, autocast)
        optimizer.zero_grad(set_to_none=True)
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    micro_steps = cfg.gradient_accumulation_steps // world_size
    log(f"world size {world_size}, device {device}, dtype {dtype}, "
        f"{model.get_num_params() / 1e6:.2f}M parameters, global batch {global_batch} x "
        f"{cfg.block_size} tokens ({micro_steps} micro-steps of {cfg.batch_size} per rank)")
    if len(splits["train"].splits) > 1:
        startup.log_mixture(log, splits["train"], cfg.max_iters * global_batch, cfg.block_size)
    batches = data.rank_batches(
        splits["train"], block_size=cfg.block_size, batch_size=cfg.batch_size,
        micro_steps=micro_steps, rank=rank, world_size=world_size, seed=cfg.seed,
        mode=cfg.sampling, start_step=samples // global_batch, device=device,
        vocab_size=args["vocab_size"])
    return Run(cfg, rank, world_size, device, log, model, forward, trained, optimizer, scaler,
               autocast, meta, args, splits, startup.data_identity(splits), scoring, batches,
               *open_metrics(cfg, rank == 0), global_batch, micro_steps,
               model.flops_per_token() * global_batch * cfg.block_size, peak_flops(device))


def train(run, stop_signals, iter_num, samples, best_val):
    """Evaluate (and save) every eval_interval steps and at the end; between, one optimizer
    step per iteration. A signal stops the run at one step, agreed by all ranks, and saves."""
    cfg, start_iter = run.cfg, iter_num
    history = deque(maxlen=SPIKE_WINDOW)  # (loss, gradient norm) of the last applied steps
    # ---------------------------------------------------------------- TRAINING LOOP BEGIN
    t_last = time.perf_counter()
    while True:
        if iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters or cfg.eval_only:
            best_val = evaluate_and_save(run, iter_num, samples, best_val,
                                         may_save=iter_num > start_iter)
            t_last = time.perf_counter()
            watchdog.beat(iter_num)
        if cfg.eval_only or iter_num >= cfg.max_iters:
            break
        row, stop, alone, data_wait = train_step(run, iter_num, samples, history, stop_signals)
        t_now = time.perf_counter()
        dt, t_last = t_now - t_last, t_now
        report_step(run, row, dt, alone, data_wait, first=iter_num == start_iter)
        iter_num += 1
        samples += run.global_batch
        watchdog.beat(iter_num, step_s=dt)
        if stop:
            run.log(f"stopping at iter {iter_num}: signal received, saving a checkpoint")
            if run.rank == 0:
                save(run, iter_num, samples, best_val)
                run.log(f"interrupted at iter {iter_num}; resume with --init_from=resume")
            break
    # ---------------------------------------------------------------- TRAINING LOOP END
    watchdog.stop()
    if run.metrics is not None:
        run.metrics.close()
    if run.wandb is not None:
        run.wandb.finish()


def evaluate_and_save(run, iter_num, samples, best_val, may_save):
    """The evaluation of iter_num, logged and recorded, and on rank 0 a checkpoint when it is
    one to keep (not the one just resumed from); the best val loss so far."""
    cfg = run.cfg
    token_bytes, swag = run.scoring
    losses = evaluate(run.forward, run.splits, cfg, run.rank, run.world_size, run.autocast,
                      run.device, run.args["vocab_size"], token_bytes)
    if swag is not None and iter_num % cfg.hellaswag_interval == 0:
        # the uncompiled model: a compiled one would compile again for each new shape
        losses.update(hellaswag.evaluate(run.model, swag, run.rank, run.world_size,
                                         run.autocast, run.device))
    log_evaluation(run.log, iter_num, losses)
    record(run.metrics, run.wandb, {"iter": iter_num, **losses})
    improved = losses["val_loss"] < best_val
    if not all(map(math.isfinite, losses.values())):
        run.log(f"warning: non-finite evaluation loss at iter {iter_num}: no checkpoint "
                f"written, the previous ones are kept")
    elif run.rank == 0 and may_save and (
            improved or cfg.always_save_checkpoint or iter_num >= cfg.max_iters):
        save(run, iter_num, samples, min(best_val, losses["val_loss"]))
    return min(best_val, losses["val_loss"])


def train_step(run, iter_num, samples, history, stop_signals):
    """One optimizer step over the global batch: (its row for metrics.jsonl, whether a rank was
    signalled to stop, this rank's seconds alone in it, its seconds waiting for data)."""
    cfg, model, optimizer, scaler = run.cfg, run.model, run.optimizer, run.scaler
    lr = lr_at(cfg, iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    torch.manual_seed(cfg.seed + 7919 * run.rank + 104729 * iter_num)  # dropout resumes exactly
    loss_sum, data_wait, alone = forward_backward(run.trained, run.batches, run.micro_steps,
                                                  run.autocast, scaler, run.world_size)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    loss, grad_norm, stop = share_step_results(loss_sum, grad_norm, stop_signals,
                                               run.world_size)
    problem = step_problem(cfg, loss, grad_norm, history, scaler.is_enabled())
    if problem is None:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    # everything below is diagnostics, done while the device runs the optimizer step
    batch_fp = data.global_batch_fingerprint(samples // run.global_batch, run.global_batch,
                                             run.splits["train"], cfg.block_size, cfg.seed,
                                             cfg.sampling)
    if problem is None and math.isfinite(loss):
        history.append((loss, grad_norm))
    elif problem is not None:
        skip_or_stop(cfg, run.log, problem, iter_num, loss, batch_fp)
    row = {"iter": iter_num, "loss": loss, "grad_norm": grad_norm, "lr": lr,
           "batch_fp": batch_fp, **({"skipped": problem} if problem else {})}
    return row, stop, alone, data_wait


def report_step(run, row, dt, alone, data_wait, first):
    """A step's timings added to its row, on the console every log_interval steps with every
    rank's numbers (the slowest rank named, but not at a run's first step, whose one-time work
    differs between ranks), and the row in metrics.jsonl (and wandb)."""
    row.update(ms=dt * 1000, tok_per_s=run.global_batch * run.cfg.block_size / dt,
               data_wait=data_wait / dt)
    if run.peak:
        row["mfu"] = run.flops_per_step / dt / (run.peak * run.world_size)
    if torch.device(run.device).type == "cuda":  # the allocator's own count: no synchronising
        row["peak_mem"] = torch.cuda.max_memory_allocated(run.device)
    if row["iter"] % run.cfg.log_interval == 0:
        row.update(rank_telemetry(alone, data_wait, run.device, run.world_size))
        log_step(run.log, row, run.peak)
        if not first:
            log_straggler(run.log, row)
    record(run.metrics, run.wandb, row)


def save(run, iter_num, samples, best_val):
    t = time.perf_counter()
    path = save_checkpoint(run.cfg, run.model, run.optimizer, run.scaler, run.args, run.meta,
                           iter_num, samples, best_val, run.identity)
    run.log(f"saved {path} ({time.perf_counter() - t:.2f} s)")


def main(argv):
    stop_signals = startup.catch_stop_signals()
    cfg, given = configurator.parse_given(TrainConfig, argv)
    check_config(cfg)
    rank, local_rank, world_size = startup.distributed_env()
    watchdog.start(cfg.out_dir, rank, world_size, cfg.hang_timeout_s, cfg.startup_timeout_s)
    log = print if rank == 0 else (lambda *a, **k: None)
    device = startup.pick_device(cfg.device, local_rank,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    startup.init_distributed(cfg, device, world_size)
    # rank 0 holds out_dir's lock for the run: a second run there would delete this one's
    # checkpoints and interleave its metrics (refused like any start-up error, by agree())
    with contextlib.ExitStack() as out_dir_lock:
        try:
            if rank == 0:
                out_dir_lock.enter_context(fileio.locked(cfg.out_dir, "train.py", log))
            resume, meta, args, splits, model = startup.start_up(cfg, given, world_size, log)
            scoring = startup.open_scoring(cfg, meta, args["vocab_size"], log)
            error = None
        except UserError as e:
            error = str(e)
        if not startup.agree(error, rank, world_size) or \
                not startup.same_data_on_all_ranks(splits, cfg.data_dir, rank, world_size):
            return 1
        log(f"configuration:\n{configurator.describe(cfg)}")
        model.to(device)
        optimizer, scaler, iter_num, samples, best_val = restore(cfg, model, resume,
                                                                 torch.device(device).type)
        resume = None  # free the checkpoint's tensors
        run = prepare_run(cfg, rank, world_size, device, log, model, optimizer, scaler, meta,
                          args, splits, scoring, samples)
        train(run, stop_signals, iter_num, samples, best_val)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


def run_cli(argv):
    return errors.run(main, "train.py", argv)


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))
