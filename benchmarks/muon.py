"""optimizer=muon over the ranks (ddpgpt/muon.py: each matrix's Newton-Schulz on its owner), on
the CPU under torchrun (gloo):

  work     Newton-Schulz FLOPs per step of the most loaded rank at N = 1, 2, 4, 8, counted from
           the owners (muon.owners) for the quick start's and GPT-2 124M's matrices
  ranks    train.py's model, wrapping and optimizer (benchmarks/fsdp_rank.py) at 1 and 4 ranks (2
           in the small mode) under ddp, and under fsdp: each step's and its optimizer step's
           time, and the bytes of weights, gradients and optimizer state each rank holds
  losses   train.py, float32 Newton-Schulz: fsdp+muon against ddp+muon at 2 and 4 ranks, and
           ddp+muon against one process, on the same global batches

The work and the losses do not depend on the machine's load; the times do.
"""
import os
import statistics
import sys

import torch

from benchmarks import common, fsdp, report, training
from ddpgpt import muon, optim
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig

TITLE = "Muon over the ranks: each matrix's update computed once"
RECIPE = ["--arch=modern", "--optimizer=muon", "--muon_ns_dtype=float32"]
STEP_MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=256", "--block_size=128",
              "--batch_size=2", "--vocab_size=512"]
FULL = {"step_model": STEP_MODEL, "step_ranks": [1, 4], "timed_steps": 8, "loss_ranks": [2, 4],
        "loss_steps": 20}
SMALL = {"step_model": fsdp.TINY + ["--vocab_size=320"], "step_ranks": [1, 2],
         "timed_steps": 3, "loss_ranks": [2], "loss_steps": 6}
WORK_RANKS = [1, 2, 4, 8]
# the models whose Muon matrices' work is counted: the quick start's (config/quickstart_modern.py)
# and GPT-2 124M's
MODELS = {"quick start (modern)": dict(arch="modern", n_layer=4, n_head=4, n_embd=128),
          "GPT-2 124M": dict(arch="gpt2", n_layer=12, n_head=12, n_embd=768)}
NS_STEPS = 5  # torch.optim.Muon's
WORK_SLACK, BYTES_SLACK, LOSS_RTOL = 1.1, 1.1, 1e-5
TABLES = {
    "work": [("matrices", "{model}"), ("ranks", "{ranks}"),
             ("most loaded rank, GFLOP/step", "{most:.3f}"), ("total / N", "{share:.3f}"),
             ("ratio", "{ratio:.3f}"), ("largest matrix", "{largest:.3f}"),
             ("ddp's all_gather, received per rank (bfloat16)", "{gathered:size}")],
    "results": [("parallel", "{parallel}"), ("ranks", "{ranks}"),
                ("step ms (median)", "{step_ms:,.1f}"),
                ("optimizer step ms (median)", "{optimizer_ms:,.1f}"),
                ("optimizer share", "{share:.1%}"),
                ("weights + gradients + optimizer, per rank", "{total:size}"),
                ("load", "{load_1m}")],
    "losses": [("ranks", "{ranks}"), ("ddp vs one process", "{ddp_vs_one:.2e}"),
               ("fsdp vs ddp", "{fsdp_vs_ddp:.2e}"), ("same batches", "{same_batches}")]}


def run(small, device, workdir):
    settings = SMALL if small else FULL
    work = [count_work(name, n) for name in MODELS for n in WORK_RANKS]
    results = [measure(kind, n, settings, workdir)
               for kind, n in [("ddp", n) for n in settings["step_ranks"]] +
               [("fsdp", settings["step_ranks"][-1])]]
    losses = compare_losses(settings, workdir)
    return {"settings": {**settings, "step_args": " ".join([*settings["step_model"], *RECIPE])},
            "work": work, "results": results, "losses": losses,
            "targets": targets(work, results, losses)}


# ---- Newton-Schulz work ----

def ns_flop(rows, cols):
    """FLOPs of torch's Newton-Schulz on a rows x cols matrix: per iteration, on the wide
    orientation m x n (m <= n), X X^T (m^2 n multiply-adds), the Gram matrix squared (m^3) and
    that times X (m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * 2 * (2 * m * m * n + m ** 3)


def muon_shapes(name):
    """The (rows, columns) of the matrices Muon steps in model `name`, in the optimizer's
    order (its default muon_params)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=1024, vocab_size=50304, bias=False, **MODELS[name]))
    return [tuple(p.shape) for p in optim.muon_parameters(model, TrainConfig.muon_params)]


def count_work(name, n):
    shapes = muon_shapes(name)
    owner = muon.owners(shapes, n)
    flop = [ns_flop(*s) for s in shapes]
    load = [sum(f for f, o in zip(flop, owner) if o == r) for r in range(n)]
    return {"model": name, "ranks": n, "matrices": len(shapes), "most": max(load) / 1e9,
            "share": sum(flop) / n / 1e9, "ratio": max(load) / (sum(flop) / n),
            "largest": max(flop) / 1e9, "gathered": muon.bytes_per_step(shapes, n)}


# ---- step times and bytes ----

def measure(kind, n, settings, workdir):
    print(f"bench muon: {kind}, {n} ranks", file=sys.stderr)
    ranks = fsdp.run_ranks(n, [*settings["step_model"], *RECIPE, *fsdp.CPU, f"--parallel={kind}",
                               f"--max_iters={settings['timed_steps']}"],
                           os.path.join(workdir, f"ranks-{kind}-{n}"))
    most = fsdp.holding_most(ranks)
    # the first step builds the optimizer's state: left out; the slowest rank's time each step
    step = statistics.median(max(r["step_ms"][i] for r in ranks)
                             for i in range(1, settings["timed_steps"]))
    optimizer = statistics.median(max(r["optimizer_ms"][i] for r in ranks)
                                  for i in range(1, settings["timed_steps"]))
    return {"parallel": kind, "ranks": n, "step_ms": step, "optimizer_ms": optimizer,
            "share": optimizer / step, "params": most["params"],
            "total": most["weights"] + most["grads"] + most["optimizer"],
            "largest_whole": most["largest_whole"], "load_1m": common.load_1m()}


