"""Faults survived and nothing lost: a killed rank, another world size on resume, killed or
corrupt checkpoint writes, a full disk, a failing rank, NaN losses."""
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from ddpgpt import checkpoint, data, fileio, tokenfile
from conftest import (ROOT, RunsCode, fails, first_steps, metrics, on_ranks, python, started,
                      steps, torchrun, train_args, wait_for_line, wait_for_step,
                      write_token_files)


def compare(env, a, b, *flags):
    return python("compare_runs.py", f"--out_dir={a},{b}", *flags, env=env, check=False)


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, session_env, corpus):
    """10 steps on 1 rank from scratch, saving at every step and keeping all: the run whose
    first steps the tests below that resume on 1 rank take a copy of (first_steps), instead of
    training them again. The evaluations in between change no step."""
    out = str(tmp_path_factory.mktemp("one_rank") / "out")
    python("train.py", *train_args(corpus, out, "--max_iters=10", "--eval_interval=1",
                                   "--keep_checkpoints=10"), env=session_env)
    return out


RESIZED = ["--gradient_accumulation_steps=2", "--eval_interval=4"]


@pytest.fixture(scope="module")
def whole_on_two_ranks(tmp_path_factory, session_env, corpus):
    """8 steps on 2 ranks, uninterrupted: what a run resumed on another world size repeats,
    and whose checkpoint at 4 is what a first half on 2 ranks saves."""
    whole = str(tmp_path_factory.mktemp("whole") / "out")
    torchrun(2, "train.py", *train_args(corpus, whole, *RESIZED, "--max_iters=8"), env=session_env)
    return whole


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_reads_the_same_batches(env, corpus, tmp_path, first, then,
                                                             whole_on_two_ranks):
    args, whole, resized = RESIZED, whole_on_two_ranks, str(tmp_path / "resized")
    if first == 2:  # the whole run's first 4 steps: the same settings, on 2 ranks
        first_steps(whole, 4, resized)
    else:
        on_ranks(first, "train.py", *train_args(corpus, resized, *args, "--max_iters=4"), env=env)
    on_ranks(then, "train.py", *train_args(corpus, resized, *args, "--max_iters=8",
                                           "--init_from=resume"), env=env)
    same = compare(env, whole, resized)
    assert same.returncode == 0 and "over 8 steps" in same.stdout, same.stdout
    a, b = steps(whole), steps(resized)
    for i in range(8):  # other reduction orders: equal, up to float rounding
        assert a[i]["loss"] == pytest.approx(b[i]["loss"], rel=1e-4)


@pytest.fixture(scope="module")
def killed_mid_row_and_resumed(tmp_path_factory, session_env, corpus, one_rank):
    """(out_dir, CompletedProcess): one_rank stopped at 2 by a kill in the middle of a row of
    metrics.jsonl, and resumed to 4 with another seed: launched once, read by the tests of
    compare_runs.py's first difference and of the resumed run's rows."""
    out = first_steps(one_rank, 2, tmp_path_factory.mktemp("killed_mid_row") / "out")
    with open(f"{out}/metrics.jsonl", "a") as f:
        f.write('{"iter": 2, "loss": 4.9, "batch_')  # killed mid-write
    p = python("train.py", *train_args(corpus, out, "--max_iters=4", "--eval_interval=4",
                                       "--init_from=resume", "--seed=5"), env=session_env)
    return out, p


@pytest.mark.slow
def test_compare_runs_names_the_first_step_that_differs(env, one_rank, killed_mid_row_and_resumed):
    """b is one_rank (a) stopped at 2 and resumed with another seed."""
    a, (b, _) = one_rank, killed_mid_row_and_resumed
    diff = compare(env, a, b)
    assert diff.returncode == 1 and "first difference at iter 2: batch_fp" in diff.stdout


