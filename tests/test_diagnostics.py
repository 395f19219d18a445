"""What a run says about itself: the gradient norm, skipped spikes, each rank's telemetry and
the slowest rank, the WSD schedule, and a resumed run's wandb curve."""
import glob
import logging
import math
import os
import shutil
from collections import deque

import numpy as np
import pytest

from ddpgpt import configurator, data, schedule, tokenfile
from ddpgpt import metrics as run_metrics
from ddpgpt.settings import TrainConfig
from conftest import TINY, fails, metrics, python, steps, torchrun, write_token_files

RUN = [*TINY, "--gradient_accumulation_steps=1", "--eval_interval=1000", "--log_interval=1"]


# a wsd schedule: warm-up to iter 2, flat to 6, the cooldown over the last 2 steps
WSD = [*RUN, "--lr_schedule=wsd", "--cooldown_frac=0.25", "--warmup_iters=2", "--eval_interval=4",
       "--min_lr=1e-4", "--max_iters=8"]


@pytest.fixture(scope="module")
def wsd_run(corpus, tmp_path_factory, session_env):
    """(out_dir, CompletedProcess) of 8 steps under WSD on 1 process, saving at 4 and 8:
    trained once, read by the tests of the gradient norm and of the schedule, and copied by the
    one that extends it."""
    out = tmp_path_factory.mktemp("wsd_run") / "out"
    p = python("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *WSD, env=session_env)
    return out, p


def test_every_step_reports_its_gradient_norm(wsd_run):
    out, p = wsd_run
    rows = steps(out)
    assert all(r["grad_norm"] > 0 and math.isfinite(r["grad_norm"]) for r in rows.values())
    assert f"grad norm {rows[2]['grad_norm']:.3g}" in p.stdout


def spiked_copy(corpus, folder, step, global_batch, block_size, seed=1337):
    """The corpus with every window of global batch `step` made of one token, 0, which text
    never holds: a batch whose loss is far above anything the model has seen."""
    ids = {s: np.fromfile(os.path.join(corpus, f"{s}.bin"), dtype=np.uint16)
           for s in tokenfile.SPLITS}
    train = data.mixture([tokenfile.open_split(corpus, "train", block_size)])
    _, offsets = data.sample_windows(np.arange(step * global_batch, (step + 1) * global_batch),
                                     train, block_size, seed, "epoch")
    for o in offsets:
        ids["train"][o:o + block_size + 1] = 0
    write_token_files(folder, ids, tokenizer="byte", vocab_size=257, eot_token=256)
    return folder


@pytest.mark.slow
def test_a_loss_spike_is_skipped_and_the_data_goes_on_as_before(env, corpus, tmp_path):
    spiked = spiked_copy(corpus, str(tmp_path / "spiked"), step=60, global_batch=4, block_size=32)
    args = [*RUN, "--max_iters=66", "--learning_rate=1e-2", "--decay_lr=False",
            "--log_interval=100"]
    python("train.py", f"--data_dir={corpus}", f"--out_dir={tmp_path / 'clean'}", *args, env=env)
    p = python("train.py", f"--data_dir={spiked}", f"--out_dir={tmp_path / 'skip'}", *args,
               "--spike_policy=skip", env=env)
    clean, skip = steps(tmp_path / "clean"), steps(tmp_path / "skip")
    assert [i for i, r in skip.items() if "skipped" in r] == [60], p.stdout
    assert "loss spike" in skip[60]["skipped"] and f"batch_fp {skip[60]['batch_fp']}" in p.stdout
    assert "step skipped (spike_policy='skip')" in p.stdout
    assert [r["batch_fp"] for r in clean.values()] == [r["batch_fp"] for r in skip.values()]
    # before the spike the two runs are the same run; after it, training goes on as usual
    assert [clean[i]["loss"] for i in range(60)] == [skip[i]["loss"] for i in range(60)]
    assert skip[61]["loss"] < 2 * clean[61]["loss"]


def test_a_spike_after_a_flat_history_is_judged_without_dividing_by_zero(env, tmp_path):
    """lr=0 on data of one repeated byte: the same loss at every step, a spread of 0, and
    then the batch of step 25 of random bytes was a ZeroDivisionError."""
    ids = {s: np.full(n, ord("a"), dtype=np.uint16) for s, n in (("train", 6401), ("val", 400))}
    train = data.mixture([tokenfile.TokenSplit(("train.bin",), np.dtype(np.uint16), 0,
                                               np.array([0, 6401]))])  # 200 blocks, 50 steps
    _, offsets = data.sample_windows(np.arange(25 * 4, 26 * 4), train, 32, 1337, "epoch")
    rng = np.random.default_rng(0)
    for o in offsets:  # inside its block: the windows of the other steps stay all 'a'
        ids["train"][o + 1:o + 32] = rng.integers(0, 256, 31)
    folder = str(tmp_path / "flat")
    write_token_files(folder, ids, tokenizer="byte", vocab_size=257, eot_token=256)
    p = python("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}", *RUN,
               "--max_iters=30", "--learning_rate=0", "--decay_lr=False",
               "--spike_policy=skip", env=env)
    rows = steps(tmp_path / "out")
    assert len({rows[i]["loss"] for i in range(25)}) == 1  # flat
    assert [i for i, r in rows.items() if "skipped" in r] == [25], p.stdout
    assert "spike" in rows[25]["skipped"] and "Traceback" not in p.stderr


@pytest.mark.slow
def test_each_rank_reports_and_the_slowest_is_named_when_it_stays_the_slowest(env, corpus,
                                                                             tmp_path):
    """tests/slow_rank.py makes rank 1's reads of token files 200 ms slower; the batches read
    ahead while a step runs hide a step's time of it, a few ms here."""
    p = torchrun(2, "tests/slow_rank.py", f"--data_dir={corpus}", f"--out_dir={tmp_path}",
                 *TINY, "--gradient_accumulation_steps=2", "--eval_interval=1000",
                 "--max_iters=12", "--log_interval=2", env=dict(env, SLOW_RANK="1"))
    logged = [r for r in steps(tmp_path).values() if "rank_ms" in r]
    assert [r["iter"] for r in logged] == [0, 2, 4, 6, 8, 10]
    for r in logged:
        assert len(r["rank_ms"]) == len(r["rank_data_wait_ms"]) == len(r["rank_mem_mib"]) == 2
        assert min(r["rank_mem_mib"]) > 50
    for r in logged[1:]:  # after the first step, which also makes the model's first buffers
        assert r["rank_ms"][1] > r["rank_ms"][0] + 100 and r["rank_data_wait_ms"][1] > 100
    # named once: at the fifth log step after the first, with the mean of those five
    (line,) = [line for line in p.stdout.splitlines() if "is the slowest" in line]
    five = logged[1:]
    alone = sum(r["rank_ms"][1] for r in five) / 5
    median = sum(r["rank_ms"][0] for r in five) / 5
    assert line.startswith("iter 10: rank 1 is the slowest, at each of the last 5 log steps "
                           f"(iters 2 to 10): {alone:.1f} ms alone in the step against a median "
                           f"of {median:.1f} ms for the other ranks, {alone / median:.2f}x "
                           f"(+{alone - median:.1f} ms a step)"), line


def telemetry_row(i, ms):
    return {"iter": i, "rank_ms": ms, "rank_data_wait_ms": [0.0] * len(ms)}


def straggler_lines(rows, caplog):
    caplog.clear()
    slowest = deque(maxlen=run_metrics.STRAGGLER_STEPS)
    with caplog.at_level(logging.INFO, logger="ddpgpt"):
        for row in rows:
            run_metrics.log_straggler(row, slowest)
    return caplog.messages


def test_a_slowest_rank_that_flips_or_is_barely_slower_is_not_named(caplog):
    # a busy machine: the slowest rank changes from step to step, however slow
    assert straggler_lines((telemetry_row(i, [100, 300] if i % 3 else [300, 100])
                            for i in range(30)), caplog) == []
    # always the same rank, but 10% slower: noise as well
    assert straggler_lines((telemetry_row(i, [100, 110, 100, 101]) for i in range(30)),
                           caplog) == []


def test_a_rank_that_stays_slower_is_named_every_window_not_every_step(caplog):
    lines = straggler_lines((telemetry_row(i, [100.0, 130.0, 90.0]) for i in range(12)), caplog)
    assert len(lines) == 2 and lines[0].startswith(
        "iter 4: rank 1 is the slowest, at each of the last 5 log steps (iters 0 to 4): 130.0 "
        "ms alone in the step against a median of 95.0 ms for the other ranks, 1.37x (+35.0 ms "
        "a step), 0.0 ms of it waiting for data"), lines
    assert lines[1].startswith("iter 9: rank 1 is the slowest, at each of the last 5 log steps "
                               "(iters 5 to 9)")
    # one step where another rank is the slowest starts the count again
    rows = [telemetry_row(i, [100.0, 150.0]) for i in range(8)]
    rows[3] = telemetry_row(3, [150.0, 100.0])
    assert straggler_lines(rows, caplog) == []


def test_wsd_is_flat_then_decays_to_min_lr_over_the_cooldown():
    cfg = TrainConfig(max_iters=20, lr_schedule="wsd", cooldown_frac=0.25, warmup_iters=2,
                      learning_rate=1e-3, min_lr=1e-4)
    lr = [schedule.lr_at(cfg, it) for it in range(20)]
    assert lr[:2] == pytest.approx([1e-3 / 3, 2e-3 / 3])  # warm-up
    assert lr[2:15] == [1e-3] * 13  # stable
    cooldown = lr[15:]
    assert all(a > b for a, b in zip(cooldown, cooldown[1:])) and cooldown[-1] == 1e-4
    assert cooldown[0] == pytest.approx(1e-4 + 0.9e-3 * (1 - math.sqrt(1 / 5)))


def test_cosine_is_nanogpts():
    cfg = TrainConfig(max_iters=12, warmup_iters=3, lr_decay_iters=10, learning_rate=1e-3,
                      min_lr=1e-4)

    def nanogpt_lr(it):  # nanoGPT's get_lr, as train.py has always computed it
        if it < 3:
            return 1e-3 * (it + 1) / (3 + 1)
        if it > 10:
            return 1e-4
        ratio = (it - 3) / (10 - 3)
        return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    assert [schedule.lr_at(cfg, it) for it in range(12)] == [nanogpt_lr(i) for i in range(12)]


def test_a_cosine_schedule_that_max_iters_cuts_short_is_noted(caplog):
    caplog.set_level(logging.INFO, logger="ddpgpt.schedule")
    short = TrainConfig(max_iters=100, warmup_iters=10, lr_decay_iters=1000, learning_rate=1e-3,
                        min_lr=1e-4)
    schedule.note_an_unfinished_decay(short)
    assert caplog.messages == [
        f"note: max_iters=100 ends before lr_decay_iters=1000: the last step's learning rate is "
        f"{schedule.lr_at(short, 99):.3g}, not min_lr=0.0001; to decay to min_lr by the end, set "
        f"--lr_decay_iters=100"]
    caplog.clear()
    for whole in (dict(lr_decay_iters=100), dict(lr_schedule="wsd"), dict(decay_lr=False)):
        schedule.note_an_unfinished_decay(TrainConfig(max_iters=100, warmup_iters=10, **whole))
    assert caplog.messages == []


def test_each_step_is_taken_at_the_schedules_learning_rate(wsd_run):
    out, _ = wsd_run
    cfg = configurator.parse(TrainConfig, WSD, "train.py")
    assert [r["lr"] for _, r in sorted(steps(out).items())] == \
        [schedule.lr_at(cfg, it) for it in range(8)]


@pytest.mark.slow
def test_a_wsd_run_is_not_extended_from_inside_its_cooldown(wsd_run, env, corpus, tmp_path):
    """Raising max_iters of a finished wsd run jumped its lr from min_lr back to 78% of the
    peak, without a word; from a checkpoint before the cooldown it goes on smoothly. On a copy
    of wsd_run."""
    out = tmp_path / "out"
    shutil.copytree(wsd_run[0], out)
    schedule = [f"--data_dir={corpus}", f"--out_dir={out}", *WSD]
    err = fails("train.py", *schedule, "--max_iters=16", "--init_from=resume", env=env).stderr
    assert f"the checkpoint in {out} is at iter 8, past the start of its wsd cooldown (iter 6 " \
           f"of max_iters=8), where the learning rate decays to min_lr: with max_iters=16 it " \
           f"would jump from 1.00e-04 to " in err and "keep max_iters=8." in err, err
    os.rename(out / "ckpt_0000008.pt", tmp_path / "ckpt_0000008.pt")  # resume from iter 4
    python("train.py", *schedule, "--max_iters=16", "--init_from=resume", env=env)
    lr = [r["lr"] for _, r in sorted(steps(out).items())]
    assert lr[2:12] == [3e-3] * 10 and lr[-1] == 1e-4  # stable until the new cooldown


@pytest.mark.slow
def test_a_resumed_run_goes_on_with_the_same_wandb_run(env, corpus, tmp_path):
    out = tmp_path / "out"
    args = [f"--data_dir={corpus}", f"--out_dir={out}", *RUN, "--eval_interval=2",
            "--wandb_log=True"]
    env = dict(env, WANDB_DIR=str(tmp_path))
    python("train.py", *args, "--max_iters=2", env=env, cwd=str(tmp_path))
    python("train.py", *args, "--max_iters=4", "--init_from=resume", env=env, cwd=str(tmp_path))
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs), runs
    assert sorted(r["iter"] for r in metrics(out) if "loss" in r) == [0, 1, 2, 3]


@pytest.mark.parametrize("args, message", [
    (["--cooldown_frac=1.5"], "cooldown_frac=1.5 must be above 0 and at most 1"),
    (["--spike_zscore=0"], "spike_zscore=0.0 must be above 0"),
    (["--lr_schedule=linear"], "lr_schedule='linear' is not one of 'cosine', 'wsd'"),
    (["--spike_policy=clip"], "spike_policy='clip' is not one of 'off', 'skip'"),
    (["--lr_schedule=wsd", "--max_iters=20", "--warmup_iters=2000"],
     "lr_schedule='wsd': warmup_iters=2000 does not end before the cooldown, which starts at "
     "iter 16 (the last cooldown_frac=0.2 of max_iters=20), so the learning rate would still "
     "be rising where it should decay: set warmup_iters to at most 16, or raise max_iters."),
    (["--startup_timeout_s=99999999999"],
     "startup_timeout_s=99999999999 must be at least 0 and at most 31536000"),
])
def test_bad_schedule_and_spike_keys(env, corpus, args, message):
    assert message in fails("train.py", f"--data_dir={corpus}", *TINY, *args, env=env).stderr
