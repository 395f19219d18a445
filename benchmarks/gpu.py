"""The GPU path, checked on one GPU by one command and recorded: `python bench.py
gpu`, at most 9 minutes, no network, its data made here. Fifteen checks, each with pass or fail,
its numbers and its time, in the order of what only a GPU shows: the versions; every collective
of the multi-GPU paths over NCCL in a one-rank group (benchmarks/nccl_rank.py); GPT-2 124M
(config/owt.py) in bf16 with torch.compile through train.py as a user runs it, and
benchmarks/minimal_loop.py, nanoGPT's loop at its barest on the same model and GPU (the
ceiling); recompiles and graph breaks, counted in TORCH_LOGS's lines, in a
fresh run and after a resume; a checkpoint's save time and a resume that goes on with the same
batches and losses; on the quick start's model: two ranks of DDP + compile on the one GPU with
gloo (two processes cannot share a GPU under NCCL); one rank under torchrun in
float16 with the GradScaler, document-aligned windows and an evaluation and background save
every other step, its peak memory flat across the evaluations; sample.py, and eval.py with
HellaSwag, on the GPU; two ranks of fsdp (FSDP2, compiled blocks, a sharded checkpoint saved
in the background midway), resumed from that folder, and their losses and gradient norms
against DDP's, both with Muon in float32, where they differ by rounding alone; and the
recipe's two keys (arch=modern, optimizer=muon) on GPT-2 124M's model and batch, whose step
must stay within 10% of GPT-2's with AdamW, and under fsdp on two ranks in bf16 mixed
precision with selective recomputation, the loss in chunks and fsdp's two non-default keys.

A dry run (`--small`) does every step on a tiny model on the CPU, in float32
without compile (TORCH_LOGS still set and read), so that CI tests the plumbing. Without a GPU
and without --small every check is recorded as not run."""
import json
import math
import os
import re
import shlex
import shutil
import socket
import sys
import time

import numpy as np
import torch

from benchmarks import common, evaluating, report
from ddpgpt import arch, checkpoint, runtime, tokenfile
from ddpgpt.model import GPT, GPTConfig

TITLE = "GPU"
NO_GPU = "not run: no GPU in this session (run `python bench.py gpu` on one)"
OUT_OF_TIME = "not run: too little of the part's time budget was left"
TORCH_LOGS = "recompiles,graph_breaks"
CPU = ["--device=cpu", "--dtype=float32", "--compile=False"]
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4"]
# 2 micro-steps per rank; the network check on the one node (it is off there by default)
TWO_RANKS = ["--backend=gloo", "--gradient_accumulation_steps=4", "--network_check=on"]
UNEVEN_EVALUATION = ["--eval_iters=3"]  # for 2 ranks: one has a batch fewer
RECIPE = ["--arch=modern", "--optimizer=muon"]  # the same FLOPs per token as GPT-2's
# recipe two's optimizer pieces (docs/training.md), in the 2-rank runs as in nccl_rank.py
RECIPE_TWO = ["--muon_coefficients=polar_express", "--muon_beta2=0.95",
              "--cautious_weight_decay=True"]
# the ddp and fsdp 2-rank runs, compared step by step: the recipe's Muon with recipe two's
# pieces, whose owners gather (ddp) or exchange rows (fsdp), in float32 throughout, where the
# two differ by rounding alone
PARITY = ["--dtype=float32", "--muon_ns_dtype=float32", *RECIPE, *RECIPE_TWO]
SELECTIVE = ["--activation_checkpointing=selective", "--loss_chunks=4"]  # the loss in chunks too
FSDP_KEYS = ["--reshard_after_forward=False", "--reduce_every_micro_step=True"]  # not defaults
EVERY_OTHER_STEP = 2  # the 1-rank check's evaluations and saves
HELLASWAG_EXAMPLES = 40
# What each mode runs: train.py's arguments for GPT-2 124M ("main") and for the 2-rank run
# (a small model, as gloo carries every gradient through host memory); the steps, the
# checkpoint the resume starts from, the first steps not counted (start-up, compilation); the
# time caps in seconds on each command and on the whole part.
MODES = {
    "gpu": dict(
        main=["config/owt.py", "--device=cuda", "--dtype=bfloat16", "--compile=True"],
        ranks=["config/quickstart.py", "--device=cuda", "--dtype=bfloat16", "--compile=True",
               *TWO_RANKS],
        one_rank=["config/quickstart.py", "--device=cuda", "--dtype=float16", "--compile=True",
                  "--backend=nccl"],
        collectives=["cuda", "nccl", "bfloat16"],
        steps=20, save_at=15, warmup=5, rank_steps=10, one_rank_steps=10, vocab=50257,
        tokens=2_000_000, new_tokens=200,
        device="cuda", caps=dict(train=300, minimal=180, resume=180, ranks=180, sample=90),
        budget_s=520),
    "dry run": dict(
        main=[*TINY, "--gradient_accumulation_steps=2", *CPU], ranks=[*TINY, *CPU, *TWO_RANKS],
        one_rank=[*TINY, "--gradient_accumulation_steps=2", *CPU, "--backend=gloo"],
        collectives=["cpu", "gloo", "float32"],
        steps=6, save_at=4, warmup=2, rank_steps=3, one_rank_steps=6, vocab=257, tokens=100_000,
        new_tokens=20,
        device="cpu", caps=dict(train=300, minimal=300, resume=300, ranks=300, sample=300),
        budget_s=1200)}
