"""The hang watchdog: a run that stops making progress says where each rank is, then ends.
docs/hangs.md says when it fires, what it prints, how to read it and what it cannot do.

train.py beats it at each completed step, after each evaluation and before each checkpoint
save. Each rank decides on its own clock (the step's all-reduce keeps the ranks within a step
of each other) and reports through files, not collectives, which are what hang; a rank stuck
where Python cannot run is left to faulthandler's own thread (BACKSTOP_S)."""
import faulthandler
import json
import linecache
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from itertools import groupby

from ddpgpt import fileio, lock
from ddpgpt.loader import READER

EXIT_CODE = 124  # as coreutils' timeout: the run timed out
WARMUP_STEPS = 5  # compiling, allocator and autotuning make the first steps slow
STEP_WINDOW = 100  # the median of the last 100 steps follows a run whose step time changes
SLOWER_THAN_MEDIAN = 10
POLL_S = 1.0
REPORT_WAIT_S = 15  # how long rank 0 waits for the other ranks' reports
# faulthandler's exit comes this long after the watchdog's own would have, so that it only
# acts when the watchdog thread could not run
BACKSTOP_S = REPORT_WAIT_S + 30
# our code: this package and the scripts beside it
OURS = (os.path.dirname(os.path.abspath(__file__)),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_watchdog = None


def start(out_dir, rank, world_size, hang_timeout_s, startup_timeout_s):
    """Watch this process (one rank); 0 for both timeouts watches nothing."""
    global _watchdog
    if hang_timeout_s or startup_timeout_s:
        _watchdog = Watchdog(out_dir, rank, world_size, hang_timeout_s, startup_timeout_s)


def beat(iter_num, step_s=None, doing=None):
    """Progress: a step of step_s seconds completed (this rank is now at iter_num), or, with no
    step_s, an evaluation or a save begins (doing: 'evaluation', 'checkpoint save') or ends."""
    if _watchdog is not None:
        _watchdog.beat(iter_num, step_s, doing)


def stop():
    """The training loop is over: what follows (closing logs, wandb) is not watched."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stopped.set()
        faulthandler.cancel_dump_traceback_later()
        _watchdog = None


def limit_s(hang_timeout_s, step_times):
    """The training limit: hang_timeout_s, or 10 x the median step if longer; None if off."""
    return max(hang_timeout_s, SLOWER_THAN_MEDIAN * statistics.median(step_times or [0])) \
        if hang_timeout_s else None


class Watchdog:
    def __init__(self, out_dir, rank, world_size, hang_timeout_s, startup_timeout_s):
        self.folder = os.path.join(out_dir, "hang")
        self.rank, self.world_size, self.hang_timeout_s = rank, world_size, hang_timeout_s
        self.started = time.time()  # reports written before this are from an earlier run
        self.found = {}  # {rank: its report}, as they come in
        self.steps, self.step_times = 0, deque(maxlen=STEP_WINDOW)
        self.iter_num, self.limit = None, startup_timeout_s or None
        self.doing = None  # what began at the last beat: an evaluation, a save, or steps
        self.last = time.monotonic()
        self.stopped = threading.Event()
        self.arm_backstop()
        threading.Thread(target=self.watch, name="hang-watchdog", daemon=True).start()

    def beat(self, iter_num, step_s, doing):
        self.iter_num, self.last, self.doing = iter_num, time.monotonic(), doing
        if step_s is not None:
            self.steps += 1
            if self.steps > WARMUP_STEPS:
                self.step_times.append(step_s)
            self.limit = limit_s(self.hang_timeout_s, self.step_times)
        self.arm_backstop()

    def arm_backstop(self):
        if self.limit is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            faulthandler.dump_traceback_later(self.limit + BACKSTOP_S, exit=True)

    def watch(self):
        while not self.stopped.wait(POLL_S):
            idle = time.monotonic() - self.last
            if self.limit is not None and idle > self.limit:
                self.fire(idle)

    def at(self):
        if self.doing:
            return f"the {self.doing} at iter {self.iter_num}"
        return "start-up" if self.steps == 0 else f"iter {self.iter_num}"

    def fire(self, idle):
        try:
            self.report(idle)
        except Exception:  # a bug in the report must not leave the run hung
            traceback.print_exc()
        self.say(f"exiting with code {EXIT_CODE}, so that torchrun or SLURM ends the run (and "
                 f"can restart it)")
        lock.release_held()  # os._exit runs no cleanup
        os._exit(EXIT_CODE)

    def report(self, idle):
        in_thread(sys.stdout.flush, 1)  # the log's last lines before the report
        self.say(f"no progress for {idle:.0f} s (limit {self.limit:.0f} s) in {self.at()}; the "
                 f"Python stacks of this rank's threads, most recent call first:")
        with tempfile.TemporaryFile("w+") as f:  # faulthandler writes only to a file descriptor
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            self.say(f.read())
        where = where_now(threading.get_ident(), self.world_size)
        self.say(f"where: {where}")
        if self.doing:
            key = "startup_timeout_s" if self.steps == 0 else "hang_timeout_s"
            self.say(f"the limit holds for each {self.doing} too: if it is only slow, raise "
                     f"{key} above the time one takes")
        # the files may be on the mount that hangs: exit whether or not this finishes
        in_thread(self.dump_flight_recorder, REPORT_WAIT_S)
        in_thread(lambda: self.share(where), REPORT_WAIT_S + 5)

    def dump_flight_recorder(self):
        """Write the flight recorder's record of this rank's collectives where torch writes it
        when a collective times out (this limit ends a hang before dist_timeout_s would):
        TORCH_FR_DUMP_TEMP_FILE<rank> (launch/srun.sh sets it), when the recorder is on
        (TORCH_FR_BUFFER_SIZE; the older TORCH_NCCL_* names too) and the process group is up.
        NCCL's recorder under nccl, the CPU backends' under gloo."""
        env, dist = os.environ, sys.modules.get("torch.distributed")
        entries = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
        if not entries.isdigit() or int(entries) == 0 or dist is None or not dist.is_initialized():
            return
        c10d = sys.modules["torch"]._C._distributed_c10d
        dump = c10d._dump_nccl_trace if dist.get_backend() == "nccl" else c10d._dump_fr_trace
        prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or \
            env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
        path = f"{prefix}{self.rank}"
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(dump())
        except OSError as e:
            self.say(f"could not write the flight recorder's dump: {e}")
            return
        self.say(f"the flight recorder's last collectives of this rank are in {path}")

    def say(self, text):
        """Each line on its own, prefixed with the rank: ranks that share a log write at the
        same moment, and a line written whole is not cut into another rank's."""
        for line in text.splitlines():
            os.write(sys.stderr.fileno(), f"train.py: hang (rank {self.rank}): {line}\n".encode())

    def share(self, where):
        try:
            os.makedirs(self.folder, exist_ok=True)
            write_line(os.path.join(self.folder, f"rank{self.rank}.txt"),
                       {"rank": self.rank, "at": self.at(), "where": where})
            if self.rank == 0:
                self.summarise()
            else:  # a launcher that sees this rank exit could stop rank 0 while it gathers
                self.wait_for(lambda: self.fresh("summary.txt") is not None)
        except OSError as e:
            self.say(f"could not share its report in {self.folder}: {e}")

    def summarise(self):
        self.wait_for(self.gather)
        lines = summary(self.found, self.world_size)
        path = os.path.join(self.folder, "summary.txt")
        self.say("\n".join([f"where the ranks are (also in {path}):",
                             *(f"  {line}" for line in lines)]))
        write_line(path, {"summary": lines})

    def wait_for(self, done):
        deadline = time.monotonic() + REPORT_WAIT_S
        while not done() and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)

    def gather(self):
        """Take in the ranks' fresh reports that have come; True once every rank's has."""
        for rank in set(range(self.world_size)) - set(self.found):
            if (report := self.fresh(f"rank{rank}.txt")) is not None:
                self.found[rank] = report
        return len(self.found) == self.world_size

    def fresh(self, name):
        """The file's line if written by this run, else None."""
        try:
            with open(os.path.join(self.folder, name)) as f:
                line = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return line if line.get("time", 0) >= self.started else None


