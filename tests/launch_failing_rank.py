"""train.py with one rank that fails mid-run, launched in place of train.py: FAIL_RANK's batch
reader raises after FAIL_AFTER batches, as a failing disk or a bad file would, while the other
ranks go on to the next step's all-reduce and would wait there until dist_timeout_s.
  FAIL_AS=OSError (default) or UserError: what the reader raises
  BLOCKING_TEARDOWN=1: destroying the process group blocks for an hour, as NCCL's can when a
    peer is gone, so a failing rank that tore down before it reported would never report
Used by test_launch.py (through the real launch scripts) and test_reliability.py."""
import os
import sys
import time

import torch

from as_train import run_train
from ddpgpt import loader
from ddpgpt.errors import UserError

_rank_batches = loader.rank_batches


def failing_rank_batches(*args, **kw):
    batches = _rank_batches(*args, **kw)
    if kw["rank"] != int(os.environ["FAIL_RANK"]):
        yield from batches
        return
    for _ in range(int(os.environ.get("FAIL_AFTER", "3"))):
        yield next(batches)
    error = UserError if os.environ.get("FAIL_AS") == "UserError" else OSError
    raise error(f"injected read error on rank {kw['rank']}")


loader.rank_batches = failing_rank_batches
if os.environ.get("BLOCKING_TEARDOWN"):
    torch.distributed.destroy_process_group = lambda *args, **kw: time.sleep(3600)

if __name__ == "__main__":
    run_train(sys.argv[1:])