@pytest.mark.slow
def test_compare_runs_counts_nan_losses_as_equal_and_leaves_out_a_cut_off_line(env, tmp_path):
    """Two runs that diverged alike were 'first difference at iter 1: loss nan vs nan'; a
    line cut off by a kill was a JSONDecodeError traceback."""
    rows = [{"iter": i, "loss": 5.0 if i == 0 else float("nan"), "batch_fp": f"fp{i}"}
            for i in range(3)]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"iter": 3, "loss": 4.9, "batch_')  # killed mid-write
    p = compare(env, tmp_path / "a", tmp_path / "b", "--losses")
    assert p.returncode == 0 and "identical batch_fp and loss over 3 steps" in p.stdout, p
    assert p.stderr == ""  # metrics.read leaves out a last line cut off mid-write
    rows[2]["loss"] = 4.0  # a number where the other diverged is a difference
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = compare(env, tmp_path / "a", tmp_path / "b", "--losses")
    assert p.returncode == 1 and "first difference at iter 2: loss 4.0 vs nan" in p.stdout


@pytest.mark.slow
def test_a_resume_after_a_kill_mid_row_starts_its_rows_on_a_line_of_their_own(
        env, killed_mid_row_and_resumed):
    """The resumed run's start row was written onto the cut-off line: the file was no longer
    JSON lines, and compare_runs.py and plot.py refused it from then on."""
    out, p = killed_mid_row_and_resumed
    assert [r["run"] for r in metrics(out) if "run" in r] == ["fresh", "resumed"]
    assert sorted(steps(out)) == [0, 1, 2, 3] and compare(env, out, out).returncode == 0
    assert f"note: {out}/metrics.jsonl ended in a line cut off when a run was stopped (" in p.stdout


def save_big_checkpoint(out_dir, iter_num):
    """What a checkpoint write looks like to the file system, large enough to be killed in."""
    checkpoint.save(out_dir, {"model": {"w": torch.ones(300 * 2**20 // 4)}, "model_args": {},
                              "iter_num": iter_num}, keep=3)


@pytest.mark.slow
def test_a_writer_killed_mid_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    out = str(tmp_path)
    save_big_checkpoint(out, 1)
    before = sha(checkpoint.path_for(out, 1))
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + '/tests');"
        "from test_reliability import save_big_checkpoint; save_big_checkpoint(sys.argv[2], 2)"),
        ROOT, out])
    tmp = f"{checkpoint.path_for(out, 2)}.{writer.pid}@{fileio.HOST}.tmp"  # fileio.tmp_path's
    while not (os.path.exists(tmp) and os.path.getsize(tmp) > 2**20):
        assert writer.poll() is None, "the writer finished before it could be killed"
        time.sleep(0.01)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert not os.path.exists(checkpoint.path_for(out, 2))
    state, path = checkpoint.load_latest(out)
    assert path == checkpoint.path_for(out, 1) and sha(path) == before
    save_big_checkpoint(out, 3)  # the next save clears what the killed writer left
    assert sorted(os.listdir(out)) == ["ckpt_0000001.pt", "ckpt_0000003.pt"]


@pytest.fixture(scope="module")
def damaged_newest(tmp_path_factory, session_env, corpus, one_rank):
    """(out_dir, CompletedProcess): a run of 10 that kept 3 checkpoints (6, 8 and 10, a copy
    of one_rank's), the newest truncated to half, resumed to 9 with keep_checkpoints=1:
    launched once, read by the tests of a truncated newest checkpoint and of keeping few."""
    out = first_steps(one_rank, 10, tmp_path_factory.mktemp("damaged_newest") / "out", 6, 8)
    damaged = checkpoint.path_for(out, 10)
    os.truncate(damaged, os.path.getsize(damaged) // 2)
    p = python("train.py", *train_args(corpus, out, "--max_iters=9", "--eval_interval=2",
                                       "--init_from=resume", "--keep_checkpoints=1"),
               env=session_env)
    return out, p


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_is_reported_and_the_previous_one_used(damaged_newest):
    out, p = damaged_newest
    newest = checkpoint.path_for(out, 10)
    assert f"{newest} cannot be loaded" in p.stdout
    assert f"resuming from {checkpoint.path_for(out, 8)} (iter 8)" in p.stdout


@pytest.mark.slow
def test_keeping_few_checkpoints_never_keeps_a_damaged_one_over_the_good(damaged_newest):
    """ckpt 6 and 8, a damaged 10: a resume with keep_checkpoints=1 loads 8 and saves 9, which
    it keeps, with 10 left as it is (was: 10 kept by its number, 9 and 8 deleted: nothing
    loaded any more)."""
    out, p = damaged_newest
    damaged = checkpoint.path_for(out, 10)
    assert f"resuming from {checkpoint.path_for(out, 8)} (iter 8)" in p.stdout
    assert checkpoint.list_checkpoints(out) == [damaged, checkpoint.path_for(out, 9)]
    state, path = checkpoint.load_latest(out)
    assert path == checkpoint.path_for(out, 9) and state["iter_num"] == 9


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, caplog):
    out, marker = str(tmp_path / "out"), tmp_path / "code_ran"
    os.makedirs(out)
    checkpoint.save(out, {"model": {}, "model_args": {}, "iter_num": 1}, keep=3)
    torch.save({"model": {}, "model_args": {}, "iter_num": 2, "x": RunsCode(marker)},
               checkpoint.path_for(out, 2))
    caplog.set_level(logging.INFO, logger="ddpgpt")
    state, path = checkpoint.load_latest(out)
    assert path == checkpoint.path_for(out, 1) and state["iter_num"] == 1
    assert "ckpt_0000002.pt was refused: loading it would execute code" in caplog.messages[0]
    assert "posix.system" in caplog.messages[0] and not marker.exists()


