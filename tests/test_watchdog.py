"""The hang watchdog (watchdog.py) on real torchrun jobs, gloo on CPU: a stopped rank, a rank
whose data read blocks, the watchdog turned off, a healthy run; a process that holds the GIL;
the numbers it works with."""
import json
import os
import pickle
import re
import subprocess
import sys
import time

import psutil
import pytest

from ddpgpt import watchdog
from conftest import (ROOT, TINY, fails, python, started, torchrun, torchrun_command,
                      wait_for_line, wait_for_step)

HANG_S = 5
ARGS = [*TINY, "--gradient_accumulation_steps=2", "--max_iters=100000",
        "--eval_interval=100000", "--log_interval=100000", f"--hang_timeout_s={HANG_S}"]
# where a rank waits for its peer: the step's all-reduce, or DDP's in backward
IN_ALL_REDUCE = (r"in train\.(share_step_results -> all_reduce|"
                 r"forward_backward -> backward \(DDP's gradient all_reduce\))")
TORCHRUN_GRACE_S = 30  # torchrun's SIGTERM-to-SIGKILL wait when it ends a failed run's ranks


def workers(proc):
    """{rank: process} of a torchrun's train.py ranks."""
    return {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children(recursive=True)
            if "train.py" in " ".join(p.cmdline())}


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_run_ends(env, corpus, tmp_path):
    """Rank 1 stops (SIGSTOP) mid-run: rank 0 dumps its stacks within the limit, names rank 1
    as not reporting (a report left by an earlier run does not count), all exit. The stopped
    rank runs no code of its own: torchrun ends it with SIGKILL after its grace period, and
    the time bound allows for that, rather than have the ranks kill each other."""
    out, log = tmp_path / "out", tmp_path / "log"
    (out / "hang").mkdir(parents=True)
    (out / "hang" / "rank1.txt").write_text(json.dumps(
        {"rank": 1, "at": "iter 3", "where": "an earlier run", "time": time.time() - 3600}))
    proc = started([*torchrun_command(2), os.path.join(ROOT, "train.py"), f"--data_dir={corpus}",
                    f"--out_dir={out}", *ARGS], env, log)
    ranks = {}
    try:
        wait_for_step(str(out), 5, proc)
        ranks = workers(proc)
        ranks[1].suspend()
        stopped = time.monotonic()
        wait_for_line(log, r"hang \(rank 0\): where: ", proc, timeout=HANG_S + 10)
        proc.wait(timeout=HANG_S + watchdog.REPORT_WAIT_S + TORCHRUN_GRACE_S + 20)
        ended = time.monotonic() - stopped
        assert not [p for p in ranks.values() if p.is_running()]
    finally:
        for p in ranks.values():
            if p.is_running():
                p.resume()
                p.kill()
        proc.kill()
    text = log.read_text()
    assert proc.returncode != 0, text
    assert re.search(r"hang \(rank 0\): no progress for \d+ s \(limit 5 s\) in iter \d+", text)
    assert re.search(r'hang \(rank 0\):   File ".*train\.py", line \d+ in '
                     r'(forward_backward|share_step_results)', text), text
    assert re.search(r"hang \(rank 0\): +rank 0 \(iter \d+\) " + IN_ALL_REDUCE, text), text
    assert "hang (rank 0):   rank 1: no report (stopped, gone" in text
    assert "hang (rank 1)" not in text and "exitcode  : 124" in text
    assert ended < HANG_S + watchdog.REPORT_WAIT_S + TORCHRUN_GRACE_S + 15, ended


