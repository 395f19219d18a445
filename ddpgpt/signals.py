"""Stop signals, the one place each script decides what SIGINT (Ctrl-C), SIGTERM (kill, scancel,
preemption), SIGHUP (a closed terminal) and SIGUSR1 (SLURM's warning before a time limit) do:

  train.py          records them (catch_stop_signals): the ranks agree on a step to stop at
                    and rank 0 saves; a second Ctrl-C stops at once, unsaved
  prepare.py        raises Interrupted wherever the main process is, so that every way out
                    runs the cleanup that Ctrl-C runs (raise_on_stop_signals)
  prepare's workers ignore them: the main process ends them (workers.py)
"""
import os
import signal
import sys

TRAIN_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
PREPARE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def catch_stop_signals(script="train.py"):
    """The list the stop signals are recorded in as they come, instead of dying. Caught from
    the start, so that a signal that comes while the model is built is not lost."""
    received = []

    def on_signal(signum, frame):
        if signum == signal.SIGINT and signal.SIGINT in received:
            print(f"{script}: interrupted again: stopping now, without saving", file=sys.stderr)
            os._exit(130)
        received.append(signum)

    for sig in TRAIN_SIGNALS:
        signal.signal(sig, on_signal)
    return received


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in prepare.py's main process wherever it is (a KeyboardInterrupt,
    which libraries let through too). `left` says what the run leaves behind; exit status is
    the shell's convention, 128 + the signal's number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.left = signum, "no new output was published"


def raise_on_stop_signals():
    """Raise Interrupted on a stop signal; one that the parent ignores (nohup's SIGHUP, a
    background job's SIGINT) stays ignored."""
    def stop(signum, frame):
        for s in PREPARE_SIGNALS:  # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s in PREPARE_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, stop)
