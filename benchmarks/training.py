"""Training throughput of train.py itself, run as a user runs it (python, or torchrun with
gloo), read back from the row it writes per step to metrics.jsonl: ms per step, tokens per
second, the share of the step spent waiting for data, and MFU where train.py knows the GPU's
peak (on a CPU, the achieved FLOP/s instead)."""
import json
import os
import sys

import numpy as np
import torch

from benchmarks import common
from ddpgpt import arch, configurator, runtime, tokenfile
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig

TITLE = "Training"
QUICKSTART = ["config/quickstart.py", "--device=cpu"]  # the quick start's CPU run, on any machine
# GPT-2 124M is config/owt.py's model; a CPU does a few steps of one sequence in fp32
GPT2_CPU = ["config/owt.py", "--device=cpu", "--dtype=float32", "--compile=False",
            "--batch_size=1", "--gradient_accumulation_steps=1"]
GPT2_CUDA = ["config/owt.py", "--device=cuda", "--dtype=bfloat16", "--compile=True",
             "--batch_size=12", "--gradient_accumulation_steps=4"]
# what to run: name, ranks, data, train.py's arguments, steps, and the first steps not
# counted (start-up, torch.compile)
SMALL = [dict(name="quick-start", ranks=1, data="random-bytes", args=QUICKSTART, steps=4,
              warmup=1)]
FULL = [*(dict(name="quick-start", ranks=ranks, data="pystdlib-bytes", args=QUICKSTART,
               steps=30, warmup=5) for ranks in (1, 2)),
        dict(name="GPT-2 124M", ranks=1, data="random-gpt2", args=GPT2_CPU, steps=2, warmup=1)]
GPU = dict(name="GPT-2 124M, bf16, compile", ranks=1, data="random-gpt2", args=GPT2_CUDA,
           steps=30, warmup=10, gpu=True)
NO_GPU = "not run: no GPU in this session (run `python bench.py training --device=cuda` on one)"
RANDOM = {"random-bytes": (257, 200_000), "random-gpt2": (50257, 2_000_000)}  # vocab, tokens
TIME_CAP_S = 1800  # only stops a hung run
TABLES = {
    "table": [("run", "{name}"), ("ranks", "{ranks}"), ("device", "{device}"),
              ("dtype", "{dtype}"), ("compile", "{compile}"),
              ("tokens/step", "{tokens_per_step:,}"), ("steps counted", "{steps_counted}"),
              ("ms/step (median)", "{ms_per_step:,.1f}"), ("tok/s", "{tok_per_s:,.0f}"),
              ("data wait", "{data_wait:.2%}"), ("worst step's data wait", "{data_wait_max:.2%}"),
              ("achieved TFLOP/s", "{tflops:.3f}"), ("MFU", "{mfu:.1%}"), ("load", "{load_1m}")],
    "commands": [("run", "{name}"), ("ranks", "{ranks}"), ("data", "`{data}`"),
                 ("command", "`{command}`")]}


def make_data(kind, workdir):
    folder = os.path.join(workdir, kind)
    if os.path.exists(folder):
        return folder
    if kind == "pystdlib-bytes":  # the quick-start's own data, made as the README says
        common.check(common.run_watched(
            [sys.executable, "prepare.py", "--dataset=pystdlib", "--tokenizer=byte",
             f"--out_dir={folder}"], common.child_env(), TIME_CAP_S), "prepare.py")
        return folder
    return common.random_data(folder, *RANDOM[kind])


def train_args(spec, data_dir, out_dir):
    return [*spec["args"], f"--data_dir={data_dir}", f"--out_dir={out_dir}",
            f"--max_iters={spec['steps']}", "--eval_iters=1", "--log_interval=10",
            "--wandb_log=False"]


def command(spec):
    """The command as a user types it."""
    launcher = "python" if spec["ranks"] == 1 else \
        f"torchrun --standalone --nproc_per_node={spec['ranks']}"
    return " ".join(["OMP_NUM_THREADS=1", launcher, "train.py",
                     *train_args(spec, "<data>", "<out>")])


def launch(spec, args, out_dir):
    """Run train.py as a user would; its per-step rows from metrics.jsonl, warm-up left out."""
    launcher = common.torchrun(spec["ranks"]) if spec["ranks"] > 1 else [sys.executable]
    print(f"bench training: {spec['name']}, {spec['ranks']} rank(s)", file=sys.stderr)
    # one thread per process, as torchrun sets for its ranks: with two, a CPU shared with
    # other work stalls at every OpenMP barrier, and small-model steps took several times longer
    env = common.child_env(OMP_NUM_THREADS="1")
    common.check(common.run_watched([*launcher, "train.py", *args], env, TIME_CAP_S),
                 f"train.py ({spec['name']})")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = [row for row in map(json.loads, f) if "ms" in row]
    return steps[spec["warmup"]:]