@pytest.mark.slow
def test_a_rank_whose_data_read_blocks_is_named_in_the_data_path_and_dumps_its_collectives(
        env, corpus, tmp_path):
    """Rank 1's batch reader blocks in os.open on a FIFO (as on a dead mount); rank 0 waits
    for it in the all-reduce. Both report, rank 0 says who is where, both exit at once. With
    the flight recorder on, as launch/srun.sh has it, each rank writes its last collectives
    where torch's collective timeout, which the watchdog comes before, would have."""
    fifo, out, recorded = tmp_path / "fifo", tmp_path / "out", tmp_path / "fr" / "rank_"
    os.mkfifo(fifo)
    start = time.monotonic()
    p = torchrun(2, "tests/launch_stalling_rank.py", f"--data_dir={corpus}", f"--out_dir={out}",
                 *ARGS, env=dict(env, STALL_RANK="1", STALL_AFTER="10", STALL_FIFO=str(fifo),
                                 TORCH_FR_BUFFER_SIZE="100", TORCH_FR_DUMP_TEMP_FILE=str(recorded)),
                 check=False, timeout=120)
    took = time.monotonic() - start
    assert p.returncode != 0 and "exitcode  : 124" in p.stderr, p.stderr
    assert re.search(r'hang \(rank 1\):   File ".*tokenfile\.py", line \d+ in read_file',
                     p.stderr), p.stderr
    data_wait = (r"rank 1 \(iter \d+\) in loader\.rank_batches, waiting for its next batch "
                 r"\(reader thread in tokenfile\.read_file -> os\.open\)")
    assert re.search(r"hang \(rank 0\):   " + data_wait, p.stderr), p.stderr
    assert re.search(r"hang \(rank 0\):   rank 0 \(iter \d+\) " + IN_ALL_REDUCE, p.stderr)
    assert "no report" not in p.stderr
    summary = json.loads((out / "hang" / "summary.txt").read_text())["summary"]
    assert len(summary) == 2 and any(re.fullmatch(data_wait, line) for line in summary)
    assert took < 60, took  # every rank reported: nobody waited for a missing report
    for rank in (0, 1):
        assert f"hang (rank {rank}): the flight recorder's last collectives of this rank are " \
               f"in {recorded}{rank}" in p.stderr
        with open(f"{recorded}{rank}", "rb") as f:
            entries = pickle.load(f)["entries"]
        assert "gloo:all_reduce" in {e["profiling_name"] for e in entries}, entries[-3:]


@pytest.mark.slow
@pytest.mark.parametrize("hang_timeout_s", [0, 2])
def test_hang_timeout_0_turns_it_off(env, corpus, tmp_path, hang_timeout_s):
    """One read of 4 s at about step 10, after the warm-up, far beyond 10 x the median step:
    with the watchdog on (2 s) it fires, in the data path; with hang_timeout_s=0 the run goes
    on to the end."""
    out = tmp_path / "out"
    p = python("tests/launch_stalling_rank.py", f"--data_dir={corpus}", f"--out_dir={out}",
               *TINY, "--gradient_accumulation_steps=1", "--max_iters=20", "--eval_interval=20",
               f"--hang_timeout_s={hang_timeout_s}",
               env=dict(env, STALL_RANK="0", STALL_AFTER="12", STALL_S="4"), check=False)
    if hang_timeout_s:
        assert p.returncode == watchdog.EXIT_CODE, p.stderr
        assert "hang (rank 0): where: loader.rank_batches, waiting for its next batch (reader " \
               "thread in data.read_xy -> stalling_read)" in p.stderr
    else:
        assert p.returncode == 0 and "hang" not in p.stderr, p.stderr
        assert not (out / "hang").exists()


@pytest.mark.slow
def test_a_slow_evaluation_is_named_as_one_and_the_lock_released(env, corpus, tmp_path):
    """It said 'where: model.GPT.forward', and the exit with code 124 left out_dir's lock.
    The first evaluation, before any step, is under startup_timeout_s; it waits far beyond
    that limit (launch_slow_eval.py: asleep, where eval_iters=1000000 kept a core busy for
    the whole limit)."""
    out = tmp_path / "out"
    p = python("tests/launch_slow_eval.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
               "--gradient_accumulation_steps=1", "--max_iters=4", "--startup_timeout_s=30",
               env=dict(env, SLOW_EVAL_S="600"), check=False, timeout=300)
    ended_hung_in(p, out, "evaluation", 0, limit_s=30, key="startup_timeout_s")


@pytest.mark.slow
def test_a_hung_save_is_named_as_one_with_the_advice_about_its_limit(env, corpus, tmp_path):
    """The checkpoint's save beat the watchdog a second time, without saying what it did: a
    save that hung was reported as 'iter 4', and the advice about hang_timeout_s was lost.
    The run's last save (iter 4) is written before the run goes on, and its publishing waits
    far beyond the limit (launch_slow_save.py)."""
    out = tmp_path / "out"
    p = python("tests/launch_slow_save.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
               "--gradient_accumulation_steps=1", "--max_iters=4", "--eval_interval=4",
               "--hang_timeout_s=3", env=dict(env, SLOW_SAVE_S="600"), check=False,
               timeout=300)
    ended_hung_in(p, out, "checkpoint save", 4, limit_s=3, key="hang_timeout_s")


