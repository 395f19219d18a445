"""Writing files so that no reader, and no crash, ever sees half of one: each file is written
under a temporary name of its writer's own (tmp_path), flushed to disk and renamed to its final
name when complete (publish). Token files, meta.json, checkpoints and exported folders are all
published this way. Also: what a full disk looks like (disk_full). The lock that keeps a second
writer out of a folder is lock.py's."""
import contextlib
import errno
import json
import os
import re
import shutil
import socket

import numpy as np


HOST = socket.gethostname()
LOCK_NAME = "ddpgpt.lock"  # the file of lock.py's lock on a folder, which no reader takes for data


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


def remove_stale_temporaries(folder, of=None):
    """Remove the temporary files (or folders) in folder that killed writers of this host left
    (their process is gone), of the final name `of` or of any; a live writer's, or another
    host's, stay. Returns their names."""
    stale = [name for name in sorted(os.listdir(folder)) if (m := _TMP.search(name)) and
             m.group(2) == HOST and not alive(int(m.group(1))) and
             (of is None or name[:m.start()] == of)]
    for name in stale:
        remove(os.path.join(folder, name))
    return stale


def remove(path):
    """Remove a file, or a folder and everything in it (a link, even to a folder, is a file),
    where there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_own_temporaries(folder):
    """Remove this process's temporary files in folder. A writer removes the file it knows of
    when stopped; this also finds one that a stop signal left unknown, raised after the file
    was created and before its opener returned it."""
    for name in os.listdir(folder):
        if (m := _TMP.search(name)) and m.group(2) == HOST and int(m.group(1)) == os.getpid():
            remove(os.path.join(folder, name))


def publish(tmp_path, final_path):
    """Make a completely written file visible under its final name, durably."""
    with open(tmp_path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, final_path)
    fsync_dir(os.path.dirname(os.path.abspath(final_path)))


def discard(file):
    """Close and remove a temporary file that is given up. Its buffered bytes are not wanted,
    but close() writes them first: on a full disk, often why the file is given up, that write
    fails, and must not end the clean-up, leaving this file and the caller's others behind."""
    with contextlib.suppress(OSError):
        file.close()
    remove(file.name)  # unless published or discarded already


def write_array(file, array):
    """Append a numpy array's bytes to an open file. Not ndarray.tofile: a stop signal whose
    handler raises while tofile asks whether its argument is a path comes out of numpy as a
    TypeError ("expected str, bytes or os.PathLike object, not BufferedWriter"), a traceback
    instead of the signal's clean exit (seen in prepare.py under SIGTERM)."""
    file.write(memoryview(np.ascontiguousarray(array)).cast("B"))


@contextlib.contextmanager
def publishing(path):
    """This process's temporary name for path (tmp_path), for the block to write; published
    when the block ends, or on any way out of it (a full disk, a signal) removed."""
    tmp = tmp_path(path)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        remove(tmp)  # unless published, or never made


def write_json(path, obj):
    with publishing(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def publish_folder(tmp_dir, final_dir):
    """Make a completely written folder visible under its final name, durably, every file and
    folder in it with the mode a plain open() or mkdir gives (the umask's): a library may
    write some private (safetensors' model.safetensors is 0600). Never over an existing
    folder: a rename onto an empty one would silently replace it."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
                os.fchmod(f.fileno(), 0o666 & ~umask)
        os.chmod(root, 0o777 & ~umask)
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
    ENOSPC or EDQUOT, or a short write that torch (save) or numpy reports without an
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
            # a space in a path is written \040 (octal), and so on
            if len(fields) > 2 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                                          fields[1]) == mount:
                kind = fields[2]
    return f"the {kind + ' ' if kind else ''}file system mounted on {mount}"


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
