"""Ranks that die, and runs that go on: torchrun's restarts with no variable to set (one node,
and two agents as two nodes), the paragraph with which the survivors of a dead rank end, a
stop signal before the first step, and what a failed collective's words say (peers.py)."""
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil
import torch
import pytest

from ddpgpt import checkpoint, errors, peers, signals
from conftest import (ROOT, TINY, metrics, python, rows_so_far, started, torchrun,
                      torchrun_command, traceback_of_ours, wait_for_line, wait_for_step)

# the restarts in a row of the test below; DDPGPT_TEST_RESTARTS=20 for the long loop
RESTARTS = int(os.environ.get("DDPGPT_TEST_RESTARTS", "3"))
# 30 steps, then 20 for each of those restarts (90 with 3): the runs' steps are much of their
# cost (it was 60 + 30 each: the first kill lands after a checkpoint all the same)
MAX_ITERS = 30 + 20 * RESTARTS
# eval_interval 50: a checkpoint every 50 steps, so that every restart redoes some steps
ARGS = [*TINY, "--gradient_accumulation_steps=2", f"--max_iters={MAX_ITERS}",
        "--eval_interval=50", "--log_interval=100", "--init_from=auto",
        # a restart that hangs in init_process_group (today's failure) fails within the test
        "--dist_timeout_s=60"]


def train_args(corpus, out, *extra):
    return [os.path.join(ROOT, "train.py"), f"--data_dir={corpus}", f"--out_dir={out}", *extra]


@pytest.fixture(scope="module")
def uninterrupted(session_env, corpus, tmp_path_factory):
    """The run that the restarted ones must repeat: 2 ranks, never stopped."""
    out = str(tmp_path_factory.mktemp("uninterrupted") / "out")
    torchrun(2, *train_args(corpus, out, *ARGS), env=session_env)
    return out


def rank_process(rank, out):
    """The train.py process of that rank writing into out (whichever launcher started it)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            if f"--out_dir={out}" in (p.info["cmdline"] or []) and \
                    p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} writing into {out}")


def kill_at_steps(out, kills, procs):
    """For each (step, rank, signal): once metrics.jsonl has a row of that step or later
    written since the kill before, send the signal to that rank."""
    seen = 0
    for step, rank, sig in kills:
        deadline = time.monotonic() + 180
        while not any(r.get("iter", -1) >= step for r in rows_so_far(out)[seen:]):
            assert all(p.poll() is None for p in procs), "the run ended before the kill"
            assert time.monotonic() < deadline, f"step {step} never came"
            time.sleep(0.05)
        os.kill(rank_process(rank, out).pid, sig)
        seen = len(rows_so_far(out))


def assert_same_run(env, reference, restarted, log, restarts):
    assert log.count("resuming from") == restarts, log
    assert "Traceback" not in log, log
    same = python("compare_runs.py", f"--out_dir={reference},{restarted}", "--losses", env=env,
                  check=False)
    assert same.returncode == 0 and f"over {MAX_ITERS} steps" in same.stdout, same.stdout


@pytest.mark.slow
def test_torchrun_restarts_a_run_again_and_again_and_it_continues_exactly(
        env, corpus, uninterrupted, tmp_path):
    """kill -9 of rank 1, then rank 0, then rank 1, ... under plain torchrun --max-restarts,
    no variable set. Before peers.this_restarts_store, 4 restarts in 6 hung or failed in
    init_process_group on the dead attempt's addresses (pytorch#135712), so three in a row
    failed nearly always. A checkpoint comes between any two kills, so every restart has one
    to resume from; the evaluations in between change no step."""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    spacing = (MAX_ITERS - 30) // RESTARTS
    kills = [(30 + i * spacing, (i + 1) % 2, signal.SIGKILL) for i in range(RESTARTS)]
    args = [*ARGS, f"--eval_interval={min(50, spacing - 2)}"]
    proc = started([*torchrun_command(2), f"--max-restarts={RESTARTS}",
                    *train_args(corpus, out, *args)], env, log)
    try:
        kill_at_steps(out, kills, [proc])
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        proc.kill()
    text = log.read_text()
    assert_same_run(env, uninterrupted, out, text, restarts=RESTARTS)
    # the survivor of each kill said whom it lost and that torchrun goes on
    assert len(re.findall(r"train.py: error \(rank \d\): lost rank \d \(pid \d+ on ",
                          text)) == RESTARTS
    assert f"torchrun restarts the run by itself ({RESTARTS - 1} restart(s) left of " \
           f"--max-restarts)" in text


@pytest.mark.slow
def test_with_init_from_scratch_the_survivor_says_the_restart_will_be_refused(env, corpus,
                                                                              tmp_path):
    """--max-restarts=1 and init_from left at scratch: a rank killed after a checkpoint, the
    survivor's paragraph says that torchrun's restart will be refused and what to run, and the
    restart is refused (was: 'init_from=scratch would start over', which it does not)."""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    args = [a for a in ARGS if not a.startswith("--init_from")] + ["--eval_interval=10"]
    proc = started([*torchrun_command(2), "--max-restarts=1", *train_args(corpus, out, *args)],
                   env, log)
    try:
        kill_at_steps(out, [(15, 1, signal.SIGKILL)], [proc])
        assert proc.wait(timeout=300) != 0
    finally:
        proc.kill()
    text = log.read_text()
    assert "torchrun's restart (1 left of --max-restarts) will be refused, as " \
           "init_from='scratch' is in an out_dir that holds checkpoints; run the same command " \
           "with --init_from=auto, which resumes from it." in text, text
    assert f"{out} holds the checkpoints of an earlier run" in text, text  # the refusal


@pytest.mark.slow
def test_ranks_whose_torchrun_is_killed_stop_save_and_free_the_out_dir(env, corpus, tmp_path):
    """kill -9 of torchrun itself: its ranks see their launcher gone, stop as for SIGTERM at
    one step, save, and end, so that the same command resumes (was: both trained on with no
    launcher, holding out_dir's lock, and the rerun was refused)."""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    args = [a for a in ARGS if not a.startswith("--max_iters")] + ["--max_iters=100000",
                                                                    "--log_interval=1"]
    agent = started([*torchrun_command(2), *train_args(corpus, out, *args)], env, log)
    try:
        wait_for_step(out, 3, agent)
        ranks = [rank_process(r, out) for r in (0, 1)]
        agent.kill()
        agent.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=120)
        assert not alive, log.read_text()
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()
    text = log.read_text()
    assert re.search(r"train\.py \(rank \d\): its launcher \(pid \d+\) is gone: stopping as "
                     r"for SIGTERM", text), text
    last = max(r["iter"] for r in metrics(out) if "loss" in r)
    resume = [a for a in args if not a.startswith("--max_iters")] + [f"--max_iters={last + 2}"]
    p = torchrun(2, *train_args(corpus, out, *resume), env=env)
    assert f"resuming from {checkpoint.path_for(out, last + 1)} (iter {last + 1})" in p.stdout


