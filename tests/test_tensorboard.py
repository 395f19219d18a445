"""tensorboard_log=True as a user runs it: the event files, read back with TensorBoard's own
reader, hold the numbers of metrics.jsonl's rows, once each, also across a resume after a crash
past the last checkpoint; rank 0 alone writes them; the Lightning example logs to Lightning's
TensorBoardLogger; and what a user sees when tensorboard cannot be imported, or its folder
cannot be written, fills up, or holds another run's event files."""
import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, fails, metrics, python, read_all, steps, torchrun, train_args
from ddpgpt import checkpoint
from ddpgpt import metrics as run_metrics
from test_lightning import EXAMPLE, TINY_LIGHTNING, lightning
from test_reliability import fill

ARGS = [*TINY, "--gradient_accumulation_steps=2", "--eval_interval=3", "--log_interval=2",
        "--tensorboard_log=True"]


@pytest.fixture(scope="module")
def resumed(session_env, corpus, tmp_path_factory):
    """The out_dir of a run on 2 ranks that crashed during its save at iter 6 (the checkpoint at
    6 removed: its rows of steps 3 to 5 and the evaluation at 6 are in metrics.jsonl and in its
    event file, past the checkpoint at 3), then resumed to iter 8."""
    out = tmp_path_factory.mktemp("tensorboard") / "out"
    torchrun(2, "train.py", f"--data_dir={corpus}", f"--out_dir={out}", *ARGS, "--max_iters=6",
             env=session_env)
    os.remove(out / "ckpt_0000006.pt")
    torchrun(2, "train.py", f"--data_dir={corpus}", f"--out_dir={out}", *ARGS, "--max_iters=8",
             "--init_from=resume", env=session_env)
    return out


