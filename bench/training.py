"""Training throughput of train.py itself, run as a user runs it (python, or torchrun with
gloo), read back from the row it writes per step to metrics.jsonl: ms per step, tokens per
second, the share of the step spent waiting for data, and MFU where train.py knows the GPU's
peak (on a CPU, the achieved FLOP/s instead)."""
import json
import os
import sys

import numpy as np
import torch

import configurator
import tokenfile
import train
from bench import common, report
from model import GPT, GPTConfig

TITLE = "Training"
QUICKSTART = ["config/quickstart.py"]
# GPT-2 124M is config/owt.py's model; a CPU does a few steps of one sequence in fp32
GPT2_CPU = ["config/owt.py", "--device=cpu", "--dtype=float32", "--compile=False",
            "--batch_size=1", "--gradient_accumulation_steps=1"]
GPT2_CUDA = ["config/owt.py", "--device=cuda", "--dtype=bfloat16", "--compile=True",
             "--batch_size=12", "--gradient_accumulation_steps=4"]
NO_GPU = "not run: no GPU in this session (run `python bench.py training --device=cuda` on one)"
TIME_CAP_S = 1800  # only stops a hung run


def runs(small, device):
    """What to run: name, ranks, data, train.py arguments, steps, and the first steps not
    counted (start-up, torch.compile)."""
    if small:
        cpu = [dict(name="quick-start", ranks=1, data="random-bytes", args=QUICKSTART,
                    steps=4, warmup=1)]
    else:
        cpu = [dict(name="quick-start", ranks=1, data="pystdlib-bytes", args=QUICKSTART,
                    steps=30, warmup=5),
               dict(name="quick-start", ranks=2, data="pystdlib-bytes", args=QUICKSTART,
                    steps=30, warmup=5),
               dict(name="GPT-2 124M", ranks=1, data="random-gpt2", args=GPT2_CPU,
                    steps=2, warmup=1)]
    gpu = dict(name="GPT-2 124M, bf16, compile", ranks=1, data="random-gpt2", args=GPT2_CUDA,
               steps=30, warmup=10, gpu=True)
    return cpu + [gpu if device == "cuda" else {**gpu, "status": NO_GPU}]


def random_tokens(folder, vocab_size, n_train, n_val=20_000):
    """Token files of uniformly random ids: the model's speed does not depend on the text."""
    rng = np.random.default_rng(0)
    tokenfile.write_token_files(
        folder, {"train": rng.integers(0, vocab_size, n_train),
                 "val": rng.integers(0, vocab_size, n_val)},
        tokenizer="random (benchmark)", vocab_size=vocab_size, eot_token=vocab_size - 1)


def make_data(kind, workdir):
    folder = os.path.join(workdir, kind)
    if os.path.exists(folder):
        return folder
    if kind == "pystdlib-bytes":  # the quick-start's own data, made as the README says
        common.check(common.run_watched(
            [sys.executable, "prepare.py", "--dataset=pystdlib", "--tokenizer=byte",
             f"--out_dir={folder}"], common.child_env(), TIME_CAP_S), "prepare.py")
    elif kind == "random-bytes":
        random_tokens(folder, 257, 200_000)
    else:
        random_tokens(folder, 50257, 2_000_000)
    return folder


def train_args(spec, data_dir, out_dir):
    return [*spec["args"], f"--data_dir={data_dir}", f"--out_dir={out_dir}",
            f"--max_iters={spec['steps']}", "--eval_iters=1", "--log_interval=10",
            "--wandb_log=False"]


def flops_per_token(args, data_dir):
    """model.flops_per_token() of the model train.py builds from these arguments, on the meta
    device, so that no weights are allocated."""
    cfg = configurator.parse(train.TrainConfig, args)
    with torch.device("meta"):
        model = GPT(GPTConfig(**train.model_args(cfg, tokenfile.read_meta(data_dir))))
    return model.flops_per_token(), model.get_num_params(), cfg


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


def command(spec):
    launcher = "python" if spec["ranks"] == 1 else \
        f"torchrun --standalone --nproc_per_node={spec['ranks']}"
    return " ".join(["OMP_NUM_THREADS=1", launcher, "train.py", *spec["args"],
                     "--data_dir=<data>", f"--max_iters={spec['steps']}", "--eval_iters=1"])


