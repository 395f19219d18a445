"""Compare two runs step by step: did they read the same global batches (and get the same losses)?

  python compare_runs.py --out_dir=out-a,out-b            # batch fingerprints
  python compare_runs.py --out_dir=out-a,out-b --losses   # and losses, exactly

Reads each out_dir's metrics.jsonl, where train.py writes one row per step with `batch_fp`, a
hash of the samples of that step's global batch. A run's rows are those of its last fresh start
(each run opens its rows with a start row; an earlier run in the same out_dir is left out, and
said so); where a resumed run took steps again, its rows count (ddpgpt/metrics.py, read).
Exits 0 when every step both runs logged agrees, else 1, naming the first step that differs.
"""
import math
import sys

from ddpgpt import configurator, errors, metrics
from ddpgpt.errors import UserError
from ddpgpt.settings import CompareConfig


def steps(out_dir):
    """{iter: step row} of the run in out_dir, saying so when earlier runs are left out."""
    rows = metrics.read(out_dir)
    if rows.earlier:
        print(f"{out_dir}: the last run's steps (its metrics.jsonl holds {rows.earlier} rows "
              f"of earlier runs before them)")
    return {i: r for i, r in rows.steps.items() if "batch_fp" in r}


def same(a, b):
    """Equal, a NaN loss included: two runs that both diverged at a step agree there."""
    return a == b or all(isinstance(x, float) and math.isnan(x) for x in (a, b))


def main(argv):
    cfg = configurator.parse(CompareConfig, argv, "compare_runs.py")
    if len(runs := cfg.out_dir.split(",")) != 2:
        raise UserError(f"out_dir={cfg.out_dir!r}: give the two runs to compare: --out_dir=a,b")
    a, b = map(steps, runs)
    keys = ["batch_fp", "loss"] if cfg.losses else ["batch_fp"]
    common = sorted(set(a) & set(b))
    if not common:
        raise UserError(f"{' and '.join(runs)} have no logged step in common: give the "
                        f"out_dirs of two runs that logged the same iters")
    for i in common:
        for key in keys:
            if not same(a[i].get(key), b[i].get(key)):
                print(f"first difference at iter {i}: {key} {a[i].get(key)} vs {b[i].get(key)}")
                return 1
    print(f"identical {' and '.join(keys)} over {len(common)} steps "
          f"(iter {common[0]} to {common[-1]})")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "compare_runs.py", sys.argv[1:]))
