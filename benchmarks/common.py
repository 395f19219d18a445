"""What the parts of the benchmark share: a description of the machine, running a command as a
user would while watching its memory and time, train.py's configuration, and data folders of
random ids. The tests have a harness of their own (tests/conftest.py), with a torchrun command
line and data folders like these: the benchmarks stand on nothing of the tests'."""
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from benchmarks import report
from ddpgpt import configurator, docindex, tokenfile
from ddpgpt.settings import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 2**20, 2**30
EXCEPTION = re.compile(r"^(?:\[rank\d+\]: )?([\w.]*(?:Error|Exception): .*)")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine():
    """Everything a reader needs to judge a number: hardware, versions."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / GiB, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "os": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__}


def load_1m():
    """The 1-minute load average: on a shared machine it says how much to trust a timing."""
    return round(os.getloadavg()[0], 2)


def child_env(**extra):
    """The user's environment with this checkout importable (for `python -m benchmarks.x`), and
    no torchrun variables inherited from a caller that would make a child think it is a rank."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun(nproc):
    """The start of a torchrun command line, as users run it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}"]


def ranks_command(nproc):
    """The start of the command line of a measured run of nproc ranks: torchrun's, or a plain
    process for one rank, which has no process group (launch.init_distributed): it measures
    the same and spares torchrun's own start-up."""
    return torchrun(nproc) if nproc > 1 else [sys.executable]


def train_config(args):
    """train.py's configuration for these arguments (config files from the checkout)."""
    return configurator.parse(TrainConfig, [a if a.startswith("--") else os.path.join(ROOT, a)
                                            for a in args], "train.py")


def random_data(folder, vocab_size, n_train, tokenizer="random (benchmark)"):
    """A data folder of uniformly random ids, the last one end-of-text, with each split's
    document index: a model's speed does not depend on the text."""
    os.makedirs(folder, exist_ok=True)
    rng, eot, splits = np.random.default_rng(0), vocab_size - 1, {}
    dtype = tokenfile.token_dtype(vocab_size)
    for split, n in (("train", n_train), ("val", 20_000)):
        path = os.path.join(folder, f"{split}.bin")
        ids = rng.integers(0, vocab_size, n).astype(dtype)
        ids.tofile(path)
        splits[split] = tokenfile.describe_split(path, dtype, int(np.count_nonzero(ids == eot)))
    tokenfile.write_meta(folder, tokenizer=tokenizer, vocab_size=vocab_size, eot_token=eot,
                         splits=splits)
    for split in splits:
        docindex.build(tokenfile.open_split(folder, split, 1),
                       docindex.doc_index_path(folder, split), eot)
    return folder


@dataclass
class Finished:
    returncode: int  # -9 when it was killed for passing a cap
    output: str  # stdout and stderr together
    wall_s: float
    peak_rss: int  # the most that the process and all its children held at once (sum of RSS)
    peak_private: int  # the same for their private (anonymous) memory: RSS less file pages
    cpu_s: float  # user + system CPU time of the process and all the children it waited for
    exceeded: str  # which cap it passed, e.g. "memory cap 6.0 GiB after 12.1 s"; "" if none


def tree(proc):
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def tree_memory(proc):
    """(RSS, private memory) summed over a process and its children. Private is RSS less the
    pages mapped from files (statm's "shared"): the memory the processes hold themselves, which
    is what can run a machine out of memory; file pages are page cache the kernel can drop."""
    rss = private = 0
    for p in tree(proc):
        try:
            m = p.memory_info()
        except psutil.Error:  # exited between listing and reading
            continue
        rss, private = rss + m.rss, private + m.rss - m.shared
    return rss, private


def kill_tree(proc):
    """Kill a process and all its children, each by its pid: torchrun starts every rank in a
    session of its own, so killing the launcher's process group would leave the ranks."""
    killed = tree(proc)
    for p in killed:
        try:
            p.kill()
        except psutil.Error:
            pass
    # a kill is delivered asynchronously: wait until each is dead, so the next measurement does
    # not share the machine with it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(alive, killed)):
        time.sleep(0.02)


def alive(p):
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# How often run_watched samples a command's memory (seconds), unless told: a sample walks every
# process in /proc, about 4 ms, so at 0.05 s the watching costs some 5% of a core. bench.py
# --small, whose numbers mean nothing, samples at SMALL_POLL_S.
POLL_S, SMALL_POLL_S = 0.05, 0.25


def run_watched(args, env, time_cap_s, mem_cap=None, poll_s=None, cwd=ROOT):
    """Run a command in cwd, sampling the memory of it and its children every poll_s seconds
    (POLL_S if None). Past mem_cap bytes of private memory, or time_cap_s seconds, it is killed,
    so that a loader whose memory grows with the data shows that growth without taking the
    machine down."""
    poll_s = poll_s or POLL_S
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: a full pipe would block it
        cpu0 = children_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
        watched = psutil.Process(proc.pid)
        peak_rss = peak_private = 0
        exceeded = ""
        while proc.poll() is None:
            (rss, private), elapsed = tree_memory(watched), time.perf_counter() - t0
            peak_rss, peak_private = max(peak_rss, rss), max(peak_private, private)
            if mem_cap and private > mem_cap:
                exceeded = f"memory cap {report.size(mem_cap)} after {elapsed:.1f} s"
            elif elapsed > time_cap_s:
                exceeded = f"time cap {time_cap_s:.0f} s"
            if exceeded:
                kill_tree(watched)
                break
            time.sleep(poll_s)
        proc.wait()
        out.seek(0)
        return Finished(proc.returncode, out.read(), time.perf_counter() - t0, peak_rss,
                        peak_private, children_cpu_s() - cpu0, exceeded)


def children_cpu_s():
    """CPU seconds of this process's children that have been waited for, and of theirs: a
    command's workers, once their parent has reaped them, count in it."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def check(finished, what):
    """A run that must succeed: on failure, stop the benchmark with what the command printed."""
    if finished.exceeded or finished.returncode != 0:
        raise RuntimeError(f"{what} failed ({finished.exceeded or f'exit {finished.returncode}'})"
                           f"; its output ended with:\n{finished.output[-3000:]}")
    return finished


def error_line(output):
    """The exception a failed command raised, e.g. a rank's RuntimeError rather than the
    ChildFailedError that torchrun raises after it; else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    raised = [m.group(1) for m in map(EXCEPTION.match, lines)
              if m and not m.group(1).startswith(("ChildFailedError", "torch.distributed"))]
    return (raised[0] if raised else lines[-1] if lines else "no output")[:200]


def step_time_target(target, row, reference, slack):
    """A target row: met when row's ms per step is at most (1 + slack) times the reference
    row's; not judged (None) when either did not run, with the first one's reason."""
    missing = next((r["status"] for r in (row, reference) if r["status"] != "ok"), None)
    if missing:
        return {"target": target, "measured": missing, "met": None}
    excess = row["ms_per_step"] / reference["ms_per_step"] - 1
    measured = f"{row['ms_per_step']:,.1f} vs {reference['ms_per_step']:,.1f} ms/step " \
               f"({excess:+.1%}"
    rounds = list(zip(row.get("round_ms", []), reference.get("round_ms", [])))
    if len(rounds) > 1:  # taken in turns: each round's pair saw the same load
        each = sorted(ours / theirs - 1 for ours, theirs in rounds)
        measured += f"; round by round {each[0]:+.1%} to {each[-1]:+.1%}"
    return {"target": target, "measured": measured + ")", "met": excess <= slack}