def in_thread(function, timeout_s):
    """Run function, giving up on it after timeout_s: a write to a full pipe or to a dead
    mount would block for ever."""
    thread = threading.Thread(target=function, daemon=True)
    thread.start()
    thread.join(timeout_s)


def write_line(path, fields):
    """One JSON line, stamped with the time, under its final name only when complete."""
    with open(fileio.tmp_path(path), "w") as f:
        f.write(json.dumps({**fields, "time": time.time()}) + "\n")
    os.replace(f.name, path)


def summary(reports, world_size):
    """Where the ranks are, ranks in the same place on one line, the odd ones out first; and
    the ranks that did not report."""
    places = {}
    for rank, report in sorted(reports.items()):
        places.setdefault((report["at"], report["where"]), []).append(rank)
    lines = [f"{ranks_text(ranks)} ({at}) in {where}" for (at, where), ranks
             in sorted(places.items(), key=lambda item: (len(item[1]), item[1]))]
    if missing := [r for r in range(world_size) if r not in reports]:
        lines.append(f"{ranks_text(missing)}: no report (stopped, gone, or stuck where Python "
                     f"cannot run; a rank's log may still hold its stacks)")
    return lines


def ranks_text(ranks):
    """'rank 3', 'ranks 0, 2-7'"""
    # consecutive ranks, a span, share one value of rank - position
    spans = [[r for _, r in run] for _, run in groupby(enumerate(ranks), lambda p: p[1] - p[0])]
    text = ", ".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


