"""The tensors of a sharded checkpoint (parallel=fsdp), through torch.distributed.checkpoint
(DCP): every rank writes its part of them, and any number of ranks reads them back, each its
part (whatever the world size that wrote them: DCP reshards), or one process all of them.

  .metadata            DCP's index: each tensor's global shape and where each part of it lies
  __<rank>_0.distcp    what rank <rank> wrote: its shard of each weight (model.<name>, under
                       the model's own names, nanoGPT's) and of the optimizer's state
                       (optimizer.<i>.<what>: i is the parameter's index in the optimizer, as
                       in the optimizer['state'] of a single-file checkpoint; of an optimizer
                       made of two, optim.MuonAdamW, optimizer.<part>.<i>.<what>, part 'muon'
                       or 'adamw')

checkpoint.py puts these files in a folder with the checkpoint's other values and publishes it
(checkpoint.py's docstring has the layout). A tensor under two names (the tied embedding) is
stored once, under the first, as torch.save stores it.

Reading runs no code from the files (docs/fsdp.md): the tensors load with
torch.load(weights_only=True), the index with an unpickler that makes DCP's own records only."""
import io
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.tensor import distribute_tensor

INDEX = ".metadata"
# DCP says so each time one process reads or writes alone, which it does here on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                          "uninitialized")
_CALLS = "a checkpoint's index holds only DCP's own records of its tensors"


# ---- writing ----

def write(folder, tensors, group):
    """Write tensors ({'model': ..., 'optimizer': ...} of host tensors, DTensors holding this
    rank's shards) into folder, this rank's part; every rank of group calls it, and it returns
    when all parts and the index are written and flushed to disk. group: None on one process."""
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True),
             process_group=group, no_dist=group is None)


# ---- reading ----

