"""Run train.py in this process, as `python train.py ARGS` would: for the wrappers that stand in
for train.py with one function of the package patched (launch_failing_rank.py, ...)."""
import os
import runpy
import sys

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")


def run_train(argv):
    sys.argv = [TRAIN, *argv]
    runpy.run_path(TRAIN, run_name="__main__")  # ends in train.py's sys.exit
