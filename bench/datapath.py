"""The data path against the size of train.bin: start-up time, memory per rank and the latency
of one batch, for data.py and two reference loaders, each launched with torchrun (gloo) as a
user launches a job. What one rank does and the two references are in datapath_rank.py."""
import json
import os
import sys

import numpy as np

import tokenfile
from bench import common, report
from bench.common import GiB, MiB
from bench.datapath_rank import BATCH, BLOCK

TITLE = "Data path"
LOADERS = ("ddpgpt", "nanogpt", "seed")  # as named in datapath_rank.py and text/data.md
# launches: how many times ddpgpt and (a) run each case (the median is kept); the seed's
# loader, slow and capped, runs once
FULL = {"sizes": [16 * MiB, GiB, 16 * GiB], "ranks": [1, 2, 8], "batches": 1000,
        "launches": 3, "seed_mem_cap": 6 * GiB, "seed_time_cap_s": 30}
# small: the seed's loader still finishes at 1 MiB and passes its cap at 64 MiB
SMALL = {"sizes": [MiB, 64 * MiB], "ranks": [2], "batches": 20,
         "launches": 1, "seed_mem_cap": 2 * GiB, "seed_time_cap_s": 30}
SAFETY_TIME_CAP_S = 600  # the other loaders are not capped; this only stops a hung launch
TABLES = {"table": [
    ("ranks", "{ranks}"), ("train.bin", "{size:size}"), ("loader", "{loader}"),
    ("start-up s", "{startup_s:.2f}"), ("data setup s", "{setup_s:.3f}"),
    ("RSS first", "{rss_first:size}"), ("private first", "{private_first:size}"),
    ("RSS after {batches:,}", "{rss_after:size}"),
    ("private after {batches:,}", "{private_after:size}"),
    ("batches/s per rank", "{batches_per_s:,.0f}"), ("p50 ms", "{p50_ms:.2f}"),
    ("p99 ms", "{p99_ms:.2f}"), ("load", "{load_1m}")]}


def sparse_token_file(folder, size):
    """A train.bin of `size` bytes that takes no disk space (it reads as token 0), with a
    meta.json as prepare.py writes it, so data.py takes its usual checked path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "train.bin")
    with open(path, "wb") as f:
        f.truncate(size)
    tokenfile.write_meta(folder, tokenizer="none (sparse benchmark file)", vocab_size=50257,
                         eot_token=50256,
                         splits={"train": tokenfile.describe_split(path, "uint16", 0)})
    return path


def evict(path):
    """Drop the file's pages from the page cache, so that every launch starts cold and no
    loader reads what the one before it brought in."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_ahead_kb(path):
    """The read-ahead of the disk that holds `path`: a page fault on a cold page of a memmap
    reads about this much around it, which is most of what a cold random read costs."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a disk, or a partition of one
        try:
            with open(f"{queue}/read_ahead_kb") as f:
                return int(f.read())
        except OSError:
            continue
    return None  # not on a block device (tmpfs, overlay)


def launch(loader, path, ranks, settings, out):
    """One torchrun job of `ranks` ranks reading with `loader`, the file evicted first: its
    per-rank numbers, or why it did not finish."""
    evict(path)
    is_seed = loader == "seed"
    finished = common.run_watched(
        [*common.torchrun(ranks), "-m", "bench.datapath_rank", loader, os.path.dirname(path),
         out, str(settings["batches"])], common.child_env(OMP_NUM_THREADS="1"),
        settings["seed_time_cap_s"] if is_seed else SAFETY_TIME_CAP_S,
        settings["seed_mem_cap"] if is_seed else None)
    row = {"loader": loader, "ranks": ranks, "load_1m": common.load_1m(),
           "wall_s": round(finished.wall_s, 2)}
    if finished.exceeded:
        return {**row, "status": f"exceeded the {finished.exceeded}"}
    if finished.returncode != 0:
        return {**row, "status": f"failed: {common.error_line(finished.output)}"}
    per_rank = []
    for r in range(ranks):
        with open(f"{out}.rank{r}.json") as f:
            per_rank.append(json.load(f))
    return {**row, "status": "ok", **summarize(per_rank)}


def summarize(per_rank):
    """The slowest rank's start-up, the largest rank's memory, latency over all ranks."""
    latencies = np.concatenate([r["latency_ms"] for r in per_rank])
    worst = {key: max(r[key] for r in per_rank) for key in ("startup_s", "setup_s")}
    for when in ("first", "after"):
        for kind in ("rss", "private", "file"):
            worst[f"{kind}_{when}"] = max(r[when][kind] for r in per_rank)
    return {**worst, "batches_per_s": float(np.mean([r["batches_per_s"] for r in per_rank])),
            "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99))}


def median_launch(launches):
    """One row for the launches of one case: each number is the median over them, since the
    machine's other work makes any single start-up time noisy; a launch that failed is the row."""
    failed = [r for r in launches if r["status"] != "ok"]
    if failed:
        return failed[0]
    return {**{k: float(np.median([r[k] for r in launches]))
               if isinstance(v, (int, float)) and k != "ranks" else v
               for k, v in launches[0].items()}, "launches": len(launches)}


