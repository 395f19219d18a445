"""Train a GPT with DistributedDataParallel, on one process or many.

  python train.py config/quickstart.py                       # one process, CPU or one GPU
  torchrun --standalone --nproc_per_node=8 train.py config/owt.py --batch_size=16
  srun python train.py config/owt.py                         # one SLURM task per GPU

Every key, its default and its type is in TrainConfig below; config files and --key=value
arguments override them (configurator.py). Data positions are global sample indices (data.py),
so a run resumes exactly, also on another world size with the same global batch.
"""
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import configurator
import data
from model import GPT, GPTConfig


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200  # evaluation reads eval_iters * batch_size fixed windows per split
    eval_only: bool = False
    always_save_checkpoint: bool = True  # else only when val loss improves (and at the end)
    init_from: str = "scratch"  # 'scratch', 'resume' (newest checkpoint in out_dir) or 'auto'
    keep_checkpoints: int = 3
    # wandb
    wandb_log: bool = False
    wandb_project: str = "ddpgpt"
    wandb_run_name: str = "gpt2"
    # data
    data_dir: str = "data/openwebtext"
    sampling: str = "epoch"  # 'epoch': every block once per epoch; 'random': nanoGPT's
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
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000
    min_lr: float = 6e-5
    nan_policy: str = "stop"  # on a non-finite loss or gradient: 'stop', or 'skip' the step
    # system
    backend: str = ""  # '' picks nccl on CUDA, gloo on CPU
    device: str = "auto"  # 'auto': cuda:<local rank> when CUDA is there, else cpu
    dtype: str = "auto"  # 'auto': bfloat16 on CUDA that has it, float16 on other CUDA, float32 on CPU
    compile: bool = False
    dist_timeout_s: int = 600  # how long a collective may wait before the run fails
    seed: int = 1337


CHOICES = {"init_from": ("scratch", "resume", "auto"), "sampling": data.SAMPLING_MODES,
           "nan_policy": ("stop", "skip"), "backend": ("", "nccl", "gloo"),
           "dtype": ("auto", "float32", "bfloat16", "float16")}
# dense bf16 peak of one GPU, by a substring of its name, for MFU
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


class RunError(Exception):
    """A problem the user can fix; printed as one paragraph, without a traceback."""


