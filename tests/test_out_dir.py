"""Two runs never mix in one out_dir: rerunning a from-scratch command where a run left
checkpoints is refused, naming both ways on (resume, or another out_dir), with nothing touched;
metrics.jsonl opens every run's rows with a start row, and compare_runs.py (through
ddpgpt.metrics.read) takes the rows of the run as it stands."""
import hashlib
import json
import os
import shutil

import pytest

from ddpgpt import checkpoint, metrics as run_metrics
from ddpgpt.errors import UserError
from conftest import TINY, fails, metrics, python

ARGS = [*TINY, "--gradient_accumulation_steps=1"]


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, session_env, corpus):
    """The out_dir of 4 steps on 1 process, saved at 2 and 4: trained once, copied by the test
    of a fresh start beside its checkpoints, and the reference run of the test of a run that
    left no checkpoint (its first 3 steps)."""
    out = tmp_path_factory.mktemp("four_steps") / "out"
    python("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *ARGS, "--max_iters=4",
           "--eval_interval=2", env=session_env)
    return out


@pytest.mark.slow
def test_a_fresh_start_beside_an_earlier_runs_checkpoints_is_refused(env, corpus, tmp_path,
                                                                    four_steps):
    out = str(tmp_path / "out")
    command = [f"--data_dir={corpus}", f"--out_dir={out}", *ARGS, "--max_iters=4",
               "--eval_interval=2"]
    shutil.copytree(four_steps, out)  # what `python train.py *command` left
    before = {name: digest(os.path.join(out, name)) for name in os.listdir(out)}
    # the same command again, as after a Ctrl-C: init_from is scratch by default
    message = fails("train.py", *command, env=env).stderr.strip().splitlines()[-1]
    assert message.startswith(f"train.py: error: {out} holds the checkpoints of an earlier run "
                              f"(ckpt_0000004.pt, ckpt_0000002.pt), and init_from='scratch' "
                              f"would start a new run beside them"), message
    assert "--init_from=resume" in message and "another --out_dir" in message
    assert {name: digest(os.path.join(out, name)) for name in os.listdir(out)} == before
    # auto resumes it; so does resume
    p = python("train.py", *command[:-2], "--max_iters=6", "--eval_interval=2",
               "--init_from=auto", env=env)
    assert f"resuming from {checkpoint.path_for(out, 4)}" in p.stdout
    starts = [r for r in metrics(out) if "run" in r]
    assert [(r["run"], r["iter"], r["init_from"]) for r in starts] == \
        [("fresh", 0, "scratch"), ("resumed", 4, "auto")]


def test_auto_beside_checkpoints_none_of_which_loads_is_refused(env, corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt_0000010.pt").write_bytes(b"not a checkpoint")
    message = fails("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *ARGS,
                    "--init_from=auto", env=env).stderr.strip().splitlines()[-1]
    assert "holds the checkpoints of an earlier run (ckpt_0000010.pt), and none of them loads" \
        in message, message
    assert (out / "ckpt_0000010.pt").read_bytes() == b"not a checkpoint"


@pytest.mark.slow
def test_a_run_that_left_no_checkpoint_is_told_apart_from_the_next(env, corpus, tmp_path,
                                                                   four_steps):
    """The first run's checkpoints are removed, as the refusal suggests; its rows stay in
    metrics.jsonl, and the next fresh run's follow its start row: compare_runs.py compares that
    run alone, and says so. The reference is four_steps, whose first 3 steps are those of the
    same settings' run of 3 (the learning rate's schedule does not depend on max_iters)."""
    out, ref = str(tmp_path / "out"), str(four_steps)
    common = [f"--data_dir={corpus}", *ARGS, "--max_iters=3", "--eval_interval=100"]
    python("train.py", *common, f"--out_dir={out}", "--seed=7", env=env)
    for path in checkpoint.list_checkpoints(out):
        os.remove(path)
    p = python("train.py", *common, f"--out_dir={out}", env=env)
    assert f"note: {out}/metrics.jsonl holds the rows of an earlier run" in p.stdout
    rows = metrics(out)
    assert [r["run"] for r in rows if "run" in r] == ["fresh", "fresh"]
    assert sum(1 for r in rows if r.get("iter") == 0 and "loss" in r) == 2  # both runs' iter 0
    cmp = python("compare_runs.py", f"--out_dir={out},{ref}", "--losses", env=env)
    assert f"{out}: the last run's steps (its metrics.jsonl holds 6 rows of earlier runs" \
        in cmp.stdout and "identical batch_fp and loss over 3 steps" in cmp.stdout, cmp.stdout


def write_rows(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_read_takes_the_last_fresh_run_and_a_resumptions_rows(tmp_path):
    step = lambda i, loss: {"iter": i, "loss": loss, "batch_fp": f"fp{i}"}  # noqa: E731
    write_rows(tmp_path / "metrics.jsonl", [
        step(0, 9.0),  # rows of a version without start rows: an earlier run
        {"run": "fresh", "iter": 0}, step(0, 5.0), step(1, 4.0), step(2, 3.0), step(3, 2.9),
        {"iter": 2, "val_loss": 3.1},
        # a resumption from the checkpoint at 2: its rows replace those of 2 and 3, and the
        # previous attempt's step 3, which it has not taken again yet, is not the run's
        {"run": "resumed", "iter": 2}, {"iter": 2, "val_loss": 3.0}, step(2, 3.05)],
        tail='{"iter": 3, "lo')  # a line cut short by a kill
    rows = run_metrics.read(str(tmp_path))
    assert {i: r["loss"] for i, r in rows.steps.items()} == {0: 5.0, 1: 4.0, 2: 3.05}
    assert {i: r["val_loss"] for i, r in rows.evals.items()} == {2: 3.0}
    assert [r["run"] for r in rows.starts] == ["fresh", "resumed"] and rows.earlier == 1


@pytest.mark.slow
def test_read_refuses_a_damaged_line_and_names_it(tmp_path, env):
    (tmp_path / "metrics.jsonl").write_text('{"iter": 0, "loss": 1}\nnot json\n{"iter": 1}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl, line 2 is not JSON"):
        run_metrics.read(str(tmp_path))
    message = fails("compare_runs.py", f"--out_dir={tmp_path},{tmp_path}", env=env).stderr.strip()
    assert message.startswith(f"compare_runs.py: error: {tmp_path}/metrics.jsonl, line 2 is "
                              f"not JSON") and "\n" not in message, message
    message = fails("compare_runs.py", f"--out_dir={tmp_path / 'nowhere'},{tmp_path}",
                    env=env).stderr
    assert f"cannot read {tmp_path}/nowhere/metrics.jsonl (No such file or directory): give " \
           f"the out_dir of a train.py run" in message


def test_old_files_without_start_rows_read_as_one_run(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [{"iter": 0, "loss": 2.0}, {"iter": 1, "loss": 1.5},
                                            {"iter": 1, "loss": 1.4}])
    rows = run_metrics.read(str(tmp_path))
    assert {i: r["loss"] for i, r in rows.steps.items()} == {0: 2.0, 1: 1.4}
    assert rows.starts == [] and rows.earlier == 0