def test_refusing_a_checkpoint_that_would_run_code_never_suggests_loading_it(env, tmp_path):
    """torch's own message advises weights_only=False, which would run the code: ours says
    why the file was refused, and nothing else."""
    marker, evil = tmp_path / "code_ran", tmp_path / "ckpt.pt"
    torch.save({"model": {}, "model_args": {}, "iter_num": 2, "x": RunsCode(marker)}, evil)
    err = fails("export.py", f"--out_dir={evil}", f"--to={tmp_path / 'exported'}", env=env).stderr
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"export.py: error: {evil} was refused: loading it would execute "
                              f"code (its pickle calls posix.system"), message
    assert "weights_only" not in err and "safe_globals" not in err and "trust" in message
    assert not marker.exists() and not (tmp_path / "exported").exists()


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_a_clear_error_and_keeps_the_previous_checkpoint(
        env, corpus, small_disk):
    out = os.path.join(small_disk, "out")
    os.makedirs(out)
    p = python("train.py", *train_args(corpus, out, "--max_iters=9", "--eval_interval=3"),
               env=env, check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the disk is full" in p.stderr and "Traceback" not in p.stderr
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    saved = checkpoint.list_checkpoints(out)
    assert saved, "the first checkpoints fit and must still be there"
    state, path = checkpoint.load_latest(out)
    assert path == saved[0]


@pytest.mark.slow
def test_a_disk_that_fills_while_metrics_are_written_is_a_clear_error(env, corpus, small_disk,
                                                                      tmp_path):
    """Another program fills the disk mid-run: the next row of metrics.jsonl cannot be written."""
    out = os.path.join(small_disk, "out")
    with open(tmp_path / "log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "train.py", *train_args(
            corpus, out, "--max_iters=100000", "--eval_interval=100000")], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_for_step(out, 2, proc)
            fill(os.path.join(small_disk, "filler"))
            proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        log.seek(0)
        err = log.read()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert f"could not write {out}/metrics.jsonl: the disk is full" in err
    assert "The checkpoints in" in err and "--init_from=resume" in err


def fill(path):
    """Write zeros to path until the disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_failing_rank_ends_the_whole_run_within_seconds(env, corpus, tmp_path):
    """Rank 1 meets a corrupt token at step 5, rank 0 does not: both must end promptly."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for split in tokenfile.SPLITS:
        tokens = np.fromfile(os.path.join(corpus, f"{split}.bin"), dtype=np.uint16)
        if split == "train":
            g = data.rank_sample_indices(5, 0, 1, 2, 4, 1)
            offsets = data.sample_offsets(g, [0, len(tokens)], 32, 1337, "epoch")
            tokens[offsets[0] + 3] = 60000
        tokens.tofile(bad / f"{split}.bin")  # no meta.json: a raw file, read as uint16
    start = time.time()
    p = torchrun(2, "train.py", *train_args(corpus, tmp_path / "out"), f"--data_dir={bad}",
                 "--gradient_accumulation_steps=2", "--max_iters=50", "--eval_interval=50",
                 "--dist_timeout_s=300", env=env, check=False)
    elapsed = time.time() - start
    assert p.returncode != 0
    assert "train.py: error (rank 1):" in p.stderr and "token id 60000" in p.stderr
    assert elapsed < 60, f"the run took {elapsed:.0f}s to end: it waited for a timeout"


