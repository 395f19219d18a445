"""Launched in place of train.py (TRAIN_SCRIPT=...): prints one line, `rank <RANK>:` and the
environment variables named in its arguments as NAME=value, and exits. test_launch.py reads
what launch/ hands each rank. Arguments that start with -- (train.py's) are left out."""
import os
import sys

names = [a for a in sys.argv[1:] if not a.startswith("--")]
line = f"rank {os.environ['RANK']}: " + " ".join(f"{n}={os.environ.get(n)}" for n in names)
os.write(1, f"{line}\n".encode())  # one write: the ranks share the job's log
