"""train.py with one rank that fails mid-run, for test_launch.py: launched in place of train.py
(TRAIN_SCRIPT) through the real launch scripts. FAIL_RANK's batch reader raises after
FAIL_AFTER batches, as a failing disk or a bad file would, while the other ranks go on to the
next step's all-reduce and would wait there until dist_timeout_s."""
import os
import sys

import data
import train

_rank_batches = data.rank_batches


def failing_rank_batches(*args, **kw):
    batches = _rank_batches(*args, **kw)
    if kw["rank"] != int(os.environ["FAIL_RANK"]):
        yield from batches
        return
    for _ in range(int(os.environ.get("FAIL_AFTER", "3"))):
        yield next(batches)
    raise OSError(f"injected read error on rank {kw['rank']}")


data.rank_batches = failing_rank_batches

if __name__ == "__main__":
    sys.exit(train.run_cli(sys.argv[1:]))
