"""Checkpoints in out_dir, of two kinds, each written whole under a temporary name and renamed:

  ckpt_<iter>.pt   one file (parallel=ddp), written by rank 0
  ckpt_<iter>/     a folder (parallel=fsdp) that every rank writes its part of: the tensors
                   through torch.distributed.checkpoint (sharded.py: .metadata, __<rank>_0.distcp),
                   and values.pt, the checkpoint's other values, written last by rank 0

Both hold the same contents (contents(): nanoGPT's keys and the training state, state.py's). A
folder keeps the optimizer's param_groups (of each of its parts: optim.MuonAdamW's) and every
non-tensor key in values.pt. Either kind resumes either way, on any world size (docs/fsdp.md).
A nanoGPT ckpt.pt in out_dir is found too, as the oldest. Loading never runs code from a
checkpoint (weights_only=True, and sharded.py's reader for a folder's index). A run writes
through a Saver."""
import dataclasses
import glob
import logging
import os
import pickle
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ddpgpt import fileio, parallel, runtime
from ddpgpt.errors import UserError

log = logging.getLogger(__name__)

# sharded.py (torch.distributed.checkpoint, DTensor) is imported only where a folder is read or
# written: importing it takes 1-2 s, a third of every process's start-up, for runs that write
# files and never need it

_NAME = re.compile(r"ckpt_(\d+)(\.pt)?$")
REQUIRED_KEYS = ("model", "model_args", "iter_num")
VALUES = "values.pt"  # a folder's keys that are not the model's or the optimizer's tensors
TENSORS = ("model", "optimizer")


def path_for(out_dir, iter_num, folder=False):
    return os.path.join(out_dir, f"ckpt_{iter_num:07d}{'' if folder else '.pt'}")


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, files and folders, newest first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*")):
        m = _NAME.search(path)
        if m and (os.path.isfile(path) if m.group(2) else os.path.isdir(path)):
            found.append((int(m.group(1)), path))
    nanogpt = os.path.join(out_dir, "ckpt.pt")
    return [p for _, p in sorted(found, reverse=True)] + \
        ([nanogpt] if os.path.isfile(nanogpt) else [])


def is_folder(path):
    """Is path a checkpoint folder (rather than an out_dir)? Its values.pt says so, or where
    that is lost, DCP's index: sharded.py is imported for its name only then, not by every
    sample.py, eval.py and export.py given an out_dir (DCP is a slow import)."""
    if not os.path.isdir(path):
        return False
    if os.path.exists(os.path.join(path, VALUES)):
        return True
    if list_checkpoints(path):
        return False  # an out_dir
    from ddpgpt import sharded
    return os.path.exists(os.path.join(path, sharded.INDEX))


