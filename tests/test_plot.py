"""plot.py as the README runs it: one run's curves into out_dir/curves.png, several runs into one
figure, a colour each; clear errors for what is not a run."""
import json
import math

import numpy as np
import pytest
from matplotlib import image

import plot
from conftest import TINY, fails, python

BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two colours


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, session_env, corpus):
    root = tmp_path_factory.mktemp("plot")
    runs = []
    for name, lr in (("fast", "3e-3"), ("slow", "3e-4")):
        out = root / name
        python("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
               "--gradient_accumulation_steps=1", "--max_iters=30", "--eval_interval=10",
               f"--learning_rate={lr}", f"--min_lr={lr}", env=session_env)
        runs.append(out)
    return runs


def pixels_of(png, rgb):
    picture = (image.imread(png)[..., :3] * 255).round().astype(int)
    return int(np.all(np.abs(picture - rgb) <= 2, axis=-1).sum())


@pytest.mark.slow
def test_one_run_into_its_out_dir_and_several_into_one_figure(two_runs, env, tmp_path):
    fast, slow = two_runs
    p = python("plot.py", f"--out_dir={fast}", env=env)
    assert p.stdout.strip() == f"plot.py: wrote {fast / 'curves.png'} (fast)"
    one = fast / "curves.png"
    assert image.imread(one).shape[:2] == (700, 1100)
    assert pixels_of(one, BLUE) > 1000 and pixels_of(one, ORANGE) == 0
    both = tmp_path / "both.png"
    python("plot.py", f"--out_dir={fast},{slow}", f"--to={both}", "--smooth=5", "--title=lr",
           env=env)
    assert pixels_of(both, BLUE) > 1000 and pixels_of(both, ORANGE) > 1000
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_what_is_not_a_run(env, tmp_path):
    message = fails("plot.py", f"--out_dir={tmp_path}", env=env).stderr.strip()
    assert message == (f"plot.py: error: cannot read {tmp_path}/metrics.jsonl (No such file "
                       f"or directory): give the out_dir of a train.py run"), message
    (tmp_path / "metrics.jsonl").write_text('{"run": "fresh", "iter": 0}\n')
    message = fails("plot.py", f"--out_dir={tmp_path}", env=env).stderr.strip()
    assert message.startswith(f"plot.py: error: {tmp_path}/metrics.jsonl holds no step of a "
                              f"run"), message


@pytest.mark.parametrize("line", ['[1, 2]', '"loss"', '{"loss": 4.0}'])
def test_a_line_that_is_json_but_not_a_row_is_named(env, tmp_path, line):
    """It was an AttributeError ('list' object has no attribute 'get') or a KeyError."""
    (tmp_path / "metrics.jsonl").write_text(f'{{"run": "fresh", "iter": 0}}\n{line}\n')
    message = fails("plot.py", f"--out_dir={tmp_path}", env=env).stderr.strip()
    assert message == (f"plot.py: error: {tmp_path}/metrics.jsonl, line 2 is not a row of "
                       f"train.py's ({line!r}): metrics.jsonl holds one JSON object per line, "
                       f"each with its iter, as train.py writes them"), message


def test_a_run_that_diverged_is_drawn_without_its_non_finite_values(env, tmp_path):
    """A run with nan_policy=skip and a learning rate far too high logs NaN and inf losses: it
    was 'ValueError: Axis limits cannot be NaN or Inf'."""
    rows = [{"run": "fresh", "iter": 0}]
    rows += [{"iter": i, "loss": 5.0 - i / 10 if i < 4 else (math.nan, math.inf)[i % 2],
              "lr": 1e9, "tok_per_s": 100.0} for i in range(10)]
    rows += [{"iter": i, "train_loss": v, "val_loss": v}
             for i, v in ((0, 5.0), (5, math.inf), (8, math.nan))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = python("plot.py", f"--out_dir={tmp_path}", env=env)
    assert p.stdout.splitlines()[0] == (f"plot.py: {tmp_path}: left out the values that are "
                                        f"not finite (NaN or inf): 6 of loss, 2 of train_loss, "
                                        f"2 of val_loss"), p.stdout
    assert pixels_of(tmp_path / "curves.png", BLUE) > 1000


def test_the_first_evaluation_does_not_flatten_the_val_curve():
    """The untrained model's val loss lies far above the rest: the panel is scaled to the
    later ones, and its title says the first is off the top (was: a flat line at the bottom)."""
    series = {"loss": ([0, 1], [5.6, 5.0]), "lr": ([0, 1], [1e-3, 1e-3]),
              "tok_per_s": ([0, 1], [100, 100]), "train_loss": ([0, 10, 20], [5.6, 2.1, 1.9]),
              "val_loss": ([0, 10, 20], [5.57, 2.12, 1.80])}
    fig = plot.draw({"run": (series, [])}, 0, "")
    val = fig.axes[1]
    low, high = val.get_ylim()
    assert low < 1.80 and 2.12 < high < 5.57
    assert val.get_title() == "val loss (the first evaluation, 5.5700, is off the top)"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run"]
