"""Worker processes for prepare.py's CPU work (tokenizing, counting OpenWebText's archives):
an ordered map that ends promptly however it is stopped, and never hangs.

Not multiprocessing.Pool, which can hang for ever when its workers die of a signal. Its workers
share one task queue and one result queue, each guarded by a lock (a semaphore) that a worker
holds while it waits for a task or sends a result. SIGTERM to the whole process group (what
scancel, systemd and `kill -- -PGID` send) kills workers holding one, which is never released,
and the pool's terminate() then waits for it for ever (in Pool._help_stuff_finish or
SimpleQueue.put): about 1 stop in 4 on a 2-core machine. Here each worker has a pipe of its own
for its tasks and one for its results, and nothing is shared, so a worker that dies is seen as
the end of its result pipe. The workers ignore the stop signals, which reach the whole process
group: only the main process decides to stop, and it ends them with SIGKILL, which needs
nothing from them. If the main process dies outright, their task pipes end and they exit.

Task i goes to worker i % num_proc, and results come back in task order. A worker reads its tasks in
a thread of its own, so the main process's send of a task never waits for the worker to finish an
earlier one (which could be waiting, in turn, for the main process to take its result)."""
import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections import deque
from typing import Any, NamedTuple

from ddpgpt.errors import UserError


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def ordered_map(fn, items, num_proc, initializer=None, initargs=(), ahead=2):
    """An iterator of fn(item) for each item, in order, computed by num_proc worker processes, with
    at most `ahead` tasks per worker at a time (so memory does not grow with the items). The workers
    run initializer(*initargs) first, and are ended when the block ends, however it ends."""
    workers = []
    try:
        start(workers, fn, num_proc, initializer, initargs)
        yield answers(workers, items, ahead)
    finally:
        stop(workers)


def answers(workers, items, ahead):
    pending = deque()  # the workers of the tasks sent and not yet answered, in task order
    for i, item in enumerate(items):
        pending.append(send(workers[i % len(workers)], item))
        if len(pending) == len(workers) * ahead:
            yield result(pending.popleft())
    while pending:
        yield result(pending.popleft())


class Worker(NamedTuple):
    process: multiprocessing.Process
    tasks: Any  # the main process's ends of its pipes (multiprocessing.connection.Connection)
    results: Any


def start(workers, fn, num_proc, initializer, initargs):
    """Add num_proc Workers to workers. The stop signals are blocked while each is forked, so
    that none reaches it before it ignores them; each closes the main process's ends of the
    others' pipes, which it inherits, so that the main process alone holds them."""
    context = multiprocessing.get_context("fork")  # the workers share the loaded modules
    for _ in range(num_proc):
        task_reader, task_writer = context.Pipe(duplex=False)
        result_reader, result_writer = context.Pipe(duplex=False)
        inherited = [end for w in workers for end in (w.tasks, w.results)] + [task_writer,
                                                                              result_reader]
        process = context.Process(target=serve, daemon=True, args=(
            fn, initializer, initargs, task_reader, result_writer, inherited))
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        task_reader.close()
        result_writer.close()
        workers.append(Worker(process, task_writer, result_reader))


def serve(fn, initializer, initargs, tasks, results, inherited):
    """A worker's life: its tasks, read by a thread into a queue, each answered with
    (True, fn(task)) or (False, the error), until its task pipe ends."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    for end in inherited:
        end.close()
    failed = None  # an initializer's error is every task's answer
    try:
        if initializer is not None:
            initializer(*initargs)
    except Exception as e:
        failed = sendable(e)
    waiting = queue.SimpleQueue()

    def read():
        with contextlib.suppress(EOFError, OSError):
            while True:
                waiting.put(tasks.recv())
        waiting.put(StopIteration)  # the main process is done, or gone

    threading.Thread(target=read, daemon=True).start()
    while (task := waiting.get()) is not StopIteration:
        try:
            if failed is not None:
                raise failed
            answer = (True, fn(task))
        except Exception as e:
            answer = (False, sendable(e))
        try:
            results.send(answer)
        except OSError:  # the main process is gone
            break
    os._exit(0)  # no atexit handlers or finalizers inherited from the main process


def sendable(error):
    """A worker's error as the main process raises it: a UserError as it is, anything else (a
    bug, which may not pickle) as a RuntimeError that carries the worker's traceback."""
    return error if isinstance(error, UserError) else RuntimeError(
        f"{type(error).__name__} in a worker process:\n"
        f"{''.join(traceback.format_exception(error))}")


def send(worker, task):
    try:
        worker.tasks.send(task)
    except OSError:  # EPIPE: it is gone
        raise UserError(died(worker.process)) from None
    return worker


def result(worker):
    """The worker's next answer; its error raised here; its death a UserError."""
    try:
        ok, value = worker.results.recv()
    except (EOFError, OSError):  # OSError: it died in the middle of sending an answer
        raise UserError(died(worker.process)) from None
    if not ok:
        raise value
    return value


def died(process):
    process.join(5)  # its pipe ended: its exit status comes soon
    code = process.exitcode
    try:
        how = f"was killed by {signal.Signals(-code).name}"
    except (TypeError, ValueError):  # None, or an exit status
        how = f"exited with status {code}"
    hint = " (the system's OOM killer, when memory runs out: try a lower --num_proc)" \
        if code == -signal.SIGKILL else ""
    return (f"a worker process (pid {process.pid}) {how}{hint}, so its tasks are lost: run the "
            f"same command again")


def stop(workers):
    """End every worker at once: SIGKILL needs nothing from them, and they hold nothing the
    main process needs."""
    for w in workers:
        if w.process.exitcode is None:
            with contextlib.suppress(OSError):
                w.process.kill()
    for w in workers:
        w.process.join()
        w.tasks.close()
        w.results.close()
