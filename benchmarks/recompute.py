"""activation_checkpointing: the activations a rank keeps in each mode (and in full with the
loss in chunks, loss_chunks), and what the recompute costs in step time, on the CPU:

  memory   one optimizer step of GPT-2 124M's shape (12 x 768, block 1024, vocabulary 50304,
           float32, batch 1) in each configuration, wrapped as train.py wraps it, under torch's
           MemTracker on real tensors (benchmarks/recompute_step.py): the most activations alive
           at once, those of them that the blocks' forwards keep, and the step's peak of all
           tensors
  time     the steps after it, timed without the tracker, one thread: the median of their CPU
           seconds (which the machine's other work changes less than their wall time),
           against none's

A rank's activations do not depend on the world size or on parallel (the blocks' inputs and
outputs are whole under fsdp too), so one process measures them. Memory does not depend on the
machine's load; the step times do.
"""
import json
import os
import statistics
import sys

from benchmarks import common, report

TITLE = "Activation checkpointing"
MODES = ("none", "selective", "full")
LOSS_CHUNKS = 8  # full's row with the loss in chunks: its logits' memory an eighth
CONFIGS = [(mode, 1) for mode in MODES] + [("full", LOSS_CHUNKS)]
MODEL = ["--n_layer=12", "--n_head=12", "--n_embd=768", "--block_size=1024",
         "--vocab_size=50304", "--batch_size=1"]
SMALL_MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64",
               "--vocab_size=4096", "--batch_size=2"]
CPU = ["--device=cpu", "--dtype=float32"]
FULL_SHARE = 1 / 3  # of none's activations, at most
TIMED_STEPS, SMALL_TIMED_STEPS = 3, 2
TIME_CAP_S = 1800
TABLES = {"results": [("activation_checkpointing", "{mode}"),
                      ("activations, most at once", "{activations:size}"),
                      ("share of none's", "{share:.2f}"),
                      ("of which the blocks'", "{blocks:size}"),
                      ("share of none's", "{blocks_share:.3f}"),
                      ("peak, all tensors", "{total:size}"),
                      ("step, CPU s (median)", "{cpu_s:.1f}"),
                      ("CPU time / none's", "{slowdown:.2f}"), ("step, s", "{step_s:.1f}"),
                      ("load", "{load_1m}")]}


def run(small, device, workdir):
    model = SMALL_MODEL if small else MODEL
    steps = SMALL_TIMED_STEPS if small else TIMED_STEPS
    rows = [measure(mode, chunks, model, steps, workdir) for mode, chunks in CONFIGS]
    none = rows[0]
    for r in rows:
        r["share"] = r["activations"] / none["activations"]
        r["blocks_share"] = r["blocks"] / none["blocks"]
        r["slowdown"] = r["cpu_s"] / none["cpu_s"]
    return {"settings": {"model_args": " ".join(model), "timed_steps": steps},
            "results": rows, "targets": targets(rows)}


def label(mode, loss_chunks):
    return mode if loss_chunks == 1 else f"{mode}, loss_chunks={loss_chunks}"


def measure(mode, loss_chunks, model, steps, workdir):
    """One process's step in this configuration: its activations and peak in bytes, and its
    median step time."""
    name = label(mode, loss_chunks)
    out = os.path.join(workdir, f"{mode}-{loss_chunks}.json")
    print(f"bench recompute: {name}", file=sys.stderr)
    common.check(common.run_watched(
        [sys.executable, "-m", "benchmarks.recompute_step", out, str(steps), *model, *CPU,
         f"--activation_checkpointing={mode}", f"--loss_chunks={loss_chunks}"],
        common.child_env(OMP_NUM_THREADS="1"), TIME_CAP_S),
        f"benchmarks.recompute_step ({name})")
    with open(out) as f:
        measured = json.load(f)
    return {"mode": name, "activations": measured["activations"], "blocks": measured["blocks"],
            "total": measured["peak"]["Total"], "step_s": statistics.median(measured["step_s"]),
            "cpu_s": statistics.median(measured["step_cpu_s"]), "load_1m": common.load_1m()}


def targets(rows):
    none, selective, full, chunked = rows  # in CONFIGS' order
    return [{"target": f"full's activations at most {FULL_SHARE:.2f} of none's (with "
                       f"loss_chunks={LOSS_CHUNKS}: the logits outside the blocks, whose "
                       f"memory no block's recompute touches, in chunks)",
             "measured": f"{report.size(chunked['activations'])} against "
                         f"{report.size(none['activations'])} ({chunked['share']:.2f}); a step "
                         f"{chunked['slowdown']:.2f}x none's CPU time. With the loss in one "
                         f"piece {report.size(full['activations'])} ({full['share']:.2f}), a "
                         f"step {full['slowdown']:.2f}x",
             "met": chunked["share"] <= FULL_SHARE},
            {"target": f"full's blocks' activations at most {FULL_SHARE:.2f} of none's",
             "measured": f"{report.size(full['blocks'])} against "
                         f"{report.size(none['blocks'])} ({full['blocks_share']:.3f})",
             "met": full["blocks_share"] <= FULL_SHARE},
            {"target": "selective's activations between full's and none's",
             "measured": f"{report.size(selective['activations'])} "
                         f"({selective['share']:.2f} of none's; the blocks' "
                         f"{selective['blocks_share']:.2f}); a step "
                         f"{selective['slowdown']:.2f}x none's CPU time",
             "met": full["activations"] < selective["activations"] < none["activations"]
             and full["blocks"] < selective["blocks"] < none["blocks"]}]


def plot(result):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    rows = result["results"]
    modes = [r["mode"].replace(", ", ",\n") for r in rows]
    left.bar(modes, [r["activations"] / 2**20 for r in rows], color="C0", label="all")
    left.bar(modes, [r["blocks"] / 2**20 for r in rows], color="C2", label="the blocks'")
    left.legend()
    left.set(xlabel="activation_checkpointing", ylabel="activations, most at once, MiB")
    right.bar(modes, [r["cpu_s"] for r in rows], color="C1")
    right.set(xlabel="activation_checkpointing", ylabel="step, CPU seconds (median, one thread)")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"activation_checkpointing: {result['settings']['model_args']}", fontsize=9)
    return fig
