"""Writing files so that no reader, and no crash, ever sees half of one: each file is written
under a temporary name, flushed to disk and renamed to its final name when complete. Token
files, meta.json, checkpoints and exported folders are all published this way."""
import json
import os


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp_path, final_path):
    """Make a completely written file visible under its final name, durably."""
    with open(tmp_path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, final_path)
    fsync_dir(os.path.dirname(os.path.abspath(final_path)))


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    publish(path + ".tmp", path)


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
