"""train.py with one rank whose data reads stall mid-run, launched in place of train.py. After
STALL_AFTER reads by its batch reader thread, rank STALL_RANK's reads
  STALL_FIFO=<path of a FIFO>: open that FIFO, which no one writes to, in place of the token
    file: the real tokenfile.read_file then blocks in os.open, as a read on a dead mount does;
  STALL_S=<seconds>: once, sleep that long first: one slow read, after which the run goes on.
Used by test_watchdog.py."""
import os
import sys
import threading
import time

from as_train import run_train
from ddpgpt import tokenfile

_read = tokenfile.read
_reads = 0


def stalling_read(token_split, offsets, length):
    global _reads
    if int(os.environ.get("RANK", "0")) == int(os.environ["STALL_RANK"]) and \
            threading.current_thread() is not threading.main_thread():
        _reads += 1
        if _reads > int(os.environ["STALL_AFTER"]) and "STALL_FIFO" in os.environ:
            token_split = token_split._replace(
                paths=(os.environ["STALL_FIFO"],) * len(token_split.paths))
        elif _reads == int(os.environ["STALL_AFTER"]) + 1:
            time.sleep(float(os.environ["STALL_S"]))
    return _read(token_split, offsets, length)


tokenfile.read = stalling_read

if __name__ == "__main__":
    run_train(sys.argv[1:])
