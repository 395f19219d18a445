"""The data path against the size of train.bin: start-up time, memory per rank and the latency
of one batch, for data.py (in 'epoch' and 'documents' mode) and two reference loaders, each
launched with torchrun (gloo) as a user launches a job; data.py on the largest size again as a
set of many shards, against one file of it; and the document index: how fast it is built, and
that every window of an epoch of 'documents' mode starts where a document does. What one rank
does and the two references are in datapath_rank.py."""
import glob
import json
import os
import shutil
import sys
import time

import numpy as np

from benchmarks import common, report
from ddpgpt import data, docindex, sources, tokenfile
from benchmarks.common import GiB, MiB
from benchmarks.datapath_rank import BATCH, BLOCK, SEED, data_sources

TITLE = "Data path"
# as named in datapath_rank.py and text/data.md
LOADERS = ("ddpgpt", "documents", "nanogpt", "seed")
# launches: how many times ddpgpt and (a) run each case (the median is kept); the seed's
# loader, slow and capped, runs once. shards: the largest size again, as that many shards
# (ddpgpt only: the references read one train.bin). index_size: the real token file that the
# index is built from and checked against
FULL = {"sizes": [16 * MiB, GiB, 16 * GiB], "ranks": [1, 2, 8], "batches": 1000,
        "launches": 3, "seed_mem_cap": 6 * GiB, "seed_time_cap_s": 30, "shards": 10_000,
        "index_size": GiB}
# small: the seed's loader still finishes at 1 MiB and passes its cap at 64 MiB (its one
# rank's permutation alone holds more than the cap); one rank, started without torchrun, so
# that each of the nine launches starts one process, not two or three (the mix part reads with
# two ranks, through torchrun)
SMALL = {"sizes": [MiB, 64 * MiB], "ranks": [1], "batches": 20,
         "launches": 1, "seed_mem_cap": GiB, "seed_time_cap_s": 30, "shards": 1_000,
         "index_size": 32 * MiB, "torchrun": False}
# what torchrun gives one rank, for one started without it: a process group of one, whose
# store needs no free port
ALONE = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": "0"}
EOT = 50256
# documents' lengths in tokens, lognormal: a median of 600 and a mean of about 1,000, as web
# text's in GPT-2's tokens (OpenWebText: 9.0e9 tokens in 8.0e6 documents)
DOC_MEDIAN, DOC_SIGMA = 600, 1.0
SAFETY_TIME_CAP_S = 600  # the other loaders are not capped; this only stops a hung launch
TABLES = {"table": [
    ("ranks", "{ranks}"), ("train split", "{size:size}"), ("files", "{files:,}"),
    ("loader", "{loader}"),
    ("start-up s", "{startup_s:.2f}"), ("data setup s", "{setup_s:.3f}"),
    ("RSS first", "{rss_first:size}"), ("private first", "{private_first:size}"),
    ("RSS after {batches:,}", "{rss_after:size}"),
    ("private after {batches:,}", "{private_after:size}"),
    ("batches/s per rank", "{batches_per_s:,.0f}"), ("p50 ms", "{p50_ms:.2f}"),
    ("p99 ms", "{p99_ms:.2f}"), ("load", "{load_1m}")], "index": [
    ("token file", "{size:size}"), ("documents", "{documents:,}"), ("build s", "{build_s:.2f}"),
    ("build CPU s", "{build_cpu_s:.2f}"), ("GB of tokens/s per core", "{gb_per_cpu_s:.2f}"),
    ("windows of an epoch", "{windows:,}"), ("at a start", "{aligned:.4%}"),
    ("each start once", "{each_once}"), ("load", "{load_1m}")]}


