"""parallel=fsdp against ddp, on the CPU under torchrun (gloo), and what it means on GPUs:

  memory   the bytes of weights, gradients and optimizer state that each rank holds, and its
           peak RSS, at N = 2 and 4 ranks, for ddp and fsdp (benchmarks/fsdp_rank.py: train.py's
           wrapping and one optimizer step of train.py's)
  losses   train.py under ddp and under fsdp, float32, 20 steps: the largest relative
           difference of the losses; fsdp resumed from its checkpoint at step 10, step for step
  saves    train.py with and without async_save, under ddp and fsdp: how long the step that
           starts a save takes against a step that does not, and whether the checkpoints on
           disk hold the same as a synchronous save's
  fits     the largest GPT-2 shape that trains with fsdp on 8 GPUs of 24, 40 and 80 GB,
           derived from the measured bytes per parameter (see the page's text for the rest)

Memory and losses do not depend on the machine's load; the step times of saves do.
"""
import glob
import json
import os
import re
import shutil
import statistics
import sys

import torch

from benchmarks import common, report, training
from ddpgpt import checkpoint
from ddpgpt.model import GPT, GPTConfig

TITLE = "Past one GPU's memory: fsdp"
# the memory model: GPT-2's shape at GPT-2's vocabulary, scaled down to fit 4 ranks of ddp
# beside other work in a shared machine's memory; the bytes per parameter do not depend on it
MEMORY_MODEL = ["--n_layer=6", "--n_head=8", "--n_embd=512", "--block_size=256",
                "--vocab_size=50304", "--batch_size=1", "--gradient_accumulation_steps=4"]
# the saves' model: a checkpoint of 37 MB, whose writing takes a few steps of its own
SAVE_MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=256", "--block_size=128",
              "--batch_size=2"]
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4"]
CPU = ["--device=cpu", "--dtype=float32", "--backend=gloo"]
FULL = {"memory_model": MEMORY_MODEL, "save_model": SAVE_MODEL, "ranks": [2, 4],
        "save_steps": 24, "save_every": 6, "loss_steps": 20}
# small: the losses are read from the synchronous save runs, made with the losses' keys
# (LOSS_KEYS) and as many steps, saved at the middle one: two launches of 2 ranks fewer
SMALL = {"memory_model": [*TINY, "--vocab_size=320", "--gradient_accumulation_steps=4"],
         "save_model": TINY, "ranks": [2], "save_steps": 6, "save_every": 3,
         "loss_steps": 6, "losses_from_saves": True}
# the losses' runs: micro-steps to sum, a warm-up and a gradient clip that clips
LOSS_KEYS = ["--gradient_accumulation_steps=4", "--eval_iters=2", "--learning_rate=3e-3",
             "--warmup_iters=2", "--grad_clip=0.1"]
BYTES_SLACK, STEP_RATIO, LOSS_RTOL = 1.1, 1.2, 1e-5
GPUS = 8
GPU_GIB = [24, 40, 80]
# GPT-2's architecture at GPT-2's and GPT-3's shapes: (name, n_layer, n_head, n_embd)
SHAPES = [("GPT-2 124M", 12, 12, 768), ("GPT-2 350M", 24, 16, 1024),
          ("GPT-2 774M", 36, 20, 1280), ("GPT-2 1.5B", 48, 25, 1600), ("2.7B", 32, 32, 2560),
          ("6.7B", 32, 32, 4096), ("13B", 40, 40, 5120), ("30B", 48, 56, 7168),
          ("65B", 80, 64, 8192)]
