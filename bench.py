"""Benchmarks behind the project's claims. Each part writes <out_dir>/<part>.json (its numbers,
the command, the machine) and <out_dir>/<part>.png, then docs/benchmarks.md is regenerated from
every part's JSON. How to run it: docs/benchmarks.md; what each part measures: benchmarks/."""
import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import torch

from benchmarks import (common, datapath, documents, evaluating, fsdp, gpu, memplan, mixing,
                        muon, preparing, preparing_hf, recipe, recompute, report, training)

PARTS = {"data": datapath, "mix": mixing, "training": training, "prepare": preparing,
         "prepare_hf": preparing_hf, "eval": evaluating, "documents": documents, "fsdp": fsdp,
         "muon": muon, "recipe": recipe, "recompute": recompute, "memplan": memplan, "gpu": gpu}
DOCS_DATA = os.path.join(common.ROOT, "docs", "bench")
DOCS_REPORT = os.path.join(common.ROOT, "docs", "benchmarks.md")


def parse_args(argv):
    p = argparse.ArgumentParser(description="Run the benchmarks and write docs/benchmarks.md.")
    p.add_argument("parts", nargs="*", metavar="PART",
                   help=f"any of {', '.join(PARTS)} (default: all)")
    p.add_argument("--small", action="store_true",
                   help="tiny sizes that run in seconds (CI); writes to out-bench-small/")
    p.add_argument("--dry-run", action="store_true",
                   help="the gpu part's every step on a tiny model on the CPU, to test its "
                        "plumbing (CI); the same as --small")
    p.add_argument("--out_dir", help="where the JSON and plots go (default: docs/bench, or "
                                     "out-bench-small with --small)")
    p.add_argument("--report", help="the markdown page (default: docs/benchmarks.md for "
                                    "docs/bench, else <out_dir>/benchmarks.md)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda adds GPT-2 124M in bf16 to the training part (with "
                                        "torch.compile) and to the eval part")
    p.add_argument("--report_only", action="store_true",
                   help="run nothing: rewrite the page from the JSON already in out_dir")
    args = p.parse_args(argv)
    if unknown := [part for part in args.parts if part not in PARTS]:
        p.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    args.small = args.small or args.dry_run
    # with no GPU, "every part" leaves out the GPU's, whose results it could only replace with
    # "not run"; named, it records exactly that
    every = [name for name in PARTS if name != "gpu" or args.small or torch.cuda.is_available()]
    args.parts = [] if args.report_only else args.parts or every
    args.out_dir = os.path.abspath(args.out_dir or (
        os.path.join(common.ROOT, "out-bench-small") if args.small else DOCS_DATA))
    default_report = DOCS_REPORT if args.out_dir == DOCS_DATA else \
        os.path.join(args.out_dir, "benchmarks.md")
    args.report = os.path.abspath(args.report or default_report)
    return args


def run_part(name, args, command):
    """Run one part and write its JSON and plot."""
    started, t0, load_start = datetime.datetime.now().astimezone(), time.time(), common.load_1m()
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as workdir:
        numbers = PARTS[name].run(args.small, args.device, workdir)
        if runs := numbers.pop("curves", []):  # out_dirs of train.py runs, drawn by plot.py
            common.check(common.run_watched(
                [sys.executable, "plot.py", *runs, f"--out={curves_png(args.out_dir, name)}",
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
    args = parse_args(argv)
    if args.small:
        common.POLL_S = common.SMALL_POLL_S
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(os.path.dirname(args.report), exist_ok=True)
    command = shlex.join(["python", "bench.py", *argv])
    for name in args.parts:
        print(f"bench: {name}", file=sys.stderr)
        run_part(name, args, command)
        write_report(args.out_dir, args.report)  # after each part: a later failure keeps it
    if args.report_only:
        write_report(args.out_dir, args.report)
    print(f"bench: wrote {args.out_dir} and {args.report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
