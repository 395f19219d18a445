"""The one kind of error a user can fix.

Every script runs its main() through run(), which catches UserError, prints its message as one
paragraph after the script's name and exits 1. Anything else is a bug in ddpgpt and keeps its
traceback. (A stop signal that ends train.py before its first step is one line too.)
"""
import os
import signal
import sys
import time

from ddpgpt.signals import EXIT_AT_ONCE as STOP_SIGNALS, Interrupted, say, say_once, \
    say_torchrun_reports_next


class UserError(Exception):
    """Bad input or a bad state that the user can fix. The message names the file, key or
    value, says what is wrong with it and what to do."""


class SettingsError(UserError):
    """A key or config file that cannot be read (configurator): every rank of a launch reads
    the same arguments and files and meets it alike, so rank 0 alone says it."""


def run(main, script, argv):
    """main(argv)'s exit status; a UserError is printed as one paragraph, with the rank under a
    launcher, and is status 1. Under a launcher that rank then exits at once, without any
    teardown of a process group: since PyTorch 2.6 destroying one waits for collectives that
    the other ranks may never join, and the interpreter's own exit can abort in gloo's threads
    (runtime.finish); torchrun (or srun --kill-on-bad-exit) ends the others."""
    try:
        return main(argv)
    except SettingsError as e:
        if os.environ.get("RANK", "0") == "0":
            say(f"{script}: error: {e}")
            say_torchrun_reports_next()
        else:
            wait_for_the_launcher()
        return 1
    except UserError as e:
        where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        say(f"{script}: error{where}: {e}")
        if where:
            exit_now(1)
        return 1
    except Interrupted as e:
        if not e.line:  # prepare.py's, which reports its own
            raise
        say_once(e.line)
        exit_now(128 + e.signum)


def wait_for_the_launcher(cap_s=60):
    """Rank 0 meets the same SettingsError and says it: this rank waits, silent, for the
    launcher to end it once rank 0 has exited. Were it to exit first, torchrun could end rank
    0 before its line is out."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_DFL)  # ended without a word
    time.sleep(cap_s)


def exit_now(status):
    """End the process without the interpreter's exit, whose teardown of the process group
    waits for peers that may be gone (seconds with gloo), while torchrun waits for every rank
    before it restarts the others or reports."""
    if status:
        say_torchrun_reports_next()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