# ---- where a rank is, from its threads' stacks ----

def where_now(watchdog_ident, world_size):
    """Where this process's main thread is, and its batch reader's while it waits for data."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    ours, beyond = place(frames[main])
    if ours != "loader.rank_batches":
        return described(ours, beyond, world_size)
    # the main thread waits for the reader thread's future: that thread, by its name (others
    # of ours, the watchdog's and the launcher's watchers, run our code too)
    names = {t.ident: t.name for t in threading.enumerate()}
    readers = [" -> ".join(filter(None, place(f))) for ident, f in frames.items()
               if ident not in (main, watchdog_ident) and names.get(ident, "").startswith(READER)]
    return "loader.rank_batches, waiting for its next batch" + "".join(
        f" (reader thread in {r})" for r in readers)


def where_raised(tb, world_size):
    """Where an exception was raised, said as where_now() says it of a thread, e.g.
    'train.share_step_results -> all_reduce'."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return described(*place(tb.tb_frame), world_size)


def described(ours, beyond, world_size):
    if beyond == "_engine_run_backward" and world_size > 1:
        # DDP all-reduces the gradients inside backward, out of Python's sight; a backward
        # that waits, or fails, is waiting for (or has lost) another rank
        beyond = "backward (DDP's gradient all_reduce)"
    return " -> ".join(filter(None, (ours, beyond)))


def place(frame):
    """(the innermost frame of ours, the innermost beyond it), e.g. ('train.share_step_results',
    'all_reduce') or ('tokenfile.read_file', 'os.pread'): a C function has no frame of its
    own, so the call that our frame is in names it. '' for either that is not there."""
    frames = [f for f, _ in traceback.walk_stack(frame)]  # innermost first
    ours = next((f for f in frames if is_ours(f)), None)
    beyond = calling(frames[0]) if is_ours(frames[0]) else qualname(frames[0])
    # an import (start-up, often) runs in frozen importlib frames: name the modules
    loading = [f.f_locals.get("name") for f in frames[:frames.index(ours) if ours else None]
               if f.f_code.co_name == "_find_and_load" and
               f.f_code.co_filename.startswith("<frozen importlib")]
    if loading:
        beyond = f"import {loading[-1]}" + (f" (loading {loading[0]})" if len(loading) > 1 else "")
    if ours is None:
        return "", beyond
    return f"{os.path.basename(ours.f_code.co_filename)[:-3]}.{qualname(ours)}", beyond


def is_ours(frame):
    name = frame.f_code.co_filename  # '<frozen importlib._bootstrap>' is no file of ours
    path = os.path.abspath(name)
    return name.endswith(".py") and os.path.dirname(path) in OURS and \
        os.path.basename(path) != "watchdog.py"


def qualname(frame):
    """The function's name with its class or enclosing function: rank_batches.load, not the
    <locals> and <listcomp> parts of Python's own name."""
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # Python 3.10: no class
    return ".".join(p for p in name.split(".") if not p.startswith("<"))


def calling(frame):
    """The callee of the call the frame is in, e.g. 'os.pread': the text before '(' of the
    call expression whose position Python (3.11 and later) records; '' where it cannot tell."""
    if not hasattr(frame.f_code, "co_positions"):
        return ""
    line, end_line, col, end_col = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    if line is None or col is None:
        return ""
    text = linecache.getline(frame.f_code.co_filename, line).encode()  # offsets are in bytes
    call = text[col:end_col if end_line == line else None].decode(errors="replace")
    return call.split("(", 1)[0].strip() if "(" in call else ""
