"""The memory plan (plan.py) against measured runs, and what it says fits on 8 GPUs:

  measured  plan.py's peak per rank against the peak torch's tracker counts in a real run of the
            same settings on the CPU (benchmarks/memory_rank.py under torchrun, gloo, float32), for
            ddp and fsdp, gpt2 and modern, adamw and muon, 1 and 2 ranks
  fits      the plan of GPT-2 124M to 1.5B and the modern block at 1B, 3B and 7B, bf16, a
            micro-batch of 1 and of 2 sequences of 1024 tokens on 8 ranks, under ddp and under
            fsdp (reduce_every_micro_step=True): on GPUs of 24, 40 and 80 GiB, which fit, and
            the largest batch_size (from those two plans: the peak grows with the batch as the
            activations do, in proportion)

Neither depends on the machine's load (only how long the part takes does).
"""
import json
import os
import sys

import torch

from benchmarks import common
from ddpgpt.memplan import GPU_HEADROOM
from ddpgpt.model import GPT, GPTConfig

TITLE = "Will it fit: the memory plan"
SMALL_MODEL = ["--n_layer=2", "--n_head=4", "--n_embd=64", "--block_size=64", "--batch_size=4",
               "--vocab_size=512", "--gradient_accumulation_steps=4"]
CPU = ["--device=cpu", "--dtype=float32"]
# (parallel, ranks, optimizer, arch)
MEASURED = [("ddp", 1, "adamw", "gpt2"), ("ddp", 2, "adamw", "gpt2"), ("ddp", 2, "muon", "modern"),
            ("fsdp", 2, "adamw", "gpt2"), ("fsdp", 2, "muon", "gpt2"),
            ("fsdp", 2, "adamw", "modern"), ("ddp", 1, "muon", "modern")]
# (name, arch, n_layer, n_head, n_embd)
SHAPES = [("GPT-2 124M", "gpt2", 12, 12, 768), ("GPT-2 350M", "gpt2", 24, 16, 1024),
          ("GPT-2 774M", "gpt2", 36, 20, 1280), ("GPT-2 1.5B", "gpt2", 48, 25, 1600),
          ("modern 1B", "modern", 16, 16, 2048), ("modern 3B", "modern", 28, 24, 3072),
          ("modern 7B", "modern", 32, 32, 4096)]
SMALL_SHAPES = [("tiny", "gpt2", 2, 4, 64)]  # --small: the plumbing, in seconds
GPUS, GPU_GIB, CONTEXT, VOCAB = 8, [24, 40, 80], 1024, 50304
KINDS = {"ddp": ["--parallel=ddp"],
         "fsdp": ["--parallel=fsdp", "--reduce_every_micro_step=True"]}
RTOL = 0.10
TIME_CAP_S = 3600
TABLES = {
    "results": [("parallel", "{parallel}"), ("ranks", "{ranks}"), ("optimizer", "{optimizer}"),
                ("arch", "{arch}"), ("planned peak", "{planned:size}"),
                ("measured peak", "{measured:size}"), ("planned / measured", "{ratio:.4f}")],
    "fits": [("model", "{name}"), ("parameters", "{params:,}"),
             ("ddp, 1 sequence", "{ddp_one:size}"), ("fsdp, 1 sequence", "{fsdp_one:size}"),
             *[(f"8 x {gib} GiB", f"{{gpu_{gib}}}") for gib in GPU_GIB]]}


def run(small, device, workdir):
    # --small: one configuration, the plumbing; tests/test_memplan.py checks the plan against
    # real runs of five, on 1 and 2 ranks
    measured = [measure(*run_, workdir) for run_ in (MEASURED[:1] if small else MEASURED)]
    shapes = SMALL_SHAPES if small else SHAPES
    fits = [fit(*shape) for shape in shapes]
    return {"settings": {"model": " ".join(SMALL_MODEL + CPU), "gpus": GPUS,
                         "context": CONTEXT, "headroom": GPU_HEADROOM, "rtol": RTOL},
            "results": measured, "fits": fits,
            "targets": [{"target": f"the plan's peak within {RTOL:.0%} of the peak measured by "
                                   f"the same tracker in a real CPU run, {len(measured)} "
                                   f"configurations",
                         "measured": "planned / measured "
                                     + ", ".join(f"{r['ratio']:.3f}" for r in measured),
                         "met": all(abs(r["ratio"] - 1) <= RTOL for r in measured)}]}


