"""Draw runs' curves from their metrics.jsonl into a PNG: the loss, the val loss, the learning
rate and tokens per second, against the iter.

  python plot.py --out_dir=out-quickstart                  # -> out-quickstart/curves.png
  python plot.py --out_dir=out-a,out-b --to=a_vs_b.png     # several runs, a colour each

Each run's rows are those of the run as it stands (ddpgpt/metrics.py, read: from its last fresh
start, a resumed run's rows in place of those it took again); a dotted line marks each
resumption. The step loss and tokens/s are drawn faintly as logged and, over them, as a moving
average of smooth steps (by default a fiftieth of the run); the evaluations' train loss is a
dashed line with the step loss. The figure is written whole or not at all.
"""
import math
import os
import sys

import numpy as np

from ddpgpt import configurator, errors, fileio, metrics
from ddpgpt.errors import UserError
from ddpgpt.settings import PlotConfig


def moving_average(values, window):
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    sums = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def curves(out_dir):
    """{name: (iters, values)} of one run, and the iters it was resumed at."""
    rows = metrics.read(out_dir)
    if not rows.steps:
        raise UserError(f"{out_dir}/metrics.jsonl holds no step of a run: give the out_dir of a "
                        f"train.py run that took at least one step")
    steps = [rows.steps[i] for i in sorted(rows.steps)]
    evals = [rows.evals[i] for i in sorted(rows.evals)]
    series, left_out = {}, []
    for key, logged in [("loss", steps), ("lr", steps), ("tok_per_s", steps),
                        ("train_loss", evals), ("val_loss", evals)]:
        points = [(r["iter"], r[key]) for r in logged if key in r]
        # a diverged run logs NaN and inf (nan_policy=skip), which matplotlib cannot scale to
        finite = [(i, v) for i, v in points if math.isfinite(v)]
        series[key] = ([i for i, _ in finite], [v for _, v in finite])
        left_out += [f"{len(points) - len(finite)} of {key}"] * (len(finite) < len(points))
    if left_out:
        print(f"plot.py: {out_dir}: left out the values that are not finite (NaN or inf): "
              f"{', '.join(left_out)}")
    return series, [r["iter"] for r in rows.starts if r["run"] == "resumed"]


def draw(runs, smooth, title):
    """The figure of {label: (series, resumed)}."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = {"loss": axes[0, 0], "val_loss": axes[0, 1], "lr": axes[1, 0], "tok_per_s": axes[1, 1]}
    for n, (label, (series, resumed)) in enumerate(runs.items()):
        color, marker = f"C{n % 10}", "os^Dv<>p"[n % 8]  # a marker each: runs that overlap
        for key in ("loss", "tok_per_s"):
            x, y = series[key]
            if not x:
                continue
            panels[key].plot(x, y, color=color, alpha=0.25, linewidth=0.8)
            panels[key].plot(x, moving_average(y, smooth or max(1, len(x) // 50)), color=color,
                             linewidth=1.5, label=label if key == "loss" else None)
        x, y = series["train_loss"]
        panels["loss"].plot(x, y, color=color, linestyle="--", marker=".", linewidth=1)
        x, y = series["val_loss"]
        panels["val_loss"].plot(x, y, color=color, marker=marker, markersize=3, alpha=0.85)
        panels["lr"].plot(*series["lr"], color=color, label=label)
        for ax in panels.values():
            for i in resumed:
                ax.axvline(i, color=color, linestyle=":", linewidth=1)
    titles = {"loss": "loss (each step; dashed: train loss at evaluations)",
              "val_loss": "val loss" + zoom_past_first(panels["val_loss"], [
                  s["val_loss"][1] for s, _ in runs.values()]),
              "lr": "learning rate", "tok_per_s": "tokens / s"}
    for key, ax in panels.items():
        ax.set_title(titles[key], fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("iter")
    panels["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    # the runs' names under the panels, where no curve runs
    fig.legend(*panels["loss"].get_legend_handles_labels(), loc="lower center",
               ncol=min(len(runs), 5), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def zoom_past_first(ax, val_losses):
    """Scale the val loss panel to the evaluations after each run's first: the first one, of
    the untrained model, lies far above the rest and would flatten them. What the title adds,
    where the first ones are off the panel."""
    later = [v for values in val_losses for v in values[1:]]
    if not later:
        return ""
    low, high = min(later), max(later)
    span = high - low or abs(high) * 0.1 or 1.0
    top = high + 0.15 * span
    ax.set_ylim(low - 0.1 * span, top)
    off = [values[0] for values in val_losses if values and values[0] > top]
    if len(off) == 1 and len(val_losses) == 1:
        return f" (the first evaluation, {off[0]:.4f}, is off the top)"
    return " (the first evaluations are off the top)" if off else ""


def main(argv):
    cfg = configurator.parse(PlotConfig, argv, "plot.py")
    out_dirs = cfg.out_dir.split(",")
    labels = [os.path.basename(os.path.normpath(r)) or r for r in out_dirs]
    if len(set(labels)) < len(labels):  # out/a and other/a: the paths tell them apart
        labels = out_dirs
    runs = {label: curves(r) for label, r in zip(labels, out_dirs)}
    out = cfg.to or os.path.join(out_dirs[0] if len(out_dirs) == 1 else "", "curves.png")
    fig = draw(runs, cfg.smooth, cfg.title)
    try:
        with fileio.publishing(out) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    except OSError as e:
        raise UserError(f"could not write {out} ({e.strerror or e}): give --to a path in a "
                        f"folder you can write to") from e
    print(f"plot.py: wrote {out} ({', '.join(labels)})")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "plot.py", sys.argv[1:]))