# ---- losses ----

def compare_losses(settings, workdir):
    data = training.make_data("random-bytes", workdir)
    steps = settings["loss_steps"]
    args = [*fsdp.TINY, *fsdp.CPU, *RECIPE, f"--data_dir={data}",
            "--gradient_accumulation_steps=4", f"--max_iters={steps}",
            f"--eval_interval={steps}", "--eval_iters=2", "--learning_rate=3e-3",
            "--warmup_iters=2", "--grad_clip=0.1"]
    print("bench muon: losses", file=sys.stderr)
    one, _ = fsdp.train(args, 1, os.path.join(workdir, "loss-one"))
    rows = []
    for n in settings["loss_ranks"]:
        ddp, _ = fsdp.train([*args, "--parallel=ddp"], n, os.path.join(workdir, f"loss-ddp-{n}"))
        sharded, _ = fsdp.train([*args, "--parallel=fsdp"], n,
                                os.path.join(workdir, f"loss-fsdp-{n}"))
        rows.append({"ranks": n, "ddp_vs_one": rdiff(one, ddp),
                     "fsdp_vs_ddp": rdiff(ddp, sharded),
                     "same_batches": all(one[i]["batch_fp"] == ddp[i]["batch_fp"] ==
                                         sharded[i]["batch_fp"] for i in one)})
    return rows


def rdiff(a, b):
    return max(abs(b[i]["loss"] / a[i]["loss"] - 1) for i in a)


# ---- targets ----

def targets(work, results, losses):
    out = []
    for name in MODELS:
        rows = [w for w in work if w["model"] == name]
        out.append({"target": f"{name}: Newton-Schulz work of the most loaded rank <= "
                              f"{WORK_SLACK} x total / N + the largest matrix's, N = "
                              f"{', '.join(str(w['ranks']) for w in rows)}",
                    "measured": "; ".join(f"N={w['ranks']}: {w['ratio']:.3f} x total / N"
                                          for w in rows),
                    "met": all(w["most"] <= WORK_SLACK * w["share"] + w["largest"]
                               for w in rows)})
    ddp = [r for r in results if r["parallel"] == "ddp"]
    one, many = ddp[0], ddp[-1]
    out.append({"target": f"ddp+muon: the optimizer step's share of a step (Muon's and "
                          f"AdamW's) at {many['ranks']} ranks not above its share at "
                          f"{one['ranks']}; its time shown",
                "measured": f"{many['share']:.1%} ({many['optimizer_ms']:,.1f} ms of "
                            f"{many['step_ms']:,.1f}) against {one['share']:.1%} "
                            f"({one['optimizer_ms']:,.1f} ms of {one['step_ms']:,.1f}); load "
                            f"{many['load_1m']}",
                "met": many["share"] <= one["share"]})
    sharded = next(r for r in results if r["parallel"] == "fsdp")
    whole = next(r for r in ddp if r["ranks"] == sharded["ranks"])
    n = sharded["ranks"]
    out.append({"target": f"fsdp+muon's per-rank bytes of weights + gradients + optimizer "
                          f"state at {n} ranks <= {BYTES_SLACK} x ddp+muon's / {n} + the "
                          f"largest tensor held whole",
                "measured": f"{report.size(sharded['total'])} against ddp's "
                            f"{report.size(whole['total'])} / {n} = "
                            f"{report.size(whole['total'] / n)}",
                "met": sharded["total"] <= BYTES_SLACK * whole["total"] / n +
                sharded["largest_whole"]})
    for row in losses:
        out.append({"target": f"float32 Newton-Schulz, {row['ranks']} ranks: ddp+muon within "
                              f"{LOSS_RTOL:g} of one process and fsdp+muon within {LOSS_RTOL:g} "
                              f"of ddp+muon, on the same batches",
                    "measured": f"{row['ddp_vs_one']:.2e} and {row['fsdp_vs_ddp']:.2e}; "
                                f"{'the same' if row['same_batches'] else '**other**'} "
                                f"batches",
                    "met": row["ddp_vs_one"] <= LOSS_RTOL and row["fsdp_vs_ddp"] <= LOSS_RTOL
                    and row["same_batches"]})
    return out


def plot(result):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, name in enumerate(MODELS):
        rows = [w for w in result["work"] if w["model"] == name]
        left.plot([w["ranks"] for w in rows], [w["most"] for w in rows], marker="o",
                  color=f"C{i}", label=f"{name}: most loaded rank")
        left.plot([w["ranks"] for w in rows], [w["share"] for w in rows], linestyle="--",
                  color=f"C{i}", label=f"{name}: total / N")
    left.set(xscale="log", yscale="log", xticks=WORK_RANKS, xticklabels=WORK_RANKS,
             xlabel="ranks", ylabel="Newton-Schulz GFLOP per step")
    left.legend(fontsize=8)
    rows = result["results"]
    x = range(len(rows))
    right.bar(x, [r["step_ms"] for r in rows], color="C0", label="step")
    right.bar(x, [r["optimizer_ms"] for r in rows], color="C1", label="optimizer step")
    right.set(xticks=list(x), ylabel="ms (median)")
    right.set_xticklabels([f"{r['parallel']}, {r['ranks']}" for r in rows])
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("Muon over the ranks: Newton-Schulz work (counted) and step times (CPU)")
    return fig