@pytest.mark.slow
def test_a_closed_terminal_under_nohup_torchrun_saves_and_says_how_to_outlive_it(env, corpus,
                                                                                tmp_path):
    """The SIGHUP a shell sends its jobs as it exits: torchrun handles it, nohup or not, and
    passes it to its ranks, which it ended at once, unsaved."""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    args = [a for a in ARGS if not a.startswith("--max_iters")] + ["--max_iters=100000",
                                                                    "--log_interval=1"]
    agent = started(["nohup", *torchrun_command(2), *train_args(corpus, out, *args)], env, log)
    try:
        wait_for_step(out, 3, agent)
        agent.send_signal(signal.SIGHUP)
        agent.wait(timeout=120)
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()
    text = log.read_text()
    stopped = int(re.search(r"stopping at iter (\d+): signal received", text).group(1))
    assert f"saved {checkpoint.path_for(out, stopped)}" in text and \
        "To outlive the terminal, start torchrun with setsid" in text, text


@pytest.mark.slow
def test_two_agents_as_two_nodes_restart_after_a_kill_on_either(env, corpus, uninterrupted,
                                                               tmp_path):
    """Two torchruns of one rank each, a c10d rendezvous as on two nodes: their restart counts
    differ (each counts the restarts its own ranks caused), and the run still goes on. A
    checkpoint every 20 steps (20, 40, ...) comes before each kill and between the two; the
    evaluations change no step, so the uninterrupted run (eval_interval 50) is the one to
    repeat."""
    out, logs = str(tmp_path / "out"), [tmp_path / "node0.log", tmp_path / "node1.log"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [started([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                      "--nproc_per_node=1", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}",
                      f"--rdzv-conf=is_host={int(node == 0)}", "--max-restarts=2",
                      *train_args(corpus, out, *ARGS, "--eval_interval=20")], env, log)
             for node, log in enumerate(logs)]
    try:
        kill_at_steps(out, [(30, 1, signal.SIGKILL), (70, 0, signal.SIGKILL)], procs)
        for p, log in zip(procs, logs):
            assert p.wait(timeout=240) == 0, log.read_text()
    finally:
        for p in procs:
            p.kill()
    assert_same_run(env, uninterrupted, out, logs[0].read_text(), restarts=2)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, victim, sig", [(3, 2, signal.SIGKILL), (2, 0, signal.SIGSEGV)],
                         ids=["kill -9 of rank 2 of 3", "segfault of rank 0 of 2"])
