"""train.py whose evaluations take SLOW_EVAL_S seconds longer, launched in place of train.py:
each waits that long before the real evaluation (evaluation.losses), as one over a slow file
system or of far too many eval_iters does, without keeping a core busy meanwhile. Used by
test_watchdog.py."""
import os
import sys
import time

from as_train import run_train
from ddpgpt import evaluation

_losses = evaluation.losses


def slowly(*args):
    time.sleep(float(os.environ["SLOW_EVAL_S"]))
    return _losses(*args)


evaluation.losses = slowly

if __name__ == "__main__":
    run_train(sys.argv[1:])