def run(small, device, workdir):
    settings = SMALL if small else FULL
    files = {size: sparse_token_file(os.path.join(workdir, f"size{size}"), size)
             for size in settings["sizes"]}
    rows = []
    # rank counts outermost: the launches that a target compares (the sizes and loaders at
    # one rank count) run minutes apart at most, under about the same load from other work
    for ranks in settings["ranks"]:
        for size, path in files.items():
            for loader in LOADERS:
                print(f"bench data: {report.size(size)}, {ranks} rank(s), {loader}",
                      file=sys.stderr)
                out = os.path.join(workdir, f"{loader}-{size}-{ranks}")
                launches = [launch(loader, path, ranks, settings, out)
                            for _ in range(1 if loader == "seed" else settings["launches"])]
                rows.append({"size": size, **median_launch(launches)})
    ahead = read_ahead_kb(files[settings["sizes"][0]])
    for path in files.values():
        os.remove(path)  # also drops the page cache it filled
    return {"settings": {**settings, "batch": [BATCH, BLOCK], "read_ahead_kb": ahead},
            "results": rows, "targets": targets(rows, settings)}


def find(rows, **where):
    return next((r for r in rows if r["status"] == "ok"
                 and all(r[k] == v for k, v in where.items())), None)


def growth_target(rows, settings, key, what):
    """ddpgpt's `key` at the largest file within 10% of the smallest, at every rank count."""
    small, large = settings["sizes"][0], settings["sizes"][-1]
    parts, met = [], True
    for ranks in settings["ranks"]:
        a, b = (find(rows, loader="ddpgpt", size=size, ranks=ranks) for size in (small, large))
        met = met and a is not None and b is not None and b[key] / a[key] - 1 <= 0.10
        parts.append(f"{ranks} rank(s): " + (compare(key, a, b) if a and b else "not measured"))
    return {"target": f"{what} at {report.size(large)} within 10% of {report.size(small)} "
                      f"(ddpgpt)", "measured": "; ".join(parts), "met": met}


def compare(key, a, b):
    """ddpgpt's `key` at the largest file (b) against the smallest (a)."""
    change = f"{b[key] / a[key] - 1:+.0%}"
    if key == "startup_s":  # and its part that touches the file
        return (f"{b[key]:.2f} s vs {a[key]:.2f} s ({change}; data setup {b['setup_s']:.3f} s "
                f"vs {a['setup_s']:.3f} s)")
    return f"{b[key] / MiB:,.0f} MiB vs {a[key] / MiB:,.0f} MiB ({change})"


def latency_target(rows, key):
    """ddpgpt's latency no worse than reference (a)'s, at every size and rank count."""
    pairs = [(r, find(rows, loader="nanogpt", size=r["size"], ranks=r["ranks"]))
             for r in rows if r["loader"] == "ddpgpt"]
    ratios = [(r[key] / ref[key], r, ref) for r, ref in pairs if r["status"] == "ok" and ref]
    measured = "not measured"
    if ratios:
        ratio, r, ref = max(ratios, key=lambda m: m[0])
        measured = (f"worst at {report.size(r['size'])}, {r['ranks']} rank(s): {r[key]:.2f} ms "
                    f"vs {ref[key]:.2f} ms ({ratio:.2f}x)")
    return {"target": f"batch latency {key[:3]} no worse than (a) nanoGPT's, at every size and "
                      f"rank count", "measured": measured,
            "met": len(ratios) == len(pairs) and all(m[0] <= 1 for m in ratios)}


def targets(rows, settings):
    after = f"after {settings['batches']:,} batches"
    growth = [("startup_s", "start-up (process start to first batch, slowest rank)"),
              ("rss_first", "RSS at the first batch"),
              ("private_first", "private memory at the first batch"),
              ("rss_after", f"RSS {after}"), ("private_after", f"private memory {after}")]
    return [*(growth_target(rows, settings, key, what) for key, what in growth),
            latency_target(rows, "p50_ms"), latency_target(rows, "p99_ms")]


def plot(result):
    return report.line_plot(
        result, "Data path against the size of train.bin", ("size", "train.bin, MiB", MiB, "log"),
        [("startup_s", "start-up, s (slowest rank)", 1, "linear"),
         ("private_after", "private memory after the last batch, MiB", MiB, "linear"),
         ("rss_after", "RSS after the last batch, MiB", MiB, "linear"),
         ("p50_ms", "p50 batch latency, ms", 1, "log")], series=("loader", "ranks"))