def test_the_survivors_of_a_dead_rank_say_whom_they_lost_and_end(env, corpus, tmp_path, nproc,
                                                               victim, sig):
    """kill -9 (the out-of-memory killer's signal) or a segfault of one rank mid-run: within
    30 s every rank has ended, the lowest survivor with one paragraph (which rank, where, the
    step, the newest checkpoint, the command that resumes), the others with one line, and no
    traceback but torchrun's own report."""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    args = [*TINY, f"--gradient_accumulation_steps={2 * nproc}", "--max_iters=100000",
            "--eval_interval=20", "--log_interval=100000"]
    proc = started([*torchrun_command(nproc), *train_args(corpus, out, *args)], env, log)
    try:
        wait_for_step(out, 25, proc)
        dead = rank_process(victim, out)
        dead.send_signal(sig)
        killed = time.monotonic()
        proc.wait(timeout=60)
        assert time.monotonic() - killed < 30
    finally:
        proc.kill()
    text = log.read_text()
    assert proc.returncode != 0
    first = 1 if victim == 0 else 0
    # (another survivor, which lost the dead rank first and left, may have broken this one's
    # connection: its note in the store names the dead rank all the same)
    said = re.findall(rf"train.py: error \(rank {first}\): lost rank {victim} \(pid {dead.pid} "
                      rf"on \S+\)(?:, which rank \d had lost before it left,)? in (\S+ -> .+?) "
                      rf"at iter (\d+): that rank has gone: .*", text)
    assert len(said) == 1, text
    where, step = said[0]
    assert int(step) >= 25 and where in (
        "train.forward_backward -> backward (DDP's gradient all_reduce)",
        "train.share_step_results -> all_reduce", "evaluation.split_loss -> all_reduce"), where
    paragraph = next(line for line in text.splitlines() if f"(rank {first}): lost" in line)
    assert f"The newest checkpoint is {out}/ckpt_00000" in paragraph
    assert "--init_from=auto" in paragraph and "The backend said: " in paragraph
    others = set(range(nproc)) - {victim, first}
    assert len(re.findall(rf"lost rank {victim} \(pid \d+ on \S+\) too, in ", text)) == len(others)
    assert text.count("Traceback (most recent call last)") == 1  # torchrun's ChildFailedError
    assert not traceback_of_ours(text) and "[rank" not in text


def hung_rank_0(env, corpus, tmp_path, start=None):
    """train.py as rank 0 of two, whose rank 1 never comes: it waits in init_process_group.
    Returns the process once it waits there (its store listens). start: a preexec_fn."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_env = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.Popen([sys.executable, *train_args(corpus, tmp_path / "out", *TINY)],
                            cwd=ROOT, env=rank_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=start)
    deadline = time.monotonic() + 60
    while not any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                  for c in psutil.Process(proc.pid).net_connections("tcp")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.5)  # inside the wait for rank 1 now
    return proc


def blocked_by_the_launcher():
    """As a launcher that starts it while it blocks the stop signals: the mask is inherited."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals.TRAIN_SIGNALS)


@pytest.mark.parametrize("sig, start", [(signal.SIGTERM, None),
                                        (signal.SIGINT, blocked_by_the_launcher)],
                         ids=["SIGTERM", "SIGINT blocked by its launcher"])
def test_a_stop_signal_before_the_first_step_ends_the_run_at_once(env, corpus, tmp_path, sig,
                                                                   start):
    """Hung in init_process_group, the ranks used to record SIGTERM and wait for a step that
    never came, until torchrun's SIGKILL: there is nothing to save yet. A signal its launcher
    passed on blocked comes through too (an unblocked Ctrl-C:
    test_ctrl_c_in_the_first_evaluation_ends_the_run_at_once)."""
    proc = hung_rank_0(env, corpus, tmp_path, start)
    t = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t < 5
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == (
        f"train.py: stopped by {signal.Signals(sig).name} (rank 0) before the first step: "
        f"nothing to save yet"), err
    assert "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_in_the_first_evaluation_ends_the_run_at_once(env, corpus, tmp_path):
    out, log = str(tmp_path / "out"), tmp_path / "log"
    proc = started([sys.executable, *train_args(corpus, out, *TINY, "--eval_iters=20000",
                                                "--max_iters=10")], env, log)
    wait_for_line(log, "world size", proc, timeout=60)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=10)
    text = log.read_text()
    assert proc.returncode == 130, text
    assert text.strip().splitlines()[-1] == \
        "train.py: stopped by SIGINT before the first step: nothing to save yet"
    assert "Traceback" not in text
    # the main thread could run Python: it left through the usual way out, which released
    # out_dir's lock, and no checkpoint was written
    assert not [f for f in os.listdir(out) if f == "ddpgpt.lock" or f.startswith("ckpt_")]


