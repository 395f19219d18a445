"""prepare.py against faults, run as a user meets them: stop signals (Ctrl-C, kill, a closed
terminal), a full disk (a real small tmpfs), and a second prepare into the same out_dir."""
import collections
import contextlib
import glob
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from ddpgpt import fileio, signals, workers
from conftest import OUTPUTS, ROOT, decoded, fails, python, read_all
from ddpgpt.errors import Interrupted, UserError
from ddpgpt.tokenizer import get_tokenizer


def write_jsonl(path, n_docs, words=200):
    """n_docs documents of about `words` words each, a JSON line each."""
    with open(path, "w") as f:
        for d in range(n_docs):
            f.write(json.dumps({"text": f"document {d}: " + "lorem ipsum dolor " * (words // 3)})
                    + "\n")
    return path


def last_line(stderr):
    return stderr.strip().splitlines()[-1]


# ---- stop signals ----

def as_in_a_terminal():
    """A terminal's foreground job gets Ctrl-C and SIGHUP; a suite started under nohup or with
    `&` would pass them on ignored, and prepare.py keeps an ignored signal ignored (nohup's)."""
    for stop in (signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, signal.SIG_DFL)


def blocked_by_the_launcher():
    """As a launcher that starts it while it blocks the stop signals (multiprocessing's
    resource tracker forks so): the process inherits the mask."""
    as_in_a_terminal()
    signal.pthread_sigmask(signal.SIG_BLOCK, signals.PREPARE_SIGNALS)


def tokenizing(env, out, *launcher, start=as_in_a_terminal):
    """prepare.py of the standard library on 2 workers, once it is writing tokens, paused
    there (SIGSTOP): on a loaded machine it would otherwise finish its seconds of work between
    the test's look and its signal. The test sends its signal, then resume()s it. p.signals:
    how the process took signals then, for a test's failure to show."""
    p = subprocess.Popen([*launcher, sys.executable, os.path.join(ROOT, "prepare.py"),
                          "--dataset=pystdlib", "--tokenizer=byte", "--num_proc=2",
                          "--out_dir", out], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=start)
    deadline = time.time() + 120
    while True:
        assert p.poll() is None and time.time() < deadline, p.communicate()
        p.send_signal(signal.SIGSTOP)
        while psutil.Process(p.pid).status() not in (psutil.STATUS_STOPPED,
                                                     psutil.STATUS_ZOMBIE):  # or ended
            time.sleep(0.001)
        if any(os.path.getsize(f) for f in glob.glob(f"{out}/train.bin.*.tmp")):
            p.signals = signal_masks(p.pid)
            return p
        resume(p)
        time.sleep(0.05)


def resume(p):
    p.send_signal(signal.SIGCONT)


def signal_masks(pid):
    """The blocked, ignored and caught signals (hex masks, as Linux shows them) of each of the
    process's threads, and of the test's, whose mask a process it starts inherits."""
    paths = {"test": "/proc/thread-self/status",
             **{tid: f"/proc/{pid}/task/{tid}/status" for tid in os.listdir(f"/proc/{pid}/task")}}
    masks = {}
    for thread, path in paths.items():
        with contextlib.suppress(OSError), open(path) as f:
            masks[thread] = [" ".join(line.split()) for line in f
                             if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
    return masks


@pytest.mark.parametrize("stop, start", [(signal.SIGINT, as_in_a_terminal),
                                         (signal.SIGTERM, as_in_a_terminal),
                                         (signal.SIGHUP, as_in_a_terminal),
                                         (signal.SIGINT, blocked_by_the_launcher)],
                         ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGINT blocked by its launcher"])
def test_a_stopped_run_publishes_nothing_and_leaves_nothing(stop, start, env, tmp_path):
    """Ctrl-C, kill or a closed terminal while tokenizing: one line, the workers stopped
    quietly, the temporary files and the lock gone, no final-named file, status 128 + signal;
    so too when its launcher passed the signals on blocked (such a Ctrl-C used to wait,
    unseen, until the run had ended, and the run ended 0)."""
    out = tmp_path / "out"
    p = tokenizing(env, out, start=start)
    p.send_signal(stop)
    resume(p)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + stop, f"{stderr}\nthreads' signals when stopped: {p.signals}"
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    name = signal.Signals(stop).name
    assert stderr.strip().splitlines()[-1] == (
        f"prepare.py: interrupted ({name}); this run's temporary files were removed, and no new "
        f"output was published."), stderr
    assert os.listdir(out) == []


def test_a_stop_whose_exception_numpy_swallowed_is_raised_again(monkeypatch):
    """numpy's indexing clears any error it meets (numpy#20596): a stop handler that runs
    inside it loses its Interrupted, and a Ctrl-C seen once in 160 stops let the run publish
    (status 0). prepare.py raises it again at its next result and before it publishes."""
    monkeypatch.setattr(signals, "_stopped_by", [])
    handlers = {s: signal.getsignal(s) for s in signals.PREPARE_SIGNALS}  # pytest's
    try:
        signals.raise_on_stop_signals()
        signals.raise_if_stopped()  # nothing has come: nothing raised
        with contextlib.suppress(Interrupted):  # as numpy's PyErr_Clear() does
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(Interrupted) as raised:
            signals.raise_if_stopped()
        assert raised.value.signum == signal.SIGTERM
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_under_nohup_a_closed_terminal_does_not_stop_it(env, tmp_path):
    """nohup ignores SIGHUP so that a run outlives its terminal: prepare.py keeps it so."""
    out = tmp_path / "out"
    p = tokenizing(env, out, "nohup")
    p.send_signal(signal.SIGHUP)
    resume(p)
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    decoded(out, get_tokenizer("byte"))


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_never_hangs(env, tmp_path):
    """What scancel, systemd and `kill -- -PGID` do: the workers get the signal too. With
    multiprocessing.Pool, about 1 stop in 4 hung for ever (a worker killed holding the task
    queue's lock, which Pool.terminate then waits for); 10 stops catch that 19 times in 20."""
    corpus = write_jsonl(tmp_path / "docs.jsonl", 3000)
    for attempt in range(10):
        out = tmp_path / f"out{attempt}"
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "prepare.py"),
                              f"--dataset={corpus}", "--tokenizer=byte", "--val_docs=10",
                              "--num_proc=2", "--shard_tokens=20000", f"--out_dir={out}"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        deadline = time.time() + 120
        while not (out / "train_000001.bin").exists():
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.005)
        os.killpg(p.pid, signal.SIGTERM)
        try:
            _, stderr = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"stop {attempt + 1} of 10 hung: {p.communicate()[1]}")
        assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
        assert last_line(stderr).startswith("prepare.py: interrupted (SIGTERM); this run's "
                                            "temporary files were removed, and the "), stderr
        assert not glob.glob(f"{out}/*.tmp") and not (out / fileio.LOCK_NAME).exists()


def test_a_worker_killed_outright_is_named_and_nothing_is_left(env, tmp_path):
    """The OOM killer's SIGKILL to one tokenizer worker: the run ends at once with a line that
    names it (multiprocessing.Pool would start another worker and lose its task's documents,
    or hang), and cleans up as for a signal."""
    out = tmp_path / "out"
    p = tokenizing(env, out)
    worker = psutil.Process(p.pid).children()[0]
    worker.kill()
    resume(p)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1 and "Traceback" not in stderr, stderr
    assert last_line(stderr) == (
        f"prepare.py: error: a worker process (pid {worker.pid}) was killed by SIGKILL (the "
        f"system's OOM killer, when memory runs out: try a lower --num_proc), so its tasks are "
        f"lost: run the same command again"), stderr
    assert os.listdir(out) == []


def test_a_worker_killed_while_sending_an_answer_is_named_too():
    """SIGKILL can land while a worker writes an answer: the main process then reads a message
    cut short (multiprocessing's OSError, 'got end of file during message'), not the end of
    the pipe, and names the worker all the same. A real worker, killed, and a real pipe that
    ends inside a message."""
    context = multiprocessing.get_context("fork")
    process = context.Process(target=time.sleep, args=(60,))
    process.start()
    process.kill()
    reader, writer = context.Pipe(duplex=False)
    os.write(writer.fileno(), struct.pack("!i", 100) + b"only part of it")
    writer.close()
    with pytest.raises(UserError, match=rf"a worker process \(pid {process.pid}\) was killed "
                                        r"by SIGKILL \(the system's OOM killer"):
        workers.result(workers.Worker(process, None, reader))
    reader.close()


# ---- a full disk ----

@pytest.mark.parametrize("small_disk, total", [("1m", "1.0"), ("64k", "0.1")],
                         indirect=["small_disk"], ids=["1 MiB", "64 KiB"])
def test_a_full_disk_says_where_and_damages_nothing_published(env, small_disk, total, tmp_path):
    """A previous prepare's output in the out_dir stays as it was, byte for byte. The corpus's
    long documents leave their first tokens in the index's write buffer when the disk fills:
    flushed on discarding, they failed again (on 64 KiB as on 1 MiB), which ended the clean-up
    with a bare '[Errno 28] No space left on device' and left the temporary files."""
    out = tmp_path / "disk" / "data"
    args = ["--tokenizer=byte", "--val_docs=2", "--num_proc=1", f"--out_dir={out}"]
    python("prepare.py", f"--dataset={write_jsonl(tmp_path / 'small.jsonl', 20, words=20)}",
           *args, env=env)
    before = read_all(out)
    big = write_jsonl(tmp_path / "big.jsonl", 100, words=2500)  # 3 MB of tokens
    message = last_line(fails("prepare.py", f"--dataset={big}", *args, env=env).stderr)
    assert message.startswith("prepare.py: error: the disk is full (") and \
        f"): {out} is on the tmpfs file system mounted on {small_disk}, which had " in message \
        and f" MiB free of {total} MiB. Nothing published before was damaged: this run's " \
            "temporary files were removed, and no new output was published. Free space there, " \
            "or pass an --out_dir on a disk with room, and run again." in message, message
    assert read_all(out) == before
    decoded(out, get_tokenizer("byte"))  # meta.json still describes the files


def test_a_sharded_prepare_stopped_by_a_full_disk_resumes_when_there_is_room(
        env, small_disk, tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", 2000)
    args = [f"--dataset={big}", "--tokenizer=byte", "--val_docs=2", "--num_proc=1",
            "--shard_tokens=50000"]
    python("prepare.py", *args, f"--out_dir={tmp_path / 'whole'}", env=env)
    out = tmp_path / "disk" / "data"
    message = last_line(fails("prepare.py", *args, f"--out_dir={out}", env=env).stderr)
    kept = sum(map(len, json.loads((out / "prepare.progress.json").read_text())["splits"]
                   .values()))
    assert kept > 2 and message.startswith("prepare.py: error: the disk is full (") and \
        f"this run's temporary files were removed, and the {kept} complete shard(s) in {out} " \
        f"that prepare.progress.json records are kept: the same command resumes after them" \
        in message
    assert not glob.glob(f"{out}/*.tmp") and not (out / fileio.LOCK_NAME).exists()
    subprocess.run(["mount", "-o", "remount,size=64m", small_disk], check=True)  # room made
    p = python("prepare.py", *args, f"--out_dir={out}", env=env)
    assert f"{kept} complete shard(s) kept" in p.stdout
    assert read_all(out) == read_all(tmp_path / "whole")


# ---- one writer per out_dir ----

def test_two_prepares_into_one_out_dir_one_refused_the_other_intact(env, tmp_path):
    """Started at the same moment: which one wins is chance, but only one writes, and the
    other names it. (Without the lock, one of them once deleted the other's meta.json.)"""
    out = tmp_path / "out"
    args = [sys.executable, os.path.join(ROOT, "prepare.py"), "--dataset=pystdlib",
            "--tokenizer=byte", "--val_fraction=0.01", "--num_proc=1", f"--out_dir={out}"]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    ends = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], ends
    loser = [p.returncode for p in procs].index(1)
    winner = procs[1 - loser]
    message = last_line(ends[loser][1])
    assert message.startswith(f"prepare.py: error: {out} is being written by prepare.py (pid "
                              f"{winner.pid} on {fileio.HOST}, since "), message
    assert f"If it is not running (its machine crashed, say), remove {out / fileio.LOCK_NAME}." \
        in message and "Traceback" not in ends[loser][1]
    docs = decoded(out, get_tokenizer("byte"))  # the winner's files, as its meta.json says
    assert len(docs["train"]) > 1000 and sorted(os.listdir(out)) == sorted(OUTPUTS)


def test_a_lock_held_on_another_host_refuses_without_touching_anything(env, tmp_path):
    """Where flock does not reach another host (NFS with local_lock), its lock file does."""
    out = tmp_path / "out"
    args = [f"--dataset={write_jsonl(tmp_path / 'docs.jsonl', 20)}", "--tokenizer=byte",
            "--val_docs=2", "--num_proc=1", f"--out_dir={out}"]
    python("prepare.py", *args, env=env)
    holder = {"script": "prepare.py", "pid": 4242, "host": "node-17", "started": "yesterday"}
    (out / fileio.LOCK_NAME).write_text(json.dumps(holder))
    before = read_all(out)
    message = last_line(fails("prepare.py", *args, env=env).stderr)
    assert message.startswith(f"prepare.py: error: {out} is being written by prepare.py (pid "
                              f"4242 on node-17, since yesterday)"), message
    assert read_all(out) == before


def test_a_requeued_slurm_job_takes_over_the_lock_its_earlier_run_left(env, tmp_path):
    """Killed outright on one node and requeued onto another: the same SLURM job at a later
    restart count, which SLURM never runs alongside the earlier one."""
    out = tmp_path / "out"
    out.mkdir()
    holder = {"script": "prepare.py", "pid": 4242, "host": "node-17", "started": "yesterday",
              "slurm": ["77", 0]}
    (out / fileio.LOCK_NAME).write_text(json.dumps(holder))
    env.update(SLURM_JOB_ID="77", SLURM_RESTART_COUNT="1")
    p = python("prepare.py", f"--dataset={write_jsonl(tmp_path / 'docs.jsonl', 20)}",
               "--tokenizer=byte", "--val_docs=2", "--num_proc=1", f"--out_dir={out}", env=env)
    assert f"prepare.py: taking over the lock on {out}: prepare.py (pid 4242 on node-17, SLURM " \
           f"job 77, since yesterday) held it and is no longer running" in p.stdout
    decoded(out, get_tokenizer("byte"))


def test_only_temporary_files_of_dead_writers_of_this_host_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {"live": f"train.bin.{os.getpid()}@{fileio.HOST}.tmp",
             "dead": f"train.bin.{dead.pid}@{fileio.HOST}.tmp",
             "other host": f"train.bin.{dead.pid}@node-17.tmp", "published": "train.bin"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert fileio.remove_stale_temporaries(str(tmp_path)) == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "dead")
    assert fileio.tmp_path("d/train.bin") == f"d/train.bin.{os.getpid()}@{fileio.HOST}.tmp"


@pytest.mark.parametrize("script", ["prepare.py", "train.py"])
def test_a_folder_where_the_lock_file_goes_is_named(script, env, corpus, tmp_path):
    """It said 'cannot write in <out_dir> (Is a directory)'."""
    out = tmp_path / "out"
    (out / fileio.LOCK_NAME).mkdir(parents=True)
    args = ([f"--dataset={write_jsonl(tmp_path / 'docs.jsonl', 20)}", "--tokenizer=byte",
             "--val_docs=2", "--num_proc=1"] if script == "prepare.py" else
            [f"--data_dir={corpus}", "--device=cpu"])
    message = last_line(fails(script, *args, f"--out_dir={out}", env=env).stderr)
    assert message == (f"{script}: error: {out / fileio.LOCK_NAME} is a folder, where {script} "
                       f"keeps its lock file (one writer per folder): it is not ddpgpt's. Move "
                       f"or rename it, then run again."), message
    assert os.listdir(out) == [fileio.LOCK_NAME]


def test_a_stop_signal_while_tokens_are_written_stays_the_signal(tmp_path):
    """prepare.py's stop signals raise from their handler wherever the main thread is. In
    numpy's ndarray.tofile, about 1 in 150 came out as a TypeError ("expected str, bytes or
    os.PathLike object, not BufferedWriter"), a traceback instead of the signal's clean exit
    (seen once in CI): fileio.write_array, which prepare.py and the document index write
    with, lets every one through. 3000 timer signals, each raising in the middle of writes."""
    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGALRM, stop)
    ids, seen = np.arange(64, dtype=np.uint16), []
    try:
        with open(tmp_path / "tokens.bin", "wb") as f:
            for _ in range(3000):
                try:
                    signal.setitimer(signal.ITIMER_REAL, 1e-5)
                    for _ in range(2000):
                        fileio.write_array(f, ids)
                        f.seek(0)
                    signal.setitimer(signal.ITIMER_REAL, 0)
                except Exception as e:  # what the signal became
                    seen.append(type(e).__name__)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert set(seen) == {"Stop"} and len(seen) == 3000, collections.Counter(seen)