def contents(model, optimizer, scaler, train_state, cfg):
    """What a checkpoint holds, for save(): the model's and the optimizer's state, float16's
    loss scale, the training state (state.TrainState) and the settings it trains with (cfg).
    resume() is its mirror."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "config": dataclasses.asdict(cfg),
            **train_state.state_dict()}


# ---- writing ----

def save(out_dir, state, keep):
    """Write state as the checkpoint file of state['iter_num'] and keep the newest `keep`."""
    path = path_for(out_dir, state["iter_num"])
    tmp = fileio.tmp_path(path)
    # a killed writer's (with the out_dir's lock held, no other writer is alive)
    for stale in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*.pt.*tmp")):
        os.remove(stale)
    try:
        torch.save(state, tmp)
        fileio.publish(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a short write as RuntimeError
        why = fileio.disk_full(e, out_dir) or str(e).strip()  # before the .tmp's space is freed
        fileio.remove(tmp)
        raise not_written(path, out_dir, why) from e
    replaced(path)
    prune(out_dir, keep, state["iter_num"])
    return path


def save_folder(out_dir, state, aliases, keep, group, master):
    """Write state (host tensors, DTensors of this rank's shards) as the checkpoint folder of
    state['iter_num']: every rank of group its part, rank 0 (master) values.pt, the
    publishing and keeping the newest `keep`. The folder's path."""
    from torch.distributed.checkpoint import CheckpointException
    from ddpgpt import sharded
    path = path_for(out_dir, state["iter_num"], folder=True)
    tmp = f"{path}.tmp"  # one name for every rank; the out_dir's lock keeps other runs out
    values = {k: v for k, v in state.items() if k not in TENSORS}
    optimizer = sharded.state_parts(state["optimizer"])
    values["optimizer"] = sharded.joined({part: {"param_groups": s["param_groups"]}
                                          for part, s in optimizer.items()})
    values["aliases"] = aliases
    tensors = {"model": {k: v for k, v in state["model"].items() if k not in aliases},
               "optimizer": sharded.joined({part: s["state"] for part, s in optimizer.items()})}
    try:
        sharded.write(tmp, tensors, group)  # returns once every rank's part is on disk
        if master:
            torch.save(values, os.path.join(tmp, VALUES))
            publish_folder(tmp, path)
    except (OSError, RuntimeError, CheckpointException) as e:
        error = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        why = fileio.disk_full(error, out_dir) or str(error).strip()
        if master:
            shutil.rmtree(tmp, ignore_errors=True)
        raise not_written(path, out_dir, why) from None
    if master:
        replaced(path)
        prune(out_dir, keep, state["iter_num"])
    return path


def aliases(model):
    """{name: the name it is another name for} of each weight registered under two names (the
    tied embedding and output layer), the same on every rank."""
    first, found = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            found[name] = first[id(p)]
    return found


def not_written(path, out_dir, why):
    return UserError(f"could not write checkpoint {path}: {why}. The previous checkpoints in "
                     f"{out_dir} are intact; free space or set out_dir elsewhere, then resume "
                     f"with --init_from=resume.")


def publish_folder(tmp, path):
    """fileio.publish_folder, over a folder of the same iter that is there already (one that
    did not load, and which this run is saving again)."""
    old = f"{path}.old.tmp"
    if os.path.isdir(path):
        os.rename(path, old)
    fileio.publish_folder(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def replaced(path):
    """The other kind's checkpoint of the same iter, if any, goes: one checkpoint per iter."""
    other = path[:-3] if path.endswith(".pt") else f"{path}.pt"
    fileio.remove(other)


def prune(out_dir, keep, iter_num):
    """Keep the newest `keep` checkpoints of the run as far as iter_num, the one just saved
    among them. Those of later iters are left alone and count for nothing: they are what a
    resume passed over (damaged, or not loadable here), so keeping them by number would delete
    the good ones and leave nothing that loads."""
    ours = [p for p in list_checkpoints(out_dir)
            if (m := _NAME.search(p)) and int(m.group(1)) <= iter_num]
    for old in ours[keep:]:
        fileio.remove(old)


# ---- reading ----

def model_state(state):
    """The model weights of a checkpoint, ready for GPT.load_state_dict: without the prefix
    torch.compile adds, and without the causal-mask buffers of pre-2.0 nanoGPT checkpoints.
    None for a folder whose tensors are to be read in parts (read())."""
    return {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()
            if not k.endswith(".attn.bias") or v.dim() != 4} if "model" in state else None


def refused(error):
    """What to say of a file that torch.load(weights_only=True) refused because unpickling it
    would import and call something (its pickle names a global); None for other errors. Not
    torch's own message: that advises loading with weights_only=False, which runs the code."""
    if not (isinstance(error, pickle.UnpicklingError) and "Weights only load" in str(error)):
        return None
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    return (f"was refused: loading it would execute code (its pickle calls "
            f"{named.group(1) if named else 'a function'}; a checkpoint holds only tensors and "
            f"plain values), and ddpgpt never loads such a file. Use checkpoints from a source "
            f"you trust")


def load_file(path):
    """(what torch.save wrote to path, None), or (None, what is wrong with the file)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as e:  # a truncated zip, a pickle with code in it...
        return None, refused(e) or (f"cannot be loaded ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else ''})")


def read(path, whole=TENSORS):
    """(state, None) for a checkpoint that loads, else (None, what is wrong with it). Of a folder,
    the tensors of the parts named in `whole` are read whole; with whole=() its state has 'folder'
    (its path) and 'aliases' instead of them, for resume() to read each rank's part of them."""
    state, problem = read_folder(path, whole) if os.path.isdir(path) else load_file(path)
    if problem:
        return None, problem
    needed = REQUIRED_KEYS[1:] if "folder" in state else REQUIRED_KEYS
    if missing := [k for k in needed if k not in state]:
        return None, f"is not a checkpoint (it has no {', '.join(missing)})"
    return state, None


def read_folder(path, whole):
    from ddpgpt import sharded
    values, problem = load_file(os.path.join(path, VALUES))
    if problem or not isinstance(values, dict):
        return None, problem if problem and problem.startswith("was refused") else \
            f"has no loadable {VALUES} (it {problem or 'holds no dict'})"
    if problem := sharded.problem(path):
        return None, problem
    if not whole:
        return {**values, "folder": path}, None
    values = dict(values)
    tensors = sharded.read_whole(path, whole, values.pop("aliases", {}))
    if "optimizer" in tensors:
        state = tensors["optimizer"]
        tensors["optimizer"] = sharded.joined({
            part: {"state": state.get(part, {}), "param_groups": saved["param_groups"]}
            for part, saved in sharded.state_parts(values["optimizer"]).items()})
    return {**values, **tensors}, None


def load_latest(out_dir, whole=TENSORS):
    """(state, path) of the newest checkpoint that loads, or (None, None) if there is none.
    A damaged newest checkpoint is reported and skipped in favour of the one before it."""
    for path in list_checkpoints(out_dir):
        state, problem = read(path, whole)
        if state is not None:
            return state, path
        log.info(f"checkpoint: {path} {problem}; trying an older one")
    return None, None


def resume(saved, model, optimizer, scaler, train_state):
    """The mirror of contents(): a checkpoint that read() gave into the model as wrap() left it
    (whole, or sharded over the ranks), its optimizer, loss scaler and training state. A folder
    read in parts gives each rank its shards; a file's whole tensors are sharded as they load
    into a sharded model."""
    if "folder" in saved or any(map(parallel.is_dtensor, model.parameters())):
        from ddpgpt import sharded
        if "folder" in saved:
            sharded.read_parts(saved["folder"], model, optimizer, saved["optimizer"],
                               aliases(model))
        else:
            sharded.load_whole(model, model_state(saved))
            optimizer.load_state_dict(sharded.shard_like(saved["optimizer"], optimizer))
    else:
        model.load_state_dict(model_state(saved))
        optimizer.load_state_dict(saved["optimizer"])
    if saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    train_state.load_state_dict(saved)


def size(model, averaged=False):
    """About how many bytes a checkpoint of the model takes: its float32 weights and AdamW's
    two moments (of each parameter whole, also where it is sharded), and their average
    (optim.average) if averaged."""
    return (4 if averaged else 3) * 4 * sum(p.numel() for p in model.parameters())


def check_room(out_dir, model, averaged):
    """out_dir can be written, and has room for a checkpoint of the model."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir {out_dir} cannot be written ({e.strerror or e}): set "
                        f"--out_dir to a folder you can write to.") from e
    need = size(model, averaged) * 1.1
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise UserError(f"out_dir {out_dir} has {free / 2**20:.0f} MiB free, less than one "
                        f"checkpoint needs (about {need / 2**20:.0f} MiB): free space or move "
                        f"out_dir.")


# ---- a run's saves ----

class Saver:
    """Writes a run's checkpoints: the file, on rank 0 (ddp), or the folder, on every rank
    (fsdp). In the background (background=True) as docs/checkpoints.md says: save() returns
    once the state is copied to host memory, where the next optimizer step cannot change it; a
    failed save is this run's error, raised by the next check() or save()."""

    def __init__(self, cfg, ranks, model, background):
        self.out_dir, self.keep, self.master = cfg.out_dir, cfg.keep_checkpoints, ranks.master
        self.folder = cfg.parallel == "fsdp"
        self.writes = self.folder or ranks.master
        # a folder's saves run their collectives in a group of their own, on the CPU, so that
        # a save in the background never meets the training's collectives
        self.group = dist.new_group(backend="gloo") if self.folder and ranks.world_size > 1 \
            else None
        self.aliases = aliases(model)
        self.background = ThreadPoolExecutor(
            1, "checkpoint", initializer=runtime.on_device(next(model.parameters()).device)) \
            if background else None
        self.buffers = {}  # the host copies, reused from one background save to the next
        self.pending = None  # the Future of the save in the background
        self.iter_num = None  # of the last save begun
        # what killed saves left (a partial file or folder, a folder being replaced), removed
        # before the first save: out_dir's lock keeps every other writer out
        if ranks.master:
            for stale in glob.glob(os.path.join(glob.escape(cfg.out_dir), "ckpt_*.tmp")):
                fileio.remove(stale)

    def save(self, state, last=False):
        """Write state (contents()) as the checkpoint of its iter: in the background unless
        last (a run's last save: its end, a stop signal) or there is no background."""
        if not self.writes:
            return
        t_wait = time.perf_counter()
        self.wait()  # the save before it, if it is still being written
        self.iter_num = state["iter_num"]
        t0 = time.perf_counter()
        if last or self.background is None:
            self.write(to_host(state), t0, None)
        else:
            self.pending = self.background.submit(self.write, to_host(state, self.buffers), t0,
                                                  time.perf_counter() - t_wait)

    def write(self, state, t0, waited_s):
        path = save_folder(self.out_dir, state, self.aliases, self.keep, self.group, self.master) \
            if self.folder else save(self.out_dir, state, self.keep)
        took = time.perf_counter() - t0
        log.info(f"saved {path} ({took:.2f} s)" if waited_s is None else
                 f"saved {path} ({took:.2f} s, written in the background; the run waited "
                 f"{waited_s:.2f} s, for the save before it and for the copy in host memory)")

    def check(self):
        """Raise the error of a save in the background that failed; nothing if none did."""
        if self.pending is not None and self.pending.done():
            self.wait()

    def wait(self):
        """Until the save in the background, if any, is written; its error, if it failed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        """Wait for the save in the background, if any, before out_dir's lock is let go: a run that
        ends with an error of its own logs that save's failure, if it failed, and raises its own."""
        try:
            self.wait()
        except UserError as e:
            if kind is None:
                raise
            log.error(f"the save in the background failed too: {e}")
        finally:
            if self.background is not None:
                self.background.shutdown()


def to_host(state, buffers=None):
    """state with every tensor in host memory: copied into buffers (a dict that keeps the
    copies, pinned on CUDA for a fast copy, from one save to the next), so that training may
    change the originals, when given; else each moved there (a tensor there already stays
    itself). Tensors that shared memory share it still (the tied embedding: torch.save stores
    it once). The copies are complete when it returns."""
    seen = {}

    def host(t, key):
        local = parallel.local(t)
        where = (local.device, local.untyped_storage().data_ptr(), local.storage_offset(),
                 tuple(local.shape), local.stride(), local.dtype)
        if local.numel() and where in seen:
            return seen[where]
        if buffers is None:
            copy = local.to("cpu")
        else:
            copy = buffers.get(key)
            if copy is None or copy.shape != local.shape or copy.dtype != local.dtype:
                copy = buffers[key] = torch.empty(local.shape, dtype=local.dtype,
                                                  pin_memory=torch.cuda.is_available())
            copy.copy_(local, non_blocking=True)
        if parallel.is_dtensor(t):  # the same shard of the same tensor, held in host memory
            copy = type(t)(copy, t._spec, requires_grad=False)
        seen[where] = copy
        return copy

    def walk(value, key):
        if isinstance(value, torch.Tensor):
            return host(value, key)
        if isinstance(value, dict):
            return {k: walk(v, (*key, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*key, i)) for i, v in enumerate(value))
        return value

    staged = walk(state, ())
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies are done
    return staged


def host_has_room(n_bytes, ranks):
    """Has this host the memory to keep a copy of n_bytes for each of its ranks, with as much
    again to spare? From the kernel's MemAvailable (Linux); elsewhere, yes."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True
    return 2 * n_bytes * ranks.local_world_size <= available
