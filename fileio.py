"""Writing files so that no reader, and no crash, ever sees half of one: each file is written
under a temporary name of its writer's own, flushed to disk and renamed to its final name when
complete. Token files, meta.json, checkpoints and exported folders are all published this way.

Also: what a full disk looks like (disk_full), and the lock that keeps a second writer out of a
folder (locked), for prepare.py's out_dir and train.py's.
"""
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time

from errors import UserError

HOST = socket.gethostname()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path):
    """This process's temporary name for path: two writers never write into one temporary file,
    and each publishes only its own, so even two writers that race never publish a mix."""
    return f"{path}.{os.getpid()}@{HOST}.tmp"


_TMP = re.compile(r"\.(\d+)@([^/]+)\.tmp$")


def remove_stale_temporaries(folder):
    """Remove the temporary files in folder that killed writers of this host left (their
    process is gone); a live writer's, or another host's, stay. Returns their names."""
    stale = [name for name in sorted(os.listdir(folder)) if (m := _TMP.search(name)) and
             m.group(2) == HOST and not alive(int(m.group(1)))]
    for name in stale:
        os.remove(os.path.join(folder, name))
    return stale


def publish(tmp_path, final_path):
    """Make a completely written file visible under its final name, durably."""
    with open(tmp_path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, final_path)
    fsync_dir(os.path.dirname(os.path.abspath(final_path)))


def write_json(path, obj):
    tmp = tmp_path(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        publish(tmp, path)
    except BaseException:  # a full disk, a signal: no temporary file stays behind
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def publish_folder(tmp_dir, final_dir):
    """Make a completely written folder visible under its final name, durably. Never over an
    existing one: a rename onto an empty folder would silently replace it."""
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)
    if os.path.lexists(final_dir):
        raise FileExistsError(f"{final_dir} exists")
    os.rename(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


# ---- a full disk ----

LOW_SPACE = 64 * 2**20  # below this, a short write is taken for a full disk


def disk_full(error, folder):
    """If error, met while writing in folder, is what a full disk looks like, a sentence that
    says so, naming the folder's file system and its free space; else None. A full disk is
    ENOSPC or EDQUOT, or a short write that numpy (tofile) or torch (save) reports without an
    errno, with less than LOW_SPACE free. Call it before removing what the failed write left,
    whose space would make the disk look less full."""
    code = getattr(error, "errno", None)
    if code not in (None, errno.ENOSPC, errno.EDQUOT):
        return None
    usage = shutil.disk_usage(existing(folder))
    if code is None and usage.free >= LOW_SPACE:
        return None
    reason = os.strerror(code) if code else " ".join(str(error).split()) or type(error).__name__
    return (f"the disk is full ({reason}): {folder} is on {file_system(folder)}, which had "
            f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB")


def existing(path):
    """path, or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def file_system(path):
    """'the <type> file system mounted on <mount point>' that holds path; its type comes from
    /proc/mounts, where there is one (Linux)."""
    mount = os.path.realpath(existing(path))
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    kind = None
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for fields in (line.split() for line in f):  # the last mount on a point is the one seen
            if len(fields) > 2 and unescape_mount(fields[1]) == mount:
                kind = fields[2]
    return f"the {kind + ' ' if kind else ''}file system mounted on {mount}"


def unescape_mount(field):
    """/proc/mounts writes a space in a path as \\040 (octal), and so on."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


# ---- one writer per folder ----

LOCK_NAME = "ddpgpt.lock"


@contextlib.contextmanager
def locked(folder, script, log=print):
    """Hold folder's lock while the block runs: made by prepare.py for its out_dir, and for
    train.py's, so that two runs never write into one folder at once: take it in one process
    of a run (rank 0). The folder is made if it does not exist. Another holder is a UserError
    that names it; log gets the notice when a dead holder's lock is taken over.

    The lock is fcntl.flock on folder/ddpgpt.lock, which holds its holder's host, pid, script,
    start time and SLURM job, and is removed when the block ends. The kernel releases a flock
    when its process dies, however it dies; a lock file left by a holder that is gone is taken
    over with a notice: a process of this host that no longer runs, or an earlier run of this
    SLURM job (requeued, perhaps onto another node).

    What it protects: writers that take it, on one host, and on a network file system that
    passes flock on to its server (NFSv4, Lustre with -o flock); where flock stays local to
    each host (NFS mounted with local_lock=flock or all), a writer on another host is refused
    only while its lock file is there, so two started at the same moment can both go on. What
    it does not: programs that do not take it (rm, cp, an older ddpgpt), and readers (a
    train.py reading the data prepare.py is rewriting)."""
    path = os.path.join(folder, LOCK_NAME)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = acquire(path, script, log)
    except OSError as e:
        why = disk_full(e, folder) or e.strerror or str(e)
        raise UserError(f"cannot write in {folder} ({why}): choose a folder that you can create "
                        f"and write files in.") from e
    try:
        yield
    finally:
        if same_file(fd, path):  # removed while locked: whoever opens it next makes a new one
            os.remove(path)
        os.close(fd)


def acquire(path, script, log):
    """An open descriptor of the lock file at path, locked, with this process as its holder."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        holder = read_holder(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked_now = True
        except BlockingIOError:
            locked_now = False
        except OSError as e:  # a file system that cannot lock (ENOLCK, EOPNOTSUPP)
            log(f"warning: the file system of {path} cannot lock files ({e.strerror}): only "
                f"its contents keep a second writer out")
            locked_now = True
        if locked_now and not same_file(fd, path):
            os.close(fd)  # its holder removed it between our open and our lock: a new one
            continue
        if locked_now and not holder:
            write_holder(fd, script)
            return fd
        if holder and gone(holder):
            log(f"{script}: taking over the lock on {os.path.dirname(path)}: "
                f"{describe_holder(holder)} held it and is no longer running")
            if locked_now:
                write_holder(fd, script)
                return fd
            # its flock is still held (by its children, or for a crashed host by the file
            # server, until its lease ends): a new lock file replaces the old one
            if same_file(fd, path):
                os.remove(path)
            os.close(fd)
            continue
        os.close(fd)
        raise UserError(refusal(path, holder))


def slurm_run():
    """(job id, restart count) of this SLURM job, or None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    return [job, int(os.environ.get("SLURM_RESTART_COUNT") or 0)] if job else None


def gone(holder):
    """Has the holder a lock file names ended? Only when that is known: a process of this host
    that no longer runs, or an earlier run of this SLURM job (SLURM runs one at a time)."""
    if holder.get("host") == HOST and not alive(holder.get("pid")):
        return True
    ours, theirs = slurm_run(), holder.get("slurm")
    return bool(ours and isinstance(theirs, list) and len(theirs) == 2 and
                theirs[0] == ours[0] and isinstance(theirs[1], int) and theirs[1] < ours[1])


def refusal(path, holder):
    folder = os.path.dirname(path)
    who = describe_holder(holder) if holder else "another process (which has not yet " \
                                                   "written its name in the lock file)"
    return (f"{folder} is being written by {who}, and two writers in one folder would destroy "
            f"each other's output: wait for it to end or stop it, or choose another folder. "
            f"If it is not running (its machine crashed, say), remove {path}.")


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


def write_holder(fd, script):
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"script": script, "pid": os.getpid(), "host": HOST,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                              "slurm": slurm_run()}).encode(), 0)


def same_file(fd, path):
    """Is the open file fd still the one at path?"""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def alive(pid):
    """Is process pid of this host running? A pid that is no pid counts as running: only a
    process known to be gone gives up its lock."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
