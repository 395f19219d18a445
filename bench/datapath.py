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

TITLE = "Data path"
LOADERS = {"ddpgpt": "ddpgpt (data.rank_batches, prefetch=0)",
           "nanogpt": "(a) nanoGPT: fresh memmap + torch.randint per batch",
           "seed": "(b) seed: a sample per token offset + DistributedSampler"}
# launches: how many times ddpgpt and (a) run each case (the median is kept); the seed's
# loader, slow and capped, runs once
FULL = {"sizes": [16 * MiB, GiB, 16 * GiB], "ranks": [1, 2, 8], "batches": 1000,
        "launches": 3, "seed_mem_cap": 6 * GiB, "seed_time_cap_s": 30}
# small: the seed's loader still finishes at 1 MiB and passes its cap at 64 MiB
SMALL = {"sizes": [MiB, 64 * MiB], "ranks": [2], "batches": 20,
         "launches": 1, "seed_mem_cap": 2 * GiB, "seed_time_cap_s": 30}
SAFETY_TIME_CAP_S = 600  # the other loaders are not capped; this only stops a hung launch


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
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


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


def launch(loader, folder, ranks, settings, out):
    """One torchrun job of `ranks` ranks reading with `loader`: its per-rank numbers, or why
    it did not finish."""
    is_seed = loader == "seed"
    finished = common.run_watched(
        [*common.torchrun(ranks), "-m", "bench.datapath_rank", loader, folder, out,
         str(settings["batches"])],
        common.child_env(OMP_NUM_THREADS="1"),
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


def median_launch(launches):
    """One row for the launches of one case: each number is the median over them, since the
    machine's other work makes any single start-up time noisy; a launch that failed is the row."""
    failed = [r for r in launches if r["status"] != "ok"]
    if failed:
        return failed[0]
    return {**{k: float(np.median([r[k] for r in launches]))
               if isinstance(v, (int, float)) and k != "ranks" else v
               for k, v in launches[0].items()}, "launches": len(launches)}


def summarize(per_rank):
    """The slowest rank's start-up, the largest rank's memory, latency over all ranks."""
    latencies = np.concatenate([r["latency_ms"] for r in per_rank])
    worst = {key: max(r[key] for r in per_rank) for key in ("startup_s", "setup_s")}
    for when in ("first", "after"):
        for kind in ("rss", "private", "file"):
            worst[f"{kind}_{when}"] = max(r[when][kind] for r in per_rank)
    return {**worst, "batches_per_s": float(np.mean([r["batches_per_s"] for r in per_rank])),
            "p50_ms": common.percentile(latencies, 50),
            "p99_ms": common.percentile(latencies, 99)}


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
                launches = []
                for _ in range(1 if loader == "seed" else settings["launches"]):
                    evict(path)
                    print(f"bench data: {report.size(size)}, {ranks} rank(s), {loader}",
                          file=sys.stderr)
                    out = os.path.join(workdir, f"{loader}-{size}-{ranks}")
                    launches.append(launch(loader, os.path.dirname(path), ranks, settings, out))
                rows.append({"size": size, **median_launch(launches)})
    ahead = read_ahead_kb(files[settings["sizes"][0]])
    for path in files.values():
        os.remove(path)  # also drops the page cache it filled
    return {"settings": {**settings, "batch": [12, 1024], "read_ahead_kb": ahead,
                         "files": "sparse (read as zeros), evicted from the page cache "
                                  "before every launch"},
            "results": rows, "targets": targets(rows, settings)}


# ---- targets ----

def find(rows, **where):
    for r in rows:
        if all(r[k] == v for k, v in where.items()) and r["status"] == "ok":
            return r
    return None


def growth_target(rows, settings, key, what, fmt, detail=None):
    """ddpgpt's `key` at the largest file within 10% of the smallest, for every rank count;
    detail(small row, large row) adds to what is shown for each."""
    small, large = settings["sizes"][0], settings["sizes"][-1]
    parts, met = [], True
    for ranks in settings["ranks"]:
        a = find(rows, loader="ddpgpt", size=small, ranks=ranks)
        b = find(rows, loader="ddpgpt", size=large, ranks=ranks)
        if a is None or b is None:
            parts.append(f"{ranks} rank(s): not measured")
            met = False
            continue
        change = b[key] / a[key] - 1
        met = met and change <= 0.10
        more = f"; {detail(a, b)}" if detail else ""
        parts.append(f"{ranks} rank(s): {fmt(b[key])} vs {fmt(a[key])} ({change:+.0%}{more})")
    return {"target": f"{what} at {report.size(large)} within 10% of {report.size(small)} "
                      f"(ddpgpt)", "measured": "; ".join(parts), "met": met}


def latency_target(rows, key):
    """ddpgpt's latency no worse than reference (a)'s, at every size and rank count."""
    worst, met = None, True
    for r in rows:
        if r["loader"] != "ddpgpt":
            continue
        ref = find(rows, loader="nanogpt", size=r["size"], ranks=r["ranks"])
        if r["status"] != "ok" or ref is None:
            met = False
            continue
        ratio = r[key] / ref[key]
        met = met and ratio <= 1
        if worst is None or ratio > worst[0]:
            worst = (ratio, r, ref)
    measured = "not measured"
    if worst is not None:
        ratio, r, ref = worst
        measured = (f"worst at {report.size(r['size'])}, {r['ranks']} rank(s): {r[key]:.2f} ms "
                    f"vs {ref[key]:.2f} ms ({ratio:.2f}x)")
    return {"target": f"batch latency {key[:3]} no worse than (a) nanoGPT's, at every size and "
                      f"rank count", "measured": measured, "met": met}


def mib(n_bytes):
    return f"{n_bytes / MiB:,.0f} MiB"


def targets(rows, settings):
    return [
        growth_target(rows, settings, "startup_s", "start-up (process start to first batch, "
                      "slowest rank)", lambda s: f"{s:.2f} s", detail=lambda a, b:
                      f"data setup {b['setup_s']:.3f} s vs {a['setup_s']:.3f} s"),
        growth_target(rows, settings, "rss_first", "RSS at the first batch", mib),
        growth_target(rows, settings, "private_first", "private memory at the first batch", mib),
        growth_target(rows, settings, "rss_after", f"RSS after {settings['batches']:,} batches",
                      mib),
        growth_target(rows, settings, "private_after",
                      f"private memory after {settings['batches']:,} batches", mib),
        latency_target(rows, "p50_ms"),
        latency_target(rows, "p99_ms"),
    ]


# ---- report ----

def markdown(result):
    s = result["settings"]
    head = ["ranks", "train.bin", "loader", "start-up s", "data setup s", "RSS first",
            "private first", f"RSS after {s['batches']:,}", f"private after {s['batches']:,}",
            "batches/s per rank", "p50 ms", "p99 ms", "load"]
    body = []
    for r in result["results"]:
        cells = [r["ranks"], report.size(r["size"]), r["loader"]]
        if r["status"] == "ok":
            cells += [f"{r['startup_s']:.2f}", f"{r['setup_s']:.3f}",
                      *(report.size(r[k]) for k in ("rss_first", "private_first", "rss_after",
                                                    "private_after")),
                      f"{r['batches_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"]
        else:
            cells += [r["status"]] + [""] * 8
        body.append(cells + [r["load_1m"]])
    legend = "; ".join(f"`{k}`: {v}" for k, v in LOADERS.items())
    return [
        f"Batches of {s['batch'][0]} x {s['batch'][1]} tokens; {s['batches']:,} batches per "
        f"rank; token files {s['files']} (the disk's read-ahead: {s['read_ahead_kb']} KiB). "
        f"Loaders: {legend}. The seed's loader runs under a cap of "
        f"{s['seed_mem_cap'] / GiB:.0f} GiB of private memory (all ranks together) and "
        f"{s['seed_time_cap_s']} s.",
        "",
        f"Each row of ddpgpt and (a) is the median of {s['launches']} launch(es), each with "
        f"the file evicted first. "
        "Start-up is from the rank's process start (`psutil` create time) to its first batch, "
        "slowest rank; data setup is the part of it from opening the data to the first batch. "
        "Memory is the largest rank's: RSS, and its private (anonymous) part; the rest of RSS "
        "is the page cache of the mapped file, which the kernel shares and can drop. Latency "
        "is one `next()` over batches 2 to the last, all ranks pooled. Load: the machine's "
        "1-minute load average after the launch.",
        "",
        *report.table(head, body),
        "",
        "How to read it:",
        "",
        "- Start-up is Python's imports and the ranks' rendezvous, then the data setup "
        "column. Only the data setup touches the file, so between two sizes start-up differs "
        "by that column plus the noise of the machine's load on the imports.",
        "- RSS counts the file pages a process has mapped: a loader that kept one memmap open "
        "for the whole run would hold there the pages of every window it has read (and those "
        "the kernel maps around each fault) until the kernel reclaims them. (a) maps the file "
        "afresh for each batch, and ddpgpt maps nothing: it reads each window with `os.pread`. "
        "The page cache holds the pages either way.",
        "- Latency at the largest file: nearly every window is a page-cache miss. For a miss "
        "in a memmap, as in (a), the kernel reads the disk's read-ahead around the page (zeros "
        "here, the file being sparse); a `pread` of one window reads little more than the "
        "window.",
        "- p99 latency with more ranks than cores (8 ranks on a 2-core machine): the slowest "
        "1% of batches are those during which the kernel switched the rank out for another, so "
        "p99 is the scheduler's time slice, about the same for every loader, not the loader's "
        "cost.",
        "- Latency is the time to make one batch: ddpgpt runs here without the background "
        "thread that train.py reads the next batches in while a step runs (see the training "
        "part's data wait for what a step pays).",
        "- (b) builds a permutation of every token offset in every rank before its first "
        "batch: its start-up and private memory grow with the file until it passes its cap "
        "(or cannot allocate the permutation at all).",
    ]


def plot(result, path):
    import matplotlib.pyplot as plt

    panels = [("startup_s", "start-up, s (slowest rank)", 1, "linear"),
              ("private_after", "private memory after the last batch, MiB", MiB, "linear"),
              ("rss_after", "RSS after the last batch, MiB", MiB, "linear"),
              ("p50_ms", "p50 batch latency, ms", 1, "log")]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    styles = {"ddpgpt": "C0", "nanogpt": "C1", "seed": "C3"}
    markers = {1: "o", 2: "s", 8: "^"}
    for ax, (key, label, unit, yscale) in zip(axes.flat, panels):
        for loader, color in styles.items():
            for ranks in result["settings"]["ranks"]:
                pts = [(r["size"] / MiB, r[key] / unit) for r in result["results"]
                       if r["loader"] == loader and r["ranks"] == ranks and r["status"] == "ok"]
                if pts:
                    ax.plot(*zip(*pts), color=color, marker=markers.get(ranks, "x"),
                            label=f"{loader}, {ranks} rank(s)")
        ax.set_xscale("log")
        ax.set_yscale(yscale)
        if yscale == "linear":
            ax.set_ylim(bottom=0)
        ax.set_xlabel("train.bin, MiB")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8,
               title="seed: no point where it\npassed its cap or failed", title_fontsize=8)
    fig.suptitle("Data path against the size of train.bin")
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