@pytest.mark.slow
def test_a_failing_rank_reports_before_a_teardown_that_would_block(env, corpus, tmp_path):
    """Since PyTorch 2.6 destroying a process group waits for its collectives, and NCCL's may
    wait for a peer that is gone: the failing rank prints its error and exits without it."""
    start = time.time()
    p = torchrun(2, "tests/launch_failing_rank.py", *train_args(corpus, tmp_path / "out"),
                 "--gradient_accumulation_steps=2", "--max_iters=50", "--eval_interval=50",
                 "--dist_timeout_s=300", env=dict(env, FAIL_RANK="1", FAIL_AS="UserError",
                                                  BLOCKING_TEARDOWN="1"), check=False)
    assert p.returncode != 0 and time.time() - start < 60, p.stderr
    assert "train.py: error (rank 1): injected read error on rank 1" in p.stderr


@pytest.mark.slow
def test_leaving_the_process_group_ends_its_threads(env, tmp_path):
    """A process group that outlives destroy_process_group keeps gloo's threads, and one that
    drops a collective's tensor while the interpreter exits aborts the rank ("terminate called
    without an active exception", SIGABRT: eval.py on 2 ranks about 1 run in 12 here). torch
    keeps it alive when torch._dynamo is first imported after the group is made
    (launch.init_distributed imports the module that holds it first)."""
    out = str(tmp_path / "teardown")
    torchrun(2, "tests/rank_teardown.py", out, env=env)
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as f:
            found = json.load(f)
        assert found["sum"] == [2.0, 2.0, 2.0]
        assert not [t for t in found["threads"] if "gloo" in t], found["threads"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, session_env, corpus):
    """A run of 1 rank, asked to train 100000 steps: while it trains, a second train.py into
    its out_dir (which must be refused); then Ctrl-C. (out_dir, the first run's pid, its exit
    code and what it printed, the second's stderr): launched once, read by the tests of two
    trainings in one out_dir and of Ctrl-C."""
    root = tmp_path_factory.mktemp("interrupted")
    out = str(root / "out")
    args = train_args(corpus, out, "--max_iters=100000", "--eval_interval=100000")
    proc = started([sys.executable, "train.py", *args], session_env, root / "log")
    try:
        wait_for_step(out, 1, proc)
        second = fails("train.py", *train_args(corpus, out, "--max_iters=2"),
                       env=session_env).stderr
        wait_for_step(out, 3, proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return out, proc.pid, proc.returncode, (root / "log").read_text(), second


@pytest.mark.slow
def test_two_trainings_in_one_out_dir_the_second_is_refused(interrupted):
    out, pid, _, _, err = interrupted
    assert f"{out} is being written by train.py (pid {pid}" in err


@pytest.mark.slow
def test_ctrl_c_saves_at_one_step_and_says_how_to_resume(env, corpus, interrupted):
    out, _, returncode, text, _ = interrupted
    assert returncode == 0 and "Traceback" not in text, text
    stopped = int(re.search(r"interrupted at iter (\d+); resume with --init_from=resume",
                            text).group(1))
    assert checkpoint.list_checkpoints(out) == [checkpoint.path_for(out, stopped)]
    p = python("train.py", *train_args(corpus, out, f"--max_iters={stopped + 2}",
                                       "--eval_interval=100000", "--init_from=resume"), env=env)
    assert f"resuming from {checkpoint.path_for(out, stopped)}" in p.stdout


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(env, corpus, tmp_path):
    """The first Ctrl-C comes during the evaluation at iter 2, a long one here, so the second
    comes before any step could take the first into account. (Before the first step, the
    first Ctrl-C alone ends the run: tests/test_restarts.py.)"""
    out, log = str(tmp_path / "out"), tmp_path / "log"
    proc = started([sys.executable, "train.py", *train_args(
        corpus, out, "--eval_iters=500", "--eval_interval=2", "--max_iters=10")], env, log)
    wait_for_line(log, "iter 1: loss", proc, timeout=300)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    text = log.read_text()
    assert proc.returncode == 130 and "interrupted again: stopping now" in text, text
    assert "Traceback" not in text and not checkpoint.list_checkpoints(out)


@pytest.mark.slow
def test_resuming_on_other_data_is_refused_unless_allowed(env, corpus, tmp_path, one_rank):
    out = first_steps(one_rank, 2, tmp_path / "out")
    other = tmp_path / "other"
    write_token_files(str(other), {s: np.arange(5000) % 250 for s in tokenfile.SPLITS},
                                tokenizer="byte", vocab_size=257, eot_token=256)
    again = [*train_args(corpus, out, "--max_iters=4", "--eval_interval=2",
                         "--init_from=resume"), f"--data_dir={other}"]
    err = fails("train.py", *again, env=env).stderr
    assert f"data_dir='{other}' is not the data the checkpoint" in err
    assert "--allow_data_change=True" in err
    p = python("train.py", *again, "--allow_data_change=True", env=env)
    assert "warning: data_dir=" in p.stdout and sorted(steps(out)) == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_token_file_truncated_during_the_run_is_a_clear_error(env, corpus, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(corpus, copy)
    out = str(tmp_path / "out")
    proc = started([sys.executable, "train.py", *train_args(copy, out), "--max_iters=100000",
                    "--eval_interval=100000"], env, tmp_path / "log")
    wait_for_step(out, 5, proc)
    os.truncate(copy / "train.bin", 200)
    proc.wait(timeout=120)
    text = (tmp_path / "log").read_text()
    assert proc.returncode == 1 and "Traceback" not in text, text
    assert "train.py: error: " in text and "train.bin is shorter than the" in text
    assert "truncated or replaced during the run" in text


@pytest.mark.slow
def test_a_nan_loss_stops_without_touching_the_last_good_checkpoint(env, corpus, tmp_path,
                                                                    one_rank):
    out = first_steps(one_rank, 3, tmp_path / "out")
    good = sha(checkpoint.path_for(out, 3))
    explode = ["--learning_rate=1e9", "--grad_clip=0", "--decay_lr=False", "--max_iters=9",
               "--eval_interval=3", "--init_from=resume"]
    p = python("train.py", *train_args(corpus, out, *explode), env=env, check=False)
    assert p.returncode == 1
    assert "non-finite loss" in p.stderr and "batch_fp" in p.stderr and "learning_rate" in p.stderr
    assert checkpoint.list_checkpoints(out) == [checkpoint.path_for(out, 3)]
    assert sha(checkpoint.path_for(out, 3)) == good
    p = python("train.py", *train_args(corpus, out, *explode, "--nan_policy=skip"), env=env)
    assert "step skipped (nan_policy='skip')" in p.stdout
    assert sha(checkpoint.path_for(out, 3)) == good
    saved = checkpoint.list_checkpoints(out)
    for path in saved:
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["model"].values()), path


def test_skipping_nan_steps_gives_up_when_it_cannot_recover(env, corpus, tmp_path):
    """With weights gone non-finite, nan_policy='skip' skipped 29 of 30 steps, exited 0 with no
    checkpoint, and said 'the previous ones are kept' when there were none."""
    out = tmp_path / "out"
    explode = ["--learning_rate=1e9", "--grad_clip=0", "--decay_lr=False", "--max_iters=30",
               "--eval_interval=30", "--nan_policy=skip", "--gradient_accumulation_steps=1"]
    err = fails("train.py", *train_args(corpus, out, *explode), env=env).stderr
    assert re.search(r"train.py: error: nan_policy='skip' cannot recover at iter \d+: (the "
                     r"weights themselves are no longer finite|10 steps in a row had a "
                     r"non-finite loss or gradient norm), so every step from here on would be "
                     r"skipped and nothing saved. There is no checkpoint in " +
                     re.escape(str(out)) + r" yet: start again with a lower learning_rate",
                     err), err
    assert not checkpoint.list_checkpoints(str(out))