VOCAB, CONTEXT = 50304, 1024
RESERVE = 2 * 2**30  # the CUDA context, NCCL's buffers and the allocator's fragmentation
TIME_CAP_S = 1800
TABLES = {
    "results": [("parallel", "{parallel}"), ("ranks", "{ranks}"),
                ("parameters", "{params:,}"), ("weights", "{weights:size}"),
                ("gradients", "{grads:size}"), ("optimizer", "{optimizer:size}"),
                ("per rank", "{total:size}"), ("bytes/parameter", "{per_param:.3f}"),
                ("largest held whole", "{largest_whole:size}"),
                ("peak RSS (most of a rank)", "{peak_rss:size}")],
    "saves": [("parallel", "{parallel}"), ("async_save", "{async_save}"),
              ("normal step ms (median)", "{step_ms:,.0f}"),
              ("step that starts a save, ms", "{save_step_ms:,.0f}"), ("ratio", "{ratio:.2f}"),
              ("loop waited for the save, ms", "{waited_ms:,.0f}"), ("load", "{load_1m}")],
    "fits": [("model", "{name}"), ("parameters", "{params:,}"),
             ("ddp, per GPU", "{ddp:size}"), ("fsdp, per GPU", "{fsdp:size}"),
             ("fsdp, whole gradients kept", "{fsdp_accumulating:size}")]}


def run(small, device, workdir):
    settings = SMALL if small else FULL
    results = [measure_memory(kind, n, settings, workdir)
               for n in settings["ranks"] for kind in ("ddp", "fsdp")]
    saves = [measure_saves(kind, background, settings, workdir)
             for kind in ("ddp", "fsdp") for background in (False, True)]
    losses = compare_losses(settings, workdir)  # after the saves: small mode reads their runs
    same = same_checkpoints(workdir)
    per_param = bytes_per_param(results)
    fits = [fit(name, layers, heads, width, per_param) for name, layers, heads, width in SHAPES]
    return {"settings": {**settings, "gpus": GPUS, "gpu_gib": GPU_GIB, "per_param": per_param,
                         "memory_args": " ".join(settings["memory_model"]),
                         "save_args": " ".join(settings["save_model"]),
                         "reserve": RESERVE, "context": CONTEXT, "vocab": VOCAB,
                         "losses": losses, "same_checkpoints": same,
                         "largest": largest_fits(fits)},
            "results": results, "saves": saves, "fits": fits,
            "targets": targets(results, losses, saves, same)}


# ---- memory ----

def measure_memory(kind, n, settings, workdir):
    print(f"bench fsdp: memory, {kind}, {n} ranks", file=sys.stderr)
    ranks = run_ranks(n, [*settings["memory_model"], *CPU, f"--parallel={kind}",
                          "--max_iters=1"], os.path.join(workdir, f"memory-{kind}-{n}"))
    most = holding_most(ranks)
    total = most["weights"] + most["grads"] + most["optimizer"]
    return {"parallel": kind, "ranks": n, **{k: most[k] for k in (
        "params", "weights", "grads", "optimizer", "largest_whole")}, "total": total,
        "per_param": total / most["params"], "peak_rss": max(r["peak_rss"] for r in ranks)}


def run_ranks(n, args, out):
    """benchmarks/fsdp_rank.py on n ranks with train.py's settings args: each rank's numbers."""
    common.check(common.run_watched(
        [*common.ranks_command(n), "-m", "benchmarks.fsdp_rank", out, *args],
        common.child_env(OMP_NUM_THREADS="1"), TIME_CAP_S),
        f"benchmarks.fsdp_rank ({n} ranks, {' '.join(args)})")
    ranks = []
    for path in sorted(glob.glob(f"{out}.rank*.json")):
        with open(path) as f:
            ranks.append(json.load(f))
    assert len(ranks) == n, ranks
    return ranks


def holding_most(ranks):
    """The rank that holds the most bytes: with an uneven split of a tensor, rank 0 holds
    more."""
    return max(ranks, key=lambda r: r["weights"] + r["grads"] + r["optimizer"])


def bytes_per_param(results):
    """fsdp's bytes per parameter per rank, times the ranks: what N ranks hold of each
    parameter together (16 if nothing were held twice), the most over the ranks measured."""
    return max(r["per_param"] * r["ranks"] for r in results if r["parallel"] == "fsdp")


