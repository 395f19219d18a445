"""The one kind of error a user can fix, and the one line that says it.

Every script runs its main() through run(), which catches UserError, prints its message as one
paragraph, `<script>: error (rank N): ...` (line()), and exits 1. Anything else is a bug in
ddpgpt and keeps its traceback. A stop signal that ends a script is one line too (Interrupted)."""
import os
import signal
import sys
import threading
import time


class UserError(Exception):
    """Bad input or a bad state that the user can fix. The message names the file, key or
    value, says what is wrong with it and what to do."""


class SettingsError(UserError):
    """A key or config file that cannot be read (configurator): every rank of a launch reads
    the same arguments and files and meets it alike, so rank 0 alone says it."""


class Interrupted(KeyboardInterrupt):
    """A stop signal (signals.py), raised in prepare.py's main process wherever it is (a
    KeyboardInterrupt, which libraries let through too), and in train.py's before its first
    step. `left` says what the run leaves behind, `line` what run() prints; exit status is the
    shell's convention, 128 + the signal's number."""

    def __init__(self, signum, line=""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.line, self.left = signum, line, "no new output was published"


def line(script, message, ranks=()):
    """The error line: 'train.py: error (rank 1): ...', naming the ranks it happened on."""
    named = f" (rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))})" if ranks else ""
    return f"{script}: error{named}: {message}"


def run(main, script, argv):
    """main(argv)'s exit status; a UserError is printed as one paragraph, with the rank under a
    launcher, and is status 1. Under a launcher that rank then exits at once, without any
    teardown of a process group: since PyTorch 2.6 destroying one waits for collectives that
    the other ranks may never join, and the interpreter's own exit can abort in gloo's threads
    (launch.finish); torchrun (or srun --kill-on-bad-exit) ends the others."""
    try:
        return main(argv)
    except SettingsError as e:
        if os.environ.get("RANK", "0") == "0":
            say(line(script, e))
            say_torchrun_reports_next()
        else:  # rank 0 says it: wait, silent, for the launcher to end this rank once rank 0
            # has exited (exiting first, torchrun could end rank 0 before its line is out)
            for stop in (signal.SIGTERM, signal.SIGINT):
                signal.signal(stop, signal.SIG_DFL)  # ended without a word
            time.sleep(60)
        return 1
    except UserError as e:
        rank = os.environ.get("RANK")
        say(line(script, e, [rank] if rank else ()))
        if rank:
            exit_now(1)
        return 1
    except Interrupted as e:
        if not e.line:  # prepare.py's, which reports its own
            raise
        say_once(e.line)
        exit_now(128 + e.signum)


def exit_now(status):
    """End the process without the interpreter's exit, whose teardown of the process group
    waits for peers that may be gone (seconds with gloo), while torchrun waits for every rank
    before it restarts the others or reports."""
    if status:
        say_torchrun_reports_next()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def say_torchrun_reports_next():
    """After rank 0's last line of a run that failed or was stopped under torchrun, which may
    then print a traceback of its own (ChildFailedError; its SignalException on Ctrl-C) that
    would read as the answer."""
    if os.environ.get("RANK") == "0" and "TORCHELASTIC_RUN_ID" in os.environ:
        say("(torchrun's own report of how the ranks ended may follow: what happened is said "
            "above)")


_said = threading.Lock()  # say_once's line is said once, by whichever way out comes first


def say_once(text):
    if _said.acquire(blocking=False):
        say(text)


def say(text):
    """Print the line to stderr in one write. The ranks of a launch share their launcher's
    stderr, and print() writes a line and its newline apart (stderr is unbuffered): two ranks
    saying their line at once came out as one line and then two newlines."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