def sparse_file(path, size):
    """A file of `size` bytes that takes no disk space: it reads as zeros (token 0)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def write_sparse_meta(folder, train):
    """meta.json as prepare.py writes it, so data.py takes its usual checked path."""
    tokenfile.write_meta(folder, tokenizer="none (sparse benchmark file)", vocab_size=50257,
                         eot_token=50256, splits={"train": train})


def sparse_token_file(folder, size):
    """A folder holding a sparse train.bin of `size` bytes, its meta.json and its index."""
    os.makedirs(folder, exist_ok=True)
    path = sparse_file(os.path.join(folder, "train.bin"), size)
    write_sparse_meta(folder, tokenfile.describe_split(path, "uint16", 0))
    sparse_documents(folder)
    return folder


def document_lengths(rng, n):
    return np.maximum(rng.lognormal(np.log(DOC_MEDIAN), DOC_SIGMA, n).astype(np.int64), 2)


def sparse_documents(folder):
    """The document index of the folder's sparse train.bin as if it held documents of web
    text's lengths (its tokens, all 0, have no end-of-text to find), written by
    docindex.Writer as prepare.py writes one: about 8 bytes per 1,000 tokens."""
    token_split = tokenfile.open_split(folder, "train", 1)
    writer, rng, at = docindex.Writer(docindex.doc_index_path(folder, "train")), \
        np.random.default_rng(0), 0
    while at < token_split.n_tokens:
        lengths = document_lengths(rng, 2**20)
        starts = at + np.cumsum(lengths) - lengths
        starts = starts[starts < token_split.n_tokens]
        writer.add(starts)
        at = int(starts[-1] + lengths[len(starts) - 1])
    writer.finish(token_split, EOT)


def sparse_shard_set(folder, size, n_shards):
    """A folder holding a train split of `size` bytes as n_shards sparse shards of (nearly)
    equal size, train_000000.bin ..., each listed in meta.json as prepare.py --shard_tokens
    lists it: the same number of tokens as one sparse train.bin of `size` bytes."""
    os.makedirs(folder, exist_ok=True)
    tokens, dtype = size // 2, np.dtype(np.uint16)
    shards = []
    for k in range(n_shards):
        name = f"train_{k:06d}.bin"
        n = tokens // n_shards + (k < tokens % n_shards)
        path = sparse_file(os.path.join(folder, name), n * dtype.itemsize)
        shards.append({"file": name, **tokenfile.describe_split(path, dtype, 0)})
    paths = [os.path.join(folder, s["file"]) for s in shards]
    write_sparse_meta(folder, {"tokens": tokens, "documents": 0, "shards": shards,
                               "fingerprint": tokenfile.sampled_fingerprint(paths)})
    return folder


def token_files(folder):
    return glob.glob(os.path.join(glob.escape(folder), "*.bin"))


def evict(folder):
    """Drop the token files' and the index's pages from the page cache, so that every launch
    starts cold and no loader reads what the one before it brought in."""
    for path in token_files(folder) + glob.glob(os.path.join(glob.escape(folder), "*.docidx")):
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


def launch(loader, folder, ranks, settings, out):
    """One torchrun job of `ranks` ranks reading the folder's train split with `loader` (or,
    for ddpgpt, a mixture's: `folder` as data_mix writes it), its files evicted first: its
    per-rank numbers, or why it did not finish."""
    for source in data_sources(folder):
        evict(source.folder)
    is_seed = loader == "seed"
    alone = ranks == 1 and not settings.get("torchrun", True)
    finished = common.run_watched(
        [*([sys.executable] if alone else common.torchrun(ranks)), "-m",
         "benchmarks.datapath_rank", loader, folder, out, str(settings["batches"])],
        common.child_env(OMP_NUM_THREADS="1", **(ALONE if alone else {})),
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
    return {**worst, "files_read": min(r["files"] for r in per_rank),
            "batches_per_s": float(np.mean([r["batches_per_s"] for r in per_rank])),
            "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99))}


def median_launch(launches):
    """One row for the launches of one case: each number is the median over them, since the
    machine's other work makes any single start-up time noisy; a launch that failed is the row."""
    failed = [r for r in launches if r["status"] != "ok"]
    if failed:
        return failed[0]
    return {**{k: float(np.median([r[k] for r in launches]))
               if isinstance(v, (int, float)) and k not in ("ranks", "files_read") else v
               for k, v in launches[0].items()}, "launches": len(launches)}


def run(small, device, workdir):
    settings = SMALL if small else FULL
    sizes, n_shards = settings["sizes"], settings["shards"]
    folders = {(size, 1): sparse_token_file(os.path.join(workdir, f"size{size}"), size)
               for size in sizes}
    print(f"bench data: {report.size(sizes[-1])} in {n_shards:,} shards", file=sys.stderr)
    folders[sizes[-1], n_shards] = sparse_shard_set(
        os.path.join(workdir, f"shards{n_shards}"), sizes[-1], n_shards)
    rows = []
    # rank counts outermost: the launches that a target compares (the sizes and loaders at
    # one rank count) run minutes apart at most, under about the same load from other work
    for ranks in settings["ranks"]:
        for size in sizes:
            cases = [(loader, 1) for loader in LOADERS] + \
                    ([("ddpgpt", n_shards)] if size == sizes[-1] else [])
            rows += measure(cases, size, ranks, folders, settings, workdir)
    ahead = read_ahead_kb(token_files(folders[sizes[0], 1])[0])
    for folder in folders.values():
        shutil.rmtree(folder)  # also drops the page cache its files filled
    index = [index_row(os.path.join(workdir, "index"), settings["index_size"])]
    return {"settings": {**settings, "batch": [BATCH, BLOCK], "read_ahead_kb": ahead,
                         "doc_median": DOC_MEDIAN, "doc_sigma": DOC_SIGMA},
            "results": rows, "index": index, "targets": targets(rows, index, settings)}