def check_config(cfg):
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise configurator.ConfigError(
                f"{key}={getattr(cfg, key)!r} is not one of {', '.join(map(repr, allowed))}")
    for key in ("batch_size", "block_size", "gradient_accumulation_steps", "eval_iters",
                "eval_interval", "log_interval", "keep_checkpoints", "n_layer", "n_head"):
        if getattr(cfg, key) < 1:
            raise configurator.ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    if cfg.n_embd % cfg.n_head:
        raise configurator.ConfigError(
            f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")


def distributed_env():
    """(rank, local_rank, world_size): torchrun's variables, else one srun task per process."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in env:
                raise RunError(
                    f"{key} is not set: with one srun task per GPU, train.py needs MASTER_ADDR "
                    f"and MASTER_PORT; launch through launch/srun.sh, which sets them.")
        rank, local_rank, world_size = (int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]),
                                        int(env["SLURM_NTASKS"]))
        # init_process_group's env:// rendezvous reads RANK and WORLD_SIZE: set them as
        # torchrun would (srun sets only the SLURM_* variables)
        env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
        return rank, local_rank, world_size
    return 0, 0, 1


def pick_device(cfg, local_rank):
    if cfg.device != "auto":
        return cfg.device
    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


def pick_dtype(cfg, device_type):
    if cfg.dtype != "auto":
        return cfg.dtype
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def lr_at(cfg, it):
    """Linear warm-up, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def model_vocab_size(cfg, meta):
    if cfg.vocab_size:
        return cfg.vocab_size
    if meta is None:
        return 50304  # GPT-2's 50257 rounded up, as nanoGPT does for raw .bin folders
    return -(-meta["vocab_size"] // 64) * 64  # a multiple of 64 runs faster on GPUs


def preflight(cfg, world_size, resume_state, meta, n_params):
    """Checks that can fail before the first step; each raises RunError/DataError."""
    micro = cfg.gradient_accumulation_steps
    if micro % world_size:
        raise RunError(
            f"gradient_accumulation_steps={micro} is the global number of micro-steps and must "
            f"be a multiple of the world size {world_size}: use {max(1, micro // world_size) * world_size}.")
    if cfg.eval_only and resume_state is None and cfg.init_from == "resume":
        raise RunError(f"eval_only with init_from='resume' needs a checkpoint in {cfg.out_dir}")
    if resume_state is not None:
        used = (resume_state.get("data_meta") or {}).get("tokenizer")
        if meta is not None and used is not None and used != meta.get("tokenizer"):
            raise RunError(
                f"the checkpoint was trained on {used!r} tokens but {cfg.data_dir} holds "
                f"{meta.get('tokenizer')!r} tokens: set data_dir to data made with {used!r}.")
        global_batch = cfg.batch_size * micro
        if resume_state["samples_consumed"] % global_batch:
            raise RunError(
                f"the checkpoint consumed {resume_state['samples_consumed']} samples, not a "
                f"whole number of global batches of {global_batch} (batch_size x "
                f"gradient_accumulation_steps): resume with a global batch that divides it.")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise RunError(f"out_dir {cfg.out_dir} cannot be written ({e.strerror or e}): set "
                       f"--out_dir to a folder you can write to.") from e
    need = n_params * 4 * 3 * 1.1  # fp32 weights and two AdamW moments
    free = shutil.disk_usage(cfg.out_dir).free
    if free < need:
        raise RunError(f"out_dir {cfg.out_dir} has {free / 2**20:.0f} MiB free, less than one "
                       f"checkpoint needs (about {need / 2**20:.0f} MiB): free space or move "
                       f"out_dir.")


def agree(errors_here, world_size, rank):
    """Share each rank's start-up error so that all ranks stop together and rank 0 reports
    every distinct problem once; no rank is left waiting in a later collective."""
    errors = [errors_here]
    if world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, errors_here)
    problems = {}
    for r, e in enumerate(errors):
        if e is not None:
            problems.setdefault(e, []).append(r)
    if problems and rank == 0:
        for message, ranks in problems.items():
            where = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" \
                if world_size > 1 else ""
            print(f"train.py: error{where}: {message}", file=sys.stderr)
    return not problems


def data_identity(tokens):
    return tokens.n_tokens, data.sampled_fingerprint(tokens.path)


@torch.no_grad()
def evaluate(model, splits, cfg, rank, world_size, autocast, device, vocab_size):
    """Mean loss over the fixed evaluation windows of each split, over all ranks."""
    model.eval()
    out = {}
    for name, tokens in splits.items():
        offsets = data.eval_offsets(tokens.n_tokens, cfg.block_size,
                                    cfg.eval_iters * cfg.batch_size)[rank::world_size]
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for i in range(0, len(offsets), cfg.batch_size):
            chunk = offsets[i:i + cfg.batch_size]
            x, y = data.read_windows(tokens, chunk, cfg.block_size, vocab_size)
            with autocast:
                _, loss = model(x.to(device), y.to(device))
            total += torch.stack([loss.double() * len(chunk), torch.tensor(
                len(chunk), dtype=torch.float64, device=device)])
        if world_size > 1:
            dist.all_reduce(total)
        out[name] = (total[0] / total[1]).item()
    model.train()
    return out


def settle_gradient_buckets(model, cfg, device, autocast):
    """One backward whose gradients are thrown away. DDP's first backward all-reduces every
    gradient as one bucket, and later ones in buckets rebuilt in the order the gradients came;
    with more than two ranks a sum's rounding depends on that layout. So every counted step,
    in a fresh run or after a resume, uses the rebuilt buckets, and a resumed run repeats the
    uninterrupted one bit for bit."""
    x = torch.zeros((cfg.batch_size, cfg.block_size), dtype=torch.long, device=device)
    model.require_backward_grad_sync = True
    with autocast:
        _, loss = model(x, x)
    loss.backward()


def catch_stop_signals():
    """Record SIGUSR1 (SLURM's warning before a time limit) and SIGTERM (scancel, preemption)
    instead of dying: the ranks then agree on a step to stop at, and rank 0 saves. Caught from
    the start, so that a signal that comes while the model is built is not lost."""
    received = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    return received


def main(argv):
    stop_signal = catch_stop_signals()
    cfg = configurator.parse(TrainConfig, argv)
    check_config(cfg)
    rank, local_rank, world_size = distributed_env()
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    device = pick_device(cfg, local_rank)
    device_type = torch.device(device).type
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        backend = cfg.backend or ("nccl" if device_type == "cuda" else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout_s),
                                device_id=torch.device(device) if backend == "nccl" else None)
    try:
        return train(cfg, rank, world_size, master, log, device, device_type, stop_signal)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def train(cfg, rank, world_size, master, log, device, device_type, stop_signal):
    micro_steps = cfg.gradient_accumulation_steps // world_size
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    error, state, splits = None, None, {}
    try:
        if cfg.init_from in ("resume", "auto"):
            state, path = checkpoint.load_latest(cfg.out_dir, log=log)
            if state is None and cfg.init_from == "resume":
                raise RunError(f"init_from='resume' but {cfg.out_dir} holds no loadable "
                               f"checkpoint (ckpt_*.pt): train from scratch with "
                               f"--init_from=scratch, or use --init_from=auto.")
            if state is not None:
                log(f"resuming from {path} (iter {state['iter_num']})")
        meta = data.read_meta(cfg.data_dir)
        model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                          block_size=cfg.block_size, bias=cfg.bias, dropout=cfg.dropout,
                          vocab_size=model_vocab_size(cfg, meta))
        if state is not None:  # the architecture is the checkpoint's, as in nanoGPT
            model_args.update({k: state["model_args"][k] for k in model_args if k != "dropout"})
            cfg.block_size = model_args["block_size"]
        for split in data.SPLITS:
            splits[split] = data.open_split(cfg.data_dir, split, cfg.block_size,
                                            model_args["vocab_size"], log=log)
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(**model_args))
        preflight(cfg, world_size, state, meta, sum(p.numel() for p in model.parameters()))
    except (RunError, data.DataError, configurator.ConfigError, checkpoint.CheckpointError) as e:
        error = str(e)
    except Exception as e:  # an unexpected start-up failure must not leave other ranks waiting
        error = f"{type(e).__name__}: {e}"
    if not agree(error, world_size, rank):
        return 1
    if world_size > 1:
        identities = [None] * world_size
        dist.all_gather_object(identities, {s: data_identity(t) for s, t in splits.items()})
        if any(i != identities[0] for i in identities):
            detail = "; ".join(f"rank {r}: {i}" for r, i in enumerate(identities))
            agree(f"the ranks do not see the same data in {cfg.data_dir} (tokens, fingerprint "
                  f"per split: {detail}): every node must hold the same files.", 1, rank)
            return 1

    log(f"configuration:\n{configurator.describe(cfg)}")
    dtype = pick_dtype(cfg, device_type)
    autocast = nullcontext() if dtype == "float32" else torch.autocast(
        device_type, dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    if state is not None:
        model.load_state_dict(checkpoint.model_state(state))
    model.to(device)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate,
                                           (cfg.beta1, cfg.beta2), device_type)
    iter_num, samples, best_val = 0, 0, float("inf")
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        iter_num, best_val = state["iter_num"], state.get("best_val_loss", float("inf"))
        samples = state.get("samples_consumed", iter_num * global_batch)
    start_iter, start_step = iter_num, samples // global_batch
    state = None  # free the checkpoint's tensors
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    eval_model = model
    if world_size > 1:
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda"
                    else None)
        settle_gradient_buckets(model, cfg, device, autocast)
        optimizer.zero_grad(set_to_none=True)
    n_params = raw_model.get_num_params()
    log(f"world size {world_size}, device {device}, dtype {dtype}, {n_params / 1e6:.2f}M "
        f"parameters, global batch {global_batch} x {cfg.block_size} tokens "
        f"({micro_steps} micro-steps of {cfg.batch_size} per rank)")

    metrics = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") if master else None
    wandb = None
    if cfg.wandb_log and master:
        import wandb
        wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,
                   config=dataclasses.asdict(cfg))

    def record(row):
        if master:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if wandb is not None:
                wandb.log(row, step=row["iter"])

    def save():
        path = checkpoint.save(cfg.out_dir, {
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "model_args": model_args, "iter_num": iter_num,
            "samples_consumed": step * global_batch, "best_val_loss": best_val,
            "config": dataclasses.asdict(cfg), "data_meta": meta}, cfg.keep_checkpoints)
        log(f"saved {path}")

    train_tokens = splits["train"]
    batches = data.rank_batches(
        train_tokens, block_size=cfg.block_size, batch_size=cfg.batch_size,
        micro_steps=micro_steps, rank=rank, world_size=world_size, seed=cfg.seed,
        mode=cfg.sampling, start_step=start_step, device=device,
        vocab_size=model_args["vocab_size"])
    peak = next((v for k, v in PEAK_FLOPS.items() if device_type == "cuda"
                 and k in torch.cuda.get_device_name(device)), None)
    flops_per_step = raw_model.flops_per_token() * global_batch * cfg.block_size
    step = start_step
    t_last = time.perf_counter()
    while True:
        if iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters or cfg.eval_only:
            losses = evaluate(eval_model, splits, cfg, rank, world_size, autocast, device,
                              model_args["vocab_size"])
            log(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            record({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"]})
            improved = losses["val"] < best_val
            best_val = min(best_val, losses["val"])
            if not all(map(math.isfinite, losses.values())):
                log(f"warning: non-finite evaluation loss at iter {iter_num}: no checkpoint "
                    f"written, the previous ones are kept")
            elif master and iter_num > start_iter and (
                    improved or cfg.always_save_checkpoint or iter_num >= cfg.max_iters):
                save()
            t_last = time.perf_counter()
        if cfg.eval_only or iter_num >= cfg.max_iters:
            break

        lr = lr_at(cfg, iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(cfg.seed + 7919 * rank + 104729 * iter_num)  # dropout resumes exactly
        loss_sum = torch.zeros((), device=device)
        data_wait = 0.0
        for micro in range(micro_steps):
            if world_size > 1:  # sync gradients on the last micro-step only
                model.require_backward_grad_sync = micro == micro_steps - 1
            t_data = time.perf_counter()
            x, y = next(batches)
            data_wait += time.perf_counter() - t_data
            with autocast:
                _, loss = model(x, y)
                loss = loss / micro_steps
            scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                                   cfg.grad_clip if cfg.grad_clip else math.inf)
        # one small all-reduce per step: the global mean loss and whether any rank was signalled
        shared = torch.stack([loss_sum, torch.tensor(float(bool(stop_signal)), device=device)])
        if world_size > 1:
            dist.all_reduce(shared)
        loss_mean, stop_votes = shared[0].item() / world_size, shared[1].item()
        batch_fp = data.global_batch_fingerprint(step, global_batch, train_tokens.n_tokens,
                                                 cfg.block_size, cfg.seed, cfg.sampling)
        finite = math.isfinite(loss_mean) and torch.isfinite(grad_norm).item()
        if finite or dtype == "float16":  # fp16 overflows are the scaler's to skip
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if not finite and dtype != "float16":
            message = (f"non-finite loss {loss_mean} or gradient norm at iter {iter_num} "
                       f"(batch_fp {batch_fp})")
            if cfg.nan_policy == "stop":
                raise RunError(f"{message}: training stopped without saving, so the last "
                               f"checkpoint is still good. Try a lower learning_rate, "
                               f"grad_clip=1.0 or dtype=bfloat16, and check the data at that "
                               f"batch; nan_policy='skip' skips such steps.")
            log(f"warning: {message}: step skipped (nan_policy='skip')")
        t_now = time.perf_counter()
        dt, t_last = t_now - t_last, t_now
        row = {"iter": iter_num, "loss": loss_mean, "lr": lr, "batch_fp": batch_fp,
               "ms": dt * 1000, "tok_per_s": global_batch * cfg.block_size / dt,
               "data_wait": data_wait / dt}
        if peak:
            row["mfu"] = flops_per_step / dt / (peak * world_size)
        record(row)
        if iter_num % cfg.log_interval == 0:
            mfu = f", mfu {row['mfu'] * 100:.1f}%" if peak else ""
            log(f"iter {iter_num}: loss {loss_mean:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, "
                f"{row['tok_per_s']:,.0f} tok/s{mfu}, data wait {data_wait / dt * 100:.1f}%")
        iter_num += 1
        step += 1
        if stop_votes:
            log(f"stopping at iter {iter_num}: signal received, saving a checkpoint")
            if master:
                save()
            break
    if metrics:
        metrics.close()
    if wandb is not None:
        wandb.finish()
    return 0


def run_cli(argv):
    try:
        return main(argv)
    except (configurator.ConfigError, RunError, data.DataError,
            checkpoint.CheckpointError) as e:
        where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        print(f"train.py: error{where}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))