class _IndexUnpickler(pickle.Unpickler):
    """Makes DCP's records of a checkpoint's tensors and the torch types they name; any other
    global in the pickle (os.system, ...) is refused before it is looked up."""
    ALLOWED = {(dcp_metadata.__name__, name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "BytesStorageMetadata")} | {
        (_StorageInfo.__module__, "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or \
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise Refused(f"{module}.{name}")


class Refused(Exception):
    """An index whose pickle would call something that is not DCP's."""


class _Reader(dcp.FileSystemReader):
    """DCP's reader, with the index read by _IndexUnpickler (DCP's own reads it with pickle,
    which would run whatever the file says)."""

    def read_metadata(self, *args, **kwargs):
        return read_index(self.path)


def read_index(folder):
    """A checkpoint's index (DCP's Metadata). Refused: it would run code, or it holds pickled
    objects, which DCP would unpickle freely."""
    with open(os.path.join(folder, INDEX), "rb") as f:
        index = _IndexUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(index, dcp_metadata.Metadata):
        raise ValueError("it is not DCP's Metadata")
    objects = [k for k, v in index.state_dict_metadata.items()
               if not isinstance(v, dcp_metadata.TensorStorageMetadata)]
    if objects:
        raise Refused(f"pickled objects ({', '.join(objects[:3])}) that DCP would unpickle")
    return index


def problem(folder):
    """What is wrong with a sharded checkpoint's tensors, or None: an index that does not load,
    or a file it points into that is missing or shorter than the part it should hold."""
    try:
        index = read_index(folder)
    except Refused as e:
        return (f"was refused: loading it would execute code (its index {INDEX} calls "
                f"{e}; {_CALLS}), and ddpgpt never loads such a file. Use checkpoints from a "
                f"source you trust")
    except Exception as e:  # missing, truncated, not a pickle...
        return f"has no readable index {INDEX} ({type(e).__name__}: {str(e)[:200]})"
    sizes = {}
    for info in index.storage_data.values():
        path = os.path.join(folder, info.relative_path)
        if path not in sizes:
            sizes[path] = os.path.getsize(path) if os.path.isfile(path) else -1
        if sizes[path] < info.offset + info.length:
            what = "is missing" if sizes[path] < 0 else f"is {sizes[path]:,} bytes, shorter " \
                f"than the {info.offset + info.length:,} its index says"
            return f"is incomplete: its file {info.relative_path} {what}"
    return None


def parts(optimizer):
    """{part: torch optimizer} of an optimizer made of several (optim.MuonAdamW's parts), or
    {None: optimizer}: what a checkpoint keeps of each is a torch optimizer's state_dict."""
    return getattr(optimizer, "parts", None) or {None: optimizer}


def state_parts(optimizer_state):
    """parts() of an optimizer's state_dict (or of its param_groups alone, as a folder's
    values.pt keeps them): {part: a torch optimizer's}."""
    return {None: optimizer_state} if "param_groups" in optimizer_state else optimizer_state


def joined(by_part):
    """The inverse of state_parts: a {part: ...} as the optimizer's state_dict nests it."""
    return by_part[None] if None in by_part else by_part


def optimizer_key(key):
    """(part, index, what) of a tensor of the optimizer's state in the index: part None for
    optimizer.<i>.<what>, else optimizer.<part>.<i>.<what>."""
    rest = key.split(".", 3)[1:]
    return (None, int(rest[0]), ".".join(rest[1:])) if rest[0].isdigit() else \
        (rest[0], int(rest[1]), rest[2])


def read_whole(folder, what, aliases):
    """{'model': the weights, 'optimizer': {part: {i: its state}}} (part: None but for an
    optimizer made of several) as whole tensors on the CPU, of the parts named in `what`, read
    by this process alone."""
    index = read_index(folder)
    prefixes = tuple(f"{part}." for part in what)
    flat = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in index.state_dict_metadata.items() if key.startswith(prefixes)}
    dcp.load(flat, storage_reader=_Reader(folder), no_dist=True)
    out = {part: {} for part in what}
    for key, tensor in flat.items():
        if key.startswith("model."):
            out["model"][key.removeprefix("model.")] = tensor
        else:
            part, i, name = optimizer_key(key)
            out["optimizer"].setdefault(part, {}).setdefault(i, {})[name] = tensor
    if "model" in out:
        out["model"].update({alias: out["model"][name] for alias, name in aliases.items()})
    return out


def read_parts(folder, model, optimizer, saved, aliases):
    """Load this rank's shards of a sharded checkpoint into the sharded model and its optimizer,
    at any world size: every rank calls it. The optimizer takes the checkpoint's param_groups
    (saved: the optimizer's values, {'param_groups'} or {part: {'param_groups'}}: learning
    rate and betas as saved), as torch's load_state_dict does."""
    index = read_index(folder)
    params = {part: [p for group in o.param_groups for p in group["params"]]
              for part, o in parts(optimizer).items()}
    weights = model.state_dict()  # DTensors that are views of the weights: loaded in place
    state = {}
    for key, meta in index.state_dict_metadata.items():
        if key.startswith("optimizer."):
            part, i, name = optimizer_key(key)
            p = params[part][i]
            state.setdefault(part, {}).setdefault(i, {})[name] = torch.zeros_like(p) \
                if tuple(meta.size) == tuple(p.shape) else torch.empty(meta.size,
                                                                       dtype=meta.properties.dtype)
    tensors = {"model": {k: v for k, v in weights.items() if k not in aliases},
               "optimizer": joined(state) if state else {}}
    dcp.load(tensors, storage_reader=_Reader(folder))
    groups = state_parts(saved)
    for part, o in parts(optimizer).items():
        if part in state:  # a checkpoint saved before the first optimizer step has none
            o.load_state_dict({"state": state[part], "param_groups": groups[part]["param_groups"]})


def load_whole(model, weights):
    """Whole weights (a single-file checkpoint's) into a sharded model: each rank copies in its
    shard of each."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(distribute_tensor(weights[name].to(t.device), t.device_mesh, t.placements,
                                      src_data_rank=None))


def shard_like(optimizer_state, optimizer):
    """A whole optimizer state ({'state': {i: {...}}, 'param_groups'}, as a single-file checkpoint
    holds it, or {part: such} of optim.MuonAdamW) sharded as the optimizer's parameters are, for its
    load_state_dict: each rank keeps its shard of each tensor shaped like its parameter."""
    ours = parts(optimizer)
    out = {}
    for part, saved in state_parts(optimizer_state).items():
        params = [p for group in ours[part].param_groups for p in group["params"]]
        state = {i: {name: distribute_tensor(t.to(params[i].device), params[i].device_mesh,
                                             params[i].placements, src_data_rank=None)
                     if isinstance(t, torch.Tensor) and t.shape == params[i].shape else t
                     for name, t in entry.items()}
                 for i, entry in saved["state"].items()}
        out[part] = {"state": state, "param_groups": saved["param_groups"]}
    return joined(out)
