"""The one kind of error a user can fix.

Every script runs its main() through run(), which catches UserError, prints its message as one
paragraph after the script's name and exits 1. Anything else is a bug in ddpgpt and keeps its
traceback.
"""
import os
import sys


class UserError(Exception):
    """Bad input or a bad state that the user can fix. The message names the file, key or
    value, says what is wrong with it and what to do."""


def run(main, script, argv):
    """main(argv)'s exit status; a UserError is printed as one paragraph, with the rank under a
    launcher, and is status 1. It is printed before any teardown of a process group: since
    PyTorch 2.6 destroying one waits for collectives that the other ranks may never join, so
    this rank exits without it, and torchrun (or srun --kill-on-bad-exit) ends the others."""
    try:
        return main(argv)
    except UserError as e:
        where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        print(f"{script}: error{where}: {e}", file=sys.stderr)
        return 1
