"""Compare two runs step by step: did they read the same global batches (and get the same losses)?

  python compare_runs.py out-a out-b            # batch fingerprints
  python compare_runs.py out-a out-b --losses   # and losses, exactly

Reads each out_dir's metrics.jsonl, where train.py writes one row per step with `batch_fp`, a
hash of the samples of that step's global batch. Where a run logged a step twice (it was
restarted from an older checkpoint), its last row counts. Exits 0 when every step both runs
logged agrees, else 1, naming the first step that differs.
"""
import argparse
import json
import math
import os
import sys


def steps(out_dir):
    rows = {}
    path = os.path.join(out_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError as e:
        sys.exit(f"compare_runs.py: error: cannot read {path} ({e.strerror}): give the out_dir "
                 f"of a train.py run")
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError:  # a run killed while writing it cuts a line off (a resumed run
            # then appends after it)
            print(f"compare_runs.py: note: {path}, line {number} is not whole JSON (cut off "
                  f"when a run was stopped?): left out", file=sys.stderr)
            continue
        if isinstance(row, dict) and "batch_fp" in row:
            rows[row["iter"]] = row
    return rows


def same(a, b):
    """Equal, a NaN loss included: two runs that both diverged at a step agree there."""
    return a == b or all(isinstance(x, float) and math.isnan(x) for x in (a, b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--losses", action="store_true", help="also compare losses exactly")
    args = parser.parse_args()
    a, b = steps(args.run_a), steps(args.run_b)
    keys = ["batch_fp", "loss"] if args.losses else ["batch_fp"]
    common = sorted(set(a) & set(b))
    if not common:
        sys.exit("compare_runs.py: error: the two runs have no logged step in common")
    for i in common:
        for key in keys:
            if not same(a[i].get(key), b[i].get(key)):
                print(f"first difference at iter {i}: {key} {a[i].get(key)} vs {b[i].get(key)}")
                return 1
    print(f"identical {' and '.join(keys)} over {len(common)} steps "
          f"(iter {common[0]} to {common[-1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