def scalars_read_back(folder):
    """{tag: [(step, value), ...]} as TensorBoard's reader gives them."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def as_tensorboard_holds(rows):
    """{key: [(iter, value as float32, TensorBoard's precision), ...]} of rows, by iter."""
    expected = {}
    for row in sorted(rows, key=lambda r: r["iter"]):
        for name, value in run_metrics.scalars(row).items():
            expected.setdefault(name, []).append((row["iter"], float(np.float32(value))))
    return expected


@pytest.mark.slow
def test_event_files_hold_the_metrics_rows_once_each_across_a_resume(resumed):
    written = [r["iter"] for r in metrics(resumed) if "loss" in r]
    assert written == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]  # steps 3 to 5 twice in the file
    rows = run_metrics.read(resumed)  # the run as it stands: the resumed run's from iter 3
    assert sorted(rows.steps) == list(range(8)) and sorted(rows.evals) == [0, 3, 6, 8]
    logged = scalars_read_back(resumed)
    assert logged == as_tensorboard_holds([*rows.steps.values(), *rows.evals.values()])
    assert {"loss", "grad_norm", "lr", "ms", "tok_per_s", "data_wait", "train_loss",
            "val_loss", "train_bpb", "val_bpb"} <= set(logged)
    assert not {"batch_fp", "rank_ms", "run"} & set(logged)


@pytest.mark.slow
def test_the_tensorboard_viewer_reads_the_run(resumed):
    """`tensorboard --logdir`, as docs/training.md says, through the entry point of its command
    (--inspect: what it would show, without the server). tensorboard 2.20 imports
    pkg_resources, which setuptools 82 and later lack: requirements.txt pins setuptools."""
    viewer = [sys.executable, "-c", "import sys; from tensorboard.main import run_main; "
                                    "sys.exit(run_main())"]
    p = subprocess.run([*viewer, "--inspect", f"--logdir={resumed}"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and f"Event statistics for {resumed}" in p.stdout, p.stderr
    assert re.search(r"^   max_step +8\n   min_step +0$", p.stdout, re.M), p.stdout


@pytest.mark.slow
def test_rank_0_alone_writes_an_event_file_for_each_run(resumed):
    files = glob.glob(f"{resumed.parent}/**/events.out.tfevents.*", recursive=True)
    assert sorted(os.path.dirname(f) for f in files) == [str(resumed)] * 2, files


@pytest.mark.slow
def test_the_lightning_example_logs_its_steps_to_lightnings_tensorboard_logger(
        env, corpus, tmp_path):
    out = tmp_path / "out"
    lightning(2, out, f"--data_dir={corpus}", *TINY_LIGHTNING, "--gradient_accumulation_steps=2",
              "--max_steps=3", "--num_workers=0", "--tensorboard_log=True", env=env)
    files = glob.glob(f"{out}/**/events.out.tfevents.*", recursive=True)
    assert [os.path.dirname(f) for f in files] == [str(out / "lightning_logs" / "version_0")]
    assert scalars_read_back(out / "lightning_logs" / "version_0") == \
        as_tensorboard_holds(steps(out).values())


def hidden_tensorboard(env, tmp_path):
    """env with a `tensorboard` package first on the path whose import fails as it does where
    tensorboard is not installed."""
    package = tmp_path / "hidden" / "tensorboard"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'tensorboard'\", name='tensorboard')\n")
    return dict(env, PYTHONPATH=os.pathsep.join([str(package.parent), env["PYTHONPATH"]]))


@pytest.mark.parametrize("script", ["train.py", EXAMPLE])
def test_tensorboard_not_installed_says_how_to_install_it(script, env, corpus, tmp_path):
    err = fails(script, f"--data_dir={corpus}", f"--out_dir={tmp_path / 'out'}",
                "--tensorboard_log=True", env=hidden_tensorboard(env, tmp_path)).stderr
    assert err.strip().splitlines()[-1].endswith(
        "error: tensorboard_log=True, but tensorboard cannot be imported (No module named "
        "'tensorboard'): install it, pip install tensorboard==2.20.0 (requirements.txt's "
        "version), or leave tensorboard_log out."), err


def test_a_tensorboard_dir_that_cannot_be_written_names_the_key(env, corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = fails("train.py", f"--data_dir={corpus}", f"--out_dir={tmp_path / 'out'}", *TINY,
                "--tensorboard_log=True", f"--tensorboard_dir={blocker}/tb", env=env).stderr
    assert f"cannot write in {blocker}/tb (Not a directory): set tensorboard_dir to a folder " \
           f"that you can create and write files in, or leave it out to write the event " \
           f"files in out_dir." in err, err


def test_a_tensorboard_dir_without_tensorboard_log_is_refused(env, tmp_path):
    err = fails("train.py", f"--tensorboard_dir={tmp_path}", env=env).stderr
    assert f"tensorboard_dir='{tmp_path}' is a setting of tensorboard_log=True, and this run " \
           f"is tensorboard_log=False: add --tensorboard_log=True, or leave tensorboard_dir " \
           f"out." in err, err


@pytest.mark.parametrize("small_disk", ["64k"], indirect=True)
def test_a_full_tensorboard_dir_ends_the_run_as_a_full_out_dir_does(env, corpus, small_disk,
                                                                     tmp_path):
    """Room for the lock and a page of event files: the run ends at the row that does not fit,
    with the paragraph of a full disk (was: the OSError's traceback from TensorBoard's writer
    thread, then from its flush, or a hang in that flush), its checkpoints intact."""
    tb, out = os.path.join(small_disk, "tb"), tmp_path / "out"
    filler = os.path.join(small_disk, "filler")
    fill(filler)
    os.truncate(filler, os.path.getsize(filler) - 2 * 4096)
    err = fails("train.py", *train_args(corpus, out, "--max_iters=40", "--eval_interval=10",
                                        "--tensorboard_log=True", f"--tensorboard_dir={tb}"),
                env=env, timeout=120).stderr  # torch's SummaryWriter could hang here
    assert re.search(
        rf"could not write {tb}/events\.out\.tfevents\.\S+: the disk is full \(No space left on "
        rf"device\): {tb} is on the tmpfs file system mounted on {small_disk}, which had 0\.0 MiB "
        rf"free of 0\.1 MiB\. The checkpoints in {out} are intact: free space there, or move "
        rf"tensorboard_dir, and resume with --init_from=resume\.$", err.strip(), re.M), err
    assert "Errno" not in err, err  # nor an OSError ignored at exit
    state, _ = checkpoint.load_latest(out)
    assert 10 <= state["iter_num"] < 40, err


def test_a_fresh_run_into_another_runs_tensorboard_dir_is_refused(env, corpus, tmp_path):
    """Its purge from iter 0 on would hide all of the other run's curves (was: hidden without a
    word). A fresh start of the first run's out_dir, which left no checkpoint (as torchrun
    restarts a run that failed before its first), goes on there, as it would in out_dir."""
    tb, first = tmp_path / "tb", tmp_path / "first"
    python("train.py", *train_args(corpus, first, "--max_iters=0", "--tensorboard_log=True",
                                   f"--tensorboard_dir={tb}"), env=env)
    events = read_all(tb)
    (name,) = events
    err = fails("train.py", *train_args(corpus, tmp_path / "second", "--max_iters=0",
                                        "--tensorboard_log=True", f"--tensorboard_dir={tb}"),
                env=env).stderr
    assert f"{tb} holds the TensorBoard event files of a run of another out_dir ({name}), " \
           f"which this run's would hide: TensorBoard drops what a folder holds from the " \
           f"iter a run starts at. Give this run another --tensorboard_dir, or move those " \
           f"event files elsewhere first." in err, err
    assert read_all(tb) == events
    python("train.py", *train_args(corpus, first, "--max_iters=0", "--tensorboard_log=True",
                                   f"--tensorboard_dir={tb}"), env=env)  # its own run's: taken
    assert len(os.listdir(tb)) == 2
