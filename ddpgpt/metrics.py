"""What a training run reports: a row per step and per evaluation in out_dir/metrics.jsonl (and
wandb), written by rank 0; the step's console line; and every rank's own numbers (time alone in
the step, time waiting for data, memory), gathered on log steps, with the slowest rank named.
"""
import dataclasses
import json
import os
import resource
import secrets
import statistics
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ddpgpt import fileio
from ddpgpt.errors import UserError


class Metrics(NamedTuple):
    file: Any  # metrics.jsonl, open for appending; None off rank 0
    wandb: Any  # the wandb module once initialised; None without wandb_log or off rank 0


def open_metrics(cfg, master):
    """The Metrics of a run, on rank 0; Metrics(None, None) elsewhere."""
    if not master:
        return Metrics(None, None)
    file = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a")
    if not cfg.wandb_log:
        return Metrics(file, None)
    import wandb  # slow to import, and only needed here
    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,
               config=dataclasses.asdict(cfg), id=wandb_run_id(cfg.out_dir), resume="allow")
    return Metrics(file, wandb)


def wandb_run_id(out_dir):
    """The wandb run of out_dir, made on its first run and kept there: a resumed or requeued
    run goes on with the same curve instead of starting a new run."""
    path = os.path.join(out_dir, "wandb_run_id")
    if not os.path.exists(path):
        with open(fileio.tmp_path(path), "w") as f:
            f.write(secrets.token_hex(4) + "\n")
        fileio.publish(f.name, path)
    with open(path) as f:
        return f.read().strip()


def record(metrics, row):
    """One row of metrics.jsonl (and of wandb); rank 0 alone has them open."""
    if metrics.file is not None:
        try:
            metrics.file.write(json.dumps(row) + "\n")
            metrics.file.flush()
        except OSError as e:
            out_dir = os.path.dirname(metrics.file.name)
            raise UserError(f"could not write {metrics.file.name}: "
                            f"{fileio.disk_full(e, out_dir) or e.strerror}. The checkpoints in "
                            f"{out_dir} are intact: free space there, or move out_dir, and "
                            f"resume with --init_from=resume.") from e
    if metrics.wandb is not None:
        metrics.wandb.log(row, step=row["iter"])


def close(metrics):
    if metrics.file is not None:
        metrics.file.close()
    if metrics.wandb is not None:
        metrics.wandb.finish()


# ---- the console ----

def log_step(log, row, peak):
    mfu = f", mfu {row['mfu'] * 100:.1f}%" if peak else ""
    log(f"iter {row['iter']}: loss {row['loss']:.4f}, grad norm {row['grad_norm']:.3g}, lr "
        f"{row['lr']:.2e}, {row['ms']:.1f} ms, {row['tok_per_s']:,.0f} tok/s{mfu}, data wait "
        f"{row['data_wait'] * 100:.1f}%")


# ---- every rank's numbers ----

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
