"""Data mixtures: the same train data as one source and as a mixture of 8, read as
train.py reads it (data.mixture over each source's train split, loader.rank_batches), under
torchrun: start-up, data setup and batch latency. The launches, their measuring and their
medians are the data part's (datapath.py, datapath_rank.py's ddpgpt loader)."""
import os
import shutil

from benchmarks import datapath, report
from benchmarks.common import GiB, MiB
from benchmarks.datapath_rank import BATCH, BLOCK

TITLE = "Data mixtures"
WEIGHTS = [0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]  # a source per weight, each 1/8 of the data
FULL = {"size": GiB, "weights": WEIGHTS, "ranks": [1, 2], "batches": 1000, "launches": 3}
# small: one rank count, two launches (the plumbing; every rank count is judged alike)
SMALL = {"size": 16 * MiB, "weights": WEIGHTS, "ranks": [2], "batches": 30, "launches": 1}
LATENCY_RATIO = 1.5  # the p50 target: a mixture's batch within 1.5x of one source's
TABLES = {"table": [
    ("ranks", "{ranks}"), ("sources", "{sources}"), ("files read", "{files_read}"),
    ("start-up s", "{startup_s:.2f}"), ("data setup s", "{setup_s:.3f}"),
    ("private first", "{private_first:size}"),
    ("private after {batches:,}", "{private_after:size}"),
    ("batches/s per rank", "{batches_per_s:,.0f}"), ("p50 ms", "{p50_ms:.2f}"),
    ("p99 ms", "{p99_ms:.2f}"), ("load", "{load_1m}")]}


def data_mix(folders, weights):
    """The sources as train.py's --data_mix takes them."""
    return ",".join(f"{folder}={weight}" for folder, weight in zip(folders, weights))


def run(small, device, workdir):
    settings = SMALL if small else FULL
    size, weights = settings["size"], settings["weights"]
    one = datapath.sparse_token_file(os.path.join(workdir, "one"), size)
    parts = [datapath.sparse_token_file(os.path.join(workdir, f"source{k}"),
                                        size // len(weights)) for k in range(len(weights))]
    # the data part's measure() names a case by its number of files: one per source here
    folders = {(size, 1): one, (size, len(parts)): data_mix(parts, weights)}
    cases = [("ddpgpt", 1), ("ddpgpt", len(parts))]
    rows = []
    for ranks in settings["ranks"]:
        rows += [{"sources": r["files"], **r}
                 for r in datapath.measure(cases, size, ranks, folders, settings, workdir)]
    for folder in (one, *parts):
        shutil.rmtree(folder)
    return {"settings": {**settings, "sources": len(parts), "batch": [BATCH, BLOCK]},
            "results": rows, "targets": targets(rows, settings, len(parts))}


def targets(rows, settings, n):
    size = settings["size"]
    return [datapath.within_target(
                rows, settings, "startup_s", {"size": size, "files": 1},
                {"size": size, "files": n},
                f"start-up (process start to first batch, slowest rank) with {n} sources within "
                f"10% of 1 source, {report.size(size)} of train data either way"),
            latency_target(rows, settings, n)]


def latency_target(rows, settings, n):
    """p50 batch latency with n sources within LATENCY_RATIO of one source's, at every rank
    count."""
    parts, met = [], True
    for ranks in settings["ranks"]:
        one, mix = (datapath.find(rows, ranks=ranks, sources=k) for k in (1, n))
        if one is None or mix is None:
            met = False
            parts.append(f"{ranks} rank(s): not measured")
            continue
        ratio = mix["p50_ms"] / one["p50_ms"]
        met = met and ratio <= LATENCY_RATIO
        parts.append(f"{ranks} rank(s): {mix['p50_ms']:.2f} ms vs {one['p50_ms']:.2f} ms "
                     f"({ratio:.2f}x)")
    return {"target": f"p50 batch latency with {n} sources within {LATENCY_RATIO}x of 1 "
                      f"source's, at every rank count", "measured": "; ".join(parts), "met": met}


def plot(result):
    return report.line_plot(
        result, "One source against a mixture of the same data",
        ("ranks", "ranks", 1, "linear"),
        [("startup_s", "start-up, s (slowest rank)", 1, "linear"),
         ("setup_s", "data setup, s (slowest rank)", 1, "linear"),
         ("p50_ms", "p50 batch latency, ms", 1, "linear"),
         ("p99_ms", "p99 batch latency, ms", 1, "linear")], series=("sources",))
