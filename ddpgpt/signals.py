"""Stop signals, the one place each script decides what SIGINT (Ctrl-C), SIGTERM (kill, scancel,
preemption), SIGHUP (a closed terminal) and SIGUSR1 (SLURM's warning before a time limit) do:

  train.py          before its first step, when there is nothing to save, SIGTERM, SIGINT
                    and SIGHUP end it at once, with one line, wherever it waits
                    (init_process_group waiting for a peer among them); from the first step on
                    it records them (catch_stop_signals): the ranks agree on a step to stop at
                    and rank 0 saves; a second Ctrl-C stops at once, unsaved. A SIGHUP that
                    the parent ignores (nohup's) stays ignored; torchrun, nohup or not, passes
                    it on (HANGUP says how to outlive a terminal)
  prepare.py        raises Interrupted wherever the main process is, so that every way out
                    runs the cleanup that Ctrl-C runs (raise_on_stop_signals)
  prepare's workers ignore them: the main process ends them (workers.py)
"""
import os
import signal
import threading
import time

from ddpgpt.errors import Interrupted, say, say_once, say_torchrun_reports_next

TRAIN_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
PREPARE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def end_at_once_while_importing(script):
    """Until catch_stop_signals(), while the script still imports (torch's import takes
    seconds, and torchrun passes a Ctrl-C on to its ranks as SIGINT), SIGINT and SIGTERM end
    the process with before_steps' line instead of a KeyboardInterrupt traceback from each
    rank. One that the parent ignores (a background job's SIGINT) stays ignored."""
    listen(EXIT_AT_ONCE, lambda signum, frame: end_before_steps(script, signum))


def listen(signals, handler):
    """Install handler for each of the signals that the parent does not ignore, and unblock
    them: a process inherits its parent's signal mask, and a launcher that forks while it
    blocks them (as multiprocessing's resource tracker does for SIGINT and SIGTERM) passes them
    on blocked, which would hold a Ctrl-C pending, unseen, until the process ends."""
    wanted = [s for s in signals if signal.getsignal(s) is not signal.SIG_IGN]
    for s in wanted:
        signal.signal(s, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)


def catch_stop_signals(script="train.py"):
    """The list the stop signals are recorded in as they come, instead of dying. Caught from the
    start, so that a signal that comes while the model is built is not lost. Until steps_begin()
    there is nothing to save: SIGTERM (torchrun stopping the ranks of a failed attempt, scancel),
    SIGINT and SIGHUP end the process at once instead, with one line (exit_at_once)."""
    received = []

    def on_signal(signum, frame):
        if signum in EXIT_AT_ONCE and _before_steps is not None:
            if set(received) & set(EXIT_AT_ONCE):
                return  # already on the way out: a second signal must not cut that short
            received.append(signum)
            raise Interrupted(signum, before_steps(script, signum))
        if signum == signal.SIGINT and signal.SIGINT in received:
            say(f"{script}: interrupted again: stopping now, without saving")
            os._exit(130)
        received.append(signum)

    for sig in TRAIN_SIGNALS:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TRAIN_SIGNALS)
    listen([signal.SIGHUP], on_signal)  # a closed terminal's, unless ignored (nohup)
    exit_at_once(script)
    return received


EXIT_AT_ONCE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
HANGUP = ("SIGHUP: its terminal closed, and torchrun passes that on to the ranks even under "
          "nohup. To outlive the terminal, start torchrun with setsid (setsid torchrun ... > "
          "log 2>&1 &), or in tmux or screen")
GRACE_S = 1.0  # for the main thread to leave (releasing out_dir's lock) before a thread ends it
_before_steps = None  # until steps_begin(): the write end of exit_at_once's pipe


def before_steps(script, signum):
    rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
    line = (f"{script}: stopped by {signal.Signals(signum).name}{rank} before the first step: "
            f"nothing to save yet")
    if signum == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ:
        # the same signal whoever sent it: say the likelier sender's reason too
        from ddpgpt import peers  # here: it imports torch, which prepare.py does without

        if ended := peers.ended_here():
            return (f"{line}; {', '.join(ended)} had ended, and torchrun stops the other "
                    f"ranks this way when one fails (its summary, below, says how)")
        line += (" (torchrun stops the other ranks this way when one fails: its summary, "
                 "below, names the failed rank if there is one)")
    return line


def end_before_steps(script, signum):
    """End the process at once for a stop signal before the first step, with its line."""
    say_once(before_steps(script, signum))
    say_torchrun_reports_next()
    os._exit(128 + signum)


def exit_at_once(script):
    """A stop signal before the first step raises Interrupted in the main thread (on_signal),
    which errors.run reports; but a main thread that waits in a C call, init_process_group
    waiting for a peer or a collective, runs no Python handler until the call returns. So
    Python's own C handler also writes each signal's number to a pipe (signal.set_wakeup_fd),
    and a thread of ours that reads it ends the process GRACE_S later if it is still there."""
    global _before_steps
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch():
        while (got := os.read(read_end, 16)) and _before_steps is not None:
            if (signum := next((s for s in got if s in EXIT_AT_ONCE), None)) is not None:
                time.sleep(GRACE_S)
                if _before_steps is not None:
                    end_before_steps(script, signum)
        os.close(read_end)

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    _before_steps = write_end


LAUNCHER_POLL_S = 1.0


def stop_when_the_launcher_dies(script="train.py"):
    """Under torchrun (or srun, one task a rank), a launcher killed outright (kill -9) leaves
    its ranks to init, training on with nobody to end them and holding out_dir's lock, so
    that the same command is refused. A thread watches this process's parent and, once it is
    gone, sends this process SIGTERM: the run stops as for a stop signal, at one step agreed
    by every rank (each sees its own launcher go), and saves."""
    if "RANK" not in os.environ:
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        # every rank that sees it says so: the first to see it may stop the others (the
        # ranks agree on the stop) before they look again
        say(f"{script} (rank {os.environ['RANK']}): its launcher (pid {parent}) is gone: "
            f"stopping as for SIGTERM")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def steps_begin():
    """From the first step on, a stop signal is recorded, and the step it comes in is the
    last: the ranks agree on it and rank 0 saves."""
    global _before_steps
    if _before_steps is not None:
        write_end, _before_steps = _before_steps, None
        signal.set_wakeup_fd(-1)
        os.close(write_end)  # the watcher reads the end of the pipe, and ends


_stopped_by = []  # prepare.py's stop signal, once it has come


def raise_on_stop_signals():
    """Raise Interrupted on a stop signal; one that the parent ignores (nohup's SIGHUP, a
    background job's SIGINT) stays ignored."""
    def stop(signum, frame):
        for s in PREPARE_SIGNALS:  # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        _stopped_by.append(signum)
        raise Interrupted(signum)

    listen(PREPARE_SIGNALS, stop)


def raise_if_stopped():
    """Raise the stop signal's Interrupted again if it has come: C code that clears whatever
    error it meets swallows the one the handler raised when the handler runs inside it (numpy's
    indexing of an array by an int does, numpy#20596), and the run would go on to publish."""
    if _stopped_by:
        raise Interrupted(_stopped_by[0])