def plan(args):
    """plan.py's JSON for these arguments, run as a user runs it."""
    finished = common.check(common.run_watched(
        [sys.executable, "plan.py", *args, "--json"], common.child_env(OMP_NUM_THREADS="1"),
        TIME_CAP_S), f"plan.py {' '.join(args)}")
    return json.loads(finished.output.strip().splitlines()[-1])["plan"]


def measure(parallel, ranks, optimizer, arch, workdir):
    print(f"bench memplan: {parallel}, {ranks} ranks, {optimizer}, {arch}", file=sys.stderr)
    args = [*SMALL_MODEL, *CPU, f"--parallel={parallel}", f"--optimizer={optimizer}",
            f"--arch={arch}"]
    out = os.path.join(workdir, f"{parallel}-{ranks}-{optimizer}-{arch}")
    common.check(common.run_watched(
        [*common.ranks_command(ranks), "-m", "benchmarks.memory_rank", out, *args],
        common.child_env(OMP_NUM_THREADS="1"), TIME_CAP_S), f"benchmarks.memory_rank {out}")
    with open(f"{out}.rank0.json") as f:
        measured = json.load(f)["peak"]
    planned = plan([*args, f"--world_size={ranks}"])["total"]
    return {"parallel": parallel, "ranks": ranks, "optimizer": optimizer, "arch": arch,
            "planned": planned, "measured": measured, "ratio": planned / measured}


def fit(name, arch, layers, heads, width):
    """A shape's plans at 1 and 2 sequences per micro-step, and on each GPU size the keys that
    fit with the largest batch_size."""
    print(f"bench memplan: {name}", file=sys.stderr)
    shape = [f"--arch={arch}", f"--n_layer={layers}", f"--n_head={heads}", f"--n_embd={width}",
             f"--block_size={CONTEXT}", f"--vocab_size={VOCAB}", "--dtype=bfloat16",
             f"--world_size={GPUS}", f"--gradient_accumulation_steps={2 * GPUS}"]
    totals = {kind: [plan([*shape, *keys, f"--batch_size={batch}"])["total"]
                     for batch in (1, 2)] for kind, keys in KINDS.items()}
    row = {"name": name, "params": parameters(arch, layers, heads, width),
           "ddp_one": totals["ddp"][0], "fsdp_one": totals["fsdp"][0]}
    for gib in GPU_GIB:
        room = int(gib * 2**30 * GPU_HEADROOM)
        found = [f"{kind}, batch_size <= {largest}" for kind in KINDS
                 if (largest := largest_batch(*totals[kind], room))]
        row[f"gpu_{gib}"] = "; ".join(found) or "none"
    return row


def largest_batch(one, two, room):
    return 0 if one > room else 1 + (room - one) // max(1, two - one)


def parameters(arch, layers, heads, width):
    with torch.device("meta"):
        model = GPT(GPTConfig(arch=arch, n_layer=layers, n_head=heads, n_embd=width,
                              vocab_size=VOCAB, block_size=CONTEXT, bias=False))
    return model.get_num_params(non_embedding=False)


def plot(result):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    rows = result["results"]
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["planned"] / 2**20 for r in rows], 0.4, label="planned")
    left.bar([i + 0.2 for i in x], [r["measured"] / 2**20 for r in rows], 0.4, label="measured")
    left.set_xticks(list(x), [f"{r['parallel']} {r['ranks']}\n{r['optimizer']} {r['arch']}"
                              for r in rows], fontsize=7)
    left.set(ylabel="peak per rank, MiB (CPU)")
    left.legend()
    fits = result["fits"]
    for key, colour in (("ddp_one", "C0"), ("fsdp_one", "C1")):
        right.plot(range(len(fits)), [f[key] / 2**30 for f in fits], marker="o", color=colour,
                   label=key.replace("_one", ", 1 sequence"))
    for gib in GPU_GIB:
        right.axhline(gib * GPU_HEADROOM, color="grey", linestyle="--", linewidth=0.8)
    right.set(yscale="log", ylabel=f"GiB per GPU, {GPUS} GPUs (planned)")
    right.set_xticks(range(len(fits)), [f["name"] for f in fits], rotation=45, fontsize=8)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("The memory plan: against measured runs (CPU), and on 8 GPUs (bf16)")
    return fig
