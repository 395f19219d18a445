"""One writer per folder: the lock that prepare.py takes on its out_dir and train.py's rank 0
on its own, so that two runs never write into one folder at once."""
import contextlib
import fcntl
import json
import logging
import os
import time

from ddpgpt.errors import UserError
from ddpgpt.fileio import HOST, LOCK_NAME, alive, disk_full

log = logging.getLogger(__name__)

_held = {}  # {path: open descriptor} of the locks this process holds, for release_held


@contextlib.contextmanager
def locked(folder, script, fix=None):
    """Hold folder's lock while the block runs, in one process of a run (rank 0), making the
    folder if need be. Another holder is a UserError that names it; a folder that cannot be
    written in is a UserError that says what it is and then fix, what to do.

    The lock is fcntl.flock on folder/ddpgpt.lock, which names its holder (acquire) and is
    removed when the block ends. The kernel releases a flock when its process dies, however it
    dies; a lock file left by a holder that is gone (gone()) is taken over, logged (INFO). What
    it protects, across hosts too, and what it does not: docs/bad_inputs.md (prepare.py's)."""
    path = os.path.join(folder, LOCK_NAME)
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder, where {script} keeps its lock file (one writer "
                        f"per folder): it is not ddpgpt's. Move or rename it, then run again.")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = acquire(path, script)
    except OSError as e:
        why = disk_full(e, folder) or e.strerror or str(e)
        fix = fix or "choose a folder that you can create and write files in."
        raise UserError(f"cannot write in {folder} ({why}): {fix}") from e
    _held[path] = fd
    try:
        yield
    finally:
        release(path, _held.pop(path))


def release(path, fd):
    if same_file(fd, path):  # removed while locked: whoever opens it next makes a new one
        os.remove(path)
    os.close(fd)


def release_held():
    """Release this process's locks now: for a process about to end with os._exit (the hang
    watchdog), which runs no `finally`."""
    for path in list(_held):
        with contextlib.suppress(OSError, KeyError):
            release(path, _held.pop(path))


def acquire(path, script):
    """An open descriptor of the lock file at path, locked, with this process as its holder."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        holder = read_holder(fd)
        locked_now = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            locked_now = False
        except OSError as e:  # a file system that cannot lock (ENOLCK, EOPNOTSUPP)
            log.warning(f"warning: the file system of {path} cannot lock files ({e.strerror}): "
                        f"only its contents keep a second writer out")
        if locked_now and not same_file(fd, path):
            os.close(fd)  # its holder removed it between our open and our lock: a new one
            continue
        if not (gone(holder) if holder else locked_now):  # neither free nor its holder ended
            os.close(fd)
            raise UserError(refusal(path, holder))
        if holder:
            log.info(f"{script}: taking over the lock on {os.path.dirname(path)}: "
                     f"{describe_holder(holder)} held it and is no longer running")
        if locked_now:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"script": script, "pid": os.getpid(), "host": HOST,
                                      "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                                      "slurm": slurm_run()}).encode(), 0)
            return fd
        # its flock is still held (by its children, or for a crashed host by the file
        # server, until its lease ends): a new lock file replaces the old one
        release(path, fd)


def slurm_run():
    """(job id, restart count) of this SLURM job, or None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    return [job, int(os.environ.get("SLURM_RESTART_COUNT") or 0)] if job else None


def gone(holder):
    """Has the holder a lock file names ended? Only when known: a process of this host that no
    longer runs, or an earlier run of this SLURM job (one at a time, perhaps on another node)."""
    if holder.get("host") == HOST and not alive(holder.get("pid")):
        return True
    ours, theirs = slurm_run(), holder.get("slurm")
    return bool(ours and isinstance(theirs, list) and len(theirs) == 2 and
                theirs[0] == ours[0] and isinstance(theirs[1], int) and theirs[1] < ours[1])


def refusal(path, holder):
    who = describe_holder(holder) if holder else "another process (which has not yet " \
                                                   "written its name in the lock file)"
    return (f"{os.path.dirname(path)} is being written by {who}, and two writers in one folder "
            f"would destroy each other's output: wait for it to end or stop it, or choose "
            f"another folder. If it is not running (its machine crashed, say), remove {path}.")


def describe_holder(holder):
    job = holder.get("slurm")
    return (f"{holder.get('script')} (pid {holder.get('pid')} on {holder.get('host')}"
            f"{f', SLURM job {job[0]}' if isinstance(job, list) and job else ''}, "
            f"since {holder.get('started')})")


def read_holder(fd):
    """The holder a lock file names, {} for an empty one (or one cut off as it was written)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def same_file(fd, path):
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