MIN_START_S = 20  # a command is not started with less of the budget left
LOSS_RTOL = 1e-3  # a resumed step's loss against the uninterrupted run's
# ddp's and fsdp's losses and gradient norms in float32 (PARITY): a tenth of the 1e-3 that
# fsdp's bfloat16 residual stream puts between them on the CPU (test_fsdp), so a dtype slips
# into one of them fails it
PARITY_RTOL = 1e-4
MEMORY_GROWTH = 0.02  # an evaluated step's peak memory, from the second evaluation to the last
MFU_TARGET, CEILING_TARGET, RECIPE_TARGET = 0.45, 0.03, 0.10
ONE_RANK = "1 rank: float16, documents"
CHECKS = ["versions", "collectives, 1-rank group", "train.py", "minimal loop", "recompiles",
          "checkpoint and resume", "sample.py", "2 ranks", ONE_RANK, "eval.py and HellaSwag",
          "fsdp, 2 ranks", "fsdp resumed, 2 ranks", "ddp vs fsdp", "modern + muon",
          "fsdp + muon + selective, 2 ranks"]
LOOPS = ("train.py", "minimal loop", "modern + muon")  # the speed table's rows
RECOMPILE = re.compile(r"\[__recompiles\] Recompiling function")
GRAPH_BREAK = re.compile(r"\[__graph_breaks\] Graph break")  # not the "Graph Break Reason" lines
FIRST_STEP = re.compile(r"(^|\s)iter \d+: loss ")  # train.py's line after a step
SAVED = re.compile(r"saved (\S+) \(([\d.]+) s[,)]")  # a save that waits, or in the background
SEPARATOR = "-" * 15  # sample.py's line after each sample
ABOUT = {"gpu": "A run on the GPU.",
         "dry run": "A dry run: every step on a tiny model on the CPU, in float32 without "
                    "compile. Its numbers say nothing about a GPU.",
         "not run": "Not run: no GPU in this session. The checks and commands below are what "
                    "`python bench.py gpu` runs on one."}
TABLES = {
    "checks": [("check", "{check}"), ("result", "{result}"), ("measured", "{measured}"),
               ("took", "{took_s:.0f} s")],
    "speed": [("loop", "{loop}"), ("steps counted", "{steps_counted}"),
              ("tokens/step", "{tokens_per_step:,}"), ("ms/step (median)", "{ms_per_step:,.1f}"),
              ("tok/s", "{tok_per_s:,.0f}"), ("achieved TFLOP/s", "{tflops:.3f}"),
              ("MFU", "{mfu:.1%}"), ("data wait", "{data_wait:.2%}"),
              ("peak memory", "{peak_mem:size}")]}


class Session:
    """What the checks share: the mode's settings, the data, the clock and the runs so far."""

    def __init__(self, mode, workdir):
        self.mode, self.spec, self.workdir = mode, MODES[mode], workdir
        self.deadline = time.monotonic() + self.spec["budget_s"]
        # the dry run's processes get one thread each, as benchmarks/training.py explains
        self.env = common.child_env(TORCH_LOGS=TORCH_LOGS,
                                    **({"OMP_NUM_THREADS": "1"} if mode == "dry run" else {}))
        # GPT-2's vocabulary size on the GPU; a tiny one in a dry run, whose CPU would spend
        # most of each step in the output layer
        self.data = common.random_data(os.path.join(workdir, "data"), self.spec["vocab"],
                                       self.spec["tokens"])
        # marked as the byte tokenizer's, so that sample.py decodes it with no download
        self.bytes = common.random_data(os.path.join(workdir, "bytes"), 257, 200_000, "byte")
        self.cfg = common.train_config(self.spec["main"])
        self.peak = runtime.peak_flops("cuda") if mode == "gpu" else None  # for MFU
        self.runs, self.speed = {}, {}

    def out(self, name):
        return os.path.join(self.workdir, name)


def train_args(args, data_dir, out_dir, steps, save_at):
    return [*args, f"--data_dir={data_dir}", f"--out_dir={out_dir}", f"--max_iters={steps}",
            f"--eval_interval={save_at}", "--eval_iters=2", "--log_interval=1",
            "--wandb_log=False"]


def launch(s, name, args, cap):
    """Run a command as a user would, under its cap and what is left of the part's budget;
    None when too little is left to start it, or the budget ran out before it ended. Progress
    goes to stderr, so that a caller with a time limit sees where the part is, and so does the
    end of a failed command's output: the run on a lent GPU may be the only one."""
    left = s.deadline - time.monotonic()
    if left < MIN_START_S:
        print(f"bench gpu: {name}: skipped, {left:.0f} s of the budget left", file=sys.stderr)
        return None
    print(f"bench gpu: {name}: running (at most {min(cap, left):.0f} s)", file=sys.stderr,
          flush=True)
    finished = common.run_watched(args, s.env, min(cap, left))
    print(f"bench gpu: {name}: {finished.exceeded or f'exit {finished.returncode}'} after "
          f"{finished.wall_s:.0f} s", file=sys.stderr, flush=True)
    if not succeeded(finished):
        show(name, finished.output.splitlines()[-60:])
    if finished.exceeded and left < cap:  # the budget ran out, not the command's own time
        return None
    return finished


def show(name, lines):
    print("\n".join(f"bench gpu: {name} | {line}" for line in lines), file=sys.stderr,
          flush=True)


def succeeded(finished):
    return finished is not None and not finished.exceeded and finished.returncode == 0


def check_row(check, passed, measured, **numbers):
    return {"check": check, "status": "ok", "passed": bool(passed),
            "result": "pass" if passed else "**fail**", "measured": measured, **numbers}


def not_run_row(check, why):
    """A check not run because an earlier one it needs failed."""
    return {"check": check, "status": f"not run: {why}", "passed": None}


def failed_row(check, finished):
    """A check whose command did not succeed (or was not started, or ended by the budget)."""
    if finished is None:
        return {"check": check, "status": OUT_OF_TIME, "passed": None}
    why = finished.exceeded or f"exit {finished.returncode}"
    return check_row(check, False, f"{why}: {common.error_line(finished.output)}")


