"""What a training run reports: a row per step and per evaluation in out_dir/metrics.jsonl (and
wandb, and TensorBoard), written by rank 0; the step's console line; and every rank's own
numbers (time alone in the step, time waiting for data, memory), gathered on log steps, with
the slowest rank named when it stays the slowest.

Each run opens its rows in metrics.jsonl with a start row, {"run": "fresh"} or {"run":
"resumed"} and the iter it starts at, so that the file says where one run ends and the next
begins: read() gives the rows of the run as it stands, which compare_runs.py and plot.py take."""
import dataclasses
import hashlib
import json
import logging
import os
import resource
import secrets
import statistics
import struct
import time
from collections import deque
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ddpgpt import fileio
from ddpgpt.errors import UserError

log = logging.getLogger(__name__)


class Metrics(NamedTuple):
    file: Any  # metrics.jsonl, open for appending; None off rank 0
    wandb: Any  # the wandb module once initialised; None without wandb_log or off rank 0
    tensorboard: Any  # the run's event file, open; None without tensorboard_log or off rank 0
    slowest: deque  # the slowest rank of each log step since one was last named (straggler)


STRAGGLER_STEPS = 5  # a rank is named when it is the slowest at this many log steps in a row,
STRAGGLER_MARGIN = 1.2  # each time by this factor over the median of the other ranks


