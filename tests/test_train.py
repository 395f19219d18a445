"""train.py under torchrun (gloo, CPU), as a user runs it: training, exact resume,
configuration errors."""
import json
import os

import pytest

from conftest import ROOT, python, torchrun

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=4", "--device=cpu", "--learning_rate=3e-3", "--warmup_iters=2",
        "--lr_decay_iters=40", "--min_lr=3e-4"]


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def steps(out_dir):
    return {r["iter"]: r for r in metrics(out_dir) if "loss" in r}


def test_two_ranks_train_save_and_the_loss_falls(env, corpus, tmp_path):
    out = tmp_path / "out"
    p = torchrun(2, "train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
                 "--gradient_accumulation_steps=2", "--max_iters=40", "--eval_interval=20",
                 "--log_interval=10", env=env)
    assert "world size 2" in p.stdout and "1 micro-steps of 4 per rank" in p.stdout
    rows = steps(out)
    assert sorted(rows) == list(range(40))
    first, last = rows[0]["loss"], sum(rows[i]["loss"] for i in range(35, 40)) / 5
    assert last < first - 1.0, (first, last)
    evals = [r for r in metrics(out) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 20, 40]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0
    assert sorted(os.listdir(out)) == ["ckpt_0000020.pt", "ckpt_0000040.pt", "metrics.jsonl"]
    assert p.stdout.count("iter 10: loss") == 1  # printed once, by rank 0


@pytest.mark.parametrize("ranks", [2, 4])  # with 4, a sum's rounding depends on DDP's buckets
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(ranks, env, corpus, tmp_path):
    args = [f"--data_dir={corpus}", *TINY, "--gradient_accumulation_steps=4",
            "--eval_interval=15", "--dropout=0.1"]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    torchrun(ranks, "train.py", *args, f"--out_dir={whole}", "--max_iters=30", env=env)
    torchrun(ranks, "train.py", *args, f"--out_dir={halves}", "--max_iters=15", env=env)
    p = torchrun(ranks, "train.py", *args, f"--out_dir={halves}", "--max_iters=30",
                 "--init_from=resume", env=env)
    assert "resuming from" in p.stdout and "ckpt_0000015.pt" in p.stdout
    a, b = steps(whole), steps(halves)
    assert sorted(a) == sorted(b) == list(range(30))
    for i in range(30):
        assert (a[i]["loss"], a[i]["batch_fp"]) == (b[i]["loss"], b[i]["batch_fp"]), i
    final = [r for r in metrics(whole) if r.get("iter") == 30 and "val_loss" in r]
    again = [r for r in metrics(halves) if r.get("iter") == 30 and "val_loss" in r]
    assert final == again


def test_eval_only_reports_the_same_losses_on_any_world_size(env, corpus, tmp_path):
    out = tmp_path / "out"
    torchrun(2, "train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
             "--gradient_accumulation_steps=2", "--max_iters=3", "--eval_interval=3", env=env)
    at_two = [r for r in metrics(out) if "val_loss" in r][-1]
    python("train.py", "config/eval_owt.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
           "--eval_iters=4", "--gradient_accumulation_steps=2", env=env)
    at_one = [r for r in metrics(out) if "val_loss" in r][-1]
    assert at_one["iter"] == at_two["iter"] == 3
    assert at_one["val_loss"] == pytest.approx(at_two["val_loss"], rel=1e-6)


def test_wandb_logs_offline(env, corpus, tmp_path):
    out = tmp_path / "out"
    python("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
           "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2",
           "--wandb_log=True", "--wandb_run_name=test", env=dict(env, WANDB_DIR=str(tmp_path)),
           cwd=str(tmp_path))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


# ---- what a user sees for a bad configuration ----

def train_error(env, *args, nproc=1):
    run = torchrun if nproc > 1 else python
    p = run(*([nproc] if nproc > 1 else []), "train.py", *args, env=env, check=False)
    assert p.returncode != 0
    # torchrun prints its own traceback when a rank exits non-zero; ours print none
    assert ("Traceback" not in p.stderr) if nproc == 1 else (
        f'File "{ROOT}' not in p.stderr), p.stderr
    return p.stderr


@pytest.mark.parametrize("args, message", [
    (["--learning_rat=1e-3"], "unknown key 'learning_rat'; did you mean learning_rate"),
    (["--batch_size=big"], "cannot read the value 'big'"),
    (["--batch_size=1.5"], "batch_size must be int, got 1.5"),
    (["--compile=1"], "compile must be bool"),
    (["--sampling=shuffle"], "sampling='shuffle' is not one of 'epoch', 'random'"),
    (["--n_embd=100", "--n_head=3"], "n_embd=100 must be a multiple of n_head=3"),
    (["config/nope.py"], "config file config/nope.py does not exist"),
    (["--max_iters"], "settings are written --key=value"),
])
def test_configuration_errors_name_the_key(env, args, message):
    assert message in train_error(env, *args)


def test_config_file_that_does_not_parse(env, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("batch_size = 12\nlearning_rate = = 3\n")
    assert f"config file {bad} does not parse: line 2" in train_error(env, str(bad))
    bad.write_text("n_layr = 4\n")
    assert "unknown key 'n_layr'; did you mean n_layer" in train_error(env, str(bad))


def test_resume_without_a_checkpoint(env, corpus, tmp_path):
    err = train_error(env, f"--data_dir={corpus}", f"--out_dir={tmp_path}", *TINY,
                      "--init_from=resume")
    assert "holds no loadable checkpoint" in err


def test_out_dir_that_cannot_be_written(env, corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = train_error(env, f"--data_dir={corpus}", f"--out_dir={blocker}/out", *TINY)
    assert f"out_dir {blocker}/out cannot be written" in err


def test_errors_on_two_ranks_are_reported_once(env, corpus, tmp_path):
    err = train_error(env, f"--data_dir={corpus}", f"--out_dir={tmp_path}", *TINY,
                      "--gradient_accumulation_steps=3", nproc=2)
    assert err.count("must be a multiple of the world size 2: use 2") == 1
    assert "(ranks 0, 1)" in err
