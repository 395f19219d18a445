"""Benchmarks behind the project's claims. Each part writes <out_dir>/<part>.json (its numbers,
the command, the machine) and <out_dir>/<part>.png, then docs/benchmarks.md is regenerated from
every part's JSON. How to run it: docs/benchmarks.md; what each part measures: benchmarks/."""
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import torch

from benchmarks import (common, datapath, documents, evaluating, fsdp, gpu, memplan, mixing,
                        muon, preparing, preparing_hf, recipe, recompute, report, training)
from ddpgpt import configurator, errors
from ddpgpt.configurator import key

PARTS = {"data": datapath, "mix": mixing, "training": training, "prepare": preparing,
         "prepare_hf": preparing_hf, "eval": evaluating, "documents": documents, "fsdp": fsdp,
         "muon": muon, "recipe": recipe, "recompute": recompute, "memplan": memplan, "gpu": gpu}
DOCS_DATA = os.path.join(common.ROOT, "docs", "bench")


@dataclass
class BenchConfig:
    """Run the benchmarks and write docs/benchmarks.md."""
    parts: str = key("", f"comma-separated, any of {', '.join(PARTS)}; '': all of them (gpu "
                         f"only on a GPU or with small)")
    small: bool = key(False, "tiny sizes that run in seconds (CI), into out-bench-small/; for "
                             "gpu, a dry run of its every step on the CPU", was="dry-run")
    out_dir: str = key("", "where the JSON and plots go; '': docs/bench, or out-bench-small/")
    report: str = key("", "the page; '': <out_dir>/benchmarks.md, docs/bench's docs/benchmarks.md")
    device: Literal["cpu", "cuda"] = key("cpu", "cuda: adds GPT-2 124M (bf16) to training, eval")
    report_only: bool = key(False, "run nothing: rewrite the page from the JSON in out_dir")
    POSITIONAL = ("parts",)


def parse_args(argv):
    """The settings, with out_dir and report as they apply, and the parts to run."""
    cfg = configurator.parse(BenchConfig, argv, "bench.py")
    if unknown := [part for part in cfg.parts.split(",") if cfg.parts and part not in PARTS]:
        raise errors.UserError(f"unknown part(s) {', '.join(unknown)}: choose from "
                               f"{', '.join(PARTS)}")
    # with no GPU, "every part" leaves out the GPU's, whose results it could only replace with
    # "not run"; named, it records exactly that
    every = [name for name in PARTS if name != "gpu" or cfg.small or torch.cuda.is_available()]
    parts = [] if cfg.report_only else cfg.parts.split(",") if cfg.parts else every
    cfg.out_dir = os.path.abspath(cfg.out_dir or (
        os.path.join(common.ROOT, "out-bench-small") if cfg.small else DOCS_DATA))
    cfg.report = os.path.abspath(cfg.report or os.path.join(
        os.path.dirname(cfg.out_dir) if cfg.out_dir == DOCS_DATA else cfg.out_dir, "benchmarks.md"))
    return cfg, parts


def run_part(name, args, command):
    """Run one part and write its JSON and plot."""
    started, t0, load_start = datetime.datetime.now().astimezone(), time.time(), common.load_1m()
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as workdir:
        numbers = PARTS[name].run(args.small, args.device, workdir)
        if runs := numbers.pop("curves", []):  # out_dirs of train.py runs, drawn by plot.py
            common.check(common.run_watched(
                [sys.executable, "plot.py", f"--out_dir={','.join(runs)}",
                 f"--to={curves_png(args.out_dir, name)}",
                 f"--title={PARTS[name].TITLE}: the runs' curves (plot.py)"],
                common.child_env(), 600), "plot.py")
    # a command that names the part's temporary folder shows it as <workdir>: the page and the
    # JSON keep no path of a folder that is gone
    numbers = json.loads(json.dumps(numbers).replace(workdir, "<workdir>"))
    result = {"part": name, "command": command, "small": args.small,
              "started": started.isoformat(timespec="seconds"),
              "elapsed_s": round(time.time() - t0, 1), "load_1m_start": load_start,
              "load_1m_end": common.load_1m(), "machine": common.machine(), **numbers}
    with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    PARTS[name].plot(result).savefig(os.path.join(args.out_dir, f"{name}.png"), dpi=100)


def curves_png(out_dir, name):
    return os.path.join(out_dir, f"{name}-curves.png")


def write_report(out_dir, report_path):
    """The markdown page, from the JSON of every part that has been run into out_dir."""
    here = os.path.dirname(report_path)
    parts = []
    for name, module in PARTS.items():
        path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            png = os.path.relpath(os.path.join(out_dir, f"{name}.png"), here)
            curves = curves_png(out_dir, name)  # a part's text places it with {curves}
            result["curves"] = (
                f"The runs' curves, drawn from their metrics.jsonl by `python plot.py`:\n\n"
                f"![{module.TITLE}: the runs' curves]({os.path.relpath(curves, here)})"
                if os.path.exists(curves) else "")
            parts.append((name, module.TITLE, module.TABLES, result, png))
    page = report.document(parts, os.path.relpath(out_dir, here))  # a template error leaves
    with open(report_path, "w") as f:  # the page as it was, not empty
        f.write(page)


def main(argv):
    args, parts = parse_args(argv)
    common.POLL_S = common.SMALL_POLL_S if args.small else common.POLL_S
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(os.path.dirname(args.report), exist_ok=True)
    command = shlex.join(["python", "bench.py", *argv])
    for name in parts:
        print(f"bench: {name}", file=sys.stderr)
        run_part(name, args, command)
        write_report(args.out_dir, args.report)  # after each part: a later failure keeps it
    write_report(args.out_dir, args.report)  # report_only's
    print(f"bench: wrote {args.out_dir} and {args.report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "bench.py", sys.argv[1:]))