def measure(spec, workdir, out_dir):
    data_dir = make_data(spec["data"], workdir)
    args = train_args(spec, data_dir, out_dir)
    counted = launch(spec, args, out_dir)
    cfg = configurator.parse(TrainConfig, args, "train.py")
    with torch.device("meta"):  # the model train.py built, with no weights allocated
        model = GPT(GPTConfig(**arch.model_args(cfg, tokenfile.read_meta(data_dir))))
    ms = np.array([row["ms"] for row in counted])
    tok_per_s = float(np.median([row["tok_per_s"] for row in counted]))
    mfu = [row["mfu"] for row in counted if "mfu" in row]
    return {"status": "ok", "device": cfg.device,
            "dtype": runtime.precision(cfg.dtype, cfg.device).dtype,
            "compile": cfg.compile, "params": model.get_num_params(),
            "tokens_per_step": cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size,
            "steps_counted": len(counted), "ms_per_step": float(np.median(ms)),
            "tok_per_s": tok_per_s,
            # the share of all counted step time spent in next(batches)
            "data_wait": float(sum(row["data_wait"] * row["ms"] for row in counted) / ms.sum()),
            "data_wait_max": max(row["data_wait"] for row in counted),
            "tflops": model.flops_per_token() * tok_per_s / 1e12,
            "mfu": float(np.median(mfu)) if mfu else None, "load_1m": common.load_1m()}


def run(small, device, workdir):
    """The part's numbers, and "curves": the quick-start runs' out_dirs, whose curves bench.py
    draws with plot.py (the same losses on 1 and 2 ranks; the tokens/s of each)."""
    rows, curves = [], []
    for spec in (SMALL if small else FULL) + [GPU]:
        row = {k: spec[k] for k in ("name", "ranks", "data", "steps", "warmup")}
        row.update(gpu=spec.get("gpu", False), command=command(spec))
        if spec.get("gpu") and device != "cuda":
            rows.append({**row, "status": NO_GPU})
            continue
        # the folder's name is the run's name in plot.py's legend (no comma: plot.py's
        # --out_dir separates runs by commas)
        out_dir = os.path.join(workdir, f"{spec['name']} on {spec['ranks']} rank(s)")
        rows.append({**row, **measure(spec, workdir, out_dir)})
        if spec["name"] == "quick-start":
            curves.append(out_dir)
    return {"results": rows, "targets": targets(rows), "curves": curves}


def targets(rows):
    done = [r for r in rows if r["status"] == "ok"]
    waits = "; ".join(f"{r['name']}, {r['ranks']} rank(s): {r['data_wait']:.2%} "
                      f"(worst step {r['data_wait_max']:.2%})" for r in done)
    gpu = next(r for r in rows if r["gpu"])
    if gpu["status"] != "ok":
        mfu = {"measured": gpu["status"], "met": None}
    elif gpu["mfu"] is None:
        mfu = {"measured": f"the device's peak is not in runtime.PEAK_FLOPS; "
                           f"{gpu['tflops']:.0f} TFLOP/s", "met": None}
    else:
        mfu = {"measured": f"{gpu['mfu']:.1%} MFU ({gpu['tok_per_s']:,.0f} tok/s)",
               "met": gpu["mfu"] >= 0.45}
    return [{"target": "waiting for data under 1% of step time", "measured": waits,
             "met": all(r["data_wait"] < 0.01 for r in done)},
            {"target": "GPT-2 124M at 45% MFU or better on an H100/H200-class GPU", **mfu}]


def plot(result):
    from matplotlib.figure import Figure

    done = [r for r in result["results"] if r["status"] == "ok"]
    labels = [f"{r['name']}\n{r['ranks']} rank(s), {r['device']}" for r in done]
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    left.bar(labels, [r["tok_per_s"] for r in done], color="C0")
    left.set(yscale="log", ylabel="tokens/s (median step)")
    right.bar(labels, [r["data_wait"] * 100 for r in done], color="C2", label="all steps")
    right.scatter(labels, [r["data_wait_max"] * 100 for r in done], color="k", zorder=3,
                  label="worst step")
    right.axhline(1, color="C3", linestyle="--", label="target: 1%")
    right.set_ylabel("waiting for data, % of step time")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Training throughput (train.py, metrics.jsonl)")
    fig.tight_layout()
    return fig