def documents_file(folder, size):
    """A folder holding a real train.bin of `size` bytes: random GPT-2 ids in documents of web
    text's lengths, each ended by end-of-text, and its meta.json."""
    os.makedirs(folder, exist_ok=True)
    path, rng, n = os.path.join(folder, "train.bin"), np.random.default_rng(1), size // 2
    with open(path, "wb") as f:
        for at in range(0, n, 2**24):
            tokens = rng.integers(0, EOT, min(2**24, n - at), dtype=np.uint16)
            ends = np.cumsum(document_lengths(rng, len(tokens) // 100 + 1))
            tokens[ends[ends <= len(tokens)] - 1] = EOT  # documents cut at a chunk's end, too
            tokens.tofile(f)
    write_sparse_meta(folder, tokenfile.describe_split(path, "uint16", 0))
    return tokenfile.open_split(folder, "train", BLOCK)


def index_row(folder, size):
    """The index of a real token file built by index_documents.py's function from a warm page
    cache, timed in wall and CPU seconds (one core's work); then every window of an epoch of
    'documents' mode against the starts found in the tokens, here, independently."""
    token_split = documents_file(folder, size)
    path = token_split.paths[0]
    with open(path, "rb") as f:  # the page cache warm, as after prepare.py wrote the file
        while f.read(64 * MiB):
            pass
    t, cpu = time.perf_counter(), time.process_time()
    docindex.build(token_split, docindex.doc_index_path(folder, "train"), EOT)
    build_s, build_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    token_split = sources.open_split(folder, "train", BLOCK, mode="documents")
    n = int(data.windows(data.mixture([token_split]), BLOCK, "documents").n[0])
    offsets = data.sample_offsets(np.arange(n), token_split, BLOCK, SEED, "documents")
    expected = document_starts(np.memmap(path, dtype=np.uint16, mode="r"))
    row = {"size": size, "documents": token_split.docs.documents, "build_s": build_s,
           "build_cpu_s": build_cpu_s, "gb_per_cpu_s": size / build_cpu_s / 1e9,
           "windows": n, "aligned": float(np.isin(offsets, expected).mean()),
           "each_once": bool(np.array_equal(np.sort(offsets), expected)),
           "load_1m": common.load_1m(), "status": "ok"}
    shutil.rmtree(folder)
    return row


def document_starts(tokens):
    """Every start of 'documents' mode in one file's tokens, sorted: each document's first
    token (the file's first, and each after an end-of-text), then every BLOCK-th while the
    document has targets left. Written here from the contract, not with data.py."""
    firsts = np.concatenate([[0], np.flatnonzero(tokens == EOT) + 1])
    firsts = firsts[firsts < len(tokens)]
    each = (np.diff(np.append(firsts, len(tokens))) - 2) // BLOCK + 1  # 0: one token
    level = np.arange(each.sum()) - np.repeat(np.cumsum(each) - each, each)
    return np.repeat(firsts, each) + BLOCK * level


def measure(cases, size, ranks, folders, settings, workdir):
    """The rows of the (loader, files) cases at one size and rank count. The cases take turns,
    launch after launch, so that a change in the machine's load falls on all of them alike;
    the seed's loader runs in the first turn only."""
    launches = {case: [] for case in cases}
    for turn in range(settings["launches"]):
        for loader, files in cases:
            if loader == "seed" and turn:
                continue
            print(f"bench data: {report.size(size)} in {files:,} file(s), {ranks} rank(s), "
                  f"{loader}", file=sys.stderr)
            out = os.path.join(workdir, f"{loader}-{size}-{files}-{ranks}")
            launches[loader, files].append(
                launch(loader, folders[size, files], ranks, settings, out))
    return [{"size": size, "files": files, **median_launch(launches[loader, files])}
            for loader, files in cases]


def find(rows, **where):
    return next((r for r in rows if r["status"] == "ok"
                 and all(r[k] == v for k, v in where.items())), None)


def within_target(rows, settings, key, base, case, target, loader="ddpgpt"):
    """loader's `key` in the `case` rows within 10% of the `base` rows (each a dict of the
    fields that pick a row), at every rank count."""
    parts, met = [], True
    for ranks in settings["ranks"]:
        a, b = (find(rows, loader=loader, ranks=ranks, **where) for where in (base, case))
        met = met and a is not None and b is not None and b[key] / a[key] - 1 <= 0.10
        parts.append(f"{ranks} rank(s): " + (compare(key, a, b) if a and b else "not measured"))
    return {"target": target, "measured": "; ".join(parts), "met": met}


def growth_target(rows, settings, key, what, loader="ddpgpt"):
    """loader's `key` at the largest file within 10% of the smallest."""
    small, large = settings["sizes"][0], settings["sizes"][-1]
    return within_target(rows, settings, key, {"size": small, "files": 1},
                         {"size": large, "files": 1},
                         f"{what} at {report.size(large)} within 10% of {report.size(small)} "
                         f"({loader})", loader)


def shards_target(rows, settings, key, what):
    """ddpgpt's `key` on the largest size as a shard set within 10% of it as one file."""
    size, n = settings["sizes"][-1], settings["shards"]
    return within_target(rows, settings, key, {"size": size, "files": 1},
                         {"size": size, "files": n},
                         f"{what} with {report.size(size)} in {n:,} shards within 10% of one "
                         f"{report.size(size)} file (ddpgpt)")


def compare(key, a, b):
    """ddpgpt's `key` in row b (the larger file, or the shard set) against row a."""
    change = f"{b[key] / a[key] - 1:+.0%}"
    if key == "startup_s":  # and its part that touches the file
        return (f"{b[key]:.2f} s vs {a[key]:.2f} s ({change}; data setup {b['setup_s']:.3f} s "
                f"vs {a['setup_s']:.3f} s)")
    return f"{b[key] / MiB:,.0f} MiB vs {a[key] / MiB:,.0f} MiB ({change})"


def latency_target(rows, key):
    """ddpgpt's latency no worse than reference (a)'s, at every size and rank count."""
    pairs = [(r, find(rows, loader="nanogpt", size=r["size"], ranks=r["ranks"]))
             for r in rows if r["loader"] == "ddpgpt" and r["files"] == 1]
    ratios = [(r[key] / ref[key], r, ref) for r, ref in pairs if r["status"] == "ok" and ref]
    measured = "not measured"
    if ratios:
        ratio, r, ref = max(ratios, key=lambda m: m[0])
        measured = (f"worst at {report.size(r['size'])}, {r['ranks']} rank(s): {r[key]:.2f} ms "
                    f"vs {ref[key]:.2f} ms ({ratio:.2f}x)")
    return {"target": f"batch latency {key[:3]} no worse than (a) nanoGPT's, at every size and "
                      f"rank count", "measured": measured,
            "met": len(ratios) == len(pairs) and all(m[0] <= 1 for m in ratios)}


def targets(rows, index, settings):
    after = f"after {settings['batches']:,} batches"
    what = {"startup_s": "start-up (process start to first batch, slowest rank)",
            "rss_first": "RSS at the first batch",
            "private_first": "private memory at the first batch",
            "rss_after": f"RSS {after}", "private_after": f"private memory {after}"}
    return [*(growth_target(rows, settings, key, text) for key, text in what.items()),
            latency_target(rows, "p50_ms"), latency_target(rows, "p99_ms"),
            *(shards_target(rows, settings, key, what[key])
              for key in ("startup_s", "rss_first", "rss_after")),
            *(growth_target(rows, settings, key, what[key], loader="documents")
              for key in ("startup_s", "rss_first", "rss_after")),
            *index_targets(index[0])]


def index_targets(row):
    return [{"target": "the document index built at 1 GB of tokens per second per core or "
                       "more, from a warm page cache (index_documents.py's docindex.build)",
             "measured": f"{row['gb_per_cpu_s']:.2f} GB/s per core: {report.size(row['size'])} "
                         f"of tokens in {row['build_cpu_s']:.2f} CPU s ({row['build_s']:.2f} s "
                         f"wall)", "met": row["gb_per_cpu_s"] >= 1},
            {"target": "100% of the windows of an epoch of sampling='documents' begin at a start "
                       "(a document's first token, or a block_size further in it), each start "
                       "once", "measured": f"{row['aligned']:.4%} of {row['windows']:,} windows, "
                                           f"each start once: {row['each_once']}",
             "met": row["aligned"] == 1 and row["each_once"]}]


def plot(result):
    return report.line_plot(
        result, "Data path against the size of the train split",
        ("size", "train split, MiB", MiB, "log"),
        [("startup_s", "start-up, s (slowest rank)", 1, "linear"),
         ("private_after", "private memory after the last batch, MiB", MiB, "linear"),
         ("rss_after", "RSS after the last batch, MiB", MiB, "linear"),
         ("p50_ms", "p50 batch latency, ms", 1, "log")], series=("loader", "files", "ranks"))