def bytes_target(results, n):
    ddp, fsdp = (next(r for r in results if (r["parallel"], r["ranks"]) == (kind, n))
                 for kind in ("ddp", "fsdp"))
    bound = BYTES_SLACK * ddp["total"] / n + fsdp["largest_whole"]
    return {"target": f"per-rank bytes of weights + gradients + optimizer state under fsdp at "
                      f"{n} ranks <= {BYTES_SLACK} x ddp's / {n} + the largest tensor held whole",
            "measured": f"{report.size(fsdp['total'])} against ddp's "
                        f"{report.size(ddp['total'])} / {n} = {report.size(ddp['total'] / n)} "
                        f"({fsdp['total'] / ddp['total'] * n:.4f} x); largest held whole "
                        f"{report.size(fsdp['largest_whole'])}",
            "met": fsdp["total"] <= bound}


# ---- losses ----

def train(args, n, out):
    """train.py on n ranks (one: a plain process): ({iter: its step's row}, what it
    printed)."""
    finished = common.check(common.run_watched(
        [*common.ranks_command(n), "train.py", *args, f"--out_dir={out}"],
        common.child_env(OMP_NUM_THREADS="1"), TIME_CAP_S), f"train.py ({' '.join(args)})")
    return step_rows(out), finished.output


def step_rows(out):
    """{iter: its step's row} of a train.py run's metrics.jsonl."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["iter"]: r for r in rows if "loss" in r}


def compare_losses(settings, workdir):
    """ddp and fsdp from scratch; fsdp again from its checkpoint at the middle step. With
    losses_from_saves, ddp and fsdp are the synchronous save runs (already made), and the
    resume starts from a copy of the fsdp one's checkpoint."""
    data = training.make_data("random-bytes", workdir)
    steps = settings["loss_steps"]
    print("bench fsdp: losses", file=sys.stderr)
    if settings.get("losses_from_saves"):
        assert (settings["save_steps"], settings["save_every"]) == (steps, steps // 2)
        ddp, fsdp = (step_rows(os.path.join(workdir, f"saves-{kind}-sync"))
                     for kind in ("ddp", "fsdp"))
        args = save_args("fsdp", False, settings, data)
        fsdp_out = os.path.join(workdir, "saves-fsdp-sync")
        move = shutil.copytree  # its checkpoints are also compared with the async run's
    else:
        args = [*TINY, *CPU, f"--data_dir={data}", *LOSS_KEYS, f"--max_iters={steps}",
                f"--eval_interval={steps // 2}"]
        ddp, _ = train([*args, "--parallel=ddp"], 2, os.path.join(workdir, "loss-ddp"))
        fsdp_out = os.path.join(workdir, "loss-fsdp")
        args = [*args, "--parallel=fsdp"]
        fsdp, _ = train(args, 2, fsdp_out)
        move = os.rename
    resumed_out = os.path.join(workdir, "loss-resumed")
    os.makedirs(resumed_out)
    move(checkpoint.path_for(fsdp_out, steps // 2, folder=True),
         checkpoint.path_for(resumed_out, steps // 2, folder=True))
    resumed, _ = train([*args, "--init_from=resume"], 2, resumed_out)
    return {"steps": steps, "resumed_from": steps // 2,
            "max_rdiff": max(abs(fsdp[i]["loss"] / ddp[i]["loss"] - 1)
                                             for i in ddp),
            "same_batches": all(fsdp[i]["batch_fp"] == ddp[i]["batch_fp"] for i in ddp),
            "resumed_steps": len(resumed),
            "resumed_exact": all(resumed[i]["loss"] == fsdp[i]["loss"] for i in resumed)}


# ---- saves ----

SAVED = re.compile(r"saved (\S+) \(([\d.]+) s(?:, written in the background; the run waited "
                   r"([\d.]+) s)?")


def measure_saves(kind, background, settings, workdir):
    """The steps of a run that saves every save_every steps. The step that starts a save is
    the time the loop waited for the save (the whole save, or its copy to host memory) plus
    the step after it, which the writing in the background slows; a normal step is the median
    of the steps two or more after a save."""
    data = training.make_data("random-bytes", workdir)
    every, n_steps = settings["save_every"], settings["save_steps"]
    out = os.path.join(workdir, f"saves-{kind}-{'async' if background else 'sync'}")
    print(f"bench fsdp: saves, {kind}, async_save={background}", file=sys.stderr)
    steps, output = train(save_args(kind, background, settings, data), 2, out)
    waited = saves_waited(output)
    after = [i for i in steps if i % every == 0 and 0 < i < n_steps]
    normal = [steps[i]["ms"] for i in steps if i % every >= 2]
    step_ms = statistics.median(normal)
    save_step = statistics.median(waited.get(i, 0) * 1000 + steps[i]["ms"] for i in after)
    return {"parallel": kind, "async_save": background, "step_ms": step_ms,
            "save_step_ms": save_step, "ratio": save_step / step_ms,
            "waited_ms": statistics.median(waited.get(i, 0) * 1000 for i in after),
            "load_1m": common.load_1m()}


def save_args(kind, background, settings, data):
    """train.py's arguments of a save run (with losses_from_saves, the losses' keys)."""
    keys = LOSS_KEYS if settings.get("losses_from_saves") else \
        ["--gradient_accumulation_steps=2", "--eval_iters=1"]
    return [*settings["save_model"], *CPU, f"--data_dir={data}", *keys,
            f"--max_iters={settings['save_steps']}", f"--eval_interval={settings['save_every']}",
            f"--parallel={kind}", f"--async_save={background}", "--log_interval=1000"]


def saves_waited(output):
    """{iter: seconds the loop waited for the save at that iter}, from train.py's lines
    `saved <path> (<s> s)` (it waited for the whole save) and `saved <path> (<s> s, written in
    the background; the run waited <s> s ...)`."""
    return {int(re.search(r"ckpt_(\d+)", path).group(1)): float(copy or whole)
            for path, whole, copy in SAVED.findall(output)}


def same_checkpoints(workdir):
    """Do the background saves hold what the synchronous saves of the same run hold (every
    tensor and value but the settings async_save and out_dir), at every iter, under ddp and
    fsdp?"""
    same = {}
    for kind in ("ddp", "fsdp"):
        sync, background = (os.path.join(workdir, f"saves-{kind}-{mode}")
                            for mode in ("sync", "async"))
        pairs = list(zip(checkpoint.list_checkpoints(sync),
                         checkpoint.list_checkpoints(background)))
        same[kind] = bool(pairs) and all(
            os.path.basename(a) == os.path.basename(b) and
            equal(checkpoint.read(a)[0], checkpoint.read(b)[0]) for a, b in pairs)
    return same


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and \
            all(equal(a[k], b[k]) for k in a if k not in ("async_save", "out_dir"))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(equal, a, b))
    return a == b


# ---- what fits on a GPU ----

def fit(name, layers, heads, width, per_param):
    """The memory one of GPUS GPUs needs to train a model of this shape, bf16, a micro-batch of
    one sequence of CONTEXT tokens, no activation checkpointing, under ddp and under fsdp."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=width, vocab_size=VOCAB,
                              block_size=CONTEXT, bias=False))
    p = model.get_num_params(non_embedding=False)
    block = 12 * width ** 2  # a block's weights
    root = (VOCAB + CONTEXT) * width  # the embeddings, the tied output layer
    # activations kept for the backward, 16-bit, flash attention: 34 x tokens x width bytes a
    # layer (Korthikanti et al. 2022, table 2, without the attention scores); the logits in
    # bfloat16, in float32 for the loss, and their gradient
    activations = layers * 34 * CONTEXT * width + CONTEXT * VOCAB * (2 + 4 + 4)
    # fsdp gathers the root's weights for the whole step and two blocks' at a time (one and
    # the next, prefetched), in bfloat16, and holds a block's whole gradients (float32)
    # until they are reduce-scattered
    gathered = 2 * root + 4 * root + 2 * (2 * block + 4 * block)
    ddp = 16 * p + activations + RESERVE
    fsdp = per_param * p / GPUS + gathered + activations + RESERVE
    return {"name": name, "params": p, "ddp": ddp, "fsdp": fsdp,
            "fsdp_accumulating": fsdp + 4 * p}


def largest_fits(fits):
    """For each GPU size: the largest shape that fits under ddp, fsdp, and fsdp keeping whole
    gradients (more than one micro-step per rank without reduce_every_micro_step)."""
    out = []
    for gib in GPU_GIB:
        row = {"gpu": f"{GPUS} x {gib} GB"}
        for key in ("ddp", "fsdp", "fsdp_accumulating"):
            fitting = [f for f in fits if f[key] <= gib * 1e9]
            row[key] = fitting[-1]["name"] if fitting else "none"
        out.append(row)
    return out


# ---- targets ----

def targets(results, losses, saves, same):
    out = [bytes_target(results, n) for n in sorted({r["ranks"] for r in results})]
    out.append({"target": f"fsdp's losses within {LOSS_RTOL:g} (relative) of ddp's, float32, "
                          f"{losses['steps']} steps, on the same batches",
                "measured": f"largest relative difference {losses['max_rdiff']:.2e}; "
                            f"{'the same' if losses['same_batches'] else '**other**'} batches",
                "met": losses["max_rdiff"] <= LOSS_RTOL and losses["same_batches"]})
    out.append({"target": "fsdp resumed from its checkpoint repeats the run bit for bit",
                "measured": f"{losses['resumed_steps']} steps resumed, "
                            f"{'all' if losses['resumed_exact'] else 'not all'} the same losses",
                "met": losses["resumed_exact"] and losses["resumed_steps"] > 0})
    for kind in ("ddp", "fsdp"):
        row = next(r for r in saves if r["parallel"] == kind and r["async_save"])
        out.append({"target": f"{kind}: with async_save, the step that starts a save within "
                              f"{STEP_RATIO}x of a normal step (CPU)",
                    "measured": f"{row['save_step_ms']:,.0f} ms against {row['step_ms']:,.0f} "
                                f"ms ({row['ratio']:.2f}x; load {row['load_1m']})",
                    "met": row["ratio"] <= STEP_RATIO})
    out.append({"target": "a save in the background holds what a synchronous save holds",
                "measured": "; ".join(f"{k}: {'the same' if v else '**not the same**'}"
                                      for k, v in same.items()),
                "met": all(same.values())})
    return out


def plot(result):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for kind, colour in (("ddp", "C0"), ("fsdp", "C1")):
        rows = [r for r in result["results"] if r["parallel"] == kind]
        left.plot([r["ranks"] for r in rows], [r["total"] / 2**20 for r in rows], marker="o",
                  color=colour, label=kind)
    left.set(xlabel="ranks", ylabel="weights + gradients + optimizer, MiB per rank",
             xticks=[r["ranks"] for r in result["results"]])
    left.set_ylim(bottom=0)
    left.legend()
    fits = result["fits"]
    x = range(len(fits))
    for key, colour in (("ddp", "C0"), ("fsdp", "C1"), ("fsdp_accumulating", "C2")):
        right.plot(x, [f[key] / 1e9 for f in fits], marker="o", color=colour, label=key)
    for gib in GPU_GIB:
        right.axhline(gib, color="grey", linestyle="--", linewidth=0.8)
    right.set(yscale="log", xticks=list(x), ylabel=f"GB per GPU, {GPUS} GPUs (derived)")
    right.set_xticklabels([f["name"] for f in fits], rotation=45, fontsize=8)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("fsdp: what each rank holds (measured, CPU) and what fits on a GPU (derived)")
    return fig