def measure(spec, workdir, out_dir):
    data_dir = make_data(spec["data"], workdir)
    args = train_args(spec, data_dir, out_dir)
    counted = launch(spec, args, out_dir)
    flops, params, cfg = flops_per_token(args, data_dir)
    ms = np.array([row["ms"] for row in counted])
    tok_per_s = float(np.median([row["tok_per_s"] for row in counted]))
    mfu = [row["mfu"] for row in counted if "mfu" in row]
    return {"status": "ok", "device": cfg.device,
            "dtype": train.pick_dtype(cfg, torch.device(cfg.device).type),
            "compile": cfg.compile, "params": params,
            "tokens_per_step": cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size,
            "steps_counted": len(counted), "ms_per_step": float(np.median(ms)),
            "tok_per_s": tok_per_s,
            # the share of all counted step time spent in next(batches)
            "data_wait": float(sum(row["data_wait"] * row["ms"] for row in counted) / ms.sum()),
            "data_wait_max": max(row["data_wait"] for row in counted),
            "tflops": flops * tok_per_s / 1e12, "mfu": float(np.median(mfu)) if mfu else None,
            "load_1m": common.load_1m(), "command": command(spec)}


def run(small, device, workdir):
    rows = []
    for i, spec in enumerate(runs(small, device)):
        row = {k: spec[k] for k in ("name", "ranks", "data", "steps", "warmup")}
        row["gpu"] = spec.get("gpu", False)
        rows.append({**row, "status": spec["status"]} if "status" in spec
                    else {**row, **measure(spec, workdir, os.path.join(workdir, f"out-{i}"))})
    return {"settings": {"data": {"pystdlib-bytes": "prepare.py --dataset=pystdlib "
                                                    "--tokenizer=byte",
                                  "random-bytes": "random ids, vocabulary 257",
                                  "random-gpt2": "random ids, vocabulary 50257"}},
            "results": rows, "targets": targets(rows)}


def targets(rows):
    done = [r for r in rows if r["status"] == "ok"]
    waits = "; ".join(f"{r['name']}, {r['ranks']} rank(s): {r['data_wait']:.2%} "
                      f"(worst step {r['data_wait_max']:.2%})" for r in done)
    gpu = next(r for r in rows if r["gpu"])
    if gpu["status"] != "ok":
        mfu = {"measured": gpu["status"], "met": None}
    elif gpu["mfu"] is None:
        mfu = {"measured": f"the device's peak is not in train.PEAK_FLOPS; "
                           f"{gpu['tflops']:.0f} TFLOP/s", "met": None}
    else:
        mfu = {"measured": f"{gpu['mfu']:.1%} MFU ({gpu['tok_per_s']:,.0f} tok/s)",
               "met": gpu["mfu"] >= 0.45}
    return [{"target": "waiting for data under 1% of step time", "measured": waits,
             "met": all(r["data_wait"] < 0.01 for r in done)},
            {"target": "GPT-2 124M at 45% MFU or better on an H100/H200-class GPU", **mfu}]


def markdown(result):
    head = ["run", "ranks", "device", "dtype", "compile", "tokens/step", "steps counted",
            "ms/step (median)", "tok/s", "data wait", "worst step's data wait",
            "achieved TFLOP/s", "MFU", "load"]
    body = []
    for r in result["results"]:
        if r["status"] != "ok":
            body.append([r["name"], r["ranks"], r["status"]] + [""] * (len(head) - 3))
            continue
        body.append([r["name"], r["ranks"], r["device"], r["dtype"], r["compile"],
                     f"{r['tokens_per_step']:,}", r["steps_counted"], f"{r['ms_per_step']:,.1f}",
                     f"{r['tok_per_s']:,.0f}", f"{r['data_wait']:.2%}",
                     f"{r['data_wait_max']:.2%}", f"{r['tflops']:.3f}",
                     "n/a (no known peak)" if r["mfu"] is None else f"{r['mfu']:.1%}",
                     r["load_1m"]])
    data_kinds = "; ".join(f"`{k}`: {v}" for k, v in result["settings"]["data"].items())
    commands = [f"- {r['name']}, {r['ranks']} rank(s), data `{r['data']}`: `{r['command']}`"
                for r in result["results"] if r["status"] == "ok"]
    return ["Each run is train.py in a subprocess; the numbers are from the rows it writes to "
            "metrics.jsonl, without the first steps (start-up; compilation on a GPU). "
            "Data wait is the time in `next(batches)` as a share of all counted step time. "
            "Achieved FLOP/s is `model.flops_per_token()` x tokens/s; MFU divides it by the "
            "GPU's peak in `train.PEAK_FLOPS` (a CPU has none). Every process runs one thread "
            "(`OMP_NUM_THREADS=1`, which torchrun also sets for its ranks): with two threads per "
            "process, the machine's other work stalled every OpenMP barrier and small-model "
            "steps took several times longer.", "",
            *report.table(head, body), "", f"Data: {data_kinds}.", "", "Runs:", "", *commands]


def plot(result, path):
    import matplotlib.pyplot as plt

    done = [r for r in result["results"] if r["status"] == "ok"]
    labels = [f"{r['name']}\n{r['ranks']} rank(s), {r['device']}" for r in done]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.bar(labels, [r["tok_per_s"] for r in done], color="C0")
    left.set_yscale("log")
    left.set_ylabel("tokens/s (median step)")
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
