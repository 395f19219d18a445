"""train.py with one rank whose reads of token files take 200 ms longer, as on a slow disk or a
busy node: launched by test_diagnostics.py in place of train.py (SLOW_RANK=<rank>)."""
import os
import sys
import time

from as_train import run_train
from ddpgpt import tokenfile

_read = tokenfile.read


def slow_read(*args, **kw):
    time.sleep(0.2)
    return _read(*args, **kw)


if __name__ == "__main__":
    if os.environ["RANK"] == os.environ["SLOW_RANK"]:
        tokenfile.read = slow_read
    run_train(sys.argv[1:])