def metrics_rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return list(map(json.loads, f))


def step_rows(out_dir):
    return [row for row in metrics_rows(out_dir) if "ms" in row]


def flops_per_token(cfg, data_dir):
    with torch.device("meta"):  # the model train.py builds, with no weights allocated
        model = GPT(GPTConfig(**arch.model_args(cfg, tokenfile.read_meta(data_dir))))
    return model.flops_per_token()


# ---- the checks ----

def nccl_version():
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):  # a CPU build has no NCCL
        return None


def versions(s):
    gpu = s.mode == "gpu"
    name = torch.cuda.get_device_name() if gpu else None
    peak = runtime.peak_flops_of(name) if name else None
    numbers = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl_version(),
               "device": name, "gpu_memory": torch.cuda.get_device_properties(0).total_memory
               if gpu else None, "peak_tflops": peak / 1e12 if peak else None}
    measured = report.FORMAT.format("torch {torch}, CUDA {cuda}, NCCL {nccl}; ", **numbers) + \
        (name or "no GPU (dry run)")
    if gpu:
        measured += (f", {report.size(numbers['gpu_memory'])}; MFU peak "
                     f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown to runtime.PEAK_FLOPS'}")
    # on the GPU the numbers must be complete, MFU's peak included; a dry run records the CPU's
    return check_row("versions", s.mode == "dry run" or (numbers["nccl"] and peak), measured,
                     **numbers)


def collectives(s):
    """benchmarks/nccl_rank.py: ddp and fsdp, each with Muon, in a one-rank process group over
    NCCL (gloo in a dry run), so that every collective of the multi-GPU paths runs on it once:
    the backend is the process group's own, and each path's losses must fall."""
    name = "collectives, 1-rank group"
    finished = launch(s, name, [*common.torchrun(1), "-m", "benchmarks.nccl_rank",
                                *s.spec["collectives"]], s.spec["caps"]["sample"])
    if not succeeded(finished):
        return failed_row(name, finished)
    out = json.loads(next(line for line in reversed(finished.output.splitlines())
                          if line.startswith("{")))
    paths = {"ddp": "all-reduce, Muon's all_gather_single",
             "fsdp": "all-gather, reduce-scatter, Muon's all_to_all_single"}
    passed = out["backend"] == s.spec["collectives"][1] and all(
        math.isfinite(out[k][-1]) and out[k][-1] < out[k][0] for k in paths)
    return check_row(name, passed, f"process group backend {out['backend']} (read from it), "
                     f"{out['world_size']} rank; " + "; ".join(
                         f"{k} + muon ({why}): loss {out[k][0]:.3f} -> {out[k][-1]:.3f}"
                         for k, why in paths.items()), backend=out["backend"])


def fresh_run(s):
    """train.py from scratch, as a user runs it, with TORCH_LOGS; it saves at save_at, where
    the resume check starts from, and goes on to the last step."""
    spec, out = s.spec, s.out("fresh")
    args = train_args(spec["main"], s.data, out, spec["steps"], spec["save_at"])
    finished = launch(s, "train.py", [sys.executable, "train.py", *args], spec["caps"]["train"])
    s.runs["fresh"] = finished
    if not succeeded(finished):
        return failed_row("train.py", finished)
    steps = step_rows(out)
    s.speed["train.py"] = stats = speed_of(s, steps[spec["warmup"]:], train_py=True)
    passed = len(steps) == spec["steps"] and all(math.isfinite(r["loss"]) for r in steps)
    return check_row("train.py", passed, f"{len(steps)} steps, loss {steps[0]['loss']:.3f} -> "
                     f"{steps[-1]['loss']:.3f}; {stats['ms_per_step']:,.1f} ms/step, "
                     f"MFU {report.FORMAT.format('{:.1%}', stats['mfu'])}, peak memory "
                     f"{report.FORMAT.format('{:size}', stats['peak_mem'])}")


def speed_of(s, counted, train_py, cfg=None):
    """A speed table row from train.py's counted step rows, or the minimal loop's times; cfg:
    the run's configuration, if not the main one."""
    cfg = cfg or s.cfg
    tokens = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    ms = np.array([r["ms"] for r in counted] if train_py else counted["ms"])
    tok_per_s = tokens / float(np.median(ms)) * 1000
    tflops = flops_per_token(cfg, s.data) * tok_per_s / 1e12
    row = {"status": "ok", "steps_counted": len(ms), "tokens_per_step": tokens,
           "ms_per_step": float(np.median(ms)), "tok_per_s": tok_per_s, "tflops": tflops,
           "mfu": tflops * 1e12 / s.peak if s.peak else None}
    if not train_py:
        return {**row, "data_wait": None, "peak_mem": counted["peak_mem"]}
    mfu = [r["mfu"] for r in counted if "mfu" in r]
    peaks = [r["peak_mem"] for r in counted if "peak_mem" in r]
    # train.py's own numbers where it reports them: what a user sees in metrics.jsonl
    return {**row, "mfu": float(np.median(mfu)) if mfu else row["mfu"],
            "data_wait": float(sum(r["data_wait"] * r["ms"] for r in counted) / ms.sum()),
            "peak_mem": max(peaks) if peaks else None}


def minimal_loop(s):
    spec = s.spec
    args = [*spec["main"], f"--data_dir={s.data}", f"--max_iters={spec['steps']}"]
    finished = launch(s, "minimal loop", [sys.executable, "-m", "benchmarks.minimal_loop", *args],
                      spec["caps"]["minimal"])
    if not succeeded(finished):
        return failed_row("minimal loop", finished)
    # its line of times, whatever torch logged around it
    times = next(json.loads(line) for line in reversed(finished.output.splitlines())
                 if line.startswith('{"ms"'))
    losses = times["losses"]
    times["ms"] = times["ms"][spec["warmup"]:]
    s.speed["minimal loop"] = stats = speed_of(s, times, train_py=False)
    ours = s.speed.get("train.py")
    versus = f" (train.py {ours['ms_per_step'] / stats['ms_per_step'] - 1:+.1%})" if ours else ""
    # its batches are the same every step: a loop that trains at all lowers their loss
    passed = len(losses) == spec["steps"] and all(map(math.isfinite, losses)) and \
        losses[-1] < losses[0]
    return check_row("minimal loop", passed, f"{len(losses)} steps, loss {losses[0]:.3f} -> "
                     f"{losses[-1]:.3f}; {stats['ms_per_step']:,.1f} ms/step{versus}")


def resume(s):
    """A copy of the fresh run's checkpoint at save_at, resumed to the last step: the same
    batches (batch_fp) and, within rounding, the same losses as the run that went on."""
    spec, fresh, out = s.spec, s.out("fresh"), s.out("resumed")
    if not succeeded(s.runs.get("fresh")):
        return not_run_row("checkpoint and resume", "train.py's run failed")
    saved = {path: float(seconds) for path, seconds in SAVED.findall(s.runs["fresh"].output)}
    ckpt = checkpoint.path_for(fresh, spec["save_at"])
    save_s = saved.get(ckpt)
    os.makedirs(out)
    shutil.copy2(ckpt, out)
    args = [*train_args(spec["main"], s.data, out, spec["steps"], spec["save_at"]),
            "--init_from=resume"]
    finished = launch(s, "train.py, resumed", [sys.executable, "train.py", *args],
                      spec["caps"]["resume"])
    s.runs["resumed"] = finished
    if not succeeded(finished):
        return failed_row("checkpoint and resume", finished)
    after, same_batches, loss_rdiff = went_on(fresh, out)
    if not after or after[0]["iter"] != spec["save_at"]:
        return check_row("checkpoint and resume", False, f"the resumed run's steps are "
                         f"{[r['iter'] for r in after]}, not from {spec['save_at']} on")
    size = os.path.getsize(ckpt)
    return check_row(
        "checkpoint and resume", same_batches and loss_rdiff <= LOSS_RTOL,
        f"checkpoint of iter {spec['save_at']}: {report.size(size)}, written in "
        f"{report.FORMAT.format('{:.2f}', save_s)} s; resumed, steps {after[0]['iter']} to "
        f"{after[-1]['iter']}: {'the same' if same_batches else '**other**'} batches, losses "
        f"within {loss_rdiff:.2e} (relative)", checkpoint_bytes=size, save_s=save_s,
        steps_compared=len(after), same_batches=same_batches, loss_rdiff=loss_rdiff)


def went_on(before_dir, after_dir):
    """(the resumed run's step rows, whether they read the same batches as the run that went on,
    their losses' largest relative difference from its)."""
    before = {r["iter"]: r for r in step_rows(before_dir)}
    after = step_rows(after_dir)
    same_batches = all(r["batch_fp"] == before[r["iter"]]["batch_fp"] for r in after)
    loss_rdiff = max((abs(r["loss"] / before[r["iter"]]["loss"] - 1) for r in after), default=0)
    return after, same_batches, loss_rdiff


def compile_events(output):
    """(recompiles up to the first step's line, recompiles after it, graph breaks) in the
    output of a run with TORCH_LOGS=recompiles,graph_breaks."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if FIRST_STEP.search(line)), len(lines))
    before = sum(bool(RECOMPILE.search(line)) for line in lines[:first + 1])
    after = sum(bool(RECOMPILE.search(line)) for line in lines[first + 1:])
    return before, after, sum(bool(GRAPH_BREAK.search(line)) for line in lines)


def compile_lines(output):
    """The recompiles' and graph breaks' first lines, with the guards that failed: what
    whoever has to remove them needs."""
    return [line for line in output.splitlines()
            if "[__recompiles]" in line or GRAPH_BREAK.search(line)][:80]


def recompiles(s):
    runs = {"fresh": s.runs.get("fresh"), "resumed": s.runs.get("resumed")}
    if not all(map(succeeded, runs.values())):
        return not_run_row("recompiles", "needs the fresh and the resumed train.py runs")
    events = {name: compile_events(run.output) for name, run in runs.items()}
    for name, run in runs.items():
        show(f"train.py, {name}", compile_lines(run.output))
    measured = "; ".join(f"{name}: {first} recompile(s) by the first step, {after} after, "
                         f"{breaks} graph break(s)" for name, (first, after, breaks)
                         in events.items()) + ("" if s.cfg.compile else " (compile was off)")
    numbers = {f"{name}_{key}": value for name, counts in events.items()
               for key, value in zip(("recompiles_first_step", "recompiles_after",
                                      "graph_breaks"), counts)}
    passed = all(after == 0 and breaks == 0 for _, after, breaks in events.values())
    return check_row("recompiles", passed, measured, compiled=s.cfg.compile, **numbers)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agents(args, port):
    """Two torchrun agents on this machine, each a 'node' of one rank: every rank is local
    rank 0 of its node, so --device=cuda is cuda:0 for both (torchrun --nproc_per_node=2 would
    give rank 1 cuda:1, which one GPU does not have). Node 1 is started first, in the
    background, and stopped if node 0 fails (it would wait for node 0 until its own timeout);
    the exit status is the worse of the two."""
    nodes = [shlex.join([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                         "--nproc_per_node=1", f"--node_rank={n}", "--master_addr=127.0.0.1",
                         f"--master_port={port}", "train.py", *args]) for n in (1, 0)]
    return ["bash", "-c", f"{nodes[0]} & {nodes[1]}; a=$?; [ $a = 0 ] || kill $!; wait $!; "
                          f"b=$?; exit $((a > b ? a : b))"]


def two_ranks(s, parallel="ddp", name="2 ranks", folder="ranks", extra=()):
    """2 ranks of train.py on the one GPU, with the `extra` keys; under fsdp the run must also
    leave its sharded checkpoint, a part per rank. An evaluation midway, of 3 batches over the
    2 ranks, must not recompile the model: its forwards are of the training's batch size."""
    spec, out = s.spec, s.out(folder)
    args = train_args(spec["ranks"], s.bytes, out, spec["rank_steps"], spec["rank_steps"] // 2)
    finished = launch(s, name, agents([*args, f"--parallel={parallel}", *extra,
                                       *UNEVEN_EVALUATION], free_port()), spec["caps"]["ranks"])
    s.runs[name] = finished
    if not succeeded(finished):
        return failed_row(name, finished)
    steps = step_rows(out)
    first, after, breaks = compile_events(finished.output)
    show(name, compile_lines(finished.output))
    ms = float(np.median([r["ms"] for r in steps[1:]])) if len(steps) > 1 else None
    network = next((line[line.index("network: "):] for line in finished.output.splitlines()
                    if "network: bus bandwidth" in line), "no network check's line")
    passed = "world size 2," in finished.output and len(steps) == spec["rank_steps"] and \
        all(math.isfinite(r["loss"]) for r in steps) and after == 0 and breaks == 0
    if parallel == "fsdp":
        folder = checkpoint.path_for(out, spec["rank_steps"], folder=True)
        passed = passed and sorted(os.listdir(folder))[:3] == [".metadata", "__0_0.distcp",
                                                               "__1_0.distcp"]
    return check_row(name, passed, f"world size 2 on {spec['device']}, gloo, "
                     f"{' '.join([f'--parallel={parallel}', *extra])}: "
                     f"{len(steps)} steps, {report.FORMAT.format('{:,.1f}', ms)} ms/step after "
                     f"the first; {first} recompile(s) by the first step, {after} after "
                     f"(an evaluation of uneven batches midway), "
                     f"{breaks} graph break(s); {network}", ms_per_step=ms,
                     recompiles_after=after, graph_breaks=breaks, network=network)


def fsdp_resumed(s):
    """The fsdp 2-rank run resumed on 2 ranks from a copy of its sharded folder of the midway
    step, which it saved in the background: the same batches and, within rounding, the same
    losses as the run that went on."""
    spec, fsdp, out = s.spec, s.out("fsdp"), s.out("fsdp-resumed")
    middle = spec["rank_steps"] // 2
    if not succeeded(s.runs.get("fsdp, 2 ranks")):
        return not_run_row("fsdp resumed, 2 ranks", "the fsdp 2-rank run failed")
    folder = checkpoint.path_for(fsdp, middle, folder=True)
    shutil.copytree(folder, os.path.join(out, os.path.basename(folder)))
    args = [*train_args(spec["ranks"], s.bytes, out, spec["rank_steps"], middle),
            "--parallel=fsdp", *PARITY, *UNEVEN_EVALUATION, "--init_from=resume",
            *profiled(spec)]
    finished = launch(s, "fsdp resumed, 2 ranks", agents(args, free_port()),
                      spec["caps"]["ranks"])
    if not succeeded(finished):
        return failed_row("fsdp resumed, 2 ranks", finished)
    after, same_batches, loss_rdiff = went_on(fsdp, out)
    if not after or after[0]["iter"] != middle:
        return check_row("fsdp resumed, 2 ranks", False, f"the resumed run's steps are "
                         f"{[r['iter'] for r in after]}, not from {middle} on")
    # its last two iters profiled: a trace per rank, and on CUDA a memory snapshot per rank
    profile = sorted(os.listdir(os.path.join(out, "profile")))
    window = profiled(spec)[0].split("=")[1]
    expected = [f"rank{r}_iters{window}.{kind}" for r in (0, 1) for kind in
                ["pt.trace.json", *["memory.pickle"] * (spec["device"] == "cuda")]]
    return check_row(
        "fsdp resumed, 2 ranks", same_batches and loss_rdiff <= LOSS_RTOL and
        profile == sorted(expected),
        f"from the folder of iter {middle} (saved in the background), steps {after[0]['iter']} "
        f"to {after[-1]['iter']}: {'the same' if same_batches else '**other**'} batches, "
        f"losses within {loss_rdiff:.2e} (relative); iters {window} profiled: "
        f"{', '.join(profile)}", same_batches=same_batches, loss_rdiff=loss_rdiff,
        steps_compared=len(after), profile=profile)


def profiled(spec):
    """The fsdp resumed run's profile: its last two iters, with the memory snapshot on CUDA."""
    return [f"--profile_steps={spec['rank_steps'] - 2}-{spec['rank_steps'] - 1}",
            "--profile_memory=True"]


def ddp_vs_fsdp(s):
    """The 2-rank runs under ddp and fsdp, the same keys and batches, Muon and float32
    (PARITY): fsdp's losses and gradient norms those of ddp within rounding, so Muon's row
    exchange under fsdp is judged against its gather under ddp. A dtype other than float32 in
    either (fsdp's bfloat16 residual stream) shows in the gradient norms first."""
    if not (succeeded(s.runs.get("2 ranks")) and succeeded(s.runs.get("fsdp, 2 ranks"))):
        return not_run_row("ddp vs fsdp", "the ddp or the fsdp 2-rank run failed")
    ddp, fsdp = step_rows(s.out("ranks")), step_rows(s.out("fsdp"))
    same_batches = [r["batch_fp"] for r in ddp] == [r["batch_fp"] for r in fsdp]
    loss_rdiff, norm_rdiff = (max(abs(f[key] / d[key] - 1) for d, f in zip(ddp, fsdp))
                              for key in ("loss", "grad_norm"))
    passed = same_batches and len(ddp) == len(fsdp) and \
        max(loss_rdiff, norm_rdiff) <= PARITY_RTOL
    return check_row("ddp vs fsdp", passed, f"{len(fsdp)} steps: "
                     f"{'the same' if same_batches else '**other**'} batches, losses within "
                     f"{loss_rdiff:.2e} and gradient norms within {norm_rdiff:.2e} (relative) of "
                     f"ddp's", same_batches=same_batches, loss_rdiff=loss_rdiff,
                     grad_norm_rdiff=norm_rdiff)


def one_rank(s):
    """One rank under torchrun with the keys two ranks on one GPU cannot have (NCCL: one
    process per GPU) or that no other check sets: float16 with the GradScaler, document-aligned
    windows, an evaluation and a background save every other step. Its peak memory must not
    grow from the second evaluation on, across two more."""
    name, spec, out = ONE_RANK, s.spec, s.out("one-rank")
    args = [*train_args(spec["one_rank"], s.bytes, out, spec["one_rank_steps"],
                        EVERY_OTHER_STEP), "--sampling=documents"]
    finished = launch(s, name, [*common.torchrun(1), "train.py", *args], spec["caps"]["ranks"])
    if not succeeded(finished):
        return failed_row(name, finished)
    cfg = common.train_config(args)
    steps = step_rows(out)
    evals = [r["iter"] for r in metrics_rows(out) if "val_loss" in r]
    # each evaluated step's peak from the second evaluation (the first steps allocate the
    # optimizer's state) to the last: on CUDA its own (train.py resets the peak after each
    # row), so a step that holds more than an earlier one shows; on a CPU the RSS's peak
    peaks = [r["peak_mem"] if "peak_mem" in r else r["rank_mem_mib"][0] for r in steps
             if r["iter"] in evals[1:]]
    growth = peaks[-1] / peaks[0] - 1 if len(peaks) > 1 else None
    passed = "world size 1," in finished.output and len(steps) == spec["one_rank_steps"] and \
        all(math.isfinite(r["loss"]) for r in steps) and len(evals) >= 4 and \
        growth <= MEMORY_GROWTH
    return check_row(name, passed, f"no process group (one rank), {cfg.dtype}, sampling "
                     f"{cfg.sampling}: {len(steps)} steps, {len(evals)} evaluations (at "
                     f"{', '.join(map(str, evals))}); an evaluated step's peak memory "
                     f"{report.FORMAT.format('{:+.1%}', growth)} from the second evaluation to "
                     f"the last", evaluations=len(evals), memory_growth=growth)


def eval_hellaswag(s):
    """eval.py on the 2-rank (ddp) run's checkpoint, on the device: the val loss and
    HellaSwag's score of examples written here (the byte tokenizer's data)."""
    name = "eval.py and HellaSwag"
    if not checkpoint.list_checkpoints(s.out("ranks")):
        return not_run_row(name, "the 2-rank run left no checkpoint to evaluate")
    examples = evaluating.write_examples(os.path.join(s.workdir, "hellaswag.jsonl"),
                                         HELLASWAG_EXAMPLES)
    args = [sys.executable, "eval.py", f"--out_dir={s.out('ranks')}",
            f"--device={s.spec['device']}", f"--hellaswag_path={examples}"]
    finished = launch(s, name, args, s.spec["caps"]["sample"])
    if not succeeded(finished):
        return failed_row(name, finished)
    out = json.loads(next(line for line in reversed(finished.output.splitlines())
                          if line.startswith("{")))
    passed = out["hellaswag_n"] == HELLASWAG_EXAMPLES and math.isfinite(out["val_loss"])
    return check_row(name, passed, f"val loss {out['val_loss']:.4f}; HellaSwag acc_norm "
                     f"{out['hellaswag_acc_norm']:.3f} of {out['hellaswag_n']} examples in "
                     f"{out['hellaswag_s']:.1f} s", hellaswag_n=out["hellaswag_n"])


def sample(s):
    """sample.py from the 2-rank run's checkpoint: its data is the byte tokenizer's."""
    if not checkpoint.list_checkpoints(s.out("ranks")):
        return not_run_row("sample.py", "the 2-rank run left no checkpoint to sample from")
    n = 2
    args = [sys.executable, "sample.py", f"--out_dir={s.out('ranks')}",
            f"--device={s.spec['device']}", f"--num_samples={n}",
            f"--max_new_tokens={s.spec['new_tokens']}", "--start=def "]
    finished = launch(s, "sample.py", args, s.spec["caps"]["sample"])
    if not succeeded(finished):
        return failed_row("sample.py", finished)
    printed = sum(line == SEPARATOR for line in finished.output.splitlines())
    return check_row("sample.py", printed == n, f"{printed} of {n} samples of "
                     f"{s.spec['new_tokens']} tokens printed in {finished.wall_s:.1f} s "
                     f"(start-up included)", samples=printed, wall_s=finished.wall_s)


def modern_muon(s):
    """train.py with the recipe's two keys on the main model and batch: the modern block (as
    many FLOPs per token) and Muon, whose Newton-Schulz iterations run on every rank each step;
    its step against gpt2+adamw's (the train.py check's)."""
    spec, out = s.spec, s.out("modern-muon")
    main = [*spec["main"], *RECIPE]
    args = train_args(main, s.data, out, spec["steps"], spec["steps"])
    finished = launch(s, "modern + muon", [sys.executable, "train.py", *args],
                      spec["caps"]["train"])
    if not succeeded(finished):
        return failed_row("modern + muon", finished)
    steps = step_rows(out)
    s.speed["modern + muon"] = stats = speed_of(s, steps[spec["warmup"]:], train_py=True,
                                                cfg=common.train_config(main))
    first, after, breaks = compile_events(finished.output)
    show("modern + muon", compile_lines(finished.output))
    ours = s.speed.get("train.py")
    versus = f" ({stats['ms_per_step'] / ours['ms_per_step'] - 1:+.1%} against gpt2+adamw's)" \
        if ours else ""
    passed = len(steps) == spec["steps"] and all(math.isfinite(r["loss"]) for r in steps) and \
        after == 0 and breaks == 0
    return check_row("modern + muon", passed, f"{len(steps)} steps, loss {steps[0]['loss']:.3f} "
                     f"-> {steps[-1]['loss']:.3f}; {stats['ms_per_step']:,.1f} ms/step{versus}, "
                     f"MFU {report.FORMAT.format('{:.1%}', stats['mfu'])}; {after} recompile(s) "
                     f"after the first step, {breaks} graph break(s)", recompiles_after=after,
                     graph_breaks=breaks)


def guarded(check, name, s):
    """A check whose own code fails is recorded as failed, and the others still run."""
    t0 = time.monotonic()
    try:
        row = check(s)
    except Exception as e:
        print(f"bench gpu: {name}: {type(e).__name__}: {e}", file=sys.stderr)
        row = check_row(name, False, f"the bench failed: {type(e).__name__}: {e}"[:300])
    return {**row, "took_s": time.monotonic() - t0}


# ---- the part ----

def run(small, device, workdir):
    """Small is the dry run; device is not used: the checks are the GPU's, or the CPU's in a
    dry run."""
    mode = "dry run" if small else "gpu" if torch.cuda.is_available() else None
    if mode is None:
        return not_run()
    s = Session(mode, workdir)
    print(f"bench gpu: {mode}, at most {s.spec['budget_s'] / 60:.0f} min", file=sys.stderr)
    # run in the order of what only a GPU shows, so that a budget run out leaves the rest
    # (recorded as not run): NCCL's collectives, GPT-2 124M's speed and MFU in bf16 with
    # compile, Muon's step there, fsdp in bf16, float16's scaler; then what the CPU already
    # checks on other paths
    order = [("versions", versions), ("collectives, 1-rank group", collectives),
             ("train.py", fresh_run), ("modern + muon", modern_muon),
             ("fsdp + muon + selective, 2 ranks",
              lambda s: two_ranks(s, "fsdp", "fsdp + muon + selective, 2 ranks", "fsdp-muon",
                                  [*RECIPE, *RECIPE_TWO, *SELECTIVE, *FSDP_KEYS])),
             ("fsdp, 2 ranks",
              lambda s: two_ranks(s, "fsdp", "fsdp, 2 ranks", "fsdp", PARITY)),
             (ONE_RANK, one_rank), ("checkpoint and resume", resume),
             ("recompiles", recompiles), ("minimal loop", minimal_loop),
             ("2 ranks", lambda s: two_ranks(s, extra=PARITY)),
             ("ddp vs fsdp", ddp_vs_fsdp), ("fsdp resumed, 2 ranks", fsdp_resumed),
             ("sample.py", sample), ("eval.py and HellaSwag", eval_hellaswag)]
    rows = {}
    for i, (name, check) in enumerate(order, 1):
        rows[name] = guarded(check, name, s)
        r = rows[name]
        print(f"bench gpu: [{i}/{len(order)}] {name}: {r.get('result', r['status'])}: "
              f"{r.get('measured', '')}", file=sys.stderr, flush=True)
    checks = [rows[name] for name in CHECKS]
    speed = [{"loop": name, **s.speed.get(name, {"status": rows[name]["status"]
                                                  if rows[name]["status"] != "ok"
                                                  else "failed: see its check"})}
             for name in LOOPS]
    return {"settings": settings(mode, s.spec, s.cfg), "results": checks, "speed": speed,
            "targets": targets(checks, speed)}


def settings(mode, spec, cfg):
    main = train_args(spec["main"], "<data>", "<out>", spec["steps"], spec["save_at"])
    ranks = [*train_args(spec["ranks"], "<byte data>", "<ranks>", spec["rank_steps"],
                         spec["rank_steps"] // 2), "--parallel=ddp", *PARITY, *UNEVEN_EVALUATION]
    recipe = train_args([*spec["main"], *RECIPE], "<data>", "<modern>", spec["steps"],
                        spec["steps"])
    one_rank = [*train_args(spec["one_rank"], "<byte data>", "<one-rank>",
                            spec["one_rank_steps"], EVERY_OTHER_STEP), "--sampling=documents"]
    commands = [f"torchrun --standalone --nproc_per_node=1 -m benchmarks.nccl_rank "
                f"{' '.join(spec['collectives'])}",
                f"TORCH_LOGS={TORCH_LOGS} python train.py {' '.join(main)}",
                f"python -m benchmarks.minimal_loop {' '.join(spec['main'])} --data_dir=<data> "
                f"--max_iters={spec['steps']}",
                f"TORCH_LOGS={TORCH_LOGS} python train.py {' '.join(main)} --init_from=resume"
                f"   # in a copy of <out> holding ckpt_{spec['save_at']:07d}.pt only",
                *(f"TORCH_LOGS={TORCH_LOGS} torchrun --nnodes=2 --nproc_per_node=1 "
                  f"--node_rank={n} --master_addr=127.0.0.1 --master_port=<port> train.py "
                  f"{' '.join(ranks)}{' &' if n else ''}" for n in (1, 0)),
                "   # and the same two with --parallel=fsdp --out_dir=<fsdp>; again from a copy "
                f"of its folder of iter {spec['rank_steps'] // 2} in <fsdp-resumed> with "
                f"--init_from=resume {' '.join(profiled(spec))}; and without "
                f"{' '.join(PARITY[:2])} (so bfloat16) with --parallel=fsdp "
                f"{' '.join([*RECIPE, *RECIPE_TWO, *SELECTIVE, *FSDP_KEYS])} "
                f"--out_dir=<fsdp-muon>",
                f"torchrun --standalone --nproc_per_node=1 train.py {' '.join(one_rank)}",
                f"python sample.py --out_dir=<ranks> --device={spec['device']} --num_samples=2 "
                f"--max_new_tokens={spec['new_tokens']} --start='def '",
                f"python eval.py --out_dir=<ranks> --device={spec['device']} "
                f"--hellaswag_path=<{HELLASWAG_EXAMPLES} examples>",
                f"TORCH_LOGS={TORCH_LOGS} python train.py {' '.join(recipe)}"]
    return {"mode": mode, "about": ABOUT[mode], "steps": spec["steps"],
            "save_at": spec["save_at"], "warmup": spec["warmup"],
            "rank_steps": spec["rank_steps"], "budget_s": spec["budget_s"],
            "model": describe(cfg), "commands": "\n".join(f"    {c}" for c in commands)}


def describe(cfg):
    return (f"{cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, block {cfg.block_size}, "
            f"{cfg.batch_size} x {cfg.gradient_accumulation_steps} sequences per step, "
            f"{cfg.dtype}, compile {cfg.compile}")


def not_run():
    """The record of a session with no GPU: every check and target not run."""
    checks = [{"check": name, "status": NO_GPU, "passed": None} for name in CHECKS]
    speed = [{"loop": name, "status": NO_GPU} for name in LOOPS]
    cfg = common.train_config(MODES["gpu"]["main"])
    return {"settings": settings("not run", MODES["gpu"], cfg), "results": checks,
            "speed": speed, "targets": targets(checks, speed)}


def targets(checks, speed):
    rows = {r["check"]: r for r in checks}
    ours, ceiling, recipe = speed
    return [ceiling_target(ours, ceiling), mfu_target(ours), recipe_target(ours, recipe),
            recompile_target(rows["recompiles"]),
            check_target(f"a resumed run goes on with the same batches (batch_fp) and losses "
                         f"within {LOSS_RTOL:.1%}", rows["checkpoint and resume"]),
            all_checks_target(checks)]


def not_measured(*rows):
    """The reason a target could not be judged: the first row that did not run."""
    return next(r["status"] for r in rows if r["status"] != "ok")


def ceiling_target(ours, ceiling):
    return common.step_time_target(
        f"train.py's step within {CEILING_TARGET:.0%} of the minimal loop's, on the same model "
        f"and GPU (GPT-2 124M, bf16, torch.compile)", ours, ceiling, CEILING_TARGET)


def recipe_target(ours, recipe):
    return common.step_time_target(
        f"modern+muon's train.py step within {RECIPE_TARGET:.0%} of gpt2+adamw's, on the same "
        f"model size and batch (GPT-2 124M, bf16, torch.compile)", recipe, ours, RECIPE_TARGET)


def mfu_target(ours):
    target = (f"GPT-2 124M at {MFU_TARGET:.0%} MFU or better through train.py on an "
              f"H100/H200-class GPU (bf16, torch.compile)")
    if ours["status"] != "ok":
        return {"target": target, "measured": ours["status"], "met": None}
    if ours["mfu"] is None:
        return {"target": target, "measured": f"no MFU: the device's peak is unknown; "
                                              f"{ours['tflops']:.3f} TFLOP/s", "met": None}
    return {"target": target, "measured": f"{ours['mfu']:.1%} MFU ({ours['tok_per_s']:,.0f} "
                                          f"tok/s)", "met": ours["mfu"] >= MFU_TARGET}


def recompile_target(row):
    target = "no recompiles after the first step, in a fresh run and after a resume " \
             "(torch.compile)"
    if row["status"] == "ok" and not row["compiled"]:
        return {"target": target, "measured": row["measured"], "met": None}
    return check_target(target, row)


def check_target(target, row):
    if row["status"] != "ok":
        return {"target": target, "measured": row["status"], "met": None}
    return {"target": target, "measured": row["measured"], "met": row["passed"]}


def all_checks_target(checks):
    target = f"every GPU check passes ({', '.join(CHECKS)})"
    ran = [r for r in checks if r["status"] == "ok"]
    if not ran:
        return {"target": target, "measured": not_measured(*checks), "met": None}
    failing = [r["check"] for r in ran if not r["passed"]]
    skipped = [r["check"] for r in checks if r["status"] != "ok"]
    measured = f"{len(ran) - len(failing)} of {len(checks)} pass" + \
        (f"; failed: {', '.join(failing)}" if failing else "") + \
        (f"; not run: {', '.join(skipped)}" if skipped else "")
    return {"target": target, "measured": measured, "met": not failing and not skipped}


def plot(result):
    """ms per step and achieved TFLOP/s of train.py and the minimal loop."""
    from matplotlib.figure import Figure

    done = [r for r in result["speed"] if r["status"] == "ok"]
    if not done:  # a placeholder the page can show until the GPU run
        fig = Figure(figsize=(9, 1.5))
        fig.text(0.5, 0.5, result["speed"][0]["status"], ha="center", va="center")
        return fig
    fig = Figure(figsize=(9, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    labels = [r["loop"] for r in done]
    left.bar(labels, [r["ms_per_step"] for r in done], color="C0")
    left.set_ylabel("ms per step (median)")
    right.bar(labels, [r["tflops"] for r in done], color="C2")
    right.set_ylabel("achieved TFLOP/s")
    peak = next((r["tflops"] / r["mfu"] for r in done if r["mfu"]), None)
    if peak:
        right.axhline(peak * MFU_TARGET, color="C3", linestyle="--",
                      label=f"{MFU_TARGET:.0%} MFU (target)")
        right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"train.py and the minimal loop, {result['settings']['mode']}: "
                 f"{result['settings']['model']}", fontsize=9)
    return fig
