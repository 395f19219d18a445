"""train.py, with rank r reading <data_dir>_rank<r> where that folder exists: launched by
test_shards.py in place of train.py, to give one rank other data than the rest."""
import os
import sys

from as_train import run_train


def rank_argument(arg):
    mine = f"{arg}_rank{os.environ['RANK']}"
    return mine if arg.startswith("--data_dir=") and os.path.isdir(mine[len("--data_dir="):]) \
        else arg


if __name__ == "__main__":
    run_train([rank_argument(a) for a in sys.argv[1:]])
