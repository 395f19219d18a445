"""train.py whose checkpoints take SLOW_SAVE_S seconds longer to publish, launched in place of
train.py: each is written whole under its temporary name, then waits before the rename that
makes it the newest, as a save to a slow file system does. So a test can kill a run while a
save in the background is in flight, and see the training go on meanwhile, or make a save
hang. Used by test_fsdp.py and test_watchdog.py."""
import os
import sys
import time

from as_train import run_train
from ddpgpt import fileio

_publish, _publish_folder = fileio.publish, fileio.publish_folder


def slow(publish):
    def slowly(*args):
        time.sleep(float(os.environ["SLOW_SAVE_S"]))
        return publish(*args)
    return slowly


fileio.publish, fileio.publish_folder = slow(_publish), slow(_publish_folder)

if __name__ == "__main__":
    run_train(sys.argv[1:])