def ended_hung_in(p, out, what, iter_num, limit_s, key):
    """The run p ended as hung in `what` (an evaluation, a save) at iter_num, with the advice to
    raise `key`, and let go of out_dir's lock."""
    assert p.returncode == watchdog.EXIT_CODE, p.stderr
    assert re.search(rf"train.py: hang \(rank 0\): no progress for \d+ s \(limit {limit_s} s\) "
                     rf"in the {what} at iter {iter_num};", p.stderr), p.stderr
    assert f"train.py: hang (rank 0): the limit holds for each {what} too: if it is only " \
           f"slow, raise {key} above the time one takes" in p.stderr
    assert not (out / "ddpgpt.lock").exists()


def test_a_start_up_hang_in_an_import_names_the_module(env, corpus, tmp_path):
    """Frozen importlib frames counted as ours: 'where: <frozen importlib._bootstrap_extern'.
    Importing transformers for a GPT-2 folder takes longer than a 1 s limit."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 257}))
    p = python("train.py", f"--init_from={folder}", f"--data_dir={corpus}", *TINY,
               f"--out_dir={tmp_path / 'out'}", "--startup_timeout_s=1", env=env, check=False)
    assert p.returncode == watchdog.EXIT_CODE, p.stderr
    assert re.search(r"hang \(rank 0\): where: hf\.\w+ -> import transformers", p.stderr), p.stderr
    assert "<frozen" not in p.stderr.split("where:")[1]


def test_a_rank_stuck_where_python_cannot_run_still_dumps_its_stacks_and_exits(env, tmp_path):
    """A regular expression that backtracks for hours holds the GIL, so the watchdog's thread
    cannot run: faulthandler's own thread dumps the stacks and exits 1 (its margin made short
    here)."""
    script = ("import re; from ddpgpt import watchdog; watchdog.BACKSTOP_S = 2; "
              f"watchdog.start({str(tmp_path)!r}, 0, 1, 0, 1); "
              "re.match(r'(a+)+$', 'a' * 40 + 'b')")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("Timeout (0:00:03)!"), p.stderr
    assert 'File "<string>", line 1 in <module>' in p.stderr and "train.py: hang" not in p.stderr


@pytest.mark.slow
def test_a_healthy_run_with_evaluations_and_saves_never_fires(env, corpus, tmp_path):
    out = tmp_path / "out"
    p = torchrun(2, "train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
                 "--gradient_accumulation_steps=2", "--max_iters=20", "--eval_interval=10",
                 f"--hang_timeout_s={HANG_S}", "--startup_timeout_s=60", env=env)
    assert "hang" not in p.stderr and not (out / "hang").exists() and "saved" in p.stdout


@pytest.mark.parametrize("key", ["hang_timeout_s", "startup_timeout_s"])
def test_a_negative_timeout_is_a_clear_error(env, key):
    assert f"{key}=-1 must be at least 0" in fails("train.py", f"--{key}=-1", env=env).stderr


def test_the_limit_is_ten_times_the_median_step_when_that_is_longer():
    assert watchdog.limit_s(0, [1.0] * 10) is None and watchdog.limit_s(30, []) == 30
    assert watchdog.limit_s(30, [1.0] * 10) == 30
    assert watchdog.limit_s(30, [5.0] * 9 + [600.0]) == 50


def test_the_summary_groups_ranks_and_puts_the_odd_ones_out_first():
    reports = {r: {"at": "iter 12", "where": "train.share_step_results -> all_reduce"}
               for r in (0, 2, 3, 4, 5, 7)}
    reports[1] = {"at": "iter 12", "where": "loader.rank_batches, waiting for its next batch"}
    assert watchdog.summary(reports, 8) == [
        "rank 1 (iter 12) in loader.rank_batches, waiting for its next batch",
        "ranks 0, 2-5, 7 (iter 12) in train.share_step_results -> all_reduce",
        ("rank 6: no report (stopped, gone, or stuck where Python cannot run; a rank's log "
         "may still hold its stacks)")]