# ---- what a failed collective says ----

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:12721. This is typically caused by a "
               "remote worker crashing. Check the logs of the remote worker before reporting "
               "an error. GLHF!")
# NCCL's, from torch 2.13's ProcessGroupNCCL.cpp and NCCLUtils.cpp (not seen here: no GPU)
NCCL_REMOTE = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, "
               "remote process exited or there was a network error, NCCL version 2.27.5\n"
               "ncclRemoteError: A call failed possibly due to a network error or a remote "
               "process exiting prematurely.\nLast error:\nsocketProgress: Connection closed "
               "by remote peer n2<45678>")
NCCL_ABORTED = ("NCCL communicator was aborted on rank 3.  Original reason for failure was: "
                "[PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, "
                "Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
NCCL_TIMEOUT = ("[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, "
                "Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")


def importing_torch(pid):
    """Whether train.py's process pid is in torch's import: torch's library is loaded (its
    import has begun), and the signals train.py catches once its imports are done, SIGUSR1
    among them, are not caught yet (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            loaded = "libtorch" in f.read()
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except FileNotFoundError:
        return False
    return loaded and not caught >> (signal.SIGUSR1 - 1) & 1


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_import_torch_is_one_line_from_each(env, corpus, tmp_path):
    """torchrun passes Ctrl-C on to its ranks as SIGINT: in the seconds of torch's import each
    rank printed a KeyboardInterrupt traceback of ~28 lines."""
    out = str(tmp_path / "out")
    proc = subprocess.Popen([*torchrun_command(2), *train_args(corpus, out, *TINY)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    ranks = []
    while len(ranks) < 2 or not all(importing_torch(r.pid) for r in ranks):
        assert proc.poll() is None and time.monotonic() < deadline
        with contextlib.suppress(psutil.Error):
            ranks = psutil.Process(proc.pid).children()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0]
    for rank in range(2):
        assert f"train.py: stopped by SIGINT (rank {rank}) before the first step: nothing to " \
               f"save yet\n" in text, text
    assert "KeyboardInterrupt" not in text and not traceback_of_ours(text), text


def test_a_line_to_stderr_is_written_whole():
    """Ranks that say their line at once share one stderr: print() wrote a line and its
    newline apart, and CI saw two ranks' lines run together, then two newlines (the test
    above). Python's stderr writes each write() through to its file, as this one does."""
    writes = []

    class File(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            writes.append(bytes(b))
            return len(b)

    stderr = io.TextIOWrapper(File(), line_buffering=True, write_through=True)
    with contextlib.redirect_stderr(stderr):
        errors.say("train.py: error (rank 1): a paragraph")
    assert writes == [b"train.py: error (rank 1): a paragraph\n"]


@pytest.mark.slow
def test_a_rank_killed_in_start_up_leaves_the_survivor_saying_who_stopped_it(env, corpus, tmp_path):
    """kill -9 of rank 1 in the first evaluation: torchrun stops rank 0 with SIGTERM, which
    said only "stopped by SIGTERM", as if a user had stopped the run, then left the lost rank
    to torchrun's summary; mid-run the same kill is named (launch.watched)."""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    proc = started([*torchrun_command(2), *train_args(corpus, out, *TINY, "--eval_iters=20000",
                                                      "--max_iters=10")], env, log)
    wait_for_line(log, "world size", proc, timeout=90)
    killed = rank_process(1, out)
    killed.kill()
    proc.wait(timeout=60)
    assert f"train.py: stopped by SIGTERM (rank 0) before the first step: nothing to save " \
           f"yet; rank 1 (pid {killed.pid} on {socket.gethostname()}) had ended, and " \
           f"torchrun stops the other ranks this way when one fails (its summary, below, " \
           f"says how)" in log.read_text(), log.read_text()


@pytest.mark.parametrize("text, gone, said", [
    (GLOO_CLOSED, True, "Connection closed by peer [127.0.0.1]:12721"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
     "600000ms for recv operation to complete", False,
     "Timed out waiting 600000ms for recv operation to complete"),
    (NCCL_REMOTE, True, "NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
                        "ProcessGroupNCCL.cpp:3690, remote process exited or there was a "
                        "network error, NCCL version 2.27.5"),
    (NCCL_ABORTED, True, NCCL_ABORTED),
    (NCCL_TIMEOUT, False, NCCL_TIMEOUT)])
def test_a_lost_peer_is_known_by_what_gloo_or_nccl_say(text, gone, said):
    lost = peers.lost_peer(RuntimeError(text), rank=0, world_size=4)
    assert (lost.gone, lost.said) == (gone, said)
    assert peers.lost_peer(RuntimeError(text), rank=0, world_size=1) is None


def test_other_errors_are_not_a_lost_peer():
    for text in ("CUDA out of memory. Tried to allocate 2.00 GiB", "Expected all tensors to "
                 "be on the same device", "mat1 and mat2 shapes cannot be multiplied"):
        assert peers.lost_peer(RuntimeError(text), rank=0, world_size=8) is None


def test_the_lost_rank_is_found_by_the_address_gloo_names(monkeypatch):
    """gloo names the peer's end of the broken connection, its port in network byte order:
    12721 is 45361 (0xB131) read the other way round."""
    every = [peers.Peer("n1", 10, [("127.0.0.1", 38303)]),
             peers.Peer("n1", 11, [("127.0.0.1", 36781), ("127.0.0.1", 33060)]),
             peers.Peer("n2", 12, [("::ffff:127.0.0.1", 45361)])]
    monkeypatch.setitem(peers.GROUP, "peers", every)
    assert peers.which_rank(GLOO_CLOSED, 0, 3) == (2, "rank 2 (pid 12 on n2)")
    assert peers.which_rank(GLOO_CLOSED.replace("12721", "33060"), 0, 3) == \
        (1, "rank 1 (pid 11 on n1)")
    assert peers.which_rank(GLOO_CLOSED.replace("12721", "999"), 0, 3) == \
        (None, "the rank at 127.0.0.1:999")
    assert peers.which_rank(NCCL_TIMEOUT, 0, 3) == (None, "another rank")
    assert peers.which_rank(NCCL_TIMEOUT, 1, 2) == (0, "rank 0 (pid 10 on n1)")


def test_a_survivor_follows_the_notes_in_the_store_to_the_rank_lost_first(monkeypatch):
    """Rank 1 lost rank 2, left its note and exited, which broke rank 0's connection to it:
    rank 0 names rank 2."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setitem(peers.GROUP, "store", store)
    store.set(peers.NOTE.format(1), "2")
    assert peers.lost_first(1, rank=0) == 2
    assert store.get(peers.NOTE.format(0)) == b"2"  # its own note, for the next in line
    assert peers.lost_first(3, rank=0) == 3  # no note: rank 3 is the one
    store.set(peers.NOTE.format(4), "0")  # a note that leads back to this rank
    assert peers.lost_first(4, rank=0) == 4 and peers.lost_first(None, rank=0) is None
    monkeypatch.setitem(peers.GROUP, "store", None)
    assert peers.lost_first(5, rank=0) == 5


def test_each_rank_joins_rank_0s_attempt_while_the_others_delete_its_key(monkeypatch):
    """A restart's ranks meet under the attempt that rank 0 publishes in torchrun's store,
    each deleting the key first (peers.this_restarts_store); a rank whose read came just after
    another's delete read b"" and waited alone in init_process_group until the timeout (CI:
    test_train's 4-rank resume hung 600 s; 1 in ~40 four-rank starts here). A thread deletes
    the key as fast as other ranks would; each time, rank 1 lands in rank 0's attempt (before
    the fix, 6 of 20 starts did not)."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    done, timeout = threading.Event(), timedelta(seconds=30)

    def other_ranks_deleting():
        store = agent.clone()
        while not done.is_set():
            store.delete_key(peers.ATTEMPT_KEY)
            time.sleep(0.0002)

    deleter = threading.Thread(target=other_ranks_deleting)
    deleter.start()
    try:
        for start in range(20):
            with peers.this_restarts_store(0, 2, timeout) as zero, \
                    peers.this_restarts_store(1, 2, timeout) as one:
                one.set(f"start {start}", "here")
                assert zero.check([f"start {start}"]), f"start {start}: rank 1 joined elsewhere"
    finally:
        done.set()
        deleter.join()