def start_row(iter_num, resumed, init_from, world_size):
    """The row that opens a run's rows in metrics.jsonl."""
    return {"run": "resumed" if resumed else "fresh", "iter": iter_num, "init_from": init_from,
            "world_size": world_size, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def open_metrics(cfg, master, start):
    """The Metrics of a run: on rank 0 with metrics.jsonl open, its start row written (and
    wandb, and TensorBoard); elsewhere with none of them."""
    slowest = deque(maxlen=STRAGGLER_STEPS)
    if not master:
        return Metrics(None, None, None, slowest)
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    fresh = start["run"] == "fresh"
    if fresh and os.path.exists(path) and os.path.getsize(path):
        # train.py refuses a fresh start beside checkpoints: that run left none
        log.info(f"note: {path} holds the rows of an earlier run, which left no checkpoint; "
                 f"this run's follow its start row ({json.dumps(start)}), and compare_runs.py and "
                 f"plot.py read those only")
    drop_cut_off_line(path)
    file = open(path, "a")
    record(Metrics(file, None, None, slowest), start)  # the start row is metrics.jsonl's alone
    metrics = Metrics(file, open_wandb(cfg, fresh), open_tensorboard(cfg), slowest)
    if metrics.tensorboard is not None:
        append(metrics, metrics.tensorboard, purge(start["iter"]))
    return metrics


def drop_cut_off_line(path):
    """Drop the last line of metrics.jsonl when a kill cut it off mid-write (it does not end
    in a newline; read() leaves it out too): rows appended after it would continue that line,
    and the file would no longer be JSON lines. The rows before it are kept."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        end = whole = f.seek(0, os.SEEK_END)
        while whole > 0:  # whole: just after the last newline (or 0), searched for backwards
            start = max(0, whole - 2**16)
            f.seek(start)
            newline = f.read(whole - start).rfind(b"\n")
            whole = start + newline + 1  # start itself where the chunk holds none (rfind: -1)
            if newline >= 0:
                break
        if whole == end:
            return
        f.truncate(whole)
    log.info(f"note: {path} ended in a line cut off when a run was stopped ({end - whole} bytes): "
             f"dropped, so that this run's rows start on a line of their own")


def open_wandb(cfg, fresh):
    """The wandb module, its run initialised; None without wandb_log."""
    if not cfg.wandb_log:
        return None
    import wandb  # slow to import, and only needed here
    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,
               config=dataclasses.asdict(cfg), id=wandb_run_id(cfg.out_dir, new=fresh),
               resume="allow")
    return wandb


def wandb_run_id(out_dir, new):
    """The wandb run of out_dir, made by its fresh start and kept there: a resumed or requeued
    run goes on with the same curve instead of starting a new run."""
    path = os.path.join(out_dir, "wandb_run_id")
    if new or not os.path.exists(path):
        with open(fileio.tmp_path(path), "w") as f:
            f.write(secrets.token_hex(4) + "\n")
        fileio.publish(f.name, path)
    with open(path) as f:
        return f.read().strip()


def tensorboard_locks(cfg):
    """[(tensorboard_dir, what to do when it cannot be written)] where the run writes its event
    files in a folder other than out_dir, which it then locks as it locks out_dir (two runs
    writing in one folder would purge each other's curves); else []."""
    folder = cfg.tensorboard_dir or cfg.out_dir
    if not cfg.tensorboard_log or os.path.realpath(folder) == os.path.realpath(cfg.out_dir):
        return []
    return [(folder, "set tensorboard_dir to a folder that you can create and write files in, "
                     "or leave it out to write the event files in out_dir.")]


def out_dir_mark(cfg):
    """The end of the names of the event files of out_dir's runs, which tells them from another
    out_dir's in a tensorboard_dir."""
    return hashlib.sha256(os.path.realpath(cfg.out_dir).encode()).hexdigest()[:12]


def refuse_another_runs_events(cfg):
    """A fresh start's purge from iter 0 on would hide all of the curves of a run of another
    out_dir in its tensorboard_dir: refused, as a fresh start beside another run's checkpoints is
    (weights.refuse_to_mix); out_dir's own earlier run's give way, as in out_dir. Rank 0's alone."""
    for folder, _ in tensorboard_locks(cfg):  # a tensorboard_dir other than out_dir
        others = sorted(name for name in os.listdir(folder) if "tfevents" in name and
                        not name.endswith(out_dir_mark(cfg)))
        if others:
            raise UserError(
                f"{folder} holds the TensorBoard event files of a run of another out_dir "
                f"({', '.join(others[:3])}{', ...' if others[3:] else ''}), which this run's would "
                f"hide: TensorBoard drops what a folder holds from the iter a run starts at. Give "
                f"this run another --tensorboard_dir, or move those event files elsewhere first.")


def import_tensorboard():
    """tensorboard's Event and Summary protocol buffers, imported only when asked for."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
    except ImportError as e:
        raise UserError(f"tensorboard_log=True, but tensorboard cannot be imported ({e}): "
                        f"install it, pip install tensorboard==2.20.0 (requirements.txt's "
                        f"version), or leave tensorboard_log out.") from e
    return event_pb2, summary_pb2


def open_tensorboard(cfg):
    """This run's event file in tensorboard_dir, open for appending; None without
    tensorboard_log. It is written here, in the main thread, a row at a time as metrics.jsonl
    is: torch's SummaryWriter writes in a thread of its own, which on a full disk printed its
    own traceback, while its flush raised the error again or waited for ever."""
    if not cfg.tensorboard_log:
        return None
    name = (f"events.out.tfevents.{time.time():010.0f}.{fileio.HOST}.{os.getpid()}."
            f"{out_dir_mark(cfg)}")
    return open(os.path.join(cfg.tensorboard_dir or cfg.out_dir, name), "ab")


def purge(start_iter):
    """The events that open a run's event file: its format, and the run's first iter (torch's
    purge_step), from which TensorBoard's readers drop what earlier runs wrote there, as read()
    drops those rows of metrics.jsonl (docs/training.md): no step is shown twice."""
    event_pb2, _ = import_tensorboard()
    return (as_record(start_iter, file_version="brain.Event:2") + as_record(
        start_iter, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))


def as_record(step, **what):
    """An event at step (what: its file_version, session_log or summary) as a record of the event
    file: its length, its data and their masked CRCs, as tensorboard's RecordWriter writes them."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    event_pb2, _ = import_tensorboard()
    data = event_pb2.Event(wall_time=time.time(), step=step, **what).SerializeToString()
    header = struct.pack("<Q", len(data))
    return b"".join([header, struct.pack("<I", masked_crc32c(header)), data,
                     struct.pack("<I", masked_crc32c(data))])


def record(metrics, row):
    """One row of metrics.jsonl (and of wandb, and TensorBoard); rank 0 alone has them open."""
    if metrics.file is not None:
        append(metrics, metrics.file, json.dumps(row) + "\n")
    if metrics.wandb is not None:
        metrics.wandb.log(row, step=row["iter"])
    if metrics.tensorboard is not None:  # the row's scalars as an event, at its iter
        _, pb = import_tensorboard()
        summary = pb.Summary(value=[pb.Summary.Value(tag=k, simple_value=v)
                                    for k, v in scalars(row).items()])
        append(metrics, metrics.tensorboard, as_record(row["iter"], summary=summary))


def append(metrics, file, data):
    """data at the end of file (metrics.jsonl, or the event file), flushed: a run killed later
    keeps it. A file that cannot be written (a full disk) ends the run."""
    try:
        file.write(data)
        file.flush()
    except OSError as e:
        folder, out_dir = (os.path.dirname(f.name) for f in (file, metrics.file))
        key = "out_dir" if os.path.samefile(folder, out_dir) else "tensorboard_dir"
        raise UserError(f"could not write {file.name}: {fileio.disk_full(e, folder) or e.strerror}"
                        f". The checkpoints in {out_dir} are intact: free space there, or move "
                        f"{key}, and resume with --init_from=resume.") from e


def scalars(row):
    """A row's numbers by key, its iter aside: what TensorBoard shows of it. Its text
    (batch_fp, skipped) and each rank's lists (rank_ms, ...) are metrics.jsonl's alone."""
    return {name: value for name, value in row.items() if name != "iter" and
            isinstance(value, (int, float)) and not isinstance(value, bool)}


def close(metrics):
    if metrics.file is not None:
        metrics.file.close()
    if metrics.wandb is not None:
        metrics.wandb.finish()
    if metrics.tensorboard is not None:
        metrics.tensorboard.close()


# ---- the console ----

def log_step(row, peak):
    mfu = f", mfu {row['mfu'] * 100:.1f}%" if peak else ""
    log.info(f"iter {row['iter']}: loss {row['loss']:.4f}, grad norm {row['grad_norm']:.3g}, lr "
             f"{row['lr']:.2e}, {row['ms']:.1f} ms, {row['tok_per_s']:,.0f} tok/s{mfu}, data wait "
             f"{row['data_wait'] * 100:.1f}%")


# ---- every rank's numbers ----

def rank_telemetry(alone_s, data_wait_s, peak_mem, device, world_size):
    """Each rank's seconds alone in the step (before the gradients' all-reduce), seconds
    waiting for data, and peak memory (peak_mem, CUDA's allocated; None: the process's RSS),
    gathered on every rank: one small collective, on log steps only."""
    memory = peak_mem if peak_mem is not None else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    mine = torch.tensor([alone_s * 1000, data_wait_s * 1000, memory / 2**20],
                        dtype=torch.float64, device=device)
    every = [mine]
    if world_size > 1:
        every = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
    ms, wait, mib = zip(*torch.stack(every).tolist())
    return {"rank_ms": list(ms), "rank_data_wait_ms": list(wait), "rank_mem_mib": list(mib)}


def log_straggler(row, slowest):
    """Name the slowest rank, by how much, once it stays the slowest (STRAGGLER_*): on a busy
    machine the slowest rank of one step is noise that flips from rank to rank; a slow disk,
    node or GPU stays. slowest (Metrics.slowest) holds the log steps since a rank was last
    named: naming one empties it, so a rank that stays slow is named again STRAGGLER_STEPS log
    steps later, not at every one."""
    ms = row["rank_ms"]
    if len(ms) < 2:
        return
    rank = max(range(len(ms)), key=ms.__getitem__)
    others = statistics.median(ms[:rank] + ms[rank + 1:])
    slowest.append((rank, row["iter"], ms[rank], others, row["rank_data_wait_ms"][rank]))
    if len(slowest) < STRAGGLER_STEPS or any(
            r != rank or m < STRAGGLER_MARGIN * o for r, _, m, o, _ in slowest):
        return
    _, iters, alone, median, waits = zip(*slowest)
    alone, median, wait = (statistics.fmean(v) for v in (alone, median, waits))
    log.info(f"iter {row['iter']}: rank {rank} is the slowest, at each of the last {len(slowest)} "
             f"log steps (iters {iters[0]} to {iters[-1]}): {alone:.1f} ms alone in the step "
             f"against a median of {median:.1f} ms for the other ranks, {alone / median:.2f}x "
             f"(+{alone - median:.1f} ms a step), {wait:.1f} ms of it waiting for data")
    slowest.clear()


# ---- reading metrics.jsonl back ----

class Rows(NamedTuple):
    """A run's rows in its metrics.jsonl, as the run stands."""
    steps: dict  # {iter: the row of that optimizer step}
    evals: dict  # {iter: the row of the evaluation at that iter}
    starts: list  # its start rows: the fresh start, then each resumption
    earlier: int  # rows of earlier runs in the file, left out


def read(out_dir):
    """The Rows of the run in out_dir: those after its last fresh start (an earlier run in the same
    out_dir that left no checkpoint wrote the rows before it). A resumed run starts again at its
    checkpoint's iter, so its rows replace those its previous attempt logged from that iter on. Rows
    written by older versions, with no start rows, are one run, a step logged twice counting last.
    Each row must be JSON; a partial last line (a process killed while writing it) is left out."""
    path = os.path.join(out_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}): give the "
                        f"out_dir of a train.py run") from e
    steps, evals, starts, earlier = {}, {}, [], 0
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as e:
            if n == len(lines):
                break
            raise not_a_row(path, n, f"is not JSON ({e})") from e
        if not isinstance(row, dict) or not isinstance(row.get("iter"), int):
            raise not_a_row(path, n, f"is not a row of train.py's ({line[:40]!r})")
        if row.get("run") == "fresh":
            steps, evals, starts, earlier = {}, {}, [], n - 1
        if "run" in row:
            starts.append(row)
            steps, evals = ({i: r for i, r in d.items() if i < row["iter"]} for d in (steps, evals))
        elif "loss" in row:
            steps[row["iter"]] = row
        elif "val_loss" in row:
            evals[row["iter"]] = row
    return Rows(steps, evals, starts, earlier)


def not_a_row(path, n, what):
    return UserError(f"{path}, line {n} {what}: metrics.jsonl holds one JSON object per line, "
                     f"each with its iter, as train.py writes them")
